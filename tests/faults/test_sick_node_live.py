"""Exit causes and a sick node on the real stack (issue 29 item 6).

One stack (control, store, data, three node agents, simulated ranks as real processes: the
torch-free rank of the scale bed, so that three relaunches cost seconds). Rank 1 of a job is
SIGKILLed from outside three times: each exit is classified by its node agent from evidence and
shown with its cause in the job's events; the third makes L1-3 name its node sick, and L1-1
quarantines it: `surgectl status` lists it, the relaunch goes around it, and `surgectl
uncordon` releases it (an unknown worker is one line, exit 2). Its survival of a control
restart is tests/control/test_sick_nodes.py's. Every process the stack started is killed by PID at the end.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.contract import control_pb2
from tests.faults.test_recovery import Stack, cli, running_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
JobState = control_pb2.JobState

JOB = """\
name: tsick
steps: 100000
model: {n_layers: 2, d_model: 32, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 1}
parallel: {dp: 2}
checkpoint: {every_steps: 0}
eval: {every_steps: 0, at_end: false}
simulate: {step_time_s: 0.05, shard_bytes: 1024}
liveness: {attribution_seconds: 0.5}
fault_policy: {max_restarts: 10}
"""


def _wait(what, read, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while not (value := read()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return value


def _running_past(stack: Stack, job: str, step: int) -> None:
    _wait(
        f"{job} RUNNING past step {step}",
        lambda: (s := stack.status(job)).state == JobState.RUNNING and s.step > step,
    )


def _faults(stack: Stack, job: str) -> list[str]:
    history = stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=False), timeout=10)
    # (the survivor's kill at each relaunch is the rank's end, type rank: not a fault of the node)
    severe = [e.message for e in history if e.type == "fault" and e.message.startswith("SEVERE ")]
    # (A survivor's broken all-reduce may be reported too, before or after the victim's exit: a
    # consequence of that incident, on the survivor's own node; the victim's are the subject.)
    return [m for m in severe if not m.startswith("SEVERE comm_error: rank 0 ")]


def test_repeated_sigkills_are_classified_then_quarantine_the_node_until_uncordon(tmp_path):
    # (the product's default: the tests' stacks run with it off, tests/conftest.py)
    with running_stack(tmp_path, ("json",), ("tsick",), workers=3, env={"SURGE_SICK_NODE_FAULTS": "3"}) as stack:
        job = stack.submit(JOB)
        _running_past(stack, job, 2)
        for n in range(1, 4):
            (victim,) = _wait("rank 1's process", lambda: stack.rank_pids(job, 1))
            os.kill(victim, signal.SIGKILL)
            faults = _wait(f"fault {n}", lambda n=n: (f := _faults(stack, job)) and len(f) >= n and f)
            # The cause, from the agent's evidence: a SIGKILL it did not send, no OOM-kill count rise.
            assert faults[n - 1].startswith("SEVERE rank_exit: rank 1 on worker worker-"), faults
            assert "(signal 9): killed by SIGKILL (sender unknown" in faults[n - 1], faults[n - 1]
            if n < 3:
                _running_past(stack, job, 0)
        sick = faults[0].split(" on ", 1)[1].split()[1]  # "rank 1 on worker-N ended ..."
        assert all(f"rank 1 on worker {sick} ended" in f for f in faults[:3]), faults

        listed = _wait("the quarantine", lambda: stack.stub.ListJobs(control_pb2.JobQuery()).cordoned)
        assert [c.worker_id for c in listed] == [sick] and listed[0].quarantine
        assert listed[0].reason.startswith(f"quarantined: 3 rank faults on {sick} in 3 incidents within 600 s")
        _running_past(stack, job, 0)  # relaunched around it
        (relaunch,) = _placement(stack, job)
        assert sick not in relaunch.split("(")[0], relaunch

        status = cli(tmp_path, "status", env={"COLUMNS": "400"})
        assert status.returncode == 0 and sick in status.stdout and "quarantined: 3 rank faults" in status.stdout
        assert f"`surgectl uncordon {sick}`" in status.stdout

        unknown = cli(tmp_path, "uncordon", "worker-99")
        assert unknown.returncode == 2  # (bad input, as surgectl's other refusals)
        assert unknown.stderr.strip().splitlines() == [
            "error: uncordon: no such worker 'worker-99' (registered: worker-0, worker-1, worker-2)"
        ], unknown.stderr
        released = cli(tmp_path, "uncordon", sick)
        assert released.returncode == 0, released.stderr
        assert released.stdout.strip() == f"{sick}: uncordoned; ranks may be placed on it again"
        assert "unhealthy workers" not in cli(tmp_path, "status", env={"COLUMNS": "400"}).stdout
        stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job, no_checkpoint=True))


def _placement(stack: Stack, job: str) -> list[str]:
    """The newest relaunch's "relaunched on wa, wb" line."""
    history = stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=False), timeout=10)
    return [e.message for e in history if e.message.startswith("ranks killed and relaunched")][-1:]
