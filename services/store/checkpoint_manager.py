"""L5-1 checkpoint manager: hands out staging locations, verifies, commits and catalogs versions.

Ranks write torch.distributed.checkpoint (DCP) shards themselves, straight to storage, or
stream them here (see "Where the bytes live" below). This
module only says where (``save_checkpoint``), seals what was written into a numbered version
(``commit_checkpoint``), proves a version intact before anyone reads it (``load_checkpoint``) and lists the
chain (``checkpoint_query``). It never decides when to save or which version to load (both come in the
command), never changes a byte it was handed and never opens a tensor.

On disk, under ``<root>/checkpoints``::

    catalog.json                               the version chain of every job
    <job_id>/.staging/step-<step>-<token>/     the job's open save: ranks write its index here
    <job_id>/<n>/                              version "<job_id>:<n>": the index + manifest.json
    <job_id>/chunks/<epoch>/<sha[:2]>/<sha>    the chunks of an epoch (content-addressed)

Incremental saves (the ranks' side: ``services/state/chunk_store.py``). A version is DCP's
``.metadata`` plus ``chunks.json`` (every chunk it references: SHA-256, bytes) in its own
directory, and chunks, each a file named by its SHA-256, in its epoch's directory. An epoch
begins with a baseline (a new directory, so its save writes every chunk); the versions after
it in the same epoch are deltas: their ranks write only the chunks the directory lacks.
``save_checkpoint`` decides which (``_next_epoch``: a new epoch every ``baseline_every``
versions, counted from the epoch's baseline whatever was pruned since, or when a version of
the epoch is recorded not ok, or its directory is gone) and says so in SaveStaged. A commit
also checks every chunk ``chunks.json`` names: there, its size, and, if no ok version of the
epoch references it already (verified at that version's commit), hashed to its name. The
manifest lists the chunks; ``bytes`` is the whole version, ``written_bytes`` what its save
wrote. Chunks are never rewritten, so a killed delta leaves every older version whole. After
retention, the job's chunks are garbage-collected (mark and sweep, under the lock, so no save
of the job can begin meanwhile): a chunk no cataloged version references is removed, and so
is an epoch directory none references. Verification hashes each chunk once per pass (a scrub
or a re-hash); a damaged chunk strikes every version that references it.

Where the bytes live (the deployment's choice, ``services/store/__main__.py``; every
SaveStaged and CheckpointInfo says it in ``transfer``, so a rank never guesses):

* ``TRANSFER_PATH`` (the default): the layout above on the store's disk, which the ranks
  write and read themselves at the paths handed out: a filesystem mounted at the same path
  on every node.
* ``TRANSFER_STREAM``: the same layout on the store's disk, which only the store touches.
  Ranks stream their files (``receive_files``: index files into the staging directory,
  chunks into the epoch's directory), each checked as it arrives: the name stays inside its
  directory (``_check_index_name``; a chunk's name is a SHA-256), the size is bounded
  (``MAX_STREAMED_CHUNK_BYTES``, ``MAX_STREAMED_INDEX_BYTES``) and as declared, the bytes
  hash to the declared SHA-256 (a chunk's: its name); a file that fails is refused
  (CheckpointTransferRefused, its cause typed) and nothing of it stays. A stream only feeds
  the job's open save of its step and attempt; the commit is the same as ever (the files
  are hashed again there). ``held_chunks`` tells a rank what the epoch has (a delta sends
  only the rest); ``send_files`` streams a committed version's index files and chunks back,
  only those its manifest names.
* ``TRANSFER_FSSPEC``: chunks live in an object store (``chunk_roots.FsspecChunks``, e.g.
  ``s3://bucket/prefix/<job>/chunks/<epoch>/<sha[:2]>/<sha>``), which the ranks write and read
  themselves; the index files stream to the store as above, and the catalog, each version's
  index and manifest stay on the store's disk. Commit checks, verification, scrubs and
  garbage collection of chunks go to the object store (one listing per epoch, a read per
  chunk hashed).

These data-plane methods are called by the store's relay for the plumbing RPCs
``PutCheckpointFiles``, ``HeldCheckpointChunks`` and ``GetCheckpointFiles`` (bytes, not
routed messages; exception checkpoint-bytes-stream); nothing is decided on them.

Staging (one open save per job, a save is "the ranks of one attempt writing one step"):

* Every rank asks ``save_checkpoint(job, step, rank, attempt)``. ``attempt`` names the
  generation of ranks (one launch of the job's ranks: the same for all of them, different
  for every launch; the ranks' checkpoint relay sets it). A rank that asks for the open
  save's step, of the open save's attempt, and has not asked for it before gets the open
  save's directory: all ranks of one attempt share one.
* Another attempt never shares a directory: its first rank gets a fresh one. Without this,
  a killed generation's half-begun save of step s would be handed to some ranks of the
  next generation saving s again, and a fresh directory to the others (they "asked twice"),
  and the version committed would lack their shards. The attempt a new one replaced is
  superseded: its later asks (a straggler of a killed generation) are refused, so it can
  never remove the newer attempt's directory. The manager remembers the last
  ``_ATTEMPTS_KEPT`` attempts of each job, in memory only.
* A rank asking a second time for the same step within its attempt (or, with an empty
  ``attempt`` from an older client, at all) starts a new attempt: it gets a fresh
  directory. A different step also gets a fresh one.
* A fresh directory abandons the job's previous open save: every other staging directory of
  the job is removed then, so a dead save never blocks or leaks into a new one.
* After a store restart nothing is open; a commit adopts the single staging directory of
  its step if exactly one is on disk (ranks that wrote before the restart are not lost).
* A commit naming an attempt is refused when the open save is another attempt's, and every
  commit is refused (``CheckpointIncomplete``) when the staging directory's DCP ``.metadata``
  names a file that is not there or is shorter than the data it should hold: the index is
  read as a stream of pickle opcodes (``pickletools``), nothing is unpickled or imported.

Commit order (why: a crash at any point leaves the chain as it was, or one step ahead, and
never points at a half-written version): hash every file -> write + fsync ``manifest.json``
-> re-stat every file (a straggler still writing fails the commit) -> fsync the directory ->
rename staging to ``<n>`` -> fsync the parent -> write the catalog to a temp file, fsync,
rename over ``catalog.json``. A directory ``<n>`` with no catalog entry (a crash between the
last two renames) was never acknowledged; the next commit of that job reuses ``n`` and
removes it.

Retention runs only when a commit asks for it (``keep_last``, ``keep_every``): the versions
of that job older than the newest ``keep_last``, except those whose step is a multiple of
``keep_every``, those named in ``keep_versions`` (the version the committing ranks resumed
from) and the job's newest version whose verdict is ok, leave the catalog first, then their
directories are removed, so the catalog never names a missing directory. The number of a
cataloged version is never reused (the latest version is never pruned, and numbering
continues from it).

Verification is off the critical path. Every file is hashed at commit (that is the
verification: the manifest is written from those digests), and the catalog records the
verdict and when it was reached (``verdict``: ok | corrupt | missing_file, ``verified_unix``,
``reason``; a catalog entry written before verdicts existed reads as ok, verified at its
commit). ``load_checkpoint`` re-hashes nothing: it refuses a version whose recorded verdict is not ok,
checks the manifest (a few hundred bytes) against the catalog and says where the version is;
the reader checks each file's SHA-256 as it reads it (``services/rank/store_client.py``).
``verify`` answers from the recorded verdicts, or re-hashes when asked (``rehash``). A scrub
(``scrub``: on the orchestrator's command, or the operator's schedule kept by the store's
composition root) re-hashes committed versions and records the verdicts; each version newly
found corrupt is published as ``CheckpointCorrupt`` (this module's own event emitter: it
publishes events only, it commands nobody). ``latest`` names the newest version whose recorded verdict is ok.
This module reports verdicts; it never picks the version to load.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.disk import syncfs
from services.contract import store_pb2
from services.contract.bus import Reply
from services.contract.failures import FailureCause, Refusal
from services.store.chunk_roots import FsspecChunks, LocalChunks

MANIFEST = "manifest.json"
CATALOG = "catalog.json"
MANIFEST_FORMAT = "surge.checkpoint.manifest/1"
CATALOG_FORMAT = "surge.checkpoint.catalog/1"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # no ':' (version ids) or '/'
_RUN_OF = re.compile(r"(.+)-[0-9a-f]{6}")  # a job id: its name, then control's 6 hex digits
_CHUNK_BYTES = 1 << 20
_HASH_THREADS = 4  # hashlib releases the GIL on large updates; shards hash in parallel
_ATTEMPTS_KEPT = 32  # per job: attempts remembered to refuse a superseded one
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
    written_bytes: int
    hashed: int  # chunks hashed at this commit (not verified by an earlier version)


@dataclass(frozen=True)
class _Hashed:
    bytes: int
    sha256: str
    fingerprint: tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode at hashing time


class CheckpointManager:
    """The version chain of every job under ``<root>/checkpoints`` (survives restarts).

    Thread-safe: the gRPC relay calls it from a thread pool. Hashing runs outside the lock,
    so one job's large commit does not hold up another job's ``save_checkpoint``.

    Args:
        root: the store root; this module owns ``root/checkpoints``.
        registry: where its Prometheus metrics register (a private one by default).
    """

    def __init__(
        self,
        root: Path,
        registry: CollectorRegistry | None = None,
        emit: Callable[[store_pb2.CheckpointCorrupt], Any] | None = None,
        transfer: int = store_pb2.TRANSFER_PATH,
        chunks: FsspecChunks | None = None,
    ):
        """``emit``: where each version newly found corrupt is published (the bus emitter of
        L5-1 in the service; None drops them). ``transfer``: how ranks move this store's
        bytes (SaveStaged.transfer: TRANSFER_PATH, the default, or TRANSFER_STREAM);
        ``chunks``: an object store for the chunks (then TRANSFER_FSSPEC; None: the
        store's disk). See "Where the bytes live" in the module docstring."""
        self._emit = emit
        self._dir = Path(root) / "checkpoints"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._chunks: LocalChunks | FsspecChunks = chunks if chunks is not None else LocalChunks(self._dir)
        if chunks is not None:
            transfer = store_pb2.TRANSFER_FSSPEC
        elif transfer not in (store_pb2.TRANSFER_PATH, store_pb2.TRANSFER_STREAM):
            raise ValueError(f"checkpoint transfer {transfer}: TRANSFER_FSSPEC needs an object store for the chunks")
        self._transfer = transfer
        self._endpoint = chunks.endpoint_url if chunks is not None else ""
        self._lock = threading.Lock()
        self._open: dict[str, _OpenSave] = {}
        self._attempts: dict[str, list[str]] = {}  # job -> attempts seen, oldest first (last: current)
        self._verifying: dict[str, Future[None]] = {}  # version -> verification in flight
        self._chain: list[dict[str, Any]] = _read_catalog(self._dir / CATALOG)
        self._chunk_sets: dict[str, frozenset[str]] = {}  # version -> the chunks it references
        reg = registry if registry is not None else CollectorRegistry()
        self._commits = Counter("surge_checkpoint_commits_total", "Versions committed.", ["job"], registry=reg)
        self._commit_seconds = Gauge(
            "surge_checkpoint_commit_seconds",
            "Hash + commit time of the last version (seconds).",
            ["job"],
            registry=reg,
        )
        self._bytes = Gauge(
            "surge_checkpoint_bytes", "Size of the last committed version (bytes).", ["job"], registry=reg
        )
        self._written = Gauge(
            "surge_checkpoint_written_bytes",
            "Chunk bytes the last committed version's save wrote (a delta: what changed).",
            ["job"],
            registry=reg,
        )
        self._swept = Counter(
            "surge_checkpoint_chunks_swept_total", "Chunk files removed by garbage collection.", ["job"], registry=reg
        )
        self._rejected = Counter(
            "surge_checkpoint_rejected_total",
            "Commits and loads refused, by operation.",
            ["job", "op"],
            registry=reg,
        )
        self._found_corrupt = Counter(
            "surge_checkpoint_corrupt_found_total",
            "Committed versions newly found corrupt, by cause.",
            ["job", "cause"],
            registry=reg,
        )
        self._scrub_seconds = Gauge(
            "surge_checkpoint_scrub_seconds", "Wall time of the last scrub (seconds).", registry=reg
        )
        self._scrubbed = Counter(
            "surge_checkpoint_scrubbed_versions_total", "Versions re-hashed by scrubs.", registry=reg
        )

    # ------------------------------------------------------------------ commands

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: Any = None) -> store_pb2.SaveStaged:
        """保存当前快照指令, first half: where rank ``msg.rank`` writes step ``msg.step``.

        Returns the open save's directory for a rank of the open save's attempt that has
        not asked for it yet; a fresh directory (removing the job's other staging
        directories) otherwise. See the module docstring for the rules.

        Raises:
            ValueError: ``job_id`` is not a safe name.
            CheckpointRejected: the job's open save is being committed right now, or
                ``msg.attempt`` was superseded by a newer attempt of the job.
        """
        job = _check_job_id(msg.job_id)
        attempt = msg.attempt
        with self._lock:
            save = self._open.get(job)
            if save is not None and save.committing:
                raise CheckpointRejected(
                    f"checkpoint {job}: save of step {save.step} is being committed; cannot begin step {msg.step}"
                )
            seen = self._attempts.setdefault(job, [])
            if attempt and attempt in seen[:-1]:
                raise CheckpointRejected(
                    f"checkpoint {job}: attempt {attempt} was superseded by a newer launch of the job's "
                    f"ranks; cannot begin step {msg.step} (rank {msg.rank})"
                )
            if attempt and (not seen or seen[-1] != attempt):
                seen.append(attempt)
                del seen[:-_ATTEMPTS_KEPT]
            if (
                save is None
                or save.step != msg.step
                or save.attempt != attempt
                or msg.rank in save.ranks
                or not save.path.is_dir()
            ):
                save = self._fresh_staging(job, msg.step, attempt)
                save.epoch, save.baseline = self._next_epoch(job, msg.baseline_every)
            save.ranks.add(msg.rank)
            path, epoch, baseline = save.path, save.epoch, save.baseline
        return store_pb2.SaveStaged(
            job_id=job,
            step=msg.step,
            staging_path=str(path),
            chunk_path=self._chunks.location(job, epoch),
            baseline=baseline,
            epoch=epoch,
            transfer=self._transfer,
            endpoint_url=self._endpoint,
        )

    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload: Any = None) -> store_pb2.SaveCompleted:
        """保存当前快照指令, second half: seal the open save of (job, step) as the next version.

        Hashes every file (SHA-256), writes ``manifest.json``, renames the staging directory
        to ``<job>/<n>`` and appends ``"<job>:<n>"`` to the chain with the job's previous
        version as parent; then applies ``keep_last`` (0 keeps all). ``seconds`` in the
        reply is the manager's hash + commit time.

        Raises:
            ValueError: ``job_id`` is not a safe name.
            CheckpointRejected: no open save for (job, step) (or it is another attempt's than
                ``msg.attempt``), its directory is empty, holds a symlink, or a file changed
                while being committed; CheckpointIncomplete: its DCP ``.metadata`` names a
                file that is missing or short. The chain is unchanged.
        """
        t0 = time.perf_counter()
        job = _check_job_id(msg.job_id)
        with self._lock:
            save = self._claim(job, msg.step, msg.attempt)
        committed = False
        try:
            files = _hash_files(save.path, job)
            if not files:
                raise CheckpointRejected(f"checkpoint {job}: step {msg.step}: staging {save.path} is empty")
            _check_complete(save.path, files, job, msg.step)
            chunks = self._check_chunks(job, msg.step, save, files) if CHUNK_INDEX in files else None
            with self._lock:
                entry = self._seal(job, msg, save, files, chunks)
                committed = True
                removed = self._retain(job, msg.keep_last, msg.keep_every, msg.keep_versions)
                self._sweep_chunks(job, save)
        except CheckpointRejected:
            self._rejected.labels(job, "commit").inc()
            raise
        finally:
            with self._lock:
                if self._open.get(job) is save:
                    if committed:
                        del self._open[job]
                    else:
                        save.committing = False  # the loop may fix the cause and commit again
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        seconds = time.perf_counter() - t0
        self._commits.labels(job).inc()
        self._commit_seconds.labels(job).set(seconds)
        self._bytes.labels(job).set(entry["bytes"])
        self._written.labels(job).set(entry.get("written_bytes", entry["bytes"]))
        return store_pb2.SaveCompleted(
            job_id=job,
            version=entry["version"],
            parent=entry["parent"],
            step=entry["step"],
            path=str(self._dir / entry["path"]),
            manifest_sha256=entry["manifest_sha256"],
            bytes=entry["bytes"],
            files=entry["files"],
            seconds=seconds,
            written_bytes=entry.get("written_bytes", 0),
            baseline=entry.get("baseline", False),
        )

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: Any = None) -> store_pb2.CheckpointLoaded:
        """加载指定版本快照指令: say where ``msg.version`` is, if its recorded verdict is ok.

        ``version`` is ``"<job>:<n>"``, ``"<job>:latest"`` or ``"latest"`` (the newest
        version whose verdict is ok, of that job or of any job); which one is the caller's
        choice, never this module's. Nothing is re-hashed here: the manifest (small) is
        checked against the catalog, and the reader checks every file's SHA-256 against the
        manifest as it reads it. A manifest that is gone or changed is recorded (and
        published) like a scrub's finding.

        Raises:
            ValueError: ``version`` is not one of the three forms.
            CheckpointNotFound: no such version (the message lists the ones that exist).
            CheckpointRejected: the version's recorded verdict is not ok, or its manifest
                is missing or differs from the catalog (CheckpointDamaged).
        """
        with self._lock:
            entry = self._resolve(msg.version)
            cause, reason, _ = _verdict(entry)
        if cause != store_pb2.VERDICT_OK:
            self._rejected.labels(entry["job_id"], "load").inc()
            raise CheckpointDamaged(reason or f"checkpoint {entry['version']}: recorded {_VERDICT_OF[cause]}", cause)
        try:
            _check_manifest(entry["version"], self._dir / entry["path"], entry["manifest_sha256"])
        except CheckpointDamaged as e:
            self._rejected.labels(entry["job_id"], "load").inc()
            self._record([(entry, e.cause, str(e))])
            raise
        return store_pb2.CheckpointLoaded(info=self._info(entry))

    def verify_checkpoints(
        self, msg: store_pb2.VerifyCheckpoints, payload: Any = None
    ) -> store_pb2.CheckpointVerification:
        """The verdict of every committed version of ``msg.job_id`` (oldest first): as
        recorded (cheap), or re-hashed now and recorded if ``msg.rehash``. Reports; never
        chooses or deletes.

        Raises:
            ValueError: ``job_id`` is not a safe name.
        """
        job = _check_job_id(msg.job_id)
        if msg.rehash:
            verdicts, _ = self._rehash(job)
        else:
            with self._lock:
                verdicts = [self._verdict_msg(e) for e in self._chain if e["job_id"] == job]
        for v in verdicts:
            if not v.ok:
                self._rejected.labels(job, "verify").inc()
        return store_pb2.CheckpointVerification(job_id=job, versions=verdicts)

    def scrub_checkpoints(self, msg: store_pb2.ScrubCheckpoints, payload: Any = None) -> store_pb2.CheckpointScrubbed:
        """Re-hash the committed versions of ``msg.job_id`` (every job if empty) and record
        the verdicts; publish each version newly found corrupt (CheckpointCorrupt). Runs
        outside the manager's lock: commits and loads go on meanwhile.

        Raises:
            ValueError: ``job_id`` is not empty and not a safe name.
        """
        job = _check_job_id(msg.job_id) if msg.job_id else ""
        t0 = time.perf_counter()
        verdicts, newly = self._rehash(job)
        seconds = time.perf_counter() - t0
        self._scrub_seconds.set(seconds)
        self._scrubbed.inc(len(verdicts))
        return store_pb2.CheckpointScrubbed(job_id=job, versions=verdicts, newly_corrupt=newly, seconds=seconds)

    def _corrupt_now(self, job_id: str = "") -> list[store_pb2.CheckpointCorrupt]:
        """The versions recorded corrupt now (of ``job_id``, or every job), oldest first:
        what a new watcher of CheckpointCorrupt is told first."""
        with self._lock:
            entries = [e for e in self._chain if (not job_id or e["job_id"] == job_id)]
            return [self._corrupt_msg(e) for e in entries if _verdict(e)[0] != store_pb2.VERDICT_OK]

    def watch_checkpoints_request(self, msg: store_pb2.WatchCheckpointsRequest, payload: Any = None) -> Reply:
        """A subscription to CheckpointCorrupt (the relay fans the events out): answered with
        the versions recorded corrupt now, as the reply's payload (a list, oldest first)."""
        job = _check_job_id(msg.job_id) if msg.job_id else ""
        return Reply(None, self._corrupt_now(job))

    def delete_checkpoint(self, msg: store_pb2.DeleteCheckpoint, payload: Any = None) -> store_pb2.CheckpointDeleted:
        """Remove ``msg.version`` (``<job>:<n>``): out of the catalog first, then its
        directory, then the job's chunks no other version references (as retention does).

        Raises:
            ValueError: not a ``<job>:<n>`` version.
            CheckpointNotFound: no such version.
            CheckpointRejected: it is in use: a save of its job or a verification of it is in
                flight, or it is the newest ok version of a job not known to have ended
                (``msg.job_ended`` false: a relaunch of the job resumes from it). Nothing
                changed.
        """
        job, sep, n = msg.version.rpartition(":")
        if not sep or not job or not n.isdigit():
            raise ValueError(f"version: expected '<job>:<n>', got {msg.version!r}")
        with self._lock:
            entry = next((e for e in self._chain if e["version"] == msg.version), None)
            if entry is None:
                have = [e["version"] for e in self._chain if e["job_id"] == job]
                raise CheckpointNotFound(f"checkpoint {msg.version} not found (have: {', '.join(have) or 'none'})")
            ok = [e["version"] for e in self._chain if e["job_id"] == job and _verdict(e)[0] == store_pb2.VERDICT_OK]
            if msg.version in self._verifying or job in self._open:
                raise CheckpointRejected(
                    f"checkpoint {msg.version} is in use: a {'save of ' + job if job in self._open else 'load'} "
                    "is in flight; try again when it is done"
                )
            if ok and ok[-1] == msg.version and not msg.job_ended:
                raise CheckpointRejected(
                    f"checkpoint {msg.version} is in use: the newest ok version of {job}, which has not ended "
                    "(a relaunch resumes from it); stop the job first"
                )
            kept = [e for e in self._chain if e is not entry]
            self._write_catalog(kept)
            self._chain = kept
            self._chunk_sets.pop(msg.version, None)
            path = self._dir / entry["path"]
            freed = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
            shutil.rmtree(path, ignore_errors=True)
            before = self._chunks.tree_bytes(job)
            self._sweep_chunks(job)
            freed += before - self._chunks.tree_bytes(job)
        return store_pb2.CheckpointDeleted(version=msg.version, bytes_freed=freed)

    # ------------------------------------------------------------------ data plane (no shared filesystem)

    def held_chunks(self, query: store_pb2.HeldCheckpointChunksQuery) -> store_pb2.HeldCheckpointChunksReply:
        """The chunks the open save's epoch holds (what its ranks need not send), as raw
        32-byte digests. Data plane: called by the relay, not a routed command.

        Raises:
            CheckpointTransferRefused: no open save of (job, step, attempt, epoch).
        """
        job, epoch, _ = self._receiving(query.job_id, query.step, query.attempt, query.epoch)
        shas = self._chunks.sizes(job, epoch)
        return store_pb2.HeldCheckpointChunksReply(sha256=b"".join(bytes.fromhex(s) for s in sorted(shas)))

    def receive_files(
        self, header: store_pb2.CheckpointUploadHeader, parts: Iterator[store_pb2.CheckpointFileData]
    ) -> store_pb2.CheckpointFilesPut:
        """Take the files a rank streams for the open save of ``header`` (TRANSFER_STREAM:
        index files into its staging directory, chunks into its epoch's directory;
        TRANSFER_FSSPEC: index files only). Each file is written to a temp name beside its
        place while it is hashed, checked when its last byte arrived (size as declared, SHA-256
        as declared; a chunk's SHA-256 is its name), then made durable and renamed into place
        (chunks: all at the stream's end, one filesystem sync). A chunk the epoch holds already
        is read and dropped. Data plane: called by the relay, not a routed command.

        Raises:
            CheckpointTransferRefused: see the class; every temp file of the stream is removed.
        """
        job, epoch, staging = self._receiving(header.job_id, header.step, header.attempt, header.epoch)
        what = f"checkpoint {job}: step {header.step}: rank {header.rank}"
        chunk_dir = self._chunks.epoch_dir(job, epoch) if isinstance(self._chunks, LocalChunks) else None
        held = set(self._chunks.sizes(job, epoch)) if chunk_dir is not None else set()
        temps: list[tuple[Path, Path]] = []  # (temp, final) of the chunks received, renamed at the end
        current: _Incoming | None = None
        files = total = present = 0
        try:
            for part in parts:
                if current is None:
                    current = self._incoming(part, what, staging, chunk_dir, held)
                elif part.name:
                    raise CheckpointTransferRefused(
                        f"{what}: {current.name}: {current.received} of {current.size} bytes, then {part.name!r} began",
                        FailureCause.FAILURE_DATA_CORRUPT,
                        current.name,
                    )
                current.add(part.data, what)
                if current.received == current.size:
                    done, current = current, None
                    done.finish(what)
                    files += 1
                    total += done.size
                    if done.final is None:
                        present += 1
                    elif done.kind == store_pb2.CHECKPOINT_FILE_CHUNK:
                        temps.append((done.temp, done.final))
                        held.add(done.name)
                    else:
                        os.replace(done.temp, done.final)
            if current is not None:
                raise CheckpointTransferRefused(
                    f"{what}: {current.name}: the stream ended after {current.received} of {current.size} bytes",
                    FailureCause.FAILURE_DATA_CORRUPT,
                    current.name,
                )
            if temps:
                synced = syncfs(temps[0][0].parent)
                for tmp, final in temps:
                    if not synced:
                        with open(tmp, "rb+") as f:
                            os.fsync(f.fileno())
                    os.replace(tmp, final)
                if not (synced and syncfs(temps[0][1].parent)):
                    for parent in {final.parent for _, final in temps}:
                        _fsync_dir(parent)
                temps = []
        finally:
            if current is not None:
                current.discard()
            for tmp, _ in temps:
                tmp.unlink(missing_ok=True)
        return store_pb2.CheckpointFilesPut(files=files, bytes=total, chunks_present=present)

    def send_files(self, query: store_pb2.CheckpointFilesQuery) -> Iterator[store_pb2.CheckpointFileData]:
        """The files of committed version ``query.version`` a reader asks for: index files of
        its directory (``manifest.json`` and those its manifest lists) and chunks it references,
        each as parts of at most ``TRANSFER_PART_BYTES`` (a file the store lacks: one part with
        ``missing``). Checked before anything is sent: the version is cataloged with an ok
        verdict, its manifest matches the catalog, every name is the version's. The bytes are
        sent as stored: the reader checks each file's SHA-256 against the manifest.

        Raises:
            ValueError: not a ``<job>:<n>`` version.
            CheckpointNotFound: no such version.
            CheckpointRejected: its verdict is not ok, its manifest is damaged, or a name is
                not one of its files (CheckpointTransferRefused).
        """
        job, sep, n = query.version.rpartition(":")
        if not sep or not job or not n.isdigit():
            raise ValueError(f"version: expected '<job>:<n>', got {query.version!r}")
        with self._lock:
            entry = next((e for e in self._chain if e["version"] == query.version), None)
        if entry is None:
            raise CheckpointNotFound(f"checkpoint {query.version} not found")
        cause, reason, _ = _verdict(entry)
        if cause != store_pb2.VERDICT_OK:
            raise CheckpointDamaged(reason or f"checkpoint {entry['version']}: recorded {_VERDICT_OF[cause]}", cause)
        directory = self._dir / entry["path"]
        files, manifest = _check_manifest(entry["version"], directory, entry["manifest_sha256"], whole=True)
        chunk_sizes = {c["sha"]: int(c["bytes"]) for c in manifest.get("chunks", ())}
        for name in query.names:
            if name != MANIFEST and name not in files:
                raise CheckpointTransferRefused(
                    f"checkpoint {entry['version']}: {name!r} is not a file of it", file=name
                )
        for sha in query.chunks:
            if sha not in chunk_sizes:
                raise CheckpointTransferRefused(
                    f"checkpoint {entry['version']}: chunk {sha!r} is not one of its", file=sha
                )
        epoch = entry.get("epoch", 0)
        jid = entry["job_id"]

        def stream() -> Iterator[store_pb2.CheckpointFileData]:
            index = store_pb2.CHECKPOINT_FILE_INDEX
            for name in query.names:
                try:
                    data = (directory / name).read_bytes()
                except FileNotFoundError:
                    yield store_pb2.CheckpointFileData(name=name, kind=index, missing=True)
                    continue
                yield from _parts(name, index, data)
            for sha in query.chunks:
                try:
                    data = self._chunks.read(jid, epoch, sha)
                except FileNotFoundError:
                    yield store_pb2.CheckpointFileData(name=sha, kind=store_pb2.CHECKPOINT_FILE_CHUNK, missing=True)
                    continue
                yield from _parts(sha, store_pb2.CHECKPOINT_FILE_CHUNK, data)

        return stream()

    def _receiving(self, job_id: str, step: int, attempt: str, epoch: int) -> tuple[str, int, Path]:
        """(job, epoch, staging directory) of the open save files are streamed for."""
        job = _check_job_id(job_id)
        with self._lock:
            save = self._open.get(job)
            if save is None or save.step != step or (attempt and save.attempt and attempt != save.attempt):
                raise CheckpointTransferRefused(f"checkpoint {job}: no open save of step {step} for this attempt")
            if save.committing:
                raise CheckpointTransferRefused(f"checkpoint {job}: step {step} is being committed")
            if epoch != save.epoch:
                raise CheckpointTransferRefused(f"checkpoint {job}: step {step} writes epoch {save.epoch}, not {epoch}")
            return job, save.epoch, save.path

    def _incoming(
        self, part: store_pb2.CheckpointFileData, what: str, staging: Path, chunk_dir: Path | None, held: set[str]
    ) -> _Incoming:
        """A file's first part, checked: its name, kind and size; its temp file opened."""
        name, size = part.name, part.size
        if part.kind == store_pb2.CHECKPOINT_FILE_CHUNK:
            if chunk_dir is None:
                raise CheckpointTransferRefused(
                    f"{what}: chunks go to the object store, not to the store service", file=name
                )
            if not _SHA256.fullmatch(name):
                raise CheckpointTransferRefused(f"{what}: chunk {name[:80]!r}: not a SHA-256", file=name[:80])
            if size > MAX_STREAMED_CHUNK_BYTES:
                raise CheckpointTransferRefused(
                    f"{what}: chunk {name}: {size} bytes, over the bound of {MAX_STREAMED_CHUNK_BYTES}", file=name
                )
            if name in held:
                return _Incoming(name, part.kind, size, name, None, None)
            final = chunk_dir / name[:2] / name
            final.parent.mkdir(parents=True, exist_ok=True)
            return _Incoming(name, part.kind, size, name, final.with_name(f".{name}.{secrets.token_hex(4)}.up"), final)
        if part.kind != store_pb2.CHECKPOINT_FILE_INDEX:
            raise CheckpointTransferRefused(f"{what}: {name[:80]!r}: no file kind", file=name[:80])
        _check_index_name(name, what)
        if size > MAX_STREAMED_INDEX_BYTES:
            raise CheckpointTransferRefused(
                f"{what}: {name}: {size} bytes, over the bound of {MAX_STREAMED_INDEX_BYTES}", file=name
            )
        if not _SHA256.fullmatch(part.sha256):
            raise CheckpointTransferRefused(f"{what}: {name}: no SHA-256 declared", file=name)
        final = staging / name
        final.parent.mkdir(parents=True, exist_ok=True)
        return _Incoming(
            name, part.kind, size, part.sha256, final.with_name(f".{final.name}.{secrets.token_hex(4)}.up"), final
        )

    def checkpoint_query(self, msg: store_pb2.CheckpointQuery, payload: Any = None) -> store_pb2.CheckpointList:
        """The committed versions of ``msg.job_id`` (every job if empty), oldest first."""
        with self._lock:
            entries = [e for e in self._chain if not msg.job_id or e["job_id"] == msg.job_id]
        return store_pb2.CheckpointList(checkpoints=[self._info(e) for e in entries])

    def _check(self, entry: dict[str, Any], memo: dict[str, tuple[int, str] | None] | None = None) -> None:
        """Verify one cataloged version; raises CheckpointRejected. Callers asking for the
        same version while it is being verified share that one verification (every rank of
        a job loads the same version at once on resume; one re-hash serves them all)."""
        version = entry["version"]
        with self._lock:
            verdict = self._verifying.get(version)
            mine = verdict is None
            if mine:
                verdict = self._verifying[version] = Future()
        if mine:
            try:
                _verify(
                    version, self._dir / entry["path"], entry["manifest_sha256"], memo, self._chunks, entry["job_id"]
                )
                verdict.set_result(None)
            except BaseException as e:
                verdict.set_exception(e)
            finally:
                with self._lock:
                    del self._verifying[version]
        verdict.result()

    def _rehash(self, job: str) -> tuple[list[store_pb2.CheckpointVerdict], list[store_pb2.CheckpointCorrupt]]:
        """Re-hash the versions of ``job`` (every job if empty), record the verdicts, publish
        the newly corrupt. Returns (verdicts of the versions still cataloged, newly corrupt)."""
        with self._lock:
            entries = [e for e in self._chain if not job or e["job_id"] == job]
        found: list[tuple[dict[str, Any], int, str]] = []
        memo: dict[str, tuple[int, str] | None] = {}  # chunk -> its finding: versions share chunks
        for entry in entries:
            try:
                self._check(entry, memo)
                found.append((entry, store_pb2.VERDICT_OK, ""))
            except CheckpointDamaged as e:
                found.append((entry, e.cause, str(e)))
            except CheckpointRejected as e:  # e.g. a symlink appeared: the bytes are not the manifest's
                found.append((entry, store_pb2.VERDICT_CORRUPT, str(e)))
        newly = self._record(found)
        with self._lock:
            live = {e["version"] for e in self._chain}
            verdicts = [self._verdict_msg(e) for e, _, _ in found if e["version"] in live]
        return verdicts, newly

    def _record(self, found: list[tuple[dict[str, Any], int, str]]) -> list[store_pb2.CheckpointCorrupt]:
        """Record verdicts (entry, cause, reason) in the catalog; publish and return the
        versions that were ok before and are not now. A version pruned meanwhile is skipped.
        A failure to rewrite the catalog keeps the verdicts in memory (counted)."""
        now = time.time()
        newly: list[store_pb2.CheckpointCorrupt] = []
        with self._lock:
            by_version = {e["version"]: e for e in self._chain}
            changed = False
            for entry, cause, reason in found:
                live = by_version.get(entry["version"])
                if live is None:
                    continue  # pruned while it was being hashed
                was = _verdict(live)[0]
                live["verdict"], live["verified_unix"], live["reason"] = _VERDICT_OF[cause], now, reason
                changed = True
                if was == store_pb2.VERDICT_OK and cause != store_pb2.VERDICT_OK:
                    newly.append(self._corrupt_msg(live))
                    self._found_corrupt.labels(live["job_id"], _VERDICT_OF[cause]).inc()
            if changed:
                try:
                    self._write_catalog(self._chain)
                except OSError:
                    self._rejected.labels("", "catalog").inc()
        if self._emit is not None:
            for event in newly:
                self._emit(event)
        return newly

    def _verdict_msg(self, entry: dict[str, Any]) -> store_pb2.CheckpointVerdict:
        cause, reason, when = _verdict(entry)
        return store_pb2.CheckpointVerdict(
            info=self._info(entry), ok=cause == store_pb2.VERDICT_OK, reason=reason, cause=cause, verified_unix=when
        )

    def _corrupt_msg(self, entry: dict[str, Any]) -> store_pb2.CheckpointCorrupt:
        cause, reason, when = _verdict(entry)
        return store_pb2.CheckpointCorrupt(
            job_id=entry["job_id"],
            version=entry["version"],
            step=entry["step"],
            reason=reason,
            cause=_FAILURE_CAUSE.get(cause, store_pb2.CORRUPT),
            found_unix=when,
        )

    # ------------------------------------------------------------------ chunks

    def _next_epoch(self, job: str, baseline_every: int) -> tuple[int, bool]:
        """(epoch, baseline) of a new save of ``job``: a delta of the newest chunked
        version's epoch while that epoch holds fewer than ``baseline_every`` versions (counted
        from its baseline, pruned ones included), all of them recorded ok, and its directory
        is there; else a baseline into a new epoch (a number never used by this job). Caller
        holds the lock."""
        mine = [e for e in self._chain if e["job_id"] == job and "epoch" in e]
        if mine and baseline_every > 1:
            last = mine[-1]
            same = [e for e in mine if e["epoch"] == last["epoch"]]
            if (
                last.get("epoch_index", 0) + 1 < baseline_every
                and all(_verdict(e)[0] == store_pb2.VERDICT_OK for e in same)
                and self._chunks.epoch_exists(job, last["epoch"])
            ):
                return last["epoch"], False
        used = [e["epoch"] for e in mine] + self._chunks.epochs(job)
        return max(used, default=0) + 1, True

    def _check_chunks(self, job: str, step: int, save: _OpenSave, files: dict[str, _Hashed]) -> _Chunks:
        """The staged save's ``chunks.json``, checked: every chunk it names is in its epoch's
        directory with its size, and each one no ok version of the epoch references (so not
        verified yet) hashes to its name. Outside the lock (hashing takes time).

        Raises:
            CheckpointIncomplete: ``chunks.json`` is malformed or names another epoch, or a
                chunk is missing, short or long, or its bytes do not hash to its name.
        """
        what = f"checkpoint {job}: step {step}"
        try:
            index = json.loads((save.path / CHUNK_INDEX).read_bytes())
            if index.get("format") != CHUNK_INDEX_FORMAT:
                raise ValueError(f"format {index.get('format')!r}, expected {CHUNK_INDEX_FORMAT!r}")
            epoch = int(index["epoch"])
            sizes = {c["sha"]: int(c["bytes"]) for c in index["chunks"]}
            written = int(index.get("written_bytes", 0))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointIncomplete(f"{what}: {CHUNK_INDEX}: unreadable ({e})", CHUNK_INDEX) from None
        if save.epoch and epoch != save.epoch:
            raise CheckpointIncomplete(
                f"{what}: {CHUNK_INDEX}: chunks of epoch {epoch}, the save was told epoch {save.epoch}", CHUNK_INDEX
            )
        for sha in sizes:
            if not _SHA256.match(sha):
                raise CheckpointIncomplete(f"{what}: {CHUNK_INDEX}: {sha!r} is not a SHA-256", CHUNK_INDEX)
        with self._lock:
            same = [
                e
                for e in self._chain
                if e["job_id"] == job and e.get("epoch") == epoch and _verdict(e)[0] == store_pb2.VERDICT_OK
            ]
        verified: set[str] = set()
        for e in same:
            verified |= self._chunk_set(e) or frozenset()
        fresh = []
        stored = self._chunks.sizes(job, epoch)  # one listing (an object store: one LIST, not a HEAD per chunk)
        for sha, size in sorted(sizes.items()):
            rel = f"{CHUNKS_DIR}/{epoch}/{sha}"
            have = stored.get(sha)
            if have is None:
                raise CheckpointIncomplete(f"{what}: {rel}: named by {CHUNK_INDEX}, which is not there", rel)
            if have != size:
                raise CheckpointIncomplete(f"{what}: {rel}: {have} bytes, {CHUNK_INDEX} says {size}", rel)
            if sha not in verified:
                fresh.append(sha)
        if fresh:
            with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(fresh))) as pool:
                digests = list(pool.map(lambda sha: self._chunks.hash(job, epoch, sha)[1], fresh))
            for sha, got in zip(fresh, digests):
                if got != sha:
                    rel = f"{CHUNKS_DIR}/{epoch}/{sha}"
                    raise CheckpointIncomplete(f"{what}: {rel}: sha256 mismatch", rel)
        return _Chunks(epoch=epoch, sizes=sizes, written_bytes=written, hashed=len(fresh))

    def _chunk_set(self, entry: dict[str, Any]) -> frozenset[str] | None:
        """The chunks a cataloged version references (from its manifest, checked against the
        catalog), or None if its manifest cannot be read or does not match."""
        version = entry["version"]
        got = self._chunk_sets.get(version)
        if got is None:
            try:
                _, manifest = _check_manifest(version, self._dir / entry["path"], entry["manifest_sha256"], whole=True)
            except (CheckpointDamaged, OSError, ValueError):
                return None
            got = self._chunk_sets[version] = frozenset(c["sha"] for c in manifest.get("chunks", ()))
        return got

    def _sweep_chunks(self, job: str, committing: _OpenSave | None = None) -> int:
        """Garbage-collect the job's chunks (mark and sweep): remove every chunk no cataloged
        version of the job references, and every epoch directory none references. An epoch
        with a version whose manifest cannot be read is left whole (what it needs is unknown).
        Nothing is swept while another save of the job is open (its chunks are in no manifest
        yet). Caller holds the lock (a save cannot begin meanwhile). Returns chunks removed."""
        epochs = self._chunks.epochs(job)
        if not epochs or self._open.get(job) not in (None, committing):
            return 0
        live = {e["version"] for e in self._chain}
        for version in [v for v in self._chunk_sets if v not in live]:
            del self._chunk_sets[version]
        need: dict[int, set[str] | None] = {}
        for e in self._chain:
            if e["job_id"] != job or "epoch" not in e:
                continue
            refs = self._chunk_set(e)
            have = need.setdefault(e["epoch"], set())
            if refs is None or have is None:
                need[e["epoch"]] = None
            else:
                have |= refs
        removed = 0
        for epoch in epochs:
            if epoch not in need:
                removed += self._chunks.remove_epoch(job, epoch)
                continue
            keep = need[epoch]
            if keep is None:
                continue
            removed += self._chunks.remove_except(job, epoch, keep)  # unreferenced chunks, killed writers' temp files
        if removed:
            self._swept.labels(job).inc(removed)
        return removed

    # ------------------------------------------------------------------ staging

    def _staging_root(self, job: str) -> Path:
        return self._dir / job / ".staging"

    def _fresh_staging(self, job: str, step: int, attempt: str = "") -> _OpenSave:
        staging = self._staging_root(job)
        if staging.is_dir():
            for old in staging.iterdir():  # abandoned saves: nobody will commit them now
                shutil.rmtree(old, ignore_errors=True)
        path = staging / f"step-{step}-{secrets.token_hex(4)}"
        path.mkdir(parents=True)
        save = _OpenSave(step=step, path=path, attempt=attempt)
        self._open[job] = save
        return save

    def _claim(self, job: str, step: int, attempt: str = "") -> _OpenSave:
        """The open save of (job, step), marked committing. Caller holds the lock."""
        save = self._open.get(job)
        if save is None:
            save = self._adopt(job, step)
        if save.step != step:
            raise CheckpointRejected(
                f"checkpoint {job}: no open save of step {step} (the open save is step {save.step})"
            )
        if attempt and save.attempt and save.attempt != attempt:
            raise CheckpointRejected(
                f"checkpoint {job}: the open save of step {step} is attempt {save.attempt}'s, not {attempt}'s"
            )
        if save.committing:
            raise CheckpointRejected(f"checkpoint {job}: step {step} is already being committed")
        if not save.path.is_dir():
            raise CheckpointRejected(f"checkpoint {job}: step {step}: staging {save.path} is gone")
        save.committing = True
        self._open[job] = save
        return save

    def _adopt(self, job: str, step: int) -> _OpenSave:
        """After a restart: the single staging directory of (job, step) on disk, if any."""
        staging = self._staging_root(job)
        found = sorted(staging.glob(f"step-{step}-*")) if staging.is_dir() else []
        if len(found) != 1:
            raise CheckpointRejected(
                f"checkpoint {job}: no open save of step {step} (BeginSave first)"
                + (f"; {len(found)} staging directories match" if found else "")
            )
        return _OpenSave(step=step, path=found[0])

    # ------------------------------------------------------------------ commit

    def _seal(
        self,
        job: str,
        msg: store_pb2.CommitCheckpoint,
        save: _OpenSave,
        files: dict[str, _Hashed],
        chunks: _Chunks | None = None,
    ) -> dict[str, Any]:
        """Manifest, re-check, rename, catalog; returns the new catalog entry. Caller holds
        the lock."""
        mine = [e for e in self._chain if e["job_id"] == job]
        n = max((e["n"] for e in mine), default=0) + 1
        parent = mine[-1]["version"] if mine else ""
        created = time.time()
        total = sum(h.bytes for h in files.values())
        chunked: dict[str, Any] = {}
        if chunks is not None:
            total += sum(chunks.sizes.values())
            same = [e for e in mine if e.get("epoch") == chunks.epoch]
            chunked = {
                "epoch": chunks.epoch,
                "epoch_index": max((e.get("epoch_index", 0) + 1 for e in same), default=0),
                "baseline": not same,
                "chunk_dir": f"{CHUNKS_DIR}/{chunks.epoch}",  # relative to the job's directory
                "written_bytes": chunks.written_bytes,
            }
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": f"{job}:{n}",
            "job_id": job,
            "parent": parent,
            "step": msg.step,
            "world_size": msg.world_size,
            "created_unix": created,
            "spec_json": msg.spec_json,
            "bytes": total,
            "files": [{"path": p, "bytes": h.bytes, "sha256": h.sha256} for p, h in sorted(files.items())],
        }
        if chunks is not None:
            manifest |= chunked
            manifest["chunks"] = [{"sha": sha, "bytes": b} for sha, b in sorted(chunks.sizes.items())]
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _write_durable(save.path / MANIFEST, data)
        _check_unchanged(save.path, files, job, msg.step)
        _fsync_dir(save.path)
        final = self._dir / job / str(n)
        if final.exists():  # left by a crash between rename and catalog; never acknowledged
            shutil.rmtree(final)
        _rename_into_place(save.path, final)
        _fsync_dir(final.parent)
        entry = {
            "version": f"{job}:{n}",
            "job_id": job,
            "n": n,
            "parent": parent,
            "step": msg.step,
            "path": f"{job}/{n}",
            "manifest_sha256": hashlib.sha256(data).hexdigest(),
            "bytes": total,
            "files": len(files) + (len(chunks.sizes) if chunks is not None else 0),
            "created_unix": created,
            "world_size": msg.world_size,
            "spec_json": msg.spec_json,
            # Every file was hashed for the manifest just now: that is the verification.
            "verdict": "ok",
            "verified_unix": time.time(),
            "reason": "",
            **chunked,
        }
        # If this write fails, <n> is an orphan that the next commit of this job replaces.
        self._write_catalog([*self._chain, entry])
        self._chain.append(entry)
        if chunks is not None:
            self._chunk_sets[entry["version"]] = frozenset(chunks.sizes)
        return entry

    def _retain(self, job: str, keep_last: int, keep_every: int = 0, keep_versions: Any = ()) -> list[Path]:
        """Drop the job's versions older than the newest ``keep_last`` from the catalog,
        except those whose step is a multiple of ``keep_every`` (> 0), those named in
        ``keep_versions`` and the newest version whose recorded verdict is ok, and return
        their directories for removal (after the catalog no longer names them). Caller holds
        the lock. A failure to rewrite the catalog keeps every version (the commit itself
        stands) and is counted; the next commit's retention covers them again."""
        if keep_last <= 0:
            return []
        mine = [e for e in self._chain if e["job_id"] == job]
        guarded = set(keep_versions)
        verified = [e["version"] for e in mine if _verdict(e)[0] == store_pb2.VERDICT_OK]
        if verified:
            guarded.add(verified[-1])
        drop = [
            e
            for e in mine[:-keep_last]
            if not (keep_every > 0 and e["step"] % keep_every == 0) and e["version"] not in guarded
        ]
        if not drop:
            return []
        gone = {e["version"] for e in drop}
        kept = [e for e in self._chain if e["version"] not in gone]
        try:
            self._write_catalog(kept)
        except OSError:
            self._rejected.labels(job, "retention").inc()
            return []
        self._chain = kept
        return [self._dir / e["path"] for e in drop]

    def _write_catalog(self, chain: list[dict[str, Any]]) -> None:
        data = json.dumps({"format": CATALOG_FORMAT, "versions": chain}, indent=1).encode()
        path = self._dir / CATALOG
        tmp = path.with_name(CATALOG + ".tmp")
        _write_durable(tmp, data)
        os.replace(tmp, path)
        _fsync_dir(self._dir)

    # ------------------------------------------------------------------ lookup

    def _resolve(self, version: str) -> dict[str, Any]:
        """Catalog entry of ``version``. Caller holds the lock."""
        ok = [e for e in self._chain if _verdict(e)[0] == store_pb2.VERDICT_OK]
        if version == "latest":
            if ok:
                return ok[-1]
            raise CheckpointNotFound(
                "checkpoint latest not found (have: none)"
                if not self._chain
                else "checkpoint latest not found: no version's recorded verdict is ok"
            )
        job, sep, n = version.rpartition(":")
        if not sep or not job or not (n == "latest" or n.isdigit()):
            raise ValueError(f'checkpoint version "{version}": expected "<job>:<n>", "<job>:latest" or "latest"')
        mine = [e for e in self._chain if e["job_id"] == job]
        if not mine:  # a job's name (control's ids are "<name>-<6 hex>"): its newest run with versions
            runs = [
                e["job_id"]
                for e in self._chain
                if _RUN_OF.fullmatch(e["job_id"]) and _RUN_OF.fullmatch(e["job_id"])[1] == job
            ]
            if runs:
                job = runs[-1]
                mine = [e for e in self._chain if e["job_id"] == job]
        if n == "latest" and mine:
            hit = [e for e in ok if e["job_id"] == job][-1:]
            if not hit:
                raise CheckpointNotFound(f"checkpoint {version} not found: no version of job {job} is verified ok")
        else:
            hit = [e for e in mine if e["n"] == int(n)] if n != "latest" else []
        if not hit and mine:
            have = ", ".join(e["version"] for e in mine)
            raise CheckpointNotFound(f"checkpoint {version} not found (have: {have})")
        if not hit:  # an unknown job: name the jobs that do have checkpoints (newest last)
            latest = {e["job_id"]: e["version"] for e in self._chain}
            have = ", ".join(list(latest.values())[-5:]) or "none"
            raise CheckpointNotFound(
                f"checkpoint {version} not found: no checkpoint of job {job} (latest of each job: {have})"
            )
        return hit[0]

    def _info(self, entry: dict[str, Any]) -> store_pb2.CheckpointInfo:
        return store_pb2.CheckpointInfo(
            version=entry["version"],
            job_id=entry["job_id"],
            parent=entry["parent"],
            step=entry["step"],
            path=str(self._dir / entry["path"]),
            manifest_sha256=entry["manifest_sha256"],
            bytes=entry["bytes"],
            files=entry["files"],
            created_unix=entry["created_unix"],
            spec_json=entry["spec_json"],
            verdict=_verdict(entry)[0],
            verified_unix=_verdict(entry)[2],
            chunk_path=self._chunks.location(entry["job_id"], entry["epoch"]) if "chunk_dir" in entry else "",
            written_bytes=entry.get("written_bytes", 0),
            baseline=entry.get("baseline", False),
            transfer=self._transfer,
            endpoint_url=self._endpoint,
        )


