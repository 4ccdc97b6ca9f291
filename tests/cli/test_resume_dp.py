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
stack is killed by PID when its group ends (running_stack).

The same stack (two one-slot workers: a dp 2 job fills it) serves priority preemption (issue 30
item 2): a priority-0 dp 2 job is preempted by a priority-5 dp 2 job; it checkpoints at an
agreed boundary, waits PREEMPTED, comes back by itself once the preemptor finished, with no
fault and no restart spent, and its losses are the uninterrupted run's bit for bit. Within a
team (session 32): a team whose quota one dp 1 job fills (nominal 1, nothing to borrow), a
slot idle: its priority-5 job preempts its priority-0 one, which comes back by itself.

The stack is the one the group cli-two-workers shares (tests/conftest.py STACK_GROUPS,
tests/shared_stacks.py), the first module on it.
"""

from __future__ import annotations

import json
import time

import pytest

from services.contract import control_pb2
from services.jobspec import parse_job_spec
from services.rank.faults import lift_pace
from tests.faults.test_recovery import cli, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
# The stop takes effect at the first step boundary its ranks agree on (a step or two after
# they all hold it: services/common/boundary_commands.py): the job is held to PACE a step from
# step 4 on (``SURGE_FAULT_INJECT`` ``slow_steps``) until it stopped, so that it stops well
# before its end whatever the machine's speed; the resumed job runs at its own speed.
STEPS, PACE = 30, 2.0
INJECT = ",".join(
    [f"{job}:slow_steps@4:rank={r}:seconds={PACE:g}" for job in ("tdp", "tplow") for r in (0, 1)]
    + [f"tqlow:slow_steps@4:rank=0:seconds={PACE:g}"]
)
# (the preempted job may be preempted after a second of running: control's env, the whole stack's)
STACK_ENV = {"SURGE_PREEMPTION_MIN_RUN_SECONDS": "1"}
RTOL = 1e-5


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its jobs:
    tdpref, tdp, tplow, tphigh."""
    return shared_stack


@pytest.fixture(scope="module")
def reference(stack) -> dict[int, dict]:
    """Rank 0's step records of an uninterrupted dp 2 run (the spec every test here compares with)."""
    ref = stack.submit(spec("tdpref", steps=STEPS, every=1000))
    assert stack.events(ref)[-1].status.outcome == JobOutcome.FINISHED
    records = rank0(stack, ref)
    assert sorted(records) == list(range(1, STEPS + 1))
    return records


def rank0(stack, job_id: str) -> dict[int, dict]:
    """Rank 0's step records by step (a step written twice would be lost here: counted apart)."""
    return {r["step"]: r for r in stack.step_records(job_id) if r["rank"] == 0}


def wait_state(stack, job_id: str, state: int, timeout: float = 120) -> control_pb2.JobStatus:
    t0 = time.monotonic()
    while (s := stack.status(job_id)).state != state:
        assert time.monotonic() - t0 < timeout, f"{job_id} is {JobState.Name(s.state)}: {s.message}"
        time.sleep(0.1)
    return s


