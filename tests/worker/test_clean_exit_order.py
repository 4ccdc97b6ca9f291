"""A rank that exits 0 is reported (RankExited) only after its session stream was read to its
end, when its loop's end (TrainingLoopFinished) had not been read by the exit: that event is what
makes the exit a normal one, and a RankExited ahead of it is graded a rank lost early
(services/control/orchestrator/triage.py) and recovered. A loaded agent's stream reader can lag
the exit by more than the half second a failed rank's report waits (services/worker/rank_launcher.py
``CLEAN_EXIT_SETTLE_SECONDS``). A process of the real launcher; the stream's reader stands still
(its end is set by the test) so that the order is the test's to choose."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import structlog

from services.contract import control_pb2, engine_pb2
from services.worker import rank_launcher
from services.worker.node_agent import NodeAgent

pytestmark = pytest.mark.timeout(60)

READER_LAG_S = 3.0  # (past STREAM_SETTLE_SECONDS, inside CLEAN_EXIT_SETTLE_SECONDS)


def exit_reported_after_a_lagging_reader(tmp_path, monkeypatch, code: int, loop_end_read: bool) -> tuple[float, float]:
    """Launch a rank that exits with ``code`` at once; its stream's reader ends READER_LAG_S after
    the exit. When (monotonic) the reader ended and when its RankExited was emitted."""
    monkeypatch.setattr(
        rank_launcher, "rank_command_line", lambda *a: [sys.executable, "-c", f"raise SystemExit({code})"]
    )
    emitted: dict[str, float] = {}
    events: list[control_pb2.WorkerEvent] = []

    def emit(event: control_pb2.WorkerEvent) -> None:
        if event.HasField("rank_exited"):
            emitted["at"] = time.monotonic()
        events.append(event)

    agent = NodeAgent(
        "w1", "127.0.0.1:1", tmp_path, emit=emit, log=structlog.get_logger(), rank_module="not.the.agents"
    )
    agent.launch_ranks(
        control_pb2.LaunchRanks(
            job_id="j",
            init=engine_pb2.InitJob(job_id="j", spec_json=json.dumps({"name": "j"})),
            ranks=[engine_pb2.RankAssignment(rank=0, world_size=1, device="cpu", generation=1)],
        )
    )
    (r,) = agent._ranks.values()
    with agent._lock:
        r.session = "open"  # (as if its hello came: a session whose reader has not reached its end)
        r.loop_ended = loop_end_read
    ended: dict[str, float] = {}

    def reader_ends() -> None:
        ended["at"] = time.monotonic()
        r.stream_closed.set()

    # The reader's lag counts from the exit, not the launch (an interpreter's start on a loaded
    # machine can take seconds): the agent's waiter marks the rank dead the moment it reaps it.
    deadline = time.monotonic() + 30
    while not r.dead:
        assert time.monotonic() < deadline, "the rank process did not exit"
        time.sleep(0.01)
    timer = threading.Timer(READER_LAG_S, reader_ends)
    timer.start()
    try:
        assert r.exited.wait(30), "no RankExited"
    finally:
        timer.join()
    assert [e.rank_exited.exit_code for e in events if e.HasField("rank_exited")] == [code]
    return ended["at"], emitted["at"]


def test_a_clean_exit_whose_loop_end_was_not_read_yet_is_reported_after_its_stream_ends(tmp_path, monkeypatch):
    reader_ended, reported = exit_reported_after_a_lagging_reader(tmp_path, monkeypatch, 0, loop_end_read=False)
    assert reported >= reader_ended  # (was: 0.5 s after the exit, ahead of what its stream still held)


@pytest.mark.parametrize("code, loop_end_read", [(1, False), (0, True)], ids=["failed-exit", "loop-end-read"])
def test_a_failed_exit_or_one_whose_loop_end_was_read_is_reported_without_waiting_for_the_stream(
    tmp_path, monkeypatch, code, loop_end_read
):
    # A failed rank's report is what a recovery starts from: it waits the half second only.
    reader_ended, reported = exit_reported_after_a_lagging_reader(tmp_path, monkeypatch, code, loop_end_read)
    assert reported < reader_ended
