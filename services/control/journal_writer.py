"""The journal's group-commit writer (``GroupCommitWriter``): one thread commits whatever
journal writes are queued, of every job, in one SQLite transaction (one fsync per group).

Why: every rank 0 step was its own transaction (its step row, its status at most every
``persist_interval_s``), and each burst's effect-less cursors another, each committed by the
thread applying the event: at 1 step/s per job, a thousand jobs were a thousand fsyncs a
second, each holding its job's queue (issue 28 item 2). Now a write is queued (``submit``:
its statements, the worker event cursors it carries, what to do once it is durable) and the
caller goes on, or waits on the returned future where it must answer only once the write is
durable (an operator command's reply, a submit's).

Order: writes are executed in the order they were queued (one FIFO, one thread), so a job's
writes, queued in the order its decisions made them, are journaled in that order, and a
worker cursor's row is computed from the cursors of the writes before it. A cursor is marked
(``WorkerCursor.mark``: what an ack says) only once its row is committed; then each write's
``on_commit`` runs (in queue order, on this thread: JobEvents are emitted in their journal
order) and its future is resolved. A group that fails (one write's constraint, a full disk)
is rolled back and its writes are committed one by one, so only the failing write's future
fails; the worker event cursors it carried are then journaled alone (the event is skipped
for good, as a refused event is), or, if the disk refuses that too, stay unwritten (never
acknowledged: resent after a restart).

Locks: the journal's connection lock (``JobStore._lock``) is held for each transaction only;
``on_commit`` and the futures' callbacks run with no lock held and must take leaf locks only
(the watch hub's, the session hub's): a decision may be waiting on a future of this thread
while it holds the orchestrator's decision lock.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog

from services.control.journal_failure import JournalHealth, journal_failure
from services.control.metrics import (
    JOURNAL_COMMIT_SECONDS,
    JOURNAL_COMMITS,
    JOURNAL_GROUP_WRITES,
    JOURNAL_QUEUE_DEPTH,
)
from services.control.worker_cursor import WorkerCursor

_log = structlog.get_logger("control.journal")

UPSERT_CURSOR = (
    "INSERT INTO worker_cursors (worker_id, incarnation, seq, ahead) VALUES (?,?,?,?) ON CONFLICT(worker_id) "
    "DO UPDATE SET incarnation=excluded.incarnation, seq=excluded.seq, ahead=excluded.ahead"
)

Statements = Callable[[sqlite3.Connection], None]


@dataclass(eq=False)
class _Write:
    statements: Statements | None  # None: a barrier (``flush``), or cursors alone
    cursors: Sequence[tuple[WorkerCursor, Sequence[int]]] = ()
    on_commit: Callable[[], None] | None = None
    future: Future = field(default_factory=Future)
    queued: float = field(default_factory=time.monotonic)


class GroupCommitWriter:
    """Commits queued journal writes in groups, on one thread (see the module docstring).

    Args:
        db: the journal's connection (autocommit mode: ``isolation_level=None``).
        lock: held around each transaction (the connection's readers take it too).
        path: the journal's file, named by a refused write's error.
        health: told of each write that failed alone and of each commit.
    """

    def __init__(
        self, db: sqlite3.Connection, lock: threading.Lock, path: str = "", health: JournalHealth | None = None
    ):
        self._db, self._db_lock = db, lock
        self._path, self._health = path, health or JournalHealth()
        self._cv = threading.Condition()  # the queue below; nothing is called under it
        self._queue: deque[_Write] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(
        self,
        statements: Statements | None,
        cursors: Sequence[tuple[WorkerCursor, Sequence[int]]] = (),
        on_commit: Callable[[], None] | None = None,
    ) -> Future:
        """Queue one write: ``statements(db)`` run in a transaction with the rows of
        ``cursors`` (each cursor with its ``seqs`` marked); ``on_commit`` runs once it is
        durable. Returns the future that resolves (None) then, or fails with the write's
        error (sqlite3.Error; a write the disk refused as ``JournalWriteFailed``, typed).

        Raises:
            sqlite3.ProgrammingError: the journal is closed.
        """
        write = _Write(statements, cursors, on_commit)
        with self._cv:
            if self._closed:
                raise sqlite3.ProgrammingError("Cannot operate on a closed database (the journal is closed).")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
                self._thread.start()
            self._queue.append(write)
            self._cv.notify()
        JOURNAL_QUEUE_DEPTH.inc()
        return write.future

    def flush(self) -> None:
        """Wait until every write queued before this call is committed (or failed), its
        ``on_commit`` run. A no-op on the writer's own thread, or once closed."""
        if threading.current_thread() is self._thread:
            return
        try:
            self.submit(None).result()
        except sqlite3.ProgrammingError:
            pass  # closed: close() committed what was queued

    def close(self) -> None:
        """Commit what is queued and end the thread (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------ private (the writer's thread)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                group = list(self._queue)
                self._queue.clear()
            self._commit(group)

    def _commit(self, group: list[_Write]) -> None:
        """One transaction for the group's writes (barriers need none); on failure, one per
        write. Then, in queue order: cursors marked, ``on_commit`` run, futures resolved."""
        writes = [w for w in group if w.statements is not None or w.cursors]
        failed: dict[_Write, BaseException] = {}
        if writes:
            with self._db_lock:
                try:
                    self._transaction(writes)
                except Exception:  # noqa: BLE001 - retried one by one below
                    for w in writes:  # (each alone: only the failing write fails)
                        try:
                            self._transaction([w])
                        except Exception as e:  # noqa: BLE001 - handed to the write's future
                            # (typed by what SQLite or the OS says: a full disk is control's
                            # own I/O fault, never the job's; journal_failure.py)
                            failed[w] = journal_failure(e, self._path) or e
                            self._health.failed(failed[w])
                            _log.error("journal write failed", error=str(e), error_type=type(failed[w]).__name__)
                            if w.statements is not None and w.cursors:
                                self._skip(w)
        done = time.monotonic()
        JOURNAL_QUEUE_DEPTH.dec(len(group))
        for w in writes:
            JOURNAL_COMMIT_SECONDS.observe(done - w.queued)
        for w in group:
            error = failed.get(w)
            if error is not None:
                w.future.set_exception(error)
                continue
            if w.on_commit is not None:
                try:
                    w.on_commit()
                except Exception:  # noqa: BLE001 - the writer must outlive one bad callback
                    _log.exception("journal on_commit failed")
            w.future.set_result(None)

    def _skip(self, w: _Write) -> None:
        """A write that failed alone: its cursors are journaled without it, as a refused
        event's are (``SessionHub.on_worker_events``: skipped for good, its seq must not hold
        the agent's watermark back); if even that fails, they stay unwritten (resent after a
        restart)."""
        try:
            self._transaction([_Write(None, w.cursors)])
        except Exception as e:  # noqa: BLE001 - the disk refuses everything: the acks wait
            _log.error("journal cursor write failed", error=str(e))

    def _transaction(self, writes: list[_Write]) -> None:
        """Under the connection's lock: the writes and their cursors' rows (one per cursor,
        after every write of it), committed; then the cursors marked. Rolled back on error."""
        db = self._db
        marks: dict[WorkerCursor, list[int]] = {}
        db.execute("BEGIN IMMEDIATE")
        try:
            for w in writes:
                if w.statements is not None:
                    w.statements(db)
                for cursor, seqs in w.cursors:
                    # (moved to the end: the last write of a worker's row wins, as it would
                    # have one transaction per write)
                    marks[cursor] = [*marks.pop(cursor, ()), *seqs]
            if marks:
                db.executemany(UPSERT_CURSOR, [cursor.row_with(seqs) for cursor, seqs in marks.items()])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        JOURNAL_COMMITS.inc()
        self._health.committed()
        JOURNAL_GROUP_WRITES.observe(len(writes))
        for cursor, seqs in marks.items():  # (before the next group computes its rows from them)
            cursor.mark(seqs)
