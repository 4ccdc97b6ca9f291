"""`surgectl resume JOB --dp N` on a real stack (issue 14 part 4): control, store, data and
two node agents, ranks as real processes over gloo (fp32, CPU).

A dp 2 job (micro_batch_size 4: a global batch of 8 rows) is stopped by `surgectl stop` at
a checkpointed step. `--dp 3` (12 rows) is refused with one line naming the field and
`--dp 4 --micro-batch-size 2` (8 rows, but 4 ranks on two one-slot workers) with one line
from the allocator; neither changes the job. `--dp 1 --grad-accum 2` (8 rows) relaunches it
on one rank from that checkpoint (model and optimizer resharded through DCP, the global data
position kept): it finishes, its status and events say dp 1 on a world of 1, and every step
after the resume has the token count and the loss (to 1e-5, relative) of an uninterrupted
dp 2 run's same step; `surgectl spec JOB` shows the new layout, and a `submit --dry-run`
reads the dataset from the running data service and submits nothing. Every process of the
stack is killed by PID at the end (running_stack).
"""

from __future__ import annotations

import json
import time

import pytest

from services.contract import control_pb2
from services.jobspec import parse_job_spec
from services.rank.faults import lift_pace
from tests.faults.test_recovery import cli, running_stack, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
# The stop takes effect at the first step boundary its ranks agree on (a step or two after
# they all hold it: services/common/boundary_commands.py): the job is held to PACE a step from
# step 4 on (``SURGE_FAULT_INJECT`` ``slow_steps``) until it stopped, so that it stops well
# before its end whatever the machine's speed; the resumed job runs at its own speed.
STEPS, PACE = 30, 2.0
PACED = ",".join(f"tdp:slow_steps@4:rank={r}:seconds={PACE:g}" for r in (0, 1))
RTOL = 1e-5


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge-resume-dp")
    with running_stack(home, ("json",), ("tdpref", "tdp"), env={"SURGE_FAULT_INJECT": PACED}) as s:
        yield s


def rank0(stack, job_id: str) -> dict[int, dict]:
    """Rank 0's step records by step (a step written twice would be lost here: counted apart)."""
    return {r["step"]: r for r in stack.step_records(job_id) if r["rank"] == 0}


def wait_state(stack, job_id: str, state: int, timeout: float = 120) -> control_pb2.JobStatus:
    t0 = time.monotonic()
    while (s := stack.status(job_id)).state != state:
        assert time.monotonic() - t0 < timeout, f"{job_id} is {JobState.Name(s.state)}: {s.message}"
        time.sleep(0.1)
    return s


def test_a_stopped_dp2_job_resumes_at_dp1_with_the_same_global_batches_and_losses(stack):
    ref = stack.submit(spec("tdpref", steps=STEPS, every=1000))
    assert stack.events(ref)[-1].status.outcome == JobOutcome.FINISHED
    reference = rank0(stack, ref)
    assert sorted(reference) == list(range(1, STEPS + 1))

    job = stack.submit(spec("tdp", steps=STEPS, every=1000))
    stack.wait_step(job, 3)
    stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job), timeout=10)  # (at once: no CLI start-up)
    stopped = wait_state(stack, job, JobState.TERMINATED)
    at = stopped.step
    assert stopped.outcome == JobOutcome.STOPPED and at < STEPS, stopped.message
    lift_pace(stack.home / "run" / "faults", job)
    assert (stopped.dp, stopped.micro_batch_size, stopped.grad_accum, stopped.world_size) == (2, 4, 1, 2)

    # Refused before anything is touched: one line, a bad-input exit, the job as it was.
    r = cli(stack.home, "resume", job, "--dp", "3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert r.stderr.startswith(
        "error: --dp 3: the global batch (data.micro_batch_size x data.grad_accum x parallel.dp)"
    )
    assert "4 x 1 x 3 = 12 rows, not the job's 8" in r.stderr
    # More ranks than the workers have: it waits in the queue as a submit of that size does
    # (was: refused); taken out of it, the job is as it was.
    r = cli(stack.home, "resume", job, "--dp", "4", "--micro-batch-size", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"{job}: resume waits in the queue (#1): needs 4 ranks (parallel.dp=4)"), r.stdout
    r = cli(stack.home, "cancel", job)
    assert r.returncode == 0, r.stdout + r.stderr
    s = stack.status(job)
    assert (s.state, s.outcome, s.dp, s.world_size, s.step) == (JobState.TERMINATED, JobOutcome.STOPPED, 2, 2, at)

    r = cli(stack.home, "resume", job, "--dp", "1", "--grad-accum", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"{job}: resumed from checkpoint {job}:1 (step {at}) at dp 1 x micro_batch_size 4 x grad_accum 2 (1 rank); "
        "now WARMING_UP"
    ) in r.stdout, r.stdout
    events = stack.events(job, timeout=240)
    end = events[-1].status
    assert (end.state, end.outcome, end.step) == (JobState.TERMINATED, JobOutcome.FINISHED, STEPS), end.message
    assert (end.dp, end.grad_accum, end.world_size) == (1, 2, 1)
    assert any(
        e.message.startswith(f"resume TERMINATED (STOPPED) from checkpoint {job}:1 (step {at}) by the operator at a ")
        and "parallel.dp 2 -> 1, data.grad_accum 1 -> 2, eval.batches 2 -> 4 (world size 2 -> 1; the global batch "
        "of 8 rows kept)"
        in e.message
        for e in events
    ), [e.message for e in events]
    assert not [e for e in events if e.type == "fault"], [e.message for e in events if e.type == "fault"]
    listed = json.loads(cli(stack.home, "status", job, "-o", "json").stdout)
    assert listed and int(listed[0]["dp"]) == 1, listed
    # `surgectl spec JOB`: the effective spec control journaled, the resume's layout in it.
    shown = cli(stack.home, "spec", job, "-o", "json")
    assert shown.returncode == 0, shown.stderr
    effective = parse_job_spec(shown.stdout, "spec.json")
    assert (effective.parallel.dp, effective.data.micro_batch_size, effective.data.grad_accum) == (1, 4, 2)
    assert effective.steps == STEPS and effective.name == "tdp"
    # A dry run with the stack up reads the dataset from the data service; submits nothing.
    (stack.home / "tdp.yaml").write_text(spec("tdp", steps=STEPS, every=1000))
    dry = cli(stack.home, "submit", str(stack.home / "tdp.yaml"), "--set", "steps=7", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# dataset tiny@v1 (the data service at 127.0.0.1:" in dry.stdout, dry.stdout
    assert parse_job_spec(dry.stdout, "dry-run.yaml").steps == 7
    assert len(stack.stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs) == 2

    ours = rank0(stack, job)
    assert sorted(ours) == list(range(1, STEPS + 1)), "a step lost or repeated across the stop and the resume"
    assert max(r["step"] for r in stack.step_records(job) if r["rank"] == 1) == at  # rank 1: only before
    after = range(at + 1, STEPS + 1)
    assert [int(ours[s]["tokens"]) for s in after] == [int(reference[s]["tokens"]) for s in after]
    worst = max(abs(ours[s]["loss"] - reference[s]["loss"]) / abs(reference[s]["loss"]) for s in after)
    print(f"resumed at dp 1 x grad_accum 2 from step {at}: max relative loss difference {worst:.2e}")
    assert worst <= RTOL
