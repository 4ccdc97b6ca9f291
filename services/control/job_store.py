"""The orchestrator's journal: jobs and their event logs in one embedded SQLite file.

Not a seed module. It persists what the orchestrator (L1-1) already owns (each job's state
enum, published status and frozen spec: replaced only by an operator resume at a new
data-parallel layout) so that a restarted `control` knows its jobs. The
orchestrator's red line against disk I/O is about training data, samples and tensors; its
own journal is how it keeps its private state, and nothing else reads this file.

WAL mode: readers never block the writer, and a commit is one fsync of the log. The file
is opened once per process. Every write goes through one group-commit writer
(services/control/journal_writer.py): queued, committed with whatever else is queued in one
transaction, in queue order; a write returns its future and, by default, waits on it
(``wait=False``: the caller goes on; ``on_commit`` runs once it is durable). Reads first wait
for the writes queued before them (``flush``): a read sees every write made before it.
Worker event cursors of events with no journaled effect are not written at all
(``applying(defer=True)``: the session hub marks them in memory, exactly_once.py); a cursor
with an effect is always in the effect's transaction. A cursor is a watermark and the seqs journaled above it
(services/control/worker_cursor.py: one agent's events are applied in order per job, not
across its jobs), its row computed and marked on the writer's thread in commit order, so two
jobs' writes never journal a stale one.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.contract import control_pb2
from services.control.journal_failure import JournalHealth
from services.control.journal_writer import GroupCommitWriter, Statements
from services.control.worker_cursor import WorkerCursor, parse_ahead

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id       TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    state        INTEGER NOT NULL,
    outcome      INTEGER NOT NULL,
    spec_json    TEXT NOT NULL,
    created_unix REAL NOT NULL,
    updated_unix REAL NOT NULL,
    status       BLOB NOT NULL,         -- control_pb2.JobStatus, serialized
    -- The SubmitJobRequest.request_id that created the job ('' none) and the sha256 of the
    -- spec text it carried: a retried submit is answered with this job after a restart too.
    request_id   TEXT NOT NULL DEFAULT '',
    spec_sha256  TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS events (
    job_id    TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    unix_time REAL NOT NULL,
    source    INTEGER NOT NULL,
    type      TEXT NOT NULL,
    message   TEXT NOT NULL,
    status    BLOB NOT NULL,            -- control_pb2.JobStatus snapshot after the event
    PRIMARY KEY (job_id, seq)
);
-- Every training step the orchestrator applied (rank 0's StepCompleted), in order of
-- application: a step applied twice (an event delivered twice) would show as two rows.
CREATE TABLE IF NOT EXISTS steps (
    job_id    TEXT NOT NULL,
    step      INTEGER NOT NULL,
    loss      REAL,                     -- NULL: not finite (a skipped step's NaN)
    tokens    INTEGER NOT NULL,
    unix_time REAL NOT NULL,            -- when the rank completed it
    applied_unix REAL NOT NULL          -- when control applied it
);
CREATE INDEX IF NOT EXISTS steps_job ON steps (job_id);
-- Per node agent: the incarnation, the WorkerEvent.seq up to which every event is applied
-- (the event stream's resume point after a control restart) and the seqs applied above it
-- (a JSON list, "" for none: dropped as duplicates when resent).
CREATE TABLE IF NOT EXISTS worker_cursors (
    worker_id   TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    ahead       TEXT NOT NULL DEFAULT ''
);
-- Workers out of placement for every job (L1-1's cordon after a device's fatal error), until
-- their node agent registers as another incarnation: commanded to L1-2 again at a restart.
CREATE TABLE IF NOT EXISTS cordons (
    worker_id TEXT PRIMARY KEY,
    cordon    BLOB NOT NULL             -- control_pb2.WorkerCordoned, serialized
);
-- Teams' quotas set by `surgectl team set` / `remove` (issue 30): over the quota file's at a
-- restart. quota: services/control/scheduler TeamQuota.to_json() as JSON, or 'null' for a
-- team removed (it falls back to the default, even where the file names it).
CREATE TABLE IF NOT EXISTS team_quotas (
    name  TEXT PRIMARY KEY,
    quota TEXT NOT NULL
);
"""

# One save_status: (status, event or None, runtime or None, spec_json or None).
Save = tuple[control_pb2.JobStatus, "control_pb2.JobEvent | None", "dict | None", "str | None"]
# A step whose write failed, held for a later one: its ``step_row`` and the events it carried.
HeldStepRows = tuple[tuple, "Sequence[control_pb2.JobEvent]"]


