"""The orchestrator's journal: jobs and their event logs in one embedded SQLite file.

Not a seed module. It persists what the orchestrator (L1-1) already owns (each job's state
enum, published status and frozen spec) so that a restarted `control` knows its jobs. The
orchestrator's red line against disk I/O is about training data, samples and tensors; its
own journal is how it keeps its private state, and nothing else reads this file.

WAL mode: readers never block the writer, and a commit is one fsync of the log. The file
is opened once per process; every call is serialised by one lock (calls come from gRPC
threads).
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from services.contract import control_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id       TEXT PRIMARY KEY,
    name         TEXT NOT NULL,
    state        INTEGER NOT NULL,
    outcome      INTEGER NOT NULL,
    spec_json    TEXT NOT NULL,
    created_unix REAL NOT NULL,
    updated_unix REAL NOT NULL,
    status       BLOB NOT NULL          -- control_pb2.JobStatus, serialized
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
"""


@dataclass(frozen=True)
class StoredJob:
    """One job as read back from the journal."""

    status: control_pb2.JobStatus
    spec_json: str
    last_seq: int  # highest event seq written for the job (0: none)


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

    def create_job(self, status: control_pb2.JobStatus, spec_json: str) -> None:
        """Insert a new job. Raises sqlite3.IntegrityError if the id already exists."""
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?)",
                (
                    status.job_id,
                    status.name,
                    status.state,
                    status.outcome,
                    spec_json,
                    status.created_unix,
                    status.updated_unix,
                    status.SerializeToString(),
                ),
            )

    def save_status(self, status: control_pb2.JobStatus, event: control_pb2.JobEvent | None = None) -> None:
        """Overwrite the job's status and (optionally) append one event, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "UPDATE jobs SET state=?, outcome=?, updated_unix=?, status=? WHERE job_id=?",
                    (status.state, status.outcome, status.updated_unix, status.SerializeToString(), status.job_id),
                )
                if event is not None:
                    self._insert_event(event)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def load_jobs(self) -> list[StoredJob]:
        """Every job, oldest first, with the highest event seq written for it."""
        with self._lock:
            rows = self._db.execute(
                "SELECT j.status, j.spec_json, COALESCE(MAX(e.seq), 0) FROM jobs j "
                "LEFT JOIN events e ON e.job_id = j.job_id "
                "GROUP BY j.job_id ORDER BY j.created_unix, j.job_id"
            ).fetchall()
        return [StoredJob(control_pb2.JobStatus.FromString(blob), spec, seq) for blob, spec, seq in rows]

    def events(self, job_id: str, from_seq: int = 0) -> list[control_pb2.JobEvent]:
        """The job's events with seq >= ``from_seq``, in seq order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, unix_time, source, type, message, status FROM events "
                "WHERE job_id=? AND seq>=? ORDER BY seq",
                (job_id, from_seq),
            ).fetchall()
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
        with self._lock:
            self._db.close()

    def _insert_event(self, e: control_pb2.JobEvent) -> None:
        self._db.execute(
            "INSERT INTO events VALUES (?,?,?,?,?,?,?)",
            (e.job_id, e.seq, e.unix_time, e.source, e.type, e.message, e.status.SerializeToString()),
        )
