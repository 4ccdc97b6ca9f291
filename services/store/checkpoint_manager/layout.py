"""Part of L5-1 (the checkpoint manager): what every other part shares. The names and formats
on disk, the errors it raises, the catalog's spelling of a verdict, the records of an open
save and of a checked save, and the durable-write helpers (``fsync`` before a rename).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.contract import store_pb2
from services.contract.failures import FailureCause, Refusal, writing

MANIFEST = "manifest.json"
CATALOG = "catalog.json"
MANIFEST_FORMAT = "surge.checkpoint.manifest/1"
CATALOG_FORMAT = "surge.checkpoint.catalog/1"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # no ':' (version ids) or '/'
_RUN_OF = re.compile(r"(.+)-[0-9a-f]{6}")  # a job id: its name, then control's 6 hex digits
_CHUNK_BYTES = 1 << 20
_HASH_THREADS = 4  # hashlib releases the GIL on large updates; shards hash in parallel
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index (rank 0 writes it last)
CHUNKS_DIR = "chunks"  # <job>/chunks/<epoch>/<sha[:2]>/<sha>: the job's content-addressed chunks
CHUNK_INDEX = "chunks.json"  # a chunked version's list of chunks (services/state/chunk_store.py)
CHUNK_INDEX_FORMAT = "surge.checkpoint.chunks/1"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The data plane (PutCheckpointFiles / GetCheckpointFiles): bounds of what a rank may stream.
TRANSFER_PART_BYTES = 1 << 20  # one CheckpointFileData's bytes at most (what this side sends)
MAX_STREAMED_CHUNK_BYTES = 64 << 20  # a chunk (the writer's chunk_bytes is 1 MiB)
MAX_STREAMED_INDEX_BYTES = 1 << 30  # .metadata / chunks.json of one version


class CheckpointNotFound(LookupError, Refusal):
    """The named version is not in the catalog (gRPC NOT_FOUND)."""


class CheckpointRejected(RuntimeError, Refusal):
    """The store's state does not allow the command: no open save, an empty or changing
    staging directory, a version that fails verification (gRPC FAILED_PRECONDITION)."""


class CheckpointIncomplete(CheckpointRejected):
    """A staging directory is not a whole save: its DCP ``.metadata`` names a file that is
    not there (``file``), or holds less than the index says, or the index is unreadable.
    The commit is refused; nothing is cataloged."""

    def __init__(self, message: str, file: str = ""):
        super().__init__(message)
        self.file = file


class CheckpointTransferRefused(CheckpointRejected):
    """A file streamed to the store (``PutCheckpointFiles``) refused on arrival, nothing of it
    kept: a name outside its directory or not a chunk's digest, a size over the bound or other
    than declared, bytes whose SHA-256 is not the declared one (a chunk's: its name), a stream
    that ended inside a file, or no open save it belongs to. ``failure_cause``: typed
    (FAILURE_DATA_CORRUPT for bytes that fail their check, FAILURE_INVALID_INPUT otherwise),
    sent with the refusal; ``file``: the name."""

    def __init__(self, message: str, cause: int = FailureCause.FAILURE_INVALID_INPUT, file: str = ""):
        super().__init__(message)
        self.failure_cause = cause
        self.file = file


class CheckpointFormatRefused(CheckpointRejected):
    """A version in a checkpoint format this build does not read (``formats.py``): older or
    newer than it; nothing about its bytes is wrong (it is never struck)."""


class CheckpointDamaged(CheckpointRejected):
    """A version's bytes do not match its manifest. ``cause``: ``store_pb2.VERDICT_CORRUPT``
    or ``store_pb2.VERDICT_MISSING_FILE``; ``file``: the file named (relative path)."""

    failure_cause = FailureCause.FAILURE_DATA_CORRUPT

    def __init__(self, message: str, cause: int, file: str = ""):
        super().__init__(message)
        self.cause = cause
        self.file = file


# Catalog spelling of a verdict <-> the proto enum.
_VERDICT_NAMES = {
    "ok": store_pb2.VERDICT_OK,
    "corrupt": store_pb2.VERDICT_CORRUPT,
    "missing_file": store_pb2.VERDICT_MISSING_FILE,
}
_VERDICT_OF = {v: k for k, v in _VERDICT_NAMES.items()}
# A damaged version's cause as the store's failure cause (CheckpointCorrupt.cause).
_FAILURE_CAUSE = {store_pb2.VERDICT_CORRUPT: store_pb2.CORRUPT, store_pb2.VERDICT_MISSING_FILE: store_pb2.MISSING_FILE}


@dataclass
class _OpenSave:
    step: int
    path: Path
    ranks: set[int] = field(default_factory=set)
    committing: bool = False
    attempt: str = ""  # SaveCheckpoint.attempt of the ranks writing it ("" : not named)
    epoch: int = 0  # the chunk directory its ranks write into (0: not told, e.g. adopted)
    baseline: bool = False


@dataclass(frozen=True)
class _Chunks:
    """A staged chunked save, checked: its epoch, every chunk it references (sha -> bytes)
    and what its ranks wrote."""

    epoch: int
    sizes: dict[str, int]
    written_bytes: int  # index files + chunks new to the epoch (see _check_chunks)


@dataclass(frozen=True)
class _SweepPlan:
    """A garbage collection decided under the lock (``_plan_sweep``), carried out off it."""

    job: str
    opened: int  # saves of the job begun when decided: one begun since stops the sweep
    epochs: list[int]  # no cataloged version references them: removed whole
    keep: dict[int, frozenset[str]]  # a referenced epoch -> its chunks that stay (the rest goes)


@dataclass(frozen=True)
class _Hashed:
    bytes: int
    sha256: str
    fingerprint: tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode at hashing time


def _verdict(entry: dict[str, Any]) -> tuple[int, str, float]:
    """(VerdictCause, reason, verified_unix) recorded for a catalog entry. An entry written
    before verdicts were recorded was hashed at its commit: ok, verified when created."""
    name = entry.get("verdict", "ok")
    return (
        _VERDICT_NAMES.get(name, store_pb2.VERDICT_CORRUPT),
        entry.get("reason", ""),
        entry.get("verified_unix", entry["created_unix"]),
    )


def _replica_verified(chain: list[dict[str, Any]], entry: dict[str, Any]) -> bool:
    """Whether ``entry``'s data-parallel replicas were found to agree (issue 29 item 3): a job
    without the replica check, or a commit of the same attempt (the same ranks), at or after
    ``entry``, saying a check at or after ``entry``'s step agreed. A later attempt does not
    count: ranks resumed from one version agree with each other whatever that version held."""
    if not entry.get("replica_checked"):
        return True
    at = next((i for i, e in enumerate(chain) if e is entry), len(chain))  # (not in the chain yet: itself)
    return any(
        e["job_id"] == entry["job_id"]
        and e.get("attempt", "") == entry.get("attempt", "")
        and e.get("replica_agreed_step", 0) >= entry["step"]
        for e in [entry, *chain[at + 1 :]]
    )


def _check_job_id(job: str) -> str:
    if not _JOB_ID.match(job):
        raise ValueError(f'checkpoint: job_id "{job}": must match {_JOB_ID.pattern}')
    return job


def _read_catalog(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    raw = json.loads(path.read_text())
    if raw.get("format") != CATALOG_FORMAT:
        raise ValueError(f"{path}: format {raw.get('format')!r}, expected {CATALOG_FORMAT!r}")
    return list(raw["versions"])


def _write_durable(path: Path, data: bytes) -> None:
    """Raises WriteRefused when the filesystem refuses it (full, quota, permission,
    read-only, I/O error: typed from the errno); any other OSError as it is."""
    with writing(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_into_place(staging: Path, final: Path) -> None:
    """The commit point of a version's files (atomic within one filesystem)."""
    with writing(final):
        os.rename(staging, final)
