"""Per-job ordering in control (issue 28 item 2): each job's node agent events applied in
order on its own queue, jobs in parallel on the applier's bounded pool; exactly-once when
one agent's events of two jobs are journaled out of seq order (``WorkerCursor``); the
operator's queries answered from published views while a decision holds the decision lock;
control's queue depth and lag as metrics. In process, on the real control plane (build())."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from services.contract import control_pb2, engine_pb2
from services.control.event_applier import EventApplier
from services.control.worker_cursor import WorkerCursor

from .conftest import drain, registration, settle, stop_plane
from .test_event_applier import heartbeat_event
from .test_worker_events import open_plane, step_event

pytestmark = pytest.mark.timeout(60)


def two_jobs_on_one_agent(plane):
    """wa (2 slots, incarnation i1) runs rank 0 of two dp=1 jobs, both RUNNING."""
    reg = registration("wa", slots=2)
    reg.incarnation = "i1"
    session = plane.c.sessions.open(reg)
    jobs = []
    for _ in range(2):
        job_id = plane.submit(dp=1, steps=500).job_id
        drain(session)
        plane.rank_event(session, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
        drain(session)
        assert plane.get(job_id).state == control_pb2.RUNNING
        jobs.append(job_id)
    return session, jobs


def in_thread(fn, timeout_s: float = 5.0):
    """``fn()``'s result, run on another thread; fails if it takes longer than ``timeout_s``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"{fn} did not return within {timeout_s} s"
    return out[0]