@dataclass(frozen=True)
class StoredJob:
    """One job as read back from the journal."""

    status: control_pb2.JobStatus
    spec_json: str
    last_seq: int  # highest event seq written for the job (0: none)
    runtime: dict = field(default_factory=dict)  # the orchestrator's bookkeeping (see save_status)
    request_id: str = ""  # the submit's request id ("" none; see create_job)
    spec_sha256: str = ""  # the sha256 of the spec text that request carried


@dataclass
class _Applying:
    """The worker event being applied on this thread: its cursor is written with the first
    journal write it causes (same transaction), or alone when it causes none."""

    cursor: WorkerCursor
    seq: int
    earlier: Sequence[int] = ()  # seqs of its burst applied before it, not yet journaled
    written: bool = False  # a write carrying the cursor is queued (or committed)
    durable: Future | None = None  # that write's future
    goes_on: bool = False  # nobody waits on this thread for its writes: the ack follows the commit

    @property
    def seqs(self) -> list[int]:
        return [*self.earlier, self.seq]


class JobStore:
    """SQLite journal of jobs and job events.

    Raises:
        sqlite3.Error: the file cannot be opened or written (disk full, bad path).
    """

    def __init__(self, path: str | Path):
        self._path = Path(path)
        if str(path) != ":memory:":
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power cut may lose the last commits but never corrupts;
        # a process crash loses nothing.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if "runtime" not in columns:  # a journal written before the column existed
            self._db.execute("ALTER TABLE jobs ADD COLUMN runtime TEXT NOT NULL DEFAULT '{}'")
        for column in ("request_id", "spec_sha256"):  # (a journal written before submits had request ids)
            if column not in columns:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
        if "ahead" not in {row[1] for row in self._db.execute("PRAGMA table_info(worker_cursors)")}:
            self._db.execute("ALTER TABLE worker_cursors ADD COLUMN ahead TEXT NOT NULL DEFAULT ''")
        self._applying = threading.local()
        self.health = JournalHealth()  # whether the journal fails to write (control's health)
        self._writer = GroupCommitWriter(self._db, self._lock, str(path), self.health)
        # job id -> the newest runtime queued for it (_save_statements: an older one is not dumped)
        self._runtimes: dict[str, object] = {}
        # The event log's reader: its own connection (WAL: it reads what is committed while
        # the writer commits), so an operator's long history never waits for a group's
        # transaction nor holds the writer up. In memory there is one database per
        # connection: the writer's is shared.
        self._reader, self._read_lock = self._db, self._lock
        if str(path) != ":memory:":
            self._reader, self._read_lock = sqlite3.connect(str(path), check_same_thread=False), threading.Lock()

    def create_job(
        self, status: control_pb2.JobStatus, spec_json: str, request_id: str = "", spec_sha256: str = ""
    ) -> None:
        """Insert a new job, with the request id of the submit that created it and the
        sha256 of its spec text (in the same row: a job journaled is never without them).
        Raises sqlite3.IntegrityError if the id already exists."""
        row = (
            status.job_id,
            status.name,
            status.state,
            status.outcome,
            spec_json,
            status.created_unix,
            status.updated_unix,
            status.SerializeToString(),
            request_id,
            spec_sha256,
        )
        self._write(
            lambda db: db.execute(
                "INSERT INTO jobs (job_id, name, state, outcome, spec_json, created_unix, updated_unix, status, "
                "request_id, spec_sha256) VALUES (?,?,?,?,?,?,?,?,?,?)",
                row,
            ),
            with_cursor=False,
        )

    def spec_json(self, job_id: str) -> str | None:
        """The job's effective spec as journaled (None: no such job)."""
        with self._lock:
            row = self._db.execute("SELECT spec_json FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def delete_job(self, job_id: str, *, wait: bool = True) -> Future:
        """Remove a job and everything journaled about it (its start failed half-way: no
        record of it may remain). Returns the write's future (``wait``: see the module
        docstring)."""

        def delete(db: sqlite3.Connection) -> None:
            for table in ("jobs", "events", "steps"):
                db.execute(f"DELETE FROM {table} WHERE job_id=?", (job_id,))

        return self._write(delete, wait=wait)

    def save_status(
        self,
        status: control_pb2.JobStatus,
        event: control_pb2.JobEvent | None = None,
        runtime: dict | None = None,
        spec_json: str | None = None,
        *,
        on_commit: Callable[[], None] | None = None,
        wait: bool = True,
    ) -> Future:
        """Overwrite the job's status (and its ``runtime`` bookkeeping, a JSON-able dict,
        when given; its frozen spec, when given: an operator resume at a new data-parallel
        layout replaces it) and optionally append one event, in one transaction; with the
        cursor of the worker event being applied on this thread, if any (:meth:`applying`).
        The arguments are serialised now (the caller may change them once this returns);
        ``on_commit``/``wait``: see the module docstring. Returns the write's future.
        ``runtime`` is the exception: a structure of its own (as the orchestrator's
        ``_runtime`` builds one), dumped on the writer's thread, and only if no newer runtime
        of the job was queued after it (see ``_save_statements``)."""
        return self._write(
            _save_statements([(status, event, runtime, spec_json)], self._runtimes), on_commit=on_commit, wait=wait
        )

    def save_statuses(
        self, saves: Sequence[Save], *, on_commit: Callable[[], None] | None = None, wait: bool = True
    ) -> Future:
        """:meth:`save_status` for each of ``saves`` (its arguments), in order, in one
        transaction: a decision of several records whose commit must not lose some and keep
        the others (services/control/orchestrator/one_write.py). Returns the write's future."""
        return self._write(_save_statements(saves, self._runtimes), on_commit=on_commit, wait=wait)

    def record_step(
        self,
        job_id: str,
        step: int,
        loss: float,
        tokens: int,
        unix_time: float,
        saves: Sequence[Save] = (),
        *,
        held: Sequence[HeldStepRows] = (),
        on_commit: Callable[[], None] | None = None,
        wait: bool = True,
    ) -> Future:
        """Append one applied training step (with the applying worker event's cursor) and
        make the ``saves`` (:meth:`save_status`'s arguments, in order), in one transaction;
        ``held``: earlier steps of the job whose write failed (``step_row`` rows, their events),
        appended first, in their order (services/control/orchestrator/held_steps.py). Returns
        the write's future."""
        row = step_row(job_id, step, loss, tokens, unix_time)
        earlier, then = _held_statements(held), _save_statements(saves, self._runtimes)

        def statements(db: sqlite3.Connection) -> None:
            earlier(db)
            db.execute("INSERT INTO steps VALUES (?,?,?,?,?,?)", row)
            then(db)

        return self._write(statements, on_commit=on_commit, wait=wait)

    def write_held_steps(
        self, held: Sequence[HeldStepRows], *, on_commit: Callable[[], None] | None = None, wait: bool = True
    ) -> Future:
        """Append steps whose write failed (``record_step``'s ``held``) alone: the job steps no
        more to carry them. Returns the write's future."""
        return self._write(_held_statements(held), with_cursor=False, on_commit=on_commit, wait=wait)

    def steps(self, job_id: str) -> list[tuple[int, float | None]]:
        """(step, loss) of every step applied for the job, in order of application (loss
        None: it was not finite)."""
        self._writer.flush()
        with self._lock:
            return self._db.execute("SELECT step, loss FROM steps WHERE job_id=? ORDER BY rowid", (job_id,)).fetchall()

    # ------------------------------------------------------------ cordoned workers

    def save_cordon(self, cordon: control_pb2.WorkerCordoned) -> None:
        """Journal a worker's cordon (replacing an earlier one of the worker), with the
        cursor of the worker event being applied on this thread, if any."""
        row = (cordon.worker_id, cordon.SerializeToString())
        self._write(
            lambda db: db.execute(
                "INSERT INTO cordons VALUES (?,?) ON CONFLICT(worker_id) DO UPDATE SET cordon=excluded.cordon", row
            )
        )

    def delete_cordon(self, worker_id: str) -> None:
        """The worker's cordon ended (with the applying worker event's cursor, if any)."""
        self._write(lambda db: db.execute("DELETE FROM cordons WHERE worker_id=?", (worker_id,)))

    def load_cordons(self) -> list[control_pb2.WorkerCordoned]:
        """Every cordon in force, by worker id."""
        self._writer.flush()
        with self._lock:
            rows = self._db.execute("SELECT cordon FROM cordons ORDER BY worker_id").fetchall()
        return [control_pb2.WorkerCordoned.FromString(row[0]) for row in rows]

    # ------------------------------------------------------------ teams' quotas

    def save_team_quota(self, name: str, quota: dict | None) -> None:
        """Journal ``name``'s quota (None: removed), replacing an earlier one; waits for the commit."""
        row = (name, json.dumps(quota))
        self._write(
            lambda db: db.execute(
                "INSERT INTO team_quotas VALUES (?,?) ON CONFLICT(name) DO UPDATE SET quota=excluded.quota", row
            ),
            with_cursor=False,
        )

    def load_team_quotas(self) -> dict[str, dict | None]:
        """Every journaled team quota (None: removed), by name."""
        self._writer.flush()
        with self._lock:
            rows = self._db.execute("SELECT name, quota FROM team_quotas ORDER BY name").fetchall()
        return {name: json.loads(quota) for name, quota in rows}

    # ------------------------------------------------------------ worker event cursors

    def worker_cursor(self, worker_id: str) -> tuple[str, int]:
        """(incarnation, seq up to which every event is applied) of a node agent; ("", 0)
        if none was applied."""
        cursor = self.cursor(worker_id)
        return cursor.incarnation, cursor.watermark

    def cursor(self, worker_id: str) -> WorkerCursor:
        """The node agent's journaled cursor (incarnation "" and nothing applied if none)."""
        self._writer.flush()
        with self._lock:
            row = self._db.execute(
                "SELECT incarnation, seq, ahead FROM worker_cursors WHERE worker_id=?", (worker_id,)
            ).fetchone()
        return WorkerCursor(worker_id, row[0], row[1], parse_ahead(row[2])) if row else WorkerCursor(worker_id, "")

    @contextmanager
    def applying(
        self,
        worker_id: str,
        incarnation: str,
        seq: int,
        defer: bool = False,
        cursor: WorkerCursor | None = None,
        earlier: Sequence[int] = (),
        goes_on: bool = False,
    ) -> Iterator[_Applying]:
        """Apply worker event ``seq`` inside this block: the first journal write on this
        thread also writes the worker's cursor (``cursor`` with ``seq`` and the ``earlier``
        applied ones of its burst added; none: ``seq`` is the watermark), in the same
        transaction (``goes_on``: the caller acks from that write's commit and waits for none
        on this thread, :meth:`goes_on`); if the block wrote nothing (an event
        with no journaled effect), the cursor is written alone on exit, or, with ``defer``,
        left to the caller (``written`` stays False: the session hub marks it in memory, no
        write). An exception leaves the cursor unwritten (the event is
        applied again if resent)."""
        ctx = _Applying(cursor or WorkerCursor(worker_id, incarnation, seq - 1), seq, earlier, goes_on=goes_on)
        self._applying.ctx = ctx
        try:
            yield ctx
        finally:
            self._applying.ctx = None
        if not ctx.written and not defer:
            self._write(None, ctx)

    def goes_on(self) -> bool:
        """Whether a worker event is being applied on this thread by a caller that waits for
        none of its writes (the event applier's bursts: its ack follows its write's commit),
        so a decision it causes may go on before its commit (orchestrator/commit_later.py)."""
        ctx = getattr(self._applying, "ctx", None)
        return ctx is not None and ctx.goes_on

    def flush(self) -> None:
        """Wait until every write queued before this call is committed (or failed)."""
        self._writer.flush()

    # ------------------------------------------------------------ private

    def _write(
        self,
        statements: Statements | None,
        ctx: _Applying | None = None,
        *,
        with_cursor: bool = True,
        on_commit: Callable[[], None] | None = None,
        wait: bool = True,
    ) -> Future:
        """Queue ``statements`` with the cursor of the worker event being applied on this
        thread, if its cursor is not written yet; wait for the commit unless ``wait`` is
        False. A failed write raises its error (sqlite3.Error) when waited for, and leaves
        the cursor unwritten."""
        ctx = ctx or (getattr(self._applying, "ctx", None) if with_cursor else None)
        carries = ctx is not None and not ctx.written
        future = self._writer.submit(statements, [(ctx.cursor, ctx.seqs)] if carries else (), on_commit)
        if carries:
            ctx.written, ctx.durable = True, future
        if wait:
            try:
                future.result()
            except BaseException:
                if carries:
                    ctx.written, ctx.durable = False, None
                raise
        return future

    def load_jobs(self) -> list[StoredJob]:
        """Every job, oldest first, with the highest event seq written for it."""
        self._writer.flush()
        with self._lock:
            rows = self._db.execute(
                "SELECT j.status, j.spec_json, COALESCE(MAX(e.seq), 0), j.runtime, j.request_id, j.spec_sha256 "
                "FROM jobs j LEFT JOIN events e ON e.job_id = j.job_id "
                "GROUP BY j.job_id ORDER BY j.created_unix, j.job_id"
            ).fetchall()
        return [
            StoredJob(control_pb2.JobStatus.FromString(blob), spec, seq, json.loads(runtime or "{}"), request, digest)
            for blob, spec, seq, runtime, request, digest in rows
        ]

    def events(
        self,
        job_id: str,
        from_seq: int = 0,
        after: Future | None = None,
        tail: int = 0,
        types: Sequence[str] = (),
    ) -> list[control_pb2.JobEvent]:
        """The job's events with seq >= ``from_seq``, of ``types`` (empty: every type), only
        the newest ``tail`` of them (0: all), in seq order: those of the writes queued before
        this call, or with ``after`` (the job's last write), of the writes up to it (another
        job's slow commit is not waited for). The selection is SQL's (the primary key read
        backwards from the newest): only the rows returned are read and deserialised, so a
        page of a long job's newest events costs the page, not the job's history."""
        if after is None:
            self._writer.flush()
        else:
            try:
                after.result()
            except Exception:  # noqa: BLE001 - a failed write journaled nothing: the log is what was committed
                pass
        kinds = sorted(set(types))
        where = "job_id=? AND seq>=?" + (f" AND type IN ({','.join('?' * len(kinds))})" if kinds else "")
        args: tuple = (job_id, from_seq, *kinds)
        sql = f"SELECT seq, unix_time, source, type, message, status FROM events WHERE {where} ORDER BY seq"
        if tail > 0:
            sql, args = f"{sql} DESC LIMIT ?", (*args, tail)
        with self._read_lock:
            rows = self._reader.execute(sql, args).fetchall()
        if tail > 0:
            rows.reverse()
        return [
            control_pb2.JobEvent(
                job_id=job_id,
                seq=seq,
                unix_time=t,
                source=source,
                type=kind,
                message=message,
                status=control_pb2.JobStatus.FromString(blob),
            )
            for seq, t, source, kind, message, blob in rows
        ]

    def close(self) -> None:
        """Commit what is queued, end the writer, close the file."""
        self._writer.close()
        with self._lock:
            self._db.close()
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()


def _save_statements(saves: Sequence[Save], newest: dict[str, object]) -> Statements:
    """The statements of ``save_status`` calls, their arguments serialised now but for the
    runtimes: a job's runtime column is overwritten whole by each save, so only the newest
    queued is dumped (``newest``: job id -> its token, set here in queue order); an older
    one whose transaction runs after a newer was queued is skipped, as the newer one's
    write follows it in queue order. Why: a job's runtime holds every rank's placement and
    start, and each rank's ready event saved it: at 1,024 x 8 ranks the start was 8,192
    dumps of 8,192-rank runtimes on the journal's writer (~180 s to RUNNING; issue 28)."""
    rows = []
    for status, e, runtime, spec_json in saves:
        status_row = (status.state, status.outcome, status.updated_unix, status.SerializeToString(), status.job_id)
        runtime_row = None
        if runtime is not None:
            token = newest[status.job_id] = object()
            runtime_row = (runtime, status.job_id, token)
        spec_row = None if spec_json is None else (spec_json, status.job_id)
        event_row = None if e is None else _event_row(e)
        rows.append((status_row, runtime_row, spec_row, event_row))

    def statements(db: sqlite3.Connection) -> None:
        for status_row, runtime_row, spec_row, event_row in rows:
            db.execute("UPDATE jobs SET state=?, outcome=?, updated_unix=?, status=? WHERE job_id=?", status_row)
            if runtime_row is not None:
                runtime, job_id, token = runtime_row
                if newest.get(job_id) is token:  # (else a newer one is queued behind: it writes)
                    db.execute("UPDATE jobs SET runtime=? WHERE job_id=?", (json.dumps(runtime), job_id))
            if spec_row is not None:
                db.execute("UPDATE jobs SET spec_json=? WHERE job_id=?", spec_row)
            if event_row is not None:
                db.execute("INSERT INTO events VALUES (?,?,?,?,?,?,?)", event_row)

    return statements


def step_row(job_id: str, step: int, loss: float, tokens: int, unix_time: float) -> tuple:
    """A row of the ``steps`` table (recorded now)."""
    return (job_id, step, loss, tokens, unix_time, time.time())


def _event_row(e: control_pb2.JobEvent) -> tuple:
    return (e.job_id, e.seq, e.unix_time, e.source, e.type, e.message, e.status.SerializeToString())


def _held_statements(held: Sequence[HeldStepRows]) -> Statements:
    """The statements appending held steps: each step's row and its events (not their
    statuses: a later write journals a newer one), serialised now."""
    rows = [(row, [_event_row(e) for e in events]) for row, events in held]

    def statements(db: sqlite3.Connection) -> None:
        for row, event_rows in rows:
            db.execute("INSERT INTO steps VALUES (?,?,?,?,?,?)", row)
            db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?)", event_rows)

    return statements
