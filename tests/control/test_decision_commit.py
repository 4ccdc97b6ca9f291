"""A decision's journal commit is off the decision lock (issue 28 item 2): while one job's
decision waits for a slow commit, another job's events, status, event log and operator
command proceed; the slow decision's commands to its ranks go only once its record is
committed, so a control killed before the commit loses the decision and its commands
together (nothing was sent that the journal does not hold)."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from prometheus_client import REGISTRY

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore

from .conftest import Plane, drain, kinds, stop_plane

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


class Gate:
    """The journal's writer held before its next transaction (a slow disk), until opened."""

    def __init__(self, plane: Plane):
        writer = plane.c.journal._writer
        self.entered, self.opened, self.armed = threading.Event(), threading.Event(), False
        transaction = writer._transaction

        def slow(writes):
            if self.armed:
                self.armed = False
                self.entered.set()
                assert self.opened.wait(30)
            return transaction(writes)

        writer._transaction = slow

    def arm(self) -> None:
        self.entered.clear()
        self.opened.clear()
        self.armed = True


def two_running_jobs(plane: Plane):
    a = plane.register("wa")
    job_a = plane.submit(name="a", dp=1, steps=50).job_id
    b = plane.register("wb")
    job_b = plane.submit(name="b", dp=1, steps=50).job_id
    for job_id, session in ((job_a, a), (job_b, b)):
        plane.rank_event(session, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
        plane.rank_event(session, job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    drain(a), drain(b)
    return (job_a, a), (job_b, b)


def in_thread(call):
    """``call()`` on a thread: (thread, its result or error, once it ends)."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def quick(call, limit_s: float = 2.0):
    started = time.monotonic()
    value = call()
    assert time.monotonic() - started < limit_s, f"took {time.monotonic() - started:.1f} s"
    return value


def test_a_slow_commit_holds_only_its_decisions_reply_and_commands(plane, request):
    (job_a, a), (job_b, b) = two_running_jobs(plane)
    gate = Gate(plane)
    request.addfinalizer(gate.opened.set)
    gate.arm()
    pause_a, reply_a = in_thread(lambda: plane.user(control_pb2.PauseJobRequest(job_id=job_a, no_checkpoint=True)))
    assert gate.entered.wait(10)  # the pause's record is being committed, slowly
    time.sleep(0.2)
    # Its reply waits for the commit, and nothing went to its ranks: the record comes first.
    assert pause_a.is_alive() and drain(a) == []
    # Control's lag says so: a write queued, not committed, and a command waiting for it.
    assert REGISTRY.get_sample_value("surge_control_journal_queue_depth") >= 1
    assert REGISTRY.get_sample_value("surge_control_outbox_depth") >= 1
    # The decision lock is free: another job's status, its event log and an operator command
    # are answered or decided meanwhile.
    orch = plane.c.orchestrator
    assert quick(lambda: orch._lock._lock.acquire(timeout=1.0))
    orch._lock._lock.release()
    assert quick(lambda: plane.get(job_b)).state == JobState.RUNNING
    assert [e.type for e in quick(lambda: plane.events(job_b))][-1] == "step"
    stop_b, reply_b = in_thread(lambda: plane.user(control_pb2.StopJobRequest(job_id=job_b, no_checkpoint=True)))
    deadline = time.monotonic() + 5
    while orch._jobs[job_b].pending != "stop":  # B's decision is taken, its reply waits for the commit
        assert time.monotonic() < deadline, "B's stop was not decided while A's commit was slow"
        time.sleep(0.01)
    # A's status shows its decision (the view is published as the decision ends); not yet sent.
    assert drain(a) == []
    gate.opened.set()
    pause_a.join(10)
    stop_b.join(10)
    assert "error" not in reply_a and "error" not in reply_b, (reply_a, reply_b)
    assert kinds(drain(a)) == ["PauseTraining"]
    assert "StopTraining" in kinds(drain(b))
    assert "pause" in plane.events(job_a)[-1].message
    assert REGISTRY.get_sample_value("surge_control_journal_commit_seconds_count") > 0


def test_a_control_killed_before_the_commit_loses_the_decision_and_its_commands(plane, tmp_path):
    (job_a, a), (job_b, b) = two_running_jobs(plane)
    seq_before = plane.events(job_a)[-1].seq
    gate = Gate(plane)
    gate.arm()
    pause_a, _ = in_thread(lambda: plane.user(control_pb2.PauseJobRequest(job_id=job_a, no_checkpoint=True)))
    assert gate.entered.wait(10)
    time.sleep(0.2)
    # Killed here: what a restarted control reads is what the journal's file holds now.
    killed = tmp_path / "killed.db"
    source, copy = sqlite3.connect(plane.c.journal._path), sqlite3.connect(killed)
    source.backup(copy)
    source.close(), copy.close()
    sent_before_the_commit = drain(a)
    gate.opened.set()
    pause_a.join(10)
    assert sent_before_the_commit == []  # nothing went out that the killed control's journal lacks
    journal = JobStore(killed)
    assert journal.events(job_a)[-1].seq == seq_before  # the pause's record is lost ...
    restarted = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        assert not any("pause" in e.message for e in restarted.events(job_a))
        assert restarted.c.orchestrator._jobs[job_a].pending == ""  # ... and so is the pause itself
        assert restarted.c.orchestrator._jobs[job_a].in_flight == {}  # (nothing to send again)
    finally:
        stop_plane(restarted.c)


def test_a_command_tied_to_a_step_write_nobody_waits_for_goes_once_it_is_committed(plane, request):
    # Rank 0's step queues its write after the decision and does not wait for it; a command
    # decided next, with no record of its own, waits for that write: the thread that decided
    # it waits too and sends it (else it stayed in the outbox until the job's next decision).
    (job_a, a), _ = two_running_jobs(plane)
    gate = Gate(plane)
    request.addfinalizer(gate.opened.set)
    gate.arm()
    step = engine_pb2.StepCompleted(step=2, loss=2.0, tokens=64)
    stepped, _ = in_thread(lambda: plane.rank_event(a, job_a, 0, step=step))
    assert gate.entered.wait(10)  # the step's write is being committed, slowly
    orch = plane.c.orchestrator

    def decide() -> None:
        with orch._lock:
            orch._loop(engine_pb2.ResumeTraining(job_id=job_a))

    decided, out = in_thread(decide)
    time.sleep(0.3)
    assert decided.is_alive() and drain(a) == []  # behind the step's record
    gate.opened.set()
    decided.join(10), stepped.join(10)
    assert "error" not in out, out
    assert kinds(drain(a)) == ["ResumeTraining"]
