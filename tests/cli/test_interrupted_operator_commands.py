"""Operator commands that can be interrupted (issue 28 item 6), on one real stack (control on a
fixed port, store, data, two node agents, a DP=2 job as rank processes): the one the group
cli-two-workers shares (tests/conftest.py STACK_GROUPS, tests/shared_stacks.py).

- Ctrl-C (SIGINT to a real `surgectl down`) while its drain is in flight leaves the stack up
  and says what to run; `surgectl resume JOB` then continues the job (was: PAUSED with its
  ranks holding their slots, refused), and so does `surgectl up` after a second interrupted
  `down` (was: "a stack is already running"); a third interrupted `down` is finished by a
  second `down`, and `up` resumes the job from the drain checkpoint. Stopped, it has every
  step once and no fault. A stop of it again says it had ended, exit 0.
- `down --force` then `up`: the job continues from its newest checkpoint with no fault and no
  restart spent (was: a `worker_lost` fault and a restart spent).
- After a kill -9 of control alone, `status` says `surgectl up`, which starts control alone
  again; after a kill -9 of every service, `status` says `surgectl up` (was: `surgectl restart
  control`; the last test of the module: the stack stays down).

PauseTraining reaches rank 1 of this module's jobs five seconds late (``SURGE_COMMAND_DELAY``,
a test-only delay on the rank's session, ``job=``: the other modules' jobs on the shared stack
pause at once, where they paused 5 s late): every drain's pause is in flight for at least
that long, the window in which the test's Ctrl-C lands. Every process is killed by PID when
the group ends (running_stack); this module leaves the stack's services killed, the group's
turn starts them again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from tests.conftest import REPO, kill_all
from tests.faults.test_recovery import SURGECTL, cli, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
STEPS = 100_000  # (never reached: each job is stopped by the test once it has shown what it must)
STACK_ENV = {"SURGE_COMMAND_DELAY": "PauseTraining:5:rank=1:job=tintr,PauseTraining:5:rank=1:job=tforce"}


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its jobs:
    tintr, tforce."""
    return shared_stack


def services(home: Path) -> dict:
    return json.loads((home / "run" / "stack.json").read_text())["services"]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(what: str, check, timeout: float = 120):
    t0 = time.monotonic()
    while not (got := check()):
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)
    return got