def sample(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_a_job_blocked_in_its_apply_does_not_delay_another_jobs_step(tmp_path):
    """Job A's step hangs in its journal write (a slow disk for A): job B's step, sent after
    it by the same agent, is applied and journaled meanwhile; the operator's status, list and
    history queries are answered; the agent's cursor and ack stay behind A's seq until A's
    apply ends, and the queue depth and oldest-message age say A's queue is behind."""
    plane, journal = open_plane(tmp_path / "control.db")
    session, (a, b) = two_jobs_on_one_agent(plane)
    applier = EventApplier(plane.c.sessions, workers=2)
    release, entered = threading.Event(), threading.Event()
    record_step = journal.record_step

    def slow_for_a(job_id, *args, **how):
        if job_id == a:
            entered.set()
            assert release.wait(30)
        return record_step(job_id, *args, **how)

    journal.record_step = slow_for_a
    try:
        applier.event(session, step_event(a, 1, 1))
        assert entered.wait(10)
        applier.event(session, heartbeat_event(a, 0, 1, 2))  # waits behind A's step, on A's queue
        applier.event(session, step_event(b, 1, 3))
        settle(lambda: [s for s, _ in journal.steps(b)], [1])  # B went on while A is blocked
        assert journal.steps(a) == []
        assert in_thread(lambda: plane.get(b)).step == 1
        assert {s.job_id for s in in_thread(lambda: plane.user(control_pb2.JobQuery())).jobs} == {a, b}
        assert in_thread(lambda: plane.events(b))[-1].job_id == b
        # Exactly-once across the reordering: 3 is journaled, 1 and 2 are not yet.
        assert journal.cursor("wa").has(3) and not journal.cursor("wa").has(1)
        assert journal.worker_cursor("wa") == ("i1", 0) and session.durable == 0
        assert sample("surge_control_queue_depth", queue="job") >= 1  # A's heartbeat
        assert sample("surge_control_oldest_unapplied_seconds") > 0
        assert sample("surge_control_job_queues") >= 1
    finally:
        release.set()
    settle(lambda: [s for s, _ in journal.steps(a)], [1])
    settle(lambda: session.durable, 3)  # (the beat, 2, is done in memory: it writes nothing)
    assert journal.worker_cursor("wa")[1] >= 1  # A's step's row, with 3 (and 2 if marked by then)
    applier.stop()
    assert sample("surge_control_queue_depth", queue="job") == 0
    assert sample("surge_control_applier_lag_seconds_count", queue="job") >= 3
    stop_plane(plane.c)


def test_a_status_query_is_answered_while_a_decision_holds_the_lock(tmp_path):
    plane, journal = open_plane(tmp_path / "control.db")
    session, (a, b) = two_jobs_on_one_agent(plane)
    orchestrator = plane.c.orchestrator
    decided, done = threading.Event(), threading.Event()

    def decision_in_progress():
        with orchestrator._lock:
            decided.set()
            done.wait(30)

    holder = threading.Thread(target=decision_in_progress, daemon=True)
    holder.start()
    try:
        assert decided.wait(5)
        assert in_thread(lambda: plane.get(a)).state == control_pb2.RUNNING
        assert len(in_thread(lambda: plane.user(control_pb2.JobQuery())).jobs) == 2
        history = in_thread(lambda: plane.events(a))
        assert [e.seq for e in history] == list(range(1, len(history) + 1))
    finally:
        done.set()
        holder.join(5)
    stop_plane(plane.c)


def test_each_jobs_events_are_applied_in_order_and_every_seq_once(tmp_path):
    """Two jobs' steps interleaved on one agent's stream, applied by four threads: each job's
    steps journaled in their order, once; the cursor ends at the last seq; resent seqs are
    dropped as duplicates; the beats write nothing (done in memory, issue 28)."""
    plane, journal = open_plane(tmp_path / "control.db")
    session, (a, b) = two_jobs_on_one_agent(plane)
    applier = EventApplier(plane.c.sessions, workers=4, max_burst=3)
    seq = 0
    for n in range(1, 41):
        for job_id in (a, b):
            seq += 1
            applier.event(session, step_event(job_id, n, seq))
            seq += 1
            applier.event(session, heartbeat_event(job_id, 0, n, seq))
    settle(lambda: session.durable, seq)
    # Every step's seq is journaled: the last beat wrote none, and a step journaled while an
    # earlier seq of the other job still waited on its queue rides above the watermark.
    cursor = journal.cursor("wa")
    assert all(cursor.has(s) for s in range(1, seq, 2)), (cursor.watermark, cursor.row_with(()))
    assert cursor.watermark >= seq - 3  # (at most the other job's last beat and step above it)
    for job_id in (a, b):
        assert [s for s, _ in journal.steps(job_id)] == list(range(1, 41))
    duplicates = plane.c.sessions.duplicates
    applier.event(session, step_event(a, 40, seq - 3))  # a resend: already applied
    drained = threading.Event()
    applier.call(drained.set)
    assert drained.wait(10)
    applier.stop()
    assert plane.c.sessions.duplicates == duplicates + 1
    assert [s for s, _ in journal.steps(a)] == list(range(1, 41))
    stop_plane(plane.c)


def test_the_cursor_is_a_watermark_and_the_seqs_journaled_above_it():
    cursor = WorkerCursor("wa", "i1")
    assert cursor.row_with([2, 3]) == ("wa", "i1", 0, "[2, 3]")
    cursor.mark([2, 3])
    assert (cursor.watermark, cursor.has(2), cursor.has(1)) == (0, True, False)
    assert cursor.row_with([1]) == ("wa", "i1", 3, "")
    cursor.mark([1])
    assert cursor.watermark == 3 and cursor.has(1)
    restored = WorkerCursor("wa", "i1", 5, [4, 7])  # (4 is below the watermark: dropped)
    assert restored.row_with([]) == ("wa", "i1", 5, "[7]")


def test_a_restart_after_an_agents_events_were_journaled_out_of_order_applies_each_once(tmp_path):
    """Job B's step (seq 2) is journaled while job A's (seq 1) still waits on A's queue, and
    control dies: the restarted control asks for everything after seq 1's predecessor, applies
    A's step and drops B's resent one (journaled above the watermark)."""
    plane, journal = open_plane(tmp_path / "control.db")
    session, (a, b) = two_jobs_on_one_agent(plane)
    plane.c.sessions.on_worker_events([(session, step_event(b, 1, 2))], admitted=True)  # as B's queue does
    assert journal.cursor("wa").has(2) and journal.worker_cursor("wa") == ("i1", 0)
    stop_plane(plane.c)  # (control dies here: seq 1 was never applied)

    plane, journal = open_plane(tmp_path / "control.db")
    reg = registration("wa", slots=2)
    reg.incarnation = "i1"
    applier = EventApplier(plane.c.sessions)
    session = plane.c.sessions.open(reg)
    assert session.applied == 0  # the surge-last-seq header: the agent resends 1 and 2
    duplicates = plane.c.sessions.duplicates
    applier.event(session, step_event(a, 1, 1))
    applier.event(session, step_event(b, 1, 2))
    settle(lambda: journal.worker_cursor("wa"), ("i1", 2))
    applier.stop()
    assert plane.c.sessions.duplicates == duplicates + 1
    assert [s for s, _ in journal.steps(a)] == [1] and [s for s, _ in journal.steps(b)] == [1]
    stop_plane(plane.c)