def _verdict(entry: dict[str, Any]) -> tuple[int, str, float]:
    """(VerdictCause, reason, verified_unix) recorded for a catalog entry. An entry written
    before verdicts were recorded was hashed at its commit: ok, verified when created."""
    name = entry.get("verdict", "ok")
    return (
        _VERDICT_NAMES.get(name, store_pb2.VERDICT_CORRUPT),
        entry.get("reason", ""),
        entry.get("verified_unix", entry["created_unix"]),
    )


# ---------------------------------------------------------------------- file helpers


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


def _list_files(directory: Path, what: str) -> list[str]:
    """Relative POSIX paths of every regular file under ``directory`` except the top-level
    manifest. A symlink would let a version change without its bytes changing: refused."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            if full.is_symlink():
                raise CheckpointRejected(f"{what}: {full.relative_to(directory)}: symlinks are not allowed")
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _hash_one(path: Path) -> _Hashed:
    st = os.stat(path)
    h = hashlib.sha256()
    read = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
            read += len(chunk)
    # A file whose size moved while it was read is still being written: a fingerprint that
    # matches nothing makes the re-check refuse it.
    grew = read != st.st_size
    fingerprint = (-1, 0, 0, 0) if grew else (read, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return _Hashed(read, h.hexdigest(), fingerprint)


def _hash_files(directory: Path, what: str) -> dict[str, _Hashed]:
    """SHA-256 and size (bytes) of every file under ``directory``, hashed in parallel."""
    names = _list_files(directory, f"checkpoint {what}")
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, len(names))) as pool:
        hashed = list(pool.map(lambda rel: _hash_one(directory / rel), names))
    return dict(zip(names, hashed))


def _check_complete(directory: Path, files: dict[str, _Hashed], job: str, step: int) -> None:
    """Refuse a staging directory whose DCP index names data that is not there.

    ``.metadata`` (written by the coordinating rank once every rank's write came back) maps
    every stored item to ``_StorageInfo(relative_path, offset, length)``. A file it names
    must be among ``files`` and hold ``offset + length`` bytes: a rank that wrote into
    another directory (or was cut short) would otherwise be committed as a version that
    cannot be loaded. A directory without ``.metadata``, or whose ``.metadata`` is not a
    pickle at all, is not a DCP save and is not judged here.

    Raises:
        CheckpointIncomplete: naming the first file missing or short, or an unreadable index.
    """
    if DCP_METADATA not in files:
        return
    what = f"checkpoint {job}: step {step}"
    try:
        data = (directory / DCP_METADATA).read_bytes()
    except FileNotFoundError:
        raise CheckpointRejected(f"{what}: {DCP_METADATA}: vanished while committing") from None
    if not data.startswith(b"\x80"):  # not a (protocol 2+) pickle: not DCP's index
        return
    try:
        needed = _dcp_storage_extents(data)
    except (ValueError, EOFError, IndexError, KeyError) as e:
        raise CheckpointIncomplete(f"{what}: {DCP_METADATA}: unreadable ({e})", DCP_METADATA) from None
    for rel, end in sorted(needed.items()):
        have = files.get(rel)
        if have is None:
            raise CheckpointIncomplete(f"{what}: {DCP_METADATA} names {rel}, which is not there", rel)
        if have.bytes < end:
            raise CheckpointIncomplete(f"{what}: {rel}: {have.bytes} bytes, {DCP_METADATA} says it holds {end}", rel)


_PICKLE_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_PICKLE_INTS = {"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"}
_PICKLE_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PICKLE_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_STORAGE_FIELDS = ("relative_path", "offset", "length")


def _dcp_storage_extents(data: bytes) -> dict[str, int]:
    """File -> bytes it must hold (the largest ``offset + length`` naming it), from the
    pickled DCP ``.metadata``, without unpickling it: a walk over the opcodes
    (``pickletools.genops``, which builds no object and imports nothing) that reads each
    ``_StorageInfo``'s state, a dict whose items come in field order (``relative_path``,
    ``offset``, ``length``, ...): a value follows its key. Strings may come back from the
    memo (``BINGET``), so the memo is tracked.

    Raises:
        ValueError: the opcode stream is malformed or truncated.
    """
    memo: dict[int, Any] = {}
    last: Any = None  # what the previous opcode pushed, if a string or an int
    key: str | None = None  # a storage field name just pushed: the next push is its value
    record: dict[str, Any] = {}  # the _StorageInfo being read (from its relative_path on)
    extents: dict[str, int] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "STOP":
            return extents
        if name == "MEMOIZE":
            memo[len(memo)] = last
            continue
        if name in _PICKLE_PUTS:
            memo[arg] = last
            continue
        value: Any = None
        if name in _PICKLE_STRINGS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
        elif name in _PICKLE_INTS:
            value = arg
        elif name in _PICKLE_GETS:
            value = memo.get(arg)
        last = value
        if key is None:
            key = value if isinstance(value, str) and value in _STORAGE_FIELDS else None
            continue
        if key == "relative_path":
            record = {"relative_path": value} if isinstance(value, str) and value else {}
            if record:
                extents.setdefault(value, 0)
        elif record:  # offset / length of the record being read (MetadataIndex.offset is not one)
            record[key] = value
            offset, length = record.get("offset"), record.get("length")
            if isinstance(offset, int) and isinstance(length, int):
                path = record["relative_path"]
                extents[path] = max(extents[path], offset + length)
                record = {}
        key = None
    raise ValueError("no STOP opcode")


def _check_unchanged(directory: Path, files: dict[str, _Hashed], job: str, step: int) -> None:
    """Refuse the commit if any file appeared, vanished or changed since it was hashed.

    A stat comparison, not a second hash: a rewrite of the same size within one filesystem
    timestamp tick slips through here, and ``load_checkpoint`` (which re-hashes) catches it.
    """
    now = _list_files(directory, f"checkpoint {job}")
    if now != sorted(files):
        extra = sorted(set(now) - set(files)) + sorted(set(files) - set(now))
        raise CheckpointRejected(f"checkpoint {job}: step {step}: {extra[0]}: appeared or vanished while committing")
    for rel, h in files.items():
        st = os.stat(directory / rel)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != h.fingerprint:
            raise CheckpointRejected(f"checkpoint {job}: step {step}: {rel}: changed while committing")


def _check_manifest(version: str, directory: Path, manifest_sha256: str, whole: bool = False) -> Any:
    """The manifest's files (path -> {bytes, sha256}) once the manifest matches the catalog;
    with ``whole``: (those files, the whole manifest).

    Raises:
        CheckpointDamaged: the manifest is missing (MISSING_FILE) or differs (CORRUPT).
    """
    try:
        data = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(
            f"checkpoint {version}: {MANIFEST}: missing", store_pb2.VERDICT_MISSING_FILE, MANIFEST
        ) from None
    if hashlib.sha256(data).hexdigest() != manifest_sha256:
        raise CheckpointDamaged(
            f"checkpoint {version}: {MANIFEST}: sha256 mismatch", store_pb2.VERDICT_CORRUPT, MANIFEST
        )
    manifest = json.loads(data)
    files = {f["path"]: f for f in manifest["files"]}
    return (files, manifest) if whole else files


def _verify(
    version: str,
    directory: Path,
    manifest_sha256: str,
    memo: dict[str, tuple[int, str] | None] | None = None,
    chunks: LocalChunks | FsspecChunks | None = None,
    job: str = "",
) -> None:
    """Re-hash ``directory`` against its manifest, and the manifest against the catalog; for
    a chunked version, every chunk it references too (``memo``: chunk path -> finding, so
    one scrub hashes a chunk shared by several versions once).

    Raises:
        CheckpointDamaged: with the cause (MISSING_FILE, CORRUPT) and the file named.
        CheckpointRejected: a symlink in the version.
    """
    manifest_files, manifest = _check_manifest(version, directory, manifest_sha256, whole=True)
    expected = manifest_files
    present = set(_list_files(directory, f"checkpoint {version}"))
    for rel in sorted(expected):
        if rel not in present:
            raise CheckpointDamaged(f"checkpoint {version}: {rel}: missing", store_pb2.VERDICT_MISSING_FILE, rel)
    for rel in sorted(present - set(expected)):
        raise CheckpointDamaged(f"checkpoint {version}: {rel}: not in the manifest", store_pb2.VERDICT_CORRUPT, rel)
    for rel in sorted(expected):
        size = os.stat(directory / rel).st_size
        if size != expected[rel]["bytes"]:
            raise CheckpointDamaged(
                f"checkpoint {version}: {rel}: size {size} bytes, manifest says {expected[rel]['bytes']}",
                store_pb2.VERDICT_CORRUPT,
                rel,
            )
    names = sorted(expected)
    try:
        with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, max(1, len(names)))) as pool:
            hashed = list(pool.map(lambda rel: _hash_one(directory / rel), names))
    except FileNotFoundError as e:  # removed while being hashed
        rel = Path(e.filename).relative_to(directory).as_posix() if e.filename else "?"
        raise CheckpointDamaged(f"checkpoint {version}: {rel}: missing", store_pb2.VERDICT_MISSING_FILE, rel) from None
    for rel, h in zip(names, hashed):
        if h.sha256 != expected[rel]["sha256"]:
            raise CheckpointDamaged(f"checkpoint {version}: {rel}: sha256 mismatch", store_pb2.VERDICT_CORRUPT, rel)
    if "chunk_dir" in manifest:
        root = chunks if chunks is not None else LocalChunks(directory.parent.parent)
        _verify_chunks(version, root, job or directory.parent.name, manifest, memo if memo is not None else {})


def _verify_chunks(
    version: str,
    root: LocalChunks | FsspecChunks,
    job: str,
    manifest: dict[str, Any],
    memo: dict[str, tuple[int, str] | None],
) -> None:
    """Every chunk a version's manifest lists is under ``root`` with its size and digest.

    Raises:
        CheckpointDamaged: naming the first chunk missing (MISSING_FILE) or wrong (CORRUPT).
    """
    label = manifest["chunk_dir"]
    chunks = sorted((c["sha"], int(c["bytes"])) for c in manifest.get("chunks", ()))

    def finding(item: tuple[str, int]) -> tuple[int, str] | None:
        sha, size = item
        key = f"{job}/{label}/{sha}"
        if key in memo:
            return memo[key]
        epoch = int(label.rsplit("/", 1)[-1])
        try:
            got_bytes, got_sha = root.hash(job, epoch, sha)
            found = (
                None
                if got_bytes == size and got_sha == sha
                else (
                    (store_pb2.VERDICT_CORRUPT, f"size {got_bytes} bytes, manifest says {size}")
                    if got_bytes != size
                    else (store_pb2.VERDICT_CORRUPT, "sha256 mismatch")
                )
            )
        except FileNotFoundError:
            found = (store_pb2.VERDICT_MISSING_FILE, "missing")
        memo[key] = found
        return found

    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, max(1, len(chunks)))) as pool:
        results = list(pool.map(finding, chunks))
    for (sha, _), found in zip(chunks, results):
        if found is not None:
            cause, why = found
            rel = f"{label}/{sha}"
            raise CheckpointDamaged(f"checkpoint {version}: {rel}: {why}", cause, rel)


class _Incoming:
    """One file arriving on a PutCheckpointFiles stream: written to ``temp`` (None: a chunk
    the epoch holds already, read and dropped) while hashed."""

    def __init__(self, name: str, kind: int, size: int, sha256: str, temp: Path | None, final: Path | None):
        self.name, self.kind, self.size, self.sha256 = name, kind, size, sha256
        self.temp, self.final = temp, final
        self.received = 0
        self._hash = hashlib.sha256()
        self._file = open(temp, "wb") if temp is not None else None  # noqa: SIM115 - closed in finish/discard

    def add(self, data: bytes, what: str) -> None:
        if self.received + len(data) > self.size:
            raise CheckpointTransferRefused(
                f"{what}: {self.name}: more than the {self.size} bytes declared",
                FailureCause.FAILURE_DATA_CORRUPT,
                self.name,
            )
        self.received += len(data)
        self._hash.update(data)
        if self._file is not None:
            self._file.write(data)

    def finish(self, what: str) -> None:
        """The whole file arrived: its digest checked, index files made durable."""
        if self._hash.hexdigest() != self.sha256:
            self.discard()
            raise CheckpointTransferRefused(
                f"{what}: {self.name}: sha256 mismatch on arrival", FailureCause.FAILURE_DATA_CORRUPT, self.name
            )
        if self._file is not None:
            if self.kind == store_pb2.CHECKPOINT_FILE_INDEX:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.temp is not None:
            self.temp.unlink(missing_ok=True)


def _check_index_name(name: str, what: str) -> None:
    """A streamed index file's name stays inside its staging directory: relative, no ``..``
    or ``.`` component, no empty component, no backslash or NUL, at most 4 deep, not the
    manifest (the store writes it).

    Raises:
        CheckpointTransferRefused: naming it (cut to 80 characters).
    """
    shown = name[:80]
    parts = name.split("/")
    if (
        not name
        or len(name) > 255
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or len(parts) > 4
        or any(p in ("", ".", "..") for p in parts)
        or name == MANIFEST
        or parts[-1].endswith(".up")
    ):
        raise CheckpointTransferRefused(f"{what}: {shown!r}: not a file name inside the staging directory", file=shown)


def _parts(name: str, kind: int, data: bytes) -> Iterator[store_pb2.CheckpointFileData]:
    """One file as parts of at most TRANSFER_PART_BYTES (the first names it)."""
    sha = hashlib.sha256(data).hexdigest() if kind == store_pb2.CHECKPOINT_FILE_INDEX else name
    view = memoryview(data)
    yield store_pb2.CheckpointFileData(
        name=name, kind=kind, size=len(data), sha256=sha, data=bytes(view[:TRANSFER_PART_BYTES])
    )
    for i in range(TRANSFER_PART_BYTES, len(data), TRANSFER_PART_BYTES):
        yield store_pb2.CheckpointFileData(data=bytes(view[i : i + TRANSFER_PART_BYTES]))


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
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
    os.rename(staging, final)


def read_committed(root: str | Path, version: str) -> store_pb2.CheckpointInfo:
    """Where ``version`` is, from the catalog under ``root`` (the store's root), for a reader
    that runs without the store service (``surgectl export``): the same resolution
    (``"<job>:<n>"``, ``"<job>:latest"``, ``"latest"``), recorded-verdict check and manifest
    check as :meth:`CheckpointManager.load_checkpoint`, read-only: nothing is created,
    recorded or published (a running store may own the catalog). The reader still checks
    every file against the manifest as it reads it.

    Raises:
        ValueError: ``version`` is not one of the three forms, or the catalog is unreadable.
        CheckpointNotFound: no such version (the message lists the ones that exist).
        CheckpointRejected: its recorded verdict is not ok, or its manifest is missing or
            differs from the catalog (CheckpointDamaged).
    """
    view = CheckpointManager.__new__(CheckpointManager)  # the lookups only: no directory, lock or metrics
    view._dir = Path(root) / "checkpoints"
    view._chain = _read_catalog(view._dir / CATALOG)
    view._chunks, view._transfer, view._endpoint = LocalChunks(view._dir), store_pb2.TRANSFER_PATH, ""
    entry = view._resolve(version)
    cause, reason, _ = _verdict(entry)
    if cause != store_pb2.VERDICT_OK:
        raise CheckpointDamaged(reason or f"checkpoint {entry['version']}: recorded {_VERDICT_OF[cause]}", cause)
    _check_manifest(entry["version"], view._dir / entry["path"], entry["manifest_sha256"])
    return view._info(entry)