def test_a_stopped_dp2_job_resumes_at_dp1_with_the_same_global_batches_and_losses(stack, reference):
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
    jobs = len(stack.stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs)
    dry = cli(stack.home, "submit", str(stack.home / "tdp.yaml"), "--set", "steps=7", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# dataset tiny@v1 (the data service at 127.0.0.1:" in dry.stdout, dry.stdout
    assert parse_job_spec(dry.stdout, "dry-run.yaml").steps == 7
    assert len(stack.stub.ListJobs(control_pb2.JobQuery(), timeout=10).jobs) == jobs

    ours = rank0(stack, job)
    assert sorted(ours) == list(range(1, STEPS + 1)), "a step lost or repeated across the stop and the resume"
    assert max(r["step"] for r in stack.step_records(job) if r["rank"] == 1) == at  # rank 1: only before
    after = range(at + 1, STEPS + 1)
    assert [int(ours[s]["tokens"]) for s in after] == [int(reference[s]["tokens"]) for s in after]
    worst = max(abs(ours[s]["loss"] - reference[s]["loss"]) / abs(reference[s]["loss"]) for s in after)
    print(f"resumed at dp 1 x grad_accum 2 from step {at}: max relative loss difference {worst:.2e}")
    assert worst <= RTOL


@pytest.mark.timeout(480)
def test_a_preempted_dp2_job_comes_back_by_itself_with_its_losses_bit_identical(stack, reference):
    low = stack.submit(spec("tplow", steps=STEPS, every=1000))
    stack.wait_step(low, 3)  # (paced from step 4: still running when the preemptor comes)
    submitted = time.time()
    request = control_pb2.SubmitJobRequest(spec_yaml=spec("tphigh", steps=5, every=1000), priority=5)
    high = stack.stub.SubmitJob(request, timeout=30).job_id
    t0 = time.monotonic()
    while not ((s := stack.status(low)).state == JobState.STANDBY and s.preempted_by == high):
        assert time.monotonic() - t0 < 120, f"{low} is {JobState.Name(s.state)}: {s.message}"
        time.sleep(0.05)
    assert s.outcome == JobOutcome.OUTCOME_UNSPECIFIED and s.message.startswith(f"queued: PREEMPTED by job {high}")
    lift_pace(stack.home / "run" / "faults", low)
    stack.wait_step(high, 1)
    to_first_step = time.time() - submitted
    high_events = stack.events(high)
    assert high_events[-1].status.outcome == JobOutcome.FINISHED
    high_end = high_events[-1].unix_time
    events = stack.events(low, timeout=300)
    end = events[-1].status
    assert (end.state, end.outcome, end.step) == (JobState.TERMINATED, JobOutcome.FINISHED, STEPS), end.message
    messages = [e.message for e in events]
    # (the released ranks' SIGKILL is their end, type rank: no fault, no decision, no budget spent)
    faults = [e.message for e in events if e.type == "fault" and "rank_released" not in e.message]
    assert faults == [], faults
    assert [m for m in messages if " after " in m and m.startswith(("restart", "rebuild"))] == []
    (resumed,) = [i for i, e in enumerate(events) if e.type == "decision" and e.message.startswith("resume STANDBY")]
    assert f"(preempted by job {high})" in messages[resumed] and "restart budgets kept" in messages[resumed]
    at = int(messages[resumed].split("(step ", 1)[1].split(")", 1)[0])
    # (training again: its ranks' start; a step is journaled once a second, and the rest of
    # the run, unpaced, may take less)
    back = next(
        e.unix_time for e in events[resumed:] if e.type == "step" or e.message.startswith("WARMING_UP -> RUNNING")
    )
    records = [r for r in stack.step_records(low) if r["rank"] == 0]
    lost = len(records) - len({r["step"] for r in records})  # (a step run again after the resume)
    print(
        f"preempted at step {at}: {lost} steps lost; the preemptor's first step {to_first_step:.1f} s after its "
        f"submit; the victim's first step again {back - high_end:.1f} s after the preemptor's end"
    )
    # Every step once: those up to the boundary before, the rest after the resume (none redone).
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), [r["step"] for r in records]
    ours = rank0(stack, low)
    assert [ours[s]["loss"] for s in range(1, STEPS + 1)] == [reference[s]["loss"] for s in range(1, STEPS + 1)]


@pytest.mark.timeout(300)
def test_within_a_team_a_higher_priority_job_preempts_the_team_s_job_that_fills_its_quota(stack):
    quota = control_pb2.TeamQuota(name="tq", nominal=1, borrow_limit=0, hard_limit=-1, weight=1.0, cohort="tq")
    stack.stub.SetTeamQuota(control_pb2.SetTeamQuotaRequest(quota=quota), timeout=30)
    try:
        low = stack.submit("team: tq\n" + spec("tqlow", steps=12, every=1000).replace("dp: 2", "dp: 1"))
        stack.wait_step(low, 3)  # (paced from step 4: still running when the preemptor comes)
        request = control_pb2.SubmitJobRequest(
            spec_yaml="team: tq\n" + spec("tqhigh", steps=3, every=1000).replace("dp: 2", "dp: 1"), priority=5
        )
        high = stack.stub.SubmitJob(request, timeout=30)
        assert high.state == JobState.STANDBY and "over its borrow limit of 0" in high.message, high.message
        s = wait_state(stack, low, JobState.STANDBY)
        assert s.preempted_by == high.job_id and s.message.startswith(f"queued: PREEMPTED by job {high.job_id}")
        lift_pace(stack.home / "run" / "faults", low)
        assert stack.events(high.job_id)[-1].status.outcome == JobOutcome.FINISHED
        events = stack.events(low, timeout=240)
        assert (events[-1].status.outcome, events[-1].status.step) == (JobOutcome.FINISHED, 12), events[-1].message
        messages = [e.message for e in events]
        assert any(
            m.startswith(f"preempted by job {high.job_id} (priority 5 > 0, within team tq's quota)") for m in messages
        )
        assert [e.message for e in events if e.type == "fault" and "rank_released" not in e.message] == []
        records = [r["step"] for r in stack.step_records(low) if r["rank"] == 0]
        assert sorted(set(records)) == list(range(1, 13)), records
    finally:
        stack.stub.SetTeamQuota(
            control_pb2.SetTeamQuotaRequest(remove=True, quota=control_pb2.TeamQuota(name="tq")), timeout=30
        )
