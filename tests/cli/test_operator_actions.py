"""Operator actions keep every step; submission is atomic (issue 12, parts 7 and 8), on a real
stack (control on a fixed port, store, data, two node agents, DP=2 jobs as rank processes): the
one the group cli-two-workers shares (tests/conftest.py STACK_GROUPS, tests/shared_stacks.py).

- `surgectl stop` checkpoints the boundary step; `surgectl resume` continues the STOPPED job
  from it and ends with the final parameters of an uninterrupted run.
- `surgectl down` drains a running job (checkpoint, PAUSED, journaled), stops the stack and
  every rank; the next `surgectl up` resumes it; it ends bit-identical too.
- A spec with an out-of-range value is refused at submit with one line naming the field and
  starts nothing; a submit that fails after its ranks were launched (control's journal
  refuses the record, injected) leaves no rank process and no job, and the next submit of
  the same size is placed.
Every process of the stack and of its jobs is killed by PID when the group ends (running_stack).

The interrupted jobs are held to PACE a step once they reached the step the test waits for
(``SURGE_FAULT_INJECT`` ``slow_steps``), so that the stop, the drain or the kill finds them
running however slow the machine; the test lifts the pace once their ranks are gone, and
the resumed job runs its remaining steps at its own speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from services.contract import control_pb2
from services.rank.faults import lift_pace
from tests.conftest import REPO, kill_all, processes_with
from tests.faults.test_recovery import SURGECTL, cli, final_state, spec
from tests.test_jobspec_ranges import spec_with

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
STEPS = 60
# Paced from the step after the one each test waits for: at least 60 s more to its end,
# until the test lifts it (200 free-running steps of about 20 ms were once all done before
# a `surgectl stop` on a loaded host had started).
PACE, STOP_AT, CRASH_AT = 2.0, 20, 25
PACED = {"tstopres": STOP_AT + 1, "tdrain": STOP_AT + 1, "tcrash": CRASH_AT + 1}
INJECT = ",".join(
    ["tfail:nan_loss@12"]  # (fires once per job and rank, across relaunches)
    + [f"{job}:slow_steps@{at}:rank={r}:seconds={PACE:g}" for job, at in PACED.items() for r in (0, 1)]
)
STACK_ENV = {"SURGE_CONTROL_FAULT_INJECT": "tjournal:journal_record"}  # (control's, keyed by job name)
JOBS = ("tref", "tshort", "tstopres", "tfail", "tdrain", "trange", "tjournal", "tafter", "tcrash", "tgpu")
# The failed job saves every 5 steps (a version committed before its NaN at step 12 whatever
# the load): over STEPS that was 80 saves, 30 s of a CI run; resumed and compared over
# FAILED_STEPS with a reference of as many steps, it shows the same.
FAILED_STEPS = 40


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its jobs: JOBS."""
    return shared_stack


@pytest.fixture(scope="module")
def reference(stack):
    """The uninterrupted run every interrupted one is compared with (its final state)."""
    job = stack.submit(spec("tref", steps=STEPS, every=1000))
    assert stack.events(job, timeout=300)[-1].status.outcome == JobOutcome.FINISHED
    return final_state(stack.home, job)


@pytest.fixture(scope="module")
def short_reference(stack):
    """An uninterrupted run of FAILED_STEPS steps (its final state)."""
    job = stack.submit(spec("tshort", steps=FAILED_STEPS, every=1000))
    assert stack.events(job, timeout=300)[-1].status.outcome == JobOutcome.FINISHED
    return final_state(stack.home, job)


