"""A data service that is down is no training fault, on the real stack: the job waits for it.

The stack (control, store, data, two workers; ranks as real processes) is the one its group
shares (tests/shared_stacks.py). The data service is SIGKILLed under a 2-rank
job, as a crash or the OOM killer would, and started again by `surgectl up` (which starts what is
down) as an operator or a container's restart policy would. Asserted: the job's status says it
waits for the data service and what brings it back, its ranks stay alive (never relaunched, no
fault, no decision but the allocation), and once the service is back it continues where its
batches ended: the store's metrics JSONL holds every step of every rank exactly once. With a
short ``fault_policy.data_outage_seconds`` the wait ends PAUSED (never FAILED) with a one-line
hint, and `surgectl resume` continues it once the data service is up.

Each job is held to PACE a step from step 6 (``SURGE_FAULT_INJECT`` ``slow_steps``) until the
data service is back, so that the kill lands mid-run whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from services.rank.faults import lift_pace
from tests.faults.test_compound import events_so_far, wait_for
from tests.faults.test_recovery import JobOutcome, JobState, cli, finished, of_type, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PACE = 0.5
INJECT = ",".join(f"{job}:slow_steps@6:rank={r}:seconds={PACE:g}" for job in ("dwait", "dbound") for r in (0, 1))
BOUND_S = 3.0  # dbound's fault_policy.data_outage_seconds


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def data_pid(stack) -> int:
    return json.loads((stack.home / "run" / "stack.json").read_text())["services"]["data"]["pid"]


def settled(stack, job: str) -> int:
    """The job's step once it stopped moving for a few paced steps (its ranks' read-ahead used up)."""
    step = stack.status(job).step
    time.sleep(4 * PACE + 0.5)
    return step if stack.status(job).step == step else 0


def start_what_is_down(stack) -> None:
    up = cli(stack.home, "up", timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "started again what was down: data" in up.stdout, up.stdout


def test_a_job_waits_for_a_killed_data_service_and_continues_every_step_once_when_it_is_back(stack):
    steps = 24
    # A 5 s stall deadline, far below the outage: a rank waiting for the data service is no stall.
    job = stack.submit(spec("dwait", steps=steps, every=100, stall=5.0))
    stack.wait_step(job, 7)
    old = data_pid(stack)
    os.kill(old, signal.SIGKILL)
    stack.data_down = True  # (the next test starts it if this one fails before it does)
    killed = time.monotonic()
    killed_at = stack.status(job).step
    # The ranks use what they had read ahead, then wait: the job says so (its ranks' relays told it).
    status = wait_for(
        lambda: (s := stack.status(job)).message.startswith("waiting for the data service") and s, 60, "the wait"
    )
    assert status.state == JobState.RUNNING, status
    assert "`surgectl up` starts what is down (or `surgectl restart data`)" in status.message, status.message
    assert "after 300 s (fault_policy.data_outage_seconds)" in status.message, status.message
    # (the table, as the operator reads it; retried: under load the status may move on meanwhile)
    # (COLUMNS wide: a runner's narrower COLUMNS would wrap the message inside its cell)
    table = lambda: cli(stack.home, "status", job, env={"COLUMNS": "1000"}).stdout  # noqa: E731
    shown = [table()]
    t0 = time.monotonic()
    while "waiting for the data service" not in " ".join(shown[-1].split()):
        assert time.monotonic() - t0 < 60, f"surgectl status never said what the job waits for; last:\n{shown[-1]}"
        shown.append(table())
    # (the relays told at the break: the ranks may still train on the batches they had read ahead)
    stuck = wait_for(lambda: settled(stack, job), 60, "the ranks to use up their read-ahead")
    time.sleep(3.0)  # down for a while (longer than the stall deadline by now): nothing fails meanwhile
    assert stack.status(job).step == stuck and stack.status(job).state == JobState.RUNNING
    start_what_is_down(stack)
    stack.data_down = False
    back = time.monotonic()
    assert back - killed > 5.0  # (down past the job's stall deadline)
    assert data_pid(stack) != old
    wait_for(lambda: stack.status(job).step > stuck, 60, "the next step after the data service came back")
    to_next_step = time.monotonic() - back
    lift_pace(stack.home / "run" / "faults", job)
    events = stack.events(job)
    finished(events)  # not FAILED with data_unavailable
    assert len(of_type(events, "decision")) == 1, of_type(events, "decision")  # the allocation only
    assert [e for e in events if e.type == "fault"] == []
    data = of_type(events, "data")
    assert len(data) == 2 and data[1].startswith("data service back after "), data
    for rank in (0, 1):  # each rank's stream broke and was opened again where its batches ended
        text = (stack.home / "run" / "logs" / f"{job}.rank{rank}.log").read_text()
        assert "data_stream_reconnecting" in text and "data_service_back" in text, text[-2000:]
    wait_for(lambda: len(stack.step_records(job)) >= 2 * steps, 30, "every step's record of both ranks")
    records = stack.step_records(job)
    for rank in (0, 1):
        assert sorted(r["step"] for r in records if r["rank"] == rank) == list(range(1, steps + 1))
    print(
        f"data service killed at step {killed_at}, the job waited at step {stuck}; its next step "
        f"{to_next_step:.1f} s after `surgectl up` returned (the data service SERVING, {back - killed:.1f} s after the kill)"
    )


def test_a_data_service_down_past_data_outage_seconds_pauses_the_job_and_resume_continues_it(stack):
    steps = 24
    if getattr(stack, "data_down", False):
        start_what_is_down(stack)
    job = stack.submit(spec("dbound", steps=steps, every=5) + f"fault_policy: {{data_outage_seconds: {BOUND_S:g}}}\n")
    stack.wait_step(job, 7)
    os.kill(data_pid(stack), signal.SIGKILL)
    status = wait_for(lambda: (s := stack.status(job)).state == JobState.PAUSED and s, 60, "the pause")
    assert status.outcome == JobOutcome.OUTCOME_UNSPECIFIED  # never FAILED
    message = status.message
    assert message.startswith("paused: SEVERE data_outage: the data service stayed unreachable for 3 s"), message
    assert message.endswith(
        "bring the data service back (`surgectl up` starts what is down, or `surgectl restart data`), then "
        f"`surgectl resume {job}` continues it from its newest checkpoint"
    ), message
    assert "\n" not in message
    events = events_so_far(stack, job)
    decisions = of_type(events, "decision")
    assert len(decisions) == 2 and decisions[1].startswith("pause after data_outage"), decisions
    wait_for(lambda: not stack.rank_pids(job, 0) and not stack.rank_pids(job, 1), 30, "the ranks to end")
    start_what_is_down(stack)
    lift_pace(stack.home / "run" / "faults", job)
    resumed = cli(stack.home, "resume", job, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    events = stack.events(job)
    assert finished(events).step == steps
    assert [e for e in events if e.type == "fault" and "data_outage" not in e.message] == []
