"""A submit is idempotent by its request id (issue 28 item 6: operator commands are safe to
interrupt): `surgectl submit` sends one request id and sends it again when the reply may
have been lost; control answers a request id it knows with the job that id created, never
a second job, also after a control restart (the id is journaled in the job's row). The same
id with another spec text is refused; no id is an old client's submit: never deduplicated."""

from __future__ import annotations

import sqlite3

import pytest

from services.contract import control_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import RequestIdReused

from .conftest import Plane, drain, spec_yaml, stop_plane

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def submit(plane: Plane, request_id: str, text: str | None = None) -> control_pb2.JobStatus:
    text = spec_yaml(name="idem", dp=1) if text is None else text
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml", request_id=request_id))


def job_ids(plane: Plane) -> list[str]:
    return [j.job_id for j in plane.user(control_pb2.JobQuery()).jobs]


def test_the_same_request_id_twice_is_one_job_answered_with_its_status_now(plane):
    a = plane.register("wa")
    first = submit(plane, "rid-1")
    assert first.state == JobState.WARMING_UP
    again = submit(plane, "rid-1")
    assert again.job_id == first.job_id and again.state == JobState.WARMING_UP
    assert job_ids(plane) == [first.job_id]
    assert [c.WhichOneof("command") for c in drain(a)] == ["launch"]  # its ranks launched once
    (row,) = plane.c.journal.load_jobs()
    assert (row.status.job_id, row.request_id) == (first.job_id, "rid-1") and len(row.spec_sha256) == 64


def test_a_queued_job_is_answered_in_its_place_not_queued_again(plane):
    first = submit(plane, "rid-q", spec_yaml(name="idem", dp=4))  # no worker: it waits
    assert (first.state, first.queue_position) == (JobState.STANDBY, 1)
    again = submit(plane, "rid-q", spec_yaml(name="idem", dp=4))
    assert (again.job_id, again.state, again.queue_position) == (first.job_id, JobState.STANDBY, 1)
    assert job_ids(plane) == [first.job_id]


def test_after_a_control_restart_the_request_id_still_answers_with_its_job(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    first = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        first.register("wa")
        job_id = submit(first, "rid-r").job_id
    finally:
        stop_plane(first.c)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        again = submit(plane, "rid-r")  # (a retry whose first try's reply control's restart lost)
        assert again.job_id == job_id and job_ids(plane) == [job_id]
        with pytest.raises(RequestIdReused):  # the spec text it was journaled with is known too
            submit(plane, "rid-r", spec_yaml(name="idem", dp=1, steps=9))
    finally:
        stop_plane(plane.c)


def test_the_same_request_id_with_another_spec_is_refused_naming_both_and_nothing_is_persisted(plane):
    plane.register("wa")
    job_id = submit(plane, "rid-2").job_id
    with pytest.raises(RequestIdReused) as refused:
        submit(plane, "rid-2", spec_yaml(name="idem", dp=1, steps=9))
    assert str(refused.value) == (
        f"job.yaml: request id rid-2 already submitted job {job_id} with another spec; "
        "a new submit needs a new request id"
    )
    assert isinstance(refused.value, ValueError)  # (control's server answers INVALID_ARGUMENT)
    assert job_ids(plane) == [job_id] and len(plane.c.journal.load_jobs()) == 1


def test_no_request_id_is_never_deduplicated_and_another_id_is_another_job(plane):
    plane.register("wa", slots=4)
    a, b = submit(plane, "").job_id, submit(plane, "").job_id
    c = submit(plane, "rid-3").job_id
    assert len({a, b, c}) == 3 and sorted(job_ids(plane)) == sorted([a, b, c])
    assert {row.request_id for row in plane.c.journal.load_jobs()} == {"", "rid-3"}


def test_a_submit_that_failed_left_no_request_id_behind_its_retry_creates_the_job(plane, monkeypatch):
    plane.register("wa")
    monkeypatch.setattr(plane.c.journal, "create_job", lambda *args: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(Exception, match="disk full"):
        submit(plane, "rid-4")
    monkeypatch.undo()
    assert job_ids(plane) == []
    status = submit(plane, "rid-4")
    assert status.state == JobState.WARMING_UP and job_ids(plane) == [status.job_id]


def test_a_journal_written_before_request_ids_opens_with_none(tmp_path):
    db = tmp_path / "old.db"
    old = sqlite3.connect(db)
    old.execute(
        "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, name TEXT NOT NULL, state INTEGER NOT NULL, "
        "outcome INTEGER NOT NULL, spec_json TEXT NOT NULL, created_unix REAL NOT NULL, "
        "updated_unix REAL NOT NULL, status BLOB NOT NULL)"
    )
    status = control_pb2.JobStatus(job_id="old-1", name="old")
    row = ("old-1", "old", 0, 0, "{}", 1.0, 1.0, status.SerializeToString())
    old.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?)", row)
    old.commit()
    old.close()
    journal = JobStore(db)
    try:
        (row,) = journal.load_jobs()
        assert (row.status.job_id, row.request_id, row.spec_sha256) == ("old-1", "", "")
        journal.create_job(control_pb2.JobStatus(job_id="new-1", name="new", created_unix=2.0), "{}", "rid", "ab")
        assert [(j.request_id, j.spec_sha256) for j in journal.load_jobs()] == [("", ""), ("rid", "ab")]
    finally:
        journal.close()