def write_spec(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def wait_state(stack, job_id: str, state: int, timeout: float = 120) -> control_pb2.JobStatus:
    t0 = time.monotonic()
    while (s := stack.status(job_id)).state != state:
        assert time.monotonic() - t0 < timeout, (
            f"{job_id} is {JobState.Name(s.state)}, not {JobState.Name(state)}: {s.message}"
        )
        time.sleep(0.1)
    return s


def lift(stack, job_id: str) -> None:
    """The job's ranks (and those of its resume) train at their own speed from now on."""
    lift_pace(stack.home / "run" / "faults", job_id)


def wait_no_ranks(job_id: str, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while processes_with(f"--job {job_id} "):
        assert time.monotonic() - t0 < timeout, (
            f"rank processes of {job_id} still run: {processes_with(f'--job {job_id} ')}"
        )
        time.sleep(0.1)


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    model = sorted(k for k in a if k.startswith("model."))
    assert model and sorted(k for k in b if k.startswith("model.")) == model
    assert [k for k in model if not torch.equal(a[k], b[k])] == [], "final parameters differ"
    optim = sorted(k for k in a if k.startswith("optim."))
    assert [k for k in optim if k in b and not torch.equal(a[k], b[k])] == [], "final optimizer state differs"


def messages(stack, job_id: str) -> list[str]:
    return [e.message for e in stack.stub.WatchJob(control_pb2.JobQuery(job_id=job_id), timeout=30)]


def test_a_spec_out_of_range_is_refused_at_submit_naming_the_field_and_starts_nothing(stack, tmp_path):
    for field, text in (
        ("steps", spec("trange").replace("steps: 30", "steps: 100000000000000000000000")),
        ("data.seq_len", spec("trange").replace("seq_len: 64", "seq_len: 10000000000")),
        (
            "liveness.stall_min_seconds",
            spec("trange").replace("stall_min_seconds: 60.0", "stall_min_seconds: 1.0e+300"),
        ),
    ):
        r = cli(stack.home, "submit", str(write_spec(tmp_path, "trange", text)))
        assert r.returncode == 2, r.stdout + r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and f"{field}: " in r.stderr, r.stderr
    assert processes_with("--job trange-") == []
    assert not [j for j in stack.stub.ListJobs(control_pb2.JobQuery()).jobs if j.name == "trange"]


def test_out_of_range_values_in_every_numeric_field_are_refused_by_control_and_start_nothing(stack):
    """Every case of tests/test_jobspec_ranges.py (the fields enumerated from the pydantic
    models), sent to the running control's SubmitJob."""
    import grpc

    from tests.test_jobspec_ranges import CASES

    refused = 0
    for case in CASES:
        path, kind, value, key = case.values
        wrapped = [value] if kind.startswith("list") else {key: value} if kind.startswith("dict") else value
        text = spec_with(path, wrapped).replace("name: ranges", "name: trange")
        with pytest.raises(grpc.RpcError) as caught:
            stack.stub.SubmitJob(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert ".".join(path) in caught.value.details(), caught.value.details()
        refused += 1
    assert refused >= 150
    assert processes_with("--job trange-") == []
    assert not [j for j in stack.stub.ListJobs(control_pb2.JobQuery()).jobs if j.name == "trange"]


def test_a_submit_that_fails_after_its_ranks_launched_leaves_no_rank_no_slot_and_no_job(stack, tmp_path):
    r = cli(stack.home, "submit", str(write_spec(tmp_path, "tjournal", spec("tjournal", steps=STEPS))))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "journal write refused" in r.stderr
    wait_no_ranks("tjournal-")
    assert not [j for j in stack.stub.ListJobs(control_pb2.JobQuery()).jobs if j.name == "tjournal"]
    # Both slots are free again: a job that needs both is placed and runs to its end.
    after = stack.submit(spec("tafter", steps=10))
    assert stack.events(after)[-1].status.outcome == JobOutcome.FINISHED
    log = (stack.home / "run" / "logs" / "control.log").read_text()
    assert "job start failed; taking its ranks back" in log


def test_stop_checkpoints_its_step_and_resume_ends_bit_identical_to_an_uninterrupted_run(stack, reference):
    job = stack.submit(spec("tstopres", steps=STEPS, every=1000))
    stack.wait_step(job, STOP_AT)
    r = cli(stack.home, "stop", job)
    assert r.returncode == 0, r.stdout + r.stderr
    # (the reply comes before the boundary: the line says the job is still running, and why)
    assert f"{job}: stop requested; now RUNNING (it stops at its next step boundary" in r.stdout, r.stdout
    stopped = wait_state(stack, job, JobState.TERMINATED)
    assert stopped.outcome == JobOutcome.STOPPED and stopped.step < STEPS
    log = messages(stack, job)
    assert any(
        m.startswith("stop requested: ranks checkpoint and stop at the next step boundary every rank") for m in log
    )
    assert f"stop: every rank agreed on after step {stopped.step}" in log, log  # the boundary, from the ranks
    assert any(m.startswith(f"checkpoint {job}:1 at step {stopped.step} ") for m in log), log
    wait_no_ranks(job)
    lift(stack, job)

    r = cli(stack.home, "resume", job)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from checkpoint {job}:1 (step {stopped.step}); now WARMING_UP" in r.stdout
    events = stack.events(job, timeout=300)
    assert (events[-1].status.state, events[-1].status.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED)
    assert any(e.message.startswith(f"resume TERMINATED (STOPPED) from checkpoint {job}:1") for e in events)
    steps = [r["step"] for r in stack.step_records(job) if r["rank"] == 0]
    assert steps == list(range(1, STEPS + 1)), "a step lost or repeated across the stop and resume"
    same_state(reference, final_state(stack.home, job))

    # Resuming what has nothing left, or cannot be found, is one line.
    r = cli(stack.home, "resume", job)
    assert r.returncode != 0 and "is TERMINATED (FINISHED)" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_failed_job_resumes_from_its_newest_verified_checkpoint_and_ends_bit_identical(stack, short_reference):
    # A NaN loss at step 12 under a policy that stops: FAILED. Its checkpoints (every 5 steps)
    # stay; resume continues from the one at step 10 (the injection fired once).
    text = spec("tfail", steps=FAILED_STEPS, every=5) + "fault_policy: {actions: {non_finite_loss: stop}}\n"
    job = stack.submit(text)
    failed = stack.events(job)[-1].status
    assert (failed.state, failed.outcome) == (JobState.TERMINATED, JobOutcome.FAILED), failed.message
    wait_no_ranks(job)
    # The newest version committed (step 10's save may still have been writing when the rank
    # failed at step 12: then the one at step 5).
    listed = cli(stack.home, "checkpoints", job, "-o", "json")
    newest = max(json.loads(listed.stdout), key=lambda c: int(c["step"]))
    assert int(newest["step"]) in (5, 10)
    r = cli(stack.home, "resume", job)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from checkpoint {newest['version']} (step {newest['step']}); now WARMING_UP" in r.stdout, (
        r.stdout + listed.stdout
    )
    events = stack.events(job, timeout=300)
    assert (events[-1].status.state, events[-1].status.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED), events[
        -1
    ].message
    assert any(e.message.startswith("resume TERMINATED (FAILED) from checkpoint") for e in events)
    same_state(short_reference, final_state(stack.home, job))


def test_down_drains_a_running_job_and_up_resumes_it_bit_identical(stack, reference):
    # The stack is stopped and started again (same control port).
    job = stack.submit(spec("tdrain", steps=STEPS, every=1000))
    stack.wait_step(job, STOP_AT)
    services = json.loads((stack.home / "run" / "stack.json").read_text())["services"]
    r = cli(stack.home, "down", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"1 job running: {job} (RUNNING); draining" in r.stdout
    assert f"{job}: PAUSED at step " in r.stdout
    for name, s in services.items():
        assert not processes_with(f"--port {s['port']} "), f"{name} still runs after down"
    wait_no_ranks(job, timeout=15)
    lift(stack, job)

    r = cli(stack.home, "up", "--workers", "2", env=stack.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed drained job {job} from checkpoint {job}:1" in r.stdout, r.stdout + r.stderr
    events = stack.events(job, timeout=300)
    assert (events[-1].status.state, events[-1].status.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED), events[
        -1
    ].message
    log = [e.message for e in events]
    assert any(m.startswith("drain (pause, then the stack stops) requested") for m in log)
    paused = [m for m in log if "; drained: `surgectl up` resumes it from checkpoint" in m]
    assert len(paused) == 1, log
    assert not [e for e in events if e.type == "fault"], [e.message for e in events if e.type == "fault"]
    steps = [r["step"] for r in stack.step_records(job) if r["rank"] == 0]
    assert steps == list(range(1, STEPS + 1)), "a step lost or repeated across down and up"
    same_state(reference, final_state(stack.home, job))


def test_up_after_a_kill_9_of_every_service_continues_the_running_job_bit_identical(stack, reference):
    # After the down/up test: the stack is up again. Every service is SIGKILLed under a running
    # job (its ranks lose their node agents); `surgectl up` brings the stack back on the same
    # ports, control restores the job from its journal and continues it (from its newest
    # checkpoint, as its ranks are gone): it ends like an uninterrupted run.
    job = stack.submit(spec("tcrash", steps=STEPS, every=10))
    stack.wait_step(job, CRASH_AT)
    services = json.loads((stack.home / "run" / "stack.json").read_text())["services"]
    kill_all([s["pid"] for s in services.values()])
    t0 = time.monotonic()
    while any(Path(f"/proc/{s['pid']}").exists() for s in services.values()):
        assert time.monotonic() - t0 < 10, "a SIGKILLed service is still there"
        time.sleep(0.05)
    lift(stack, job)
    r = cli(stack.home, "up", "--workers", "2", env=stack.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    events = stack.events(job, timeout=300)
    assert (events[-1].status.state, events[-1].status.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED), (
        "\n".join(e.message for e in events[-15:])
    )
    print(
        "after kill -9 and up:",
        *[f"  {e.type}: {e.message}" for e in events if e.type in ("decision", "recovery", "fault")],
        sep="\n",
    )
    same_state(reference, final_state(stack.home, job))


def test_a_gpu_job_on_a_cluster_without_gpus_says_why_it_waits_and_follow_prints_it(stack, tmp_path):
    """A fresh user's `submit --follow` of a gpu job on this CPU-only stack waited with no word.
    The follow keeps waiting (a GPU node may join) and prints why: the submit's line and the
    queue event it follows; it ends with the job."""
    text = spec("tgpu").replace("parallel: {dp: 2}", "parallel: {dp: 2, device: gpu}")
    env = {**os.environ, "SURGE_HOME": str(stack.home), "COLUMNS": "400"}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        env.pop(var, None)
    follow = subprocess.Popen(
        [*SURGECTL, "submit", str(write_spec(tmp_path, "tgpu", text)), "--follow"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)  # (list.extend: line by line)
    reader.start()
    why = "no node with a GPU is registered: can never run as things stand; waits for one to join"
    try:
        t0 = time.monotonic()
        while sum(why in line for line in list(lines)) < 2:  # the submit's line, then the follow's event
            assert time.monotonic() - t0 < 120 and follow.poll() is None, "".join(lines)
            time.sleep(0.1)
        job = next(line.split()[1] for line in lines if line.startswith("submitted "))
        (q,) = [q for q in stack.stub.ListTeams(control_pb2.TeamQuery(), timeout=30).queue if q.job_id == job]
        assert q.reason == f"needs 2 ranks (parallel.dp=2) on gpu: {why}" and q.device == "gpu"
        assert cli(stack.home, "cancel", job).returncode == 0
        follow.wait(timeout=60)  # the follow ends with the job
        reader.join(timeout=10)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    out = "".join(lines)
    assert "queued at position 1 of 1" in out and "STOPPED" in out, out
