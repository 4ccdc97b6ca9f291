"""A decision whose journal write fails at its commit, after the decision (a full disk, an
I/O error), is undone (issue 28 item 2): the operator is told it failed, and nothing of it
stays in memory that the journal lacks. Each decision's undo is stated beside it:

- a submit's "ranks allocated": its start abandoned (the ranks launched killed, their slots
  freed, the job forgotten, in memory and in the journal);
- an operator resume's relaunch: its ranks killed, the job put back as it was (TERMINATED,
  its step and versions), in memory and in the journal;
- an operator stop: no longer in flight (its StopTraining, behind the record, never sent);
- a recovery decision: nothing can be unsent (its relaunch is commanded as it is decided),
  so it is written again, with an event saying so: a control restarted on the journal then
  continues that recovery rather than deciding the fault afresh.

The failure is injected in the journal writer's transaction: the write's statements run,
then the transaction fails and is rolled back (the writer retries it alone; it fails again),
as SQLite does on a full disk."""

from __future__ import annotations

import re
import sqlite3
import time

import pytest

from services.contract import Module, control_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore, _save_statements
from services.control.orchestrator import JobNotFound

from . import test_operator_actions as operator_actions
from .conftest import Plane, drain, kinds, settle, stop_plane
from .test_operator_actions import running_job, saved, stopped_job

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)
FULL = "database or disk is full (injected)"
FAILED = re.escape(FULL)
# The operator-actions file's control plane and store (the store answers verifications with
# the versions a test gives it).
plane, store = operator_actions.plane, operator_actions.store


class LostCommits:
    """The journal's writes whose event ``match``es fail at their commit; ``failed``: their
    events' messages."""

    def __init__(self, monkeypatch, journal: JobStore, match):
        self.failed: list[str] = []
        real = journal.save_status

        def save_status(status, event=None, runtime=None, spec_json=None, **kw):
            if event is None or not match(event):
                return real(status, event, runtime, spec_json, **kw)
            self.failed.append(event.message)
            statements = _save_statements([(status, event, runtime, spec_json)], {})

            def full_disk(db):
                statements(db)
                raise full()

            return journal._write(full_disk, **kw)

        monkeypatch.setattr(journal, "save_status", save_status)
        real_all = journal.save_statuses

        def save_statuses(saves, **kw):  # (one write of several records: lost whole if one matches)
            hit = [e.message for _, e, _, _ in saves if e is not None and match(e)]
            if not hit:
                return real_all(saves, **kw)
            self.failed.extend(hit)
            statements = _save_statements(saves, {})

            def full_disk(db):
                statements(db)
                raise full()

            return journal._write(full_disk, **kw)

        monkeypatch.setattr(journal, "save_statuses", save_statuses)


def full() -> sqlite3.OperationalError:
    """What SQLite raises on a full disk: its text, and its result code (SQLITE_FULL), which
    is what the journal's writer reads (services/control/journal_failure.py)."""
    error = sqlite3.OperationalError(FULL)
    error.sqlite_errorcode, error.sqlite_errorname = sqlite3.SQLITE_FULL, "SQLITE_FULL"
    return error


def decision(prefix: str):
    return lambda e: e.type == "decision" and e.message.startswith(prefix)


def stored(journal: JobStore, job_id: str):
    return {j.status.job_id: j for j in journal.load_jobs()}.get(job_id)


def test_a_submit_whose_allocation_record_is_lost_keeps_no_launched_ranks(plane, monkeypatch):
    a, b = plane.register("wa"), plane.register("wb")
    journal = plane.c.journal
    lost = LostCommits(monkeypatch, journal, lambda e: e.type == "decision" and "ranks allocated" in e.message)
    with pytest.raises(Exception, match=FAILED):
        plane.submit(name="half", dp=2)
    assert len(lost.failed) == 1
    launched = set()
    for session in (a, b):
        commands = drain(session)
        assert [c.WhichOneof("command") for c in commands] == ["launch", "release"]
        launch, release = commands
        assert release.release.kill and release.release.job_id == launch.launch.job_id
        launched.add(launch.launch.job_id)
    (job_id,) = launched
    with pytest.raises(JobNotFound):
        plane.get(job_id)
    assert stored(journal, job_id) is None and journal.events(job_id) == []
    monkeypatch.undo()
    assert plane.submit(name="whole", dp=2).state == JobState.WARMING_UP  # (every slot free again)


