"""The journal's group commit (issue 28 item 2, services/control/journal_writer.py): every job's
writes queued while a commit is under way go in the next transaction together, in the order
queued; a write that fails fails alone; a rank 0 step applied by the event applier is not
waited for, and its ack goes down only once the write carrying its cursor is committed."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from prometheus_client import REGISTRY

from services.contract import control_pb2
from services.control.event_applier import EventApplier
from services.control.job_store import JobStore

from .conftest import settle, stop_plane
from .test_per_job_order import two_jobs_on_one_agent
from .test_worker_events import acks, open_plane, step_event

pytestmark = pytest.mark.timeout(60)


def commits() -> float:
    return REGISTRY.get_sample_value("surge_control_journal_commits_total") or 0.0


def held_writer(journal: JobStore) -> threading.Event:
    """Hold the journal's writer in a write of its own until the returned event is set (a
    slow disk): whatever is queued meanwhile is the next group."""
    entered, release = threading.Event(), threading.Event()

    def slow(db: sqlite3.Connection) -> None:
        entered.set()
        assert release.wait(30)

    journal._writer.submit(slow)
    assert entered.wait(10)
    return release


def job(job_id: str) -> control_pb2.JobStatus:
    return control_pb2.JobStatus(job_id=job_id, name=job_id)


def test_writes_queued_during_a_commit_are_committed_together_in_their_order(tmp_path):
    journal = JobStore(tmp_path / "control.db")
    for job_id in ("a", "b"):
        journal.create_job(job(job_id), "{}")
    release = held_writer(journal)
    before = commits()
    futures = [
        journal.record_step(job_id, step, 1.0, 64, 0.0, wait=False) for step in (1, 2, 3) for job_id in ("a", "b")
    ]
    event = control_pb2.JobEvent(job_id="a", seq=1, status=job("a"))
    emitted: list[int] = []
    futures.append(journal.save_status(job("a"), event, on_commit=lambda: emitted.append(1), wait=False))
    assert not any(f.done() for f in futures) and emitted == []
    release.set()
    for f in futures:
        f.result(10)
    assert commits() == before + 2  # the held write's, then one for the seven queued behind it
    assert [s for s, _ in journal.steps("a")] == [1, 2, 3] and [s for s, _ in journal.steps("b")] == [1, 2, 3]
    assert [e.seq for e in journal.events("a")] == [1] and emitted == [1]
    journal.close()


def test_a_failing_write_fails_alone_and_the_rest_of_its_group_is_committed(tmp_path):
    journal = JobStore(tmp_path / "control.db")
    journal.create_job(job("a"), "{}")
    release = held_writer(journal)
    first = journal.record_step("a", 1, 1.0, 64, 0.0, wait=False)
    again = journal._writer.submit(lambda db: db.execute("INSERT INTO jobs (job_id) VALUES ('a')"))  # (no such row)
    then = journal.record_step("a", 2, 1.0, 64, 0.0, wait=False)
    release.set()
    first.result(10), then.result(10)
    with pytest.raises(sqlite3.IntegrityError):
        again.result(10)
    assert [s for s, _ in journal.steps("a")] == [1, 2]
    journal.close()


def test_an_applied_steps_ack_waits_for_its_commit_and_the_applier_does_not(tmp_path):
    """The applier's thread queues rank 0's step and goes on (the job's next message is
    applied while the commit is held up); the agent's cursor and ack say nothing of the step
    until the write carrying its cursor is committed."""
    plane, journal = open_plane(tmp_path / "control.db")
    session, (a, b) = two_jobs_on_one_agent(plane)
    acks(plane, session)
    applier = EventApplier(plane.c.sessions, workers=1)
    release = held_writer(journal)
    try:
        applier.event(session, step_event(a, 1, 1))
        applier.event(session, step_event(b, 1, 2))
        settle(lambda: (plane.get(a).step, plane.get(b).step), (1, 1))  # applied, with the writer held
        assert session.durable == 0 and acks(plane, session) == []
    finally:
        release.set()
    settle(lambda: session.durable, 2)
    settle(lambda: acks(plane, session)[-1:], [2])
    assert [s for s, _ in journal.steps(a)] == [1] and [s for s, _ in journal.steps(b)] == [1]
    applier.stop()
    stop_plane(plane.c)


def test_a_failed_writes_cursor_is_journaled_without_it(tmp_path):
    """A step write that fails (its event's seq is journaled already) is rolled back whole,
    and the worker event's cursor it carried is journaled alone: the event is skipped for
    good, as a refused one is, and does not hold the agent's watermark back."""
    journal = JobStore(tmp_path / "control.db")
    journal.create_job(job("a"), "{}")
    event = control_pb2.JobEvent(job_id="a", seq=1, status=job("a"))
    journal.save_status(job("a"), event)
    with journal.applying("wa", "i1", 1) as ctx:
        failing = journal.record_step("a", 1, 1.0, 64, 0.0, [(job("a"), event, None, None)], wait=False)
    with pytest.raises(sqlite3.IntegrityError):
        failing.result(10)
    assert ctx.durable is failing and journal.steps("a") == []
    assert journal.worker_cursor("wa") == ("i1", 1)
    journal.close()