def interrupted_down(stack, job: str) -> subprocess.CompletedProcess:
    """A real `surgectl down`, sent SIGINT (a terminal's Ctrl-C) once control has its drain of
    ``job`` (before the job has paused: its pause reaches rank 1 five seconds late)."""
    proc = subprocess.Popen(
        [*SURGECTL, "down"],
        cwd=REPO,
        env={**os.environ, "SURGE_HOME": str(stack.home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a shell gives a foreground job
    )
    try:
        wait_for(f"{job} drained", lambda: stack.status(job).drained, timeout=60)
        assert stack.status(job).state == JobState.RUNNING, "the drain's pause ended before the Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_left_running(r: subprocess.CompletedProcess, before: dict) -> None:
    assert r.returncode == 130, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.startswith("interrupted: the stack keeps running") and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.stdout + r.stderr
    assert all(alive(s["pid"]) for s in before.values()), "a service was stopped by the interrupted down"


def acted_on_faults(events) -> list[str]:
    """The job's fault events but a MINOR slow-rank finding: an observation that changes
    nothing (on CI's 2 loaded cores one rank's compute can lag its peer's for a while)."""
    return [e.message for e in events if e.type == "fault" and not e.message.startswith("MINOR slow_rank")]


def test_ctrl_c_during_down_s_drain_then_resume_or_up_continues_the_job_and_down_again_finishes(stack):
    job = stack.submit(spec("tintr", steps=STEPS, every=1000))
    before = services(stack.home)

    # 1. Interrupted while draining, then `surgectl resume JOB`: the job continues where it is.
    stack.wait_step(job, 10)
    assert_left_running(interrupted_down(stack, job), before)
    r = cli(stack.home, "resume", job)
    assert r.returncode == 0 and f"{job}: resumed" in r.stdout, r.stdout + r.stderr
    at = stack.status(job).step
    wait_for("the job trains on after the resume", lambda: stack.status(job).step > at + 5)
    assert not stack.status(job).drained

    # 2. Interrupted again, then `surgectl up`: the stack is up already; the job continues.
    assert_left_running(interrupted_down(stack, job), before)
    r = cli(stack.home, "up", "--workers", "2", env=stack.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the stack is already up" in r.stdout and f"drained job {job} continues at step" in r.stdout, r.stdout
    assert {n: s["pid"] for n, s in services(stack.home).items()} == {n: s["pid"] for n, s in before.items()}
    at = stack.status(job).step
    wait_for("the job trains on after up", lambda: stack.status(job).step > at + 5)

    # 3. Interrupted again, then `surgectl down` again: it finishes what the first started
    # (the job checkpoints and pauses, the stack stops); `up` resumes it from that checkpoint.
    assert_left_running(interrupted_down(stack, job), before)
    r = cli(stack.home, "down", timeout=180)
    assert r.returncode == 0 and f"{job}: PAUSED at step " in r.stdout, r.stdout + r.stderr
    assert not any(alive(s["pid"]) for s in before.values())
    r = cli(stack.home, "up", "--workers", "2", env=stack.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"drained job {job}" in r.stdout and "continues" not in r.stdout, r.stdout

    end = stopped_after_training_on(stack, job)
    events = stack.events(job, timeout=60)
    assert not acted_on_faults(events)
    log = [e.message for e in events]
    assert sum("the drain is undone" in m for m in log) >= 2, log  # (rounds 1 and 2)
    steps = [r["step"] for r in stack.step_records(job) if r["rank"] == 0]
    assert steps == list(range(1, end.step + 1)), "a step lost or repeated across the interrupted downs"

    # Stopping what has ended: exit 0, one line saying so (was: an error, exit 1).
    r = cli(stack.home, "stop", job)
    assert r.returncode == 0 and r.stdout.strip() == f"{job}: already TERMINATED (STOPPED); nothing to stop", (
        r.stdout + r.stderr
    )


def stopped_after_training_on(stack, job: str) -> control_pb2.JobStatus:
    """Once ``job`` trains again (5 steps past where it is now), stop it; its final status."""
    at = wait_for(f"{job} RUNNING", lambda: (s := stack.status(job)).state == JobState.RUNNING and s, 180).step
    stack.wait_step(job, at + 5)
    r = cli(stack.home, "stop", job)
    assert r.returncode == 0, r.stdout + r.stderr
    end = wait_for(f"{job} ended", lambda: (s := stack.status(job)).state == JobState.TERMINATED and s, 180)
    assert end.outcome == JobOutcome.STOPPED, end.message
    return end


def test_down_force_then_up_continues_from_the_newest_checkpoint_with_no_fault_and_no_restart_spent(stack):
    job = stack.submit(spec("tforce", steps=STEPS, every=10))
    wait_for("a checkpoint", lambda: stack.status(job).checkpoint_step >= 10)
    r = cli(stack.home, "down", "--force", timeout=120)
    assert r.returncode == 0 and f"{job}: parked at step " in r.stdout, r.stdout + r.stderr
    named = re.search(rf"^{job}: `surgectl up` resumes it from (\S+) \(step (\d+)\)", r.stdout, re.M)
    assert named, r.stdout
    r = cli(stack.home, "up", "--workers", "2", env=stack.env, timeout=180)
    assert r.returncode == 0 and f"drained job {job}" in r.stdout, r.stdout + r.stderr
    # What `down --force` said `up` resumes from is what it resumed from (read after the stop).
    assert f"resumed drained job {job} from checkpoint {named[1]} (step {named[2]})" in r.stdout, r.stdout
    stopped_after_training_on(stack, job)
    events = stack.events(job, timeout=60)
    assert not acted_on_faults(events)
    log = [e.message for e in events]
    assert any(m.startswith("RUNNING -> PAUSED: forced down by the operator at step") for m in log), log
    assert not any("worker_lost" in m or "restart_ranks" in m for m in log), log


def test_after_a_kill_of_control_or_of_every_service_status_says_up_which_starts_what_is_down(stack):
    before = services(stack.home)
    kill_all([before["control"]["pid"]])
    wait_for("control gone", lambda: not alive(before["control"]["pid"]), timeout=10)
    r = cli(stack.home, "status")
    assert r.returncode == 1 and "is down (its process is gone" in r.stderr and "`surgectl up`" in r.stderr, r.stderr
    r = cli(stack.home, "up", env=stack.env, timeout=180)
    assert r.returncode == 0 and "started again what was down: control" in r.stdout, r.stdout + r.stderr
    after = services(stack.home)
    assert after["control"]["pid"] != before["control"]["pid"]
    assert {n: s["pid"] for n, s in after.items() if n != "control"} == {
        n: s["pid"] for n, s in before.items() if n != "control"
    }

    kill_all([s["pid"] for s in after.values()])
    wait_for("every service gone", lambda: not any(alive(s["pid"]) for s in after.values()), timeout=10)
    r = cli(stack.home, "status")
    assert r.returncode == 1 and "every service of the local stack is down" in r.stderr, r.stderr
    assert "`surgectl up` starts again what is down" in r.stderr and "restart" not in r.stderr
    # (`up` after a kill of every service: tests/cli/test_operator_actions.py, the last test)
