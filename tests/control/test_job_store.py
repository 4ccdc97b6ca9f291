"""The SQLite journal keeps jobs and event logs across a reopen."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2
from services.control.job_store import JobStore

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def test_jobs_and_events_survive_a_reopen(tmp_path):
    db = tmp_path / "sub" / "control.db"
    store = JobStore(db)
    status = control_pb2.JobStatus(job_id="demo-abcdef", name="demo", state=JobState.WARMING_UP, created_unix=1.0)
    store.create_job(status, '{"name": "demo"}')
    for seq, (state, step) in enumerate(
        [(JobState.RUNNING, 0), (JobState.RUNNING, 10), (JobState.TERMINATED, 20)], start=1
    ):
        status.state, status.step = state, step
        event = control_pb2.JobEvent(
            job_id=status.job_id,
            seq=seq,
            unix_time=float(seq),
            source=Module.L1_ORCHESTRATOR,
            type="state",
            status=status,
        )
        store.save_status(status, event)
    store.close()

    store = JobStore(db)
    (job,) = store.load_jobs()
    assert (job.status.job_id, job.status.state, job.status.step) == ("demo-abcdef", JobState.TERMINATED, 20)
    assert (job.spec_json, job.last_seq) == ('{"name": "demo"}', 3)
    events = store.events("demo-abcdef", from_seq=2)
    assert [(e.seq, e.status.step, e.source) for e in events] == [
        (2, 10, Module.L1_ORCHESTRATOR),
        (3, 20, Module.L1_ORCHESTRATOR),
    ]
    assert store.events("unknown") == []
    store.close()


def test_a_failed_event_write_leaves_the_status_unchanged(tmp_path):
    store = JobStore(tmp_path / "c.db")
    status = control_pb2.JobStatus(job_id="j", name="j", state=JobState.WARMING_UP)
    store.create_job(status, "{}")
    event = control_pb2.JobEvent(job_id="j", seq=1, type="state")
    store.save_status(status, event)
    status.state = JobState.RUNNING
    with pytest.raises(Exception, match="UNIQUE"):
        store.save_status(status, event)  # same seq again: the transaction rolls back
    assert store.load_jobs()[0].status.state == JobState.WARMING_UP
    store.close()


def _journal_of(tmp_path, types: list[str]) -> JobStore:
    """A journal of job "j" with one event per word of ``types``, seq 1..N, each status's step its seq."""
    store = JobStore(tmp_path / "c.db")
    status = control_pb2.JobStatus(job_id="j", name="j", state=JobState.RUNNING)
    store.create_job(status, "{}")
    for seq, kind in enumerate(types, start=1):
        status.step = seq
        store.save_status(
            status, control_pb2.JobEvent(job_id="j", seq=seq, type=kind, message=f"m{seq}", status=status)
        )
    return store


def test_events_tail_and_types_are_the_newest_of_those_types_in_seq_order(tmp_path):
    store = _journal_of(tmp_path, ["state", "step", "step", "fault", "step", "decision", "step", "state"])
    assert [e.seq for e in store.events("j", tail=3)] == [6, 7, 8]  # the newest three, oldest first
    assert [(e.seq, e.status.step, e.message) for e in store.events("j", tail=2, types=["step"])] == [
        (5, 5, "m5"),
        (7, 7, "m7"),
    ]
    assert [e.seq for e in store.events("j", types=["fault", "decision"])] == [4, 6]
    assert [e.seq for e in store.events("j", tail=1, types=["fault", "decision", "fault"])] == [6]
    assert [e.seq for e in store.events("j", from_seq=4, tail=10, types=["step"])] == [5, 7]  # tail > what there is
    assert [e.seq for e in store.events("j", tail=100)] == list(range(1, 9))
    assert store.events("j", types=["no-such-type"]) == []  # an unknown word matches nothing
    assert store.events("j", tail=5, types=["no-such-type"]) == []
    assert [e.seq for e in store.events("j")] == list(range(1, 9))  # no tail, no types: all, as before
    assert store.events("other", tail=3, types=["step"]) == []
    store.close()


def test_the_tail_of_a_long_history_reads_only_its_rows(tmp_path, monkeypatch):
    """The selection is SQL's: the tail of 2,000 events deserialises its 5 statuses, not 2,000."""
    store = _journal_of(tmp_path, ["step"] * 1999 + ["state"])
    parsed = []
    real = control_pb2.JobStatus.FromString
    monkeypatch.setattr(control_pb2.JobStatus, "FromString", lambda blob: parsed.append(1) or real(blob))
    assert [e.seq for e in store.events("j", tail=5)] == [1996, 1997, 1998, 1999, 2000]
    assert [e.seq for e in store.events("j", tail=1, types=["state"])] == [2000]
    assert len(parsed) == 6
    store.close()
