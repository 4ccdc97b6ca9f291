"""A journal write that the disk refuses is control's own I/O fault, not the job's (issue 28):
typed by SQLite's result code or the errno (never by the error's text) as JournalWriteFailed,
graded ``journal_write_failed`` by L1-3 for L1-1's failure event, and decided by the job's
fault policy (ignore by default): the decision is undone and the operator's command refused,
the job runs on, control's health says the journal fails. Untyped, the same error was graded
internal_error (FATAL): the job's policy stopped it, FAILED."""

from __future__ import annotations

import errno
import sqlite3

import pytest
from prometheus_client import REGISTRY

from services.contract import control_pb2, route_pb2
from services.contract.failures import cause_of, write_refused
from services.control.fault_detector.rules import DEFAULT_RULES, failure_class
from services.control.journal_failure import JournalHealth, JournalWriteFailed, journal_failure
from services.jobspec.fault_policy import FaultPolicySpec

from . import test_operator_actions as operator_actions
from .conftest import drain, kinds, settle
from .test_commit_undo import FULL, full
from .test_operator_actions import running_job

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)
plane, store = operator_actions.plane, operator_actions.store


def a_full_journal(tmp_path) -> sqlite3.OperationalError:
    """What SQLite itself raises when the database may not grow (max_page_count: a full disk
    as SQLite reports it, SQLITE_FULL)."""
    db = sqlite3.connect(tmp_path / "small.db", isolation_level=None)
    db.execute("CREATE TABLE t (b BLOB)")
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count={pages}")
    try:
        db.execute("INSERT INTO t VALUES (?)", (b"x" * 65536,))
    except sqlite3.OperationalError as e:
        return e
    finally:
        db.close()
    raise AssertionError("SQLite stored a row past max_page_count")


def test_sqlites_full_disk_is_typed_by_its_result_code_not_its_text(tmp_path):
    raised = a_full_journal(tmp_path)
    typed = journal_failure(raised, "/j/control.db")
    assert isinstance(typed, JournalWriteFailed) and isinstance(typed, sqlite3.OperationalError)
    assert (typed.write_error, typed.path, typed.errno) == (route_pb2.WRITE_NO_SPACE, "/j/control.db", errno.ENOSPC)
    assert typed.__cause__ is raised and str(typed) == str(raised)
    assert cause_of(typed) == route_pb2.FAILURE_WRITE_REFUSED
    assert write_refused(typed).write_error == route_pb2.WRITE_NO_SPACE
    # The same text with no result code is not typed (a text is never read) ...
    assert journal_failure(sqlite3.OperationalError(str(raised))) is None
    # ... nor is an error of another kind (a constraint: a bug, not the disk).
    constraint = sqlite3.IntegrityError("UNIQUE constraint failed")
    constraint.sqlite_errorcode = sqlite3.SQLITE_CONSTRAINT
    assert journal_failure(constraint) is None
    io = sqlite3.OperationalError("disk I/O error")
    io.sqlite_errorcode = sqlite3.SQLITE_IOERR | (3 << 8)  # an extended code: SQLITE_IOERR_WRITE
    assert journal_failure(io).write_error == route_pb2.WRITE_IO
    assert journal_failure(OSError(errno.EROFS, "Read-only file system")).write_error == route_pb2.WRITE_READ_ONLY
    assert journal_failure(OSError(errno.ENOENT, "No such file")) is None


def test_l1_3_grades_the_orchestrators_refused_write_as_a_journal_fault_the_policy_ignores():
    cls = failure_class("OrchestratorFailed", route_pb2.FAILURE_WRITE_REFUSED)
    assert cls == "journal_write_failed" and DEFAULT_RULES[cls] == control_pb2.MINOR
    assert FaultPolicySpec().action_for(cls, "MINOR") == "ignore"
    assert FaultPolicySpec(actions={cls: "stop"}).action_for(cls, "MINOR") == "stop"  # a policy may end the job
    # (an untyped failure of L1-1 is still internal_error: a bug until shown otherwise)
    assert failure_class("OrchestratorFailed", route_pb2.FAILURE_INTERNAL) == "internal_error"


def test_journal_health_says_failing_until_a_commit():
    health = JournalHealth()
    assert health.failing() == ""
    health.failed(JournalWriteFailed(FULL, route_pb2.WRITE_NO_SPACE))
    assert "WRITE_NO_SPACE" in health.failing() and FULL in health.failing()
    health.committed()
    assert health.failing() == ""


def _count(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_full_disk_under_controls_journal_refuses_the_stop_and_the_job_runs_on(plane, monkeypatch):
    job_id, a, b = running_job(plane)
    ignored = _count("surge_fault_decisions_total", **{"class": "journal_write_failed", "action": "ignore"})
    no_space = _count("surge_control_journal_failures_total", error="WRITE_NO_SPACE")
    refused_writes: list[int] = []

    def disk_full(writes) -> None:  # every transaction of the journal, as SQLite on a full disk
        refused_writes.append(len(writes))
        raise full()

    monkeypatch.setattr(plane.c.journal._writer, "_transaction", disk_full)
    with pytest.raises(Exception, match="FAILURE_WRITE_REFUSED") as refused:  # through the bus, as an operator
        plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert FULL in str(refused.value)
    assert refused_writes  # (the stop's record, then its undo's)
    # L1-3 graded L1-1's failure journal_write_failed; the job's policy ignored it (decided once).
    settle(
        lambda: (
            _count("surge_fault_decisions_total", **{"class": "journal_write_failed", "action": "ignore"}) - ignored
        ),
        1.0,
    )
    assert _count("surge_control_journal_failures_total", error="WRITE_NO_SPACE") - no_space >= 1
    assert plane.get(job_id).state == JobState.RUNNING  # (untyped: internal_error, FATAL -> FAILED)
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.pending, job.in_flight) == ("", {})  # the stop undone ...
    assert drain(a) == [] and drain(b) == []  # ... and never sent
    listed = plane.user(control_pb2.JobQuery())
    assert "control's journal fails to write since" in listed.journal_failing
    assert "WRITE_NO_SPACE" in listed.journal_failing
    # The disk has room again: the stop asked again is decided and sent; the journal is healthy.
    monkeypatch.undo()
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert kinds(drain(b)) == ["StopTraining"]
    assert plane.user(control_pb2.JobQuery()).journal_failing == ""