def test_a_resume_whose_relaunch_record_is_lost_is_put_back_as_it_was(plane, store, monkeypatch):
    job_id, a, b = stopped_job(plane, store, at=6)
    journal = plane.c.journal
    lost = LostCommits(monkeypatch, journal, decision("resume "))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert len(lost.failed) == 1
    for session in (a, b):  # its ranks launched, then killed
        assert [c.WhichOneof("command") for c in drain(session)] == ["launch", "release"]
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.step, s.checkpoint_version) == (
        JobState.TERMINATED,
        JobOutcome.STOPPED,
        6,
        f"{job_id}:1",
    )
    kept = stored(journal, job_id)
    assert (kept.status.state, kept.status.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert not any(e.message.startswith("resume ") for e in journal.events(job_id))
    monkeypatch.undo()
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.WARMING_UP  # asked again


def test_a_queued_resume_whose_relaunch_record_is_lost_waits_in_the_queue_again(plane, store, monkeypatch):
    job_id, a, b = stopped_job(plane, store, at=6)
    c = plane.register("wc")
    blocker = plane.submit(name="blocker", dp=1)
    plane.submit(name="blocker", dp=1)
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.STANDBY  # queued: no room
    for session in (a, b, c):
        drain(session)
    lost = LostCommits(monkeypatch, plane.c.journal, decision("resume "))
    plane.user(control_pb2.StopJobRequest(job_id=blocker.job_id))  # room: the queue's head is placed ...
    settle(lambda: len(lost.failed), 1)
    # ... its record lost: its ranks killed, and it waits in the queue again, as it was.
    s = settle(lambda: (plane.get(job_id).state, plane.get(job_id).queue_position), (JobState.STANDBY, 1))
    sent: list = []

    def ours() -> list[str]:  # the undo's releases follow the failed commit, on its own thread
        sent.extend(cmd for session in (a, b, c) for cmd in drain(session))
        kinds = [cmd.WhichOneof("command") for cmd in sent]
        return sorted(
            k for k, cmd in zip(kinds, sent) if k in ("launch", "release") and getattr(cmd, k).job_id == job_id
        )

    settle(ours, ["launch", "launch", "release", "release"])  # (killed: the blocker's ranks are another job's)
    job = plane.c.orchestrator._jobs[job_id]
    assert job.relaunch is not None and job.relaunch["version"] == f"{job_id}:1"
    kept = stored(plane.c.journal, job_id)
    assert kept.status.state == JobState.STANDBY and kept.runtime["queued"] is not None  # (so after a restart)
    assert s == (JobState.STANDBY, 1)


# (The two below call the orchestrator's handler directly, to see what the undo left alone:
# through the bus, L1-1's failure also goes up to L1-3 as OrchestratorFailed, graded
# journal_write_failed, which the job's policy ignores by default: test_journal_failure.py.)


def test_a_stop_whose_record_is_lost_is_not_in_flight(plane, monkeypatch):
    job_id, a, b = running_job(plane)
    orch = plane.c.orchestrator
    LostCommits(monkeypatch, plane.c.journal, decision("stop requested"))
    with pytest.raises(sqlite3.OperationalError, match=FAILED):
        orch.stop_job_request(control_pb2.StopJobRequest(job_id=job_id))
    assert drain(a) == [] and drain(b) == []  # its StopTraining never went
    job = orch._jobs[job_id]
    assert (job.pending, job.pending_seq, job.in_flight) == ("", 0, {})  # nothing in flight to send again
    assert plane.get(job_id).state == JobState.RUNNING
    monkeypatch.undo()
    plane.user(control_pb2.StopJobRequest(job_id=job_id))  # asked again: decided and sent
    assert kinds(drain(b)) == ["StopTraining"]


def test_a_recovery_decision_whose_record_is_lost_is_written_again_and_a_restart_continues_it(
    plane, store, monkeypatch, tmp_path
):
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, at=4)
    store.versions[job_id] = [(f"{job_id}:1", 4, True, "")]
    journal = plane.c.journal
    lost = LostCommits(monkeypatch, journal, decision("restart_ranks"))
    now = time.time()
    report = control_pb2.FaultReport(
        job_id=job_id,
        grade=control_pb2.SEVERE,
        fault_class="rank_exit",
        source=Module.L1_FAULT_DETECTOR,
        rank=1,
        worker_id="wb",
        detail="rank 1 exited with -9",
        detected_unix=now,
        occurred_unix=now,
    )
    with pytest.raises(sqlite3.OperationalError, match=FAILED):
        plane.c.orchestrator.on_fault_report(report)
    assert len(lost.failed) == 1
    # The relaunch was commanded as it was decided: it cannot be unsent.
    for session in (a, b):
        assert [c.WhichOneof("command") for c in drain(session)] == ["release", "launch"]
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    events = [e.message for e in journal.events(job_id)]
    assert not any(m.startswith("restart_ranks") for m in events)  # the decision's record is lost ...
    (again,) = [m for m in events if "was not journaled" in m]
    assert again == (
        f"the decision on rank_exit of rank 1 was not journaled (JournalWriteFailed: {FULL}); written again: its "
        "recovery goes on"
    )
    # ... and what it decided is journaled: a restarted control continues this recovery (its
    # restart spent once), it does not decide the fault afresh.
    monkeypatch.undo()
    copy = tmp_path / "restarted.db"
    source, target = sqlite3.connect(journal._path), sqlite3.connect(copy)
    source.backup(target)
    source.close(), target.close()
    restarted = Plane(build(JobStore(copy), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        job = restarted.c.orchestrator._jobs[job_id]
        assert job.incident is not None and job.incident.fault_class == "rank_exit"
        assert dict(job.restarts) == {"rank_exit": 1}
        assert restarted.get(job_id).state == JobState.FAULT_FROZEN
    finally:
        stop_plane(restarted.c)
