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
