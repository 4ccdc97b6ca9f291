"""A journal write that the disk refused, typed: control's own store failing is an I/O fault of
control, not of the job whose decision it was writing (issue 28).

Why: a failed commit's ``sqlite3.OperationalError`` reached L1-3 as L1-1's failure of no known
cause (FAILURE_INTERNAL, graded ``internal_error``, FATAL), so a full disk under control's
journal ended every running job whose decision it failed to write. Here the error is typed
by what SQLite says of it (``sqlite_errorcode``, its primary result code) or by the
``errno`` of an ``OSError``, never by its text: a full disk, an I/O error, a read-only or
refused file become :class:`JournalWriteFailed` (``FAILURE_WRITE_REFUSED`` with the
``WriteError`` it stands for), which L1-3 grades ``journal_write_failed`` for L1-1's failure
event and L1-1's fault policy decides (services/jobspec/fault_policy.py: ignore by default:
the job keeps running, the decision refused is undone and the operator told).

``JournalHealth``: whether the journal's last transaction failed and why (what control's
health says: the ``surge_control_journal_failing`` gauge, ``JobList.journal_failing``).
"""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
from collections.abc import Callable

import structlog

from services.contract import route_pb2
from services.contract.failures import WRITE_ERRNOS, FailureCause
from services.control.metrics import JOURNAL_FAILING, JOURNAL_FAILURES

_log = structlog.get_logger("control.journal")

# SQLite's primary result codes (the low byte of an extended code, sqlite.org/rescode.html)
# of a write the file or its disk refused -> the WriteError they stand for. Others (a
# constraint, a misuse, a locked database, a corrupt file) are not a refused write: they stay
# as they were raised (a bug or a damaged journal, graded internal_error).
SQLITE_WRITE_ERRORS: dict[int, int] = {
    sqlite3.SQLITE_FULL: route_pb2.WRITE_NO_SPACE,
    sqlite3.SQLITE_IOERR: route_pb2.WRITE_IO,
    sqlite3.SQLITE_READONLY: route_pb2.WRITE_READ_ONLY,
    sqlite3.SQLITE_PERM: route_pb2.WRITE_PERMISSION,
    sqlite3.SQLITE_CANTOPEN: route_pb2.WRITE_PERMISSION,
}
_ERRNOS = {v: k for k, v in WRITE_ERRNOS.items() if k != errno.EPERM}  # WriteError -> its errno


class JournalWriteFailed(sqlite3.OperationalError):
    """Control's journal could not store a write (``write_error``: a ``WriteError``; ``path``:
    the journal's file). A ``sqlite3.OperationalError`` still (its callers catch those), typed
    ``FAILURE_WRITE_REFUSED`` (services/contract/failures.py reads ``failure_cause`` first).
    Its ``__cause__`` is the error SQLite or the OS raised; its text is that error's."""

    failure_cause = FailureCause.FAILURE_WRITE_REFUSED
    fault_class = "journal_write_failed"

    def __init__(self, message: str, write_error: int, path: str = ""):
        super().__init__(message)
        self.write_error, self.path = write_error, path
        self.errno = _ERRNOS.get(write_error, errno.EIO)


def journal_failure(error: BaseException, path: str = "") -> JournalWriteFailed | None:
    """``error`` (raised by a journal transaction) as a :class:`JournalWriteFailed` when its
    type says the disk or the file refused the write: a ``sqlite3.Error`` by its
    ``sqlite_errorcode``, an ``OSError`` by its ``errno`` (``WRITE_ERRNOS``); else None."""
    if isinstance(error, JournalWriteFailed):
        return error
    kind = 0
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)
        if isinstance(code, int):
            kind = SQLITE_WRITE_ERRORS.get(code & 0xFF, 0)
    elif isinstance(error, OSError) and error.errno in WRITE_ERRNOS:
        kind = WRITE_ERRNOS[error.errno]
    if not kind:
        return None
    typed = JournalWriteFailed(str(error), kind, path)
    typed.__cause__ = error
    return typed


class JournalHealth:
    """Whether control's journal is failing: since when, and its last error (one line).
    Set by the journal's writer on a transaction that failed alone, cleared by the next one
    committed. Thread-safe (a leaf lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0
        self._error = ""
        self._recovered: list[Callable[[], None]] = []

    def on_recovered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the writer's thread, no lock held: leaf locks only) each time
        a transaction commits after the journal failed: what was refused may be written again."""
        self._recovered.append(callback)

    def failed(self, error: BaseException) -> None:
        kind = getattr(error, "write_error", 0)
        name = route_pb2.WriteError.Name(kind) if kind else "not typed"
        with self._lock:
            if not self._since:
                self._since = time.time()
            self._error = f"{type(error).__name__} ({name}): {error}"
        JOURNAL_FAILING.set(1)
        JOURNAL_FAILURES.labels(error=name).inc()

    def committed(self) -> None:
        if not self._since:  # (the usual case: no lock taken)
            return
        with self._lock:
            recovered, self._since, self._error = bool(self._since), 0.0, ""
        JOURNAL_FAILING.set(0)
        for callback in self._recovered if recovered else ():
            try:
                callback()
            except Exception:  # noqa: BLE001 - the commit stands whatever a listener does
                _log.exception("journal recovery listener failed")

    def failing(self) -> str:
        """ "" while the journal commits; else what control's health says of it."""
        with self._lock:
            if not self._since:
                return ""
            return f"control's journal fails to write since {time.strftime('%H:%M:%S', time.localtime(self._since))}: {self._error}"
