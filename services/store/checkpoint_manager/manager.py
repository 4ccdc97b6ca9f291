"""The checkpoint manager's commands (L5-1): the class the store's relay holds.

``CheckpointManager`` is the one seed module; its parts are mixins, one concern a file:
``staging.py`` (one open save per job), ``chunks.py`` (epochs, the commit's chunk check,
garbage collection), ``commit.py`` (seal, retention, catalog), ``verification.py``
(re-hash, verdicts, scrub), ``data_plane.py`` (bytes without a shared filesystem),
``series.py`` (a job's Prometheus series retired at its end). Here: its state and metrics,
the commands it receives, and the catalog lookups.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.contract import store_pb2
from services.contract.bus import Reply
from services.store.checkpoint_manager.chunks import Chunks
from services.store.checkpoint_manager.commit import Commit, _check_complete, _hash_files
from services.store.checkpoint_manager.data_plane import DataPlane
from services.store.checkpoint_manager.formats import recorded, refusal
from services.store.checkpoint_manager.layout import (
    _RUN_OF,
    _VERDICT_OF,
    CATALOG,
    CHUNK_INDEX,
    CheckpointDamaged,
    CheckpointFormatRefused,
    CheckpointNotFound,
    CheckpointRejected,
    _check_job_id,
    _OpenSave,
    _read_catalog,
    _replica_verified,
    _verdict,
)
from services.store.checkpoint_manager.series import Series
from services.store.checkpoint_manager.staging import Staging
from services.store.checkpoint_manager.verification import Verification, _check_manifest
from services.store.chunk_roots import FsspecChunks, LocalChunks

_ATTEMPTS_KEPT = 32  # per job: attempts remembered to refuse a superseded one


class CheckpointManager(Staging, Chunks, Commit, Verification, DataPlane, Series):
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
        later: Callable[[float, Callable[..., Any], tuple], Any] | None = None,
        linger_s: float = 300.0,
    ):
        """``emit``: where each version newly found corrupt is published (the bus emitter of
        L5-1 in the service; None drops them). ``transfer``: how ranks move this store's
        bytes (SaveStaged.transfer: TRANSFER_PATH, the default, or TRANSFER_STREAM);
        ``chunks``: an object store for the chunks (then TRANSFER_FSSPEC; None: the
        store's disk). See "Where the bytes live" in the module docstring. ``later(seconds,
        fn, args)``, ``linger_s``: the composition root's timer that removes an ended job's
        series, and after how long (None: at once; series.py)."""
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
        self._opened: dict[str, int] = {}  # job -> saves begun (a fresh staging directory each)
        self._gates: dict[str, threading.Lock] = {}  # job -> held by its sweep while it removes one batch
        self._removing: dict[str, set[int]] = {}  # job -> epochs being removed whole (never reused meanwhile)
        self._ended: set[str] = self._read_ended()  # jobs ended (series.py): a sweep of theirs makes no series
        self._newest_known: set[str] = set()  # jobs whose newest-commit gauges this process has set
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
        # The newest committed version's time and step, from the catalog: set at each commit, and
        # at start for every job not ended (series.py _newest_from_catalog: after a store
        # restart, though every save of the job fails, a full disk's included).
        self._newest_unix = Gauge(
            "surge_checkpoint_last_commit_timestamp_seconds",
            "Unix time the job's newest committed checkpoint was committed (from the store's catalog).",
            ["job"],
            registry=reg,
        )
        self._newest_step = Gauge(
            "surge_checkpoint_last_commit_step",
            "Step of the job's newest committed checkpoint (from the store's catalog).",
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
        # Labelled by job (retired at the job's end, series.py), with their label names.
        self._per_job = (
            (self._commits, ("job",)),
            (self._commit_seconds, ("job",)),
            (self._bytes, ("job",)),
            (self._written, ("job",)),
            (self._newest_unix, ("job",)),
            (self._newest_step, ("job",)),
            (self._swept, ("job",)),
            (self._rejected, ("job", "op")),
            (self._found_corrupt, ("job", "cause")),
        )
        self._later, self._linger_s = later, linger_s
        self._scrub_seconds = Gauge(
            "surge_checkpoint_scrub_seconds", "Wall time of the last scrub (seconds).", registry=reg
        )
        self._scrubbed = Counter(
            "surge_checkpoint_scrubbed_versions_total", "Versions re-hashed by scrubs.", registry=reg
        )
        self._newest_from_catalog()

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
            if job not in self._ended and job not in self._newest_known:
                # (a store restarted under a running job: what its catalog says, at its first save)
                self._newest_known.add(job)
                newest = _newest_entry(self._chain, job)
                if newest is not None:
                    self._newest_unix.labels(job).set(newest["created_unix"])
                    self._newest_step.labels(job).set(newest["step"])
            gate = self._gates.get(job)
        if gate is not None:  # a sweep's batch in flight ends before this rank may look at the epoch
            with gate:
                pass
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
                self._note_ended(job, False)  # (a resumed job: its series are made again)
                removed = self._retain(job, msg.keep_last, msg.keep_every, msg.keep_versions)
                plan = self._plan_sweep(job, save)
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
        for _, path in removed:
            shutil.rmtree(path, ignore_errors=True)
        if plan is not None:  # off the lock: saves of any job begin and commit meanwhile
            self._sweep(plan)
        seconds = time.perf_counter() - t0
        self._commits.labels(job).inc()
        self._commit_seconds.labels(job).set(seconds)
        self._bytes.labels(job).set(entry["bytes"])
        self._written.labels(job).set(entry.get("written_bytes", entry["bytes"]))
        self._newest_unix.labels(job).set(entry["created_unix"])
        self._newest_step.labels(job).set(entry["step"])
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
            removed_versions=[version for version, _ in removed],
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
        if why := refusal(entry["version"], entry):  # (intact, in a format this build cannot read)
            self._rejected.labels(entry["job_id"], "load").inc()
            raise CheckpointFormatRefused(why)
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
                raise CheckpointNotFound(
                    f"checkpoint {msg.version} not found "
                    + (f"(have: {', '.join(have)})" if have else f"(job {job} has no checkpoint versions)")
                )
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
            if msg.job_ended:  # (after a store restart too, when control's retire came before it)
                self._note_ended(job, True)
            kept = [e for e in self._chain if e is not entry]
            self._write_catalog(kept)
            self._chain = kept
            self._chunk_sets.pop(msg.version, None)
            plan = self._plan_sweep(job)
            last = not any(e["job_id"] == job for e in kept)
            newest = _newest_entry(kept, job)
            if newest is not None and job in self._newest_known and job not in self._ended:
                # (its newest deleted, an ended job's own: the gauges say the one now newest)
                self._newest_unix.labels(job).set(newest["created_unix"])
                self._newest_step.labels(job).set(newest["step"])
        path = self._dir / entry["path"]
        freed = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
        shutil.rmtree(path, ignore_errors=True)
        if plan is not None:
            freed += self._sweep(plan)[1]
        if last:  # the job's last version is gone: so are its series (they described its versions)
            self._forget_series(job)
        return store_pb2.CheckpointDeleted(version=msg.version, bytes_freed=freed)

    def _forget_series(self, job: str) -> None:
        """Remove ``job``'s label sets from this module's per-job Prometheus series."""
        per_job = (self._commits, self._commit_seconds, self._bytes, self._written, self._swept)
        removals = [(m, (job,)) for m in (*per_job, self._newest_unix, self._newest_step)]
        removals += [(self._rejected, (job, op)) for op in ("commit", "retention", "load", "verify")]
        removals += [(self._found_corrupt, (job, cause)) for cause in _VERDICT_OF.values()]
        for metric, labels in removals:
            try:
                metric.remove(*labels)
            except KeyError:  # never set
                pass

    def checkpoint_query(self, msg: store_pb2.CheckpointQuery, payload: Any = None) -> store_pb2.CheckpointList:
        """The committed versions of ``msg.job_id`` (every job if empty), oldest first."""
        with self._lock:
            entries = [e for e in self._chain if not msg.job_id or e["job_id"] == msg.job_id]
        return store_pb2.CheckpointList(checkpoints=[self._info(e) for e in entries])

    # ------------------------------------------------------------------ lookup

    def _resolve(self, version: str) -> dict[str, Any]:
        """Catalog entry of ``version``. Caller holds the lock."""
        # `latest`: intact (the recorded verdict) and right (replicas found to agree, where checked).
        ok = [e for e in self._chain if _verdict(e)[0] == store_pb2.VERDICT_OK and _replica_verified(self._chain, e)]
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
            raise _not_found(f"checkpoint {version} not found", f" (have: {have})")
        if not hit:  # an unknown job: name the jobs that do have checkpoints (newest last)
            latest: dict[str, str] = {}
            for e in self._chain:  # (a job's newer commit moves it last: newest last, as said)
                latest.pop(e["job_id"], None)
                latest[e["job_id"]] = e["version"]
            shown = list(latest.values())[-5:]
            left = len(latest) - len(shown)
            more = f"; {left} more job{'s' if left > 1 else ''}: `surgectl checkpoints`" if left else ""
            have = (", ".join(shown) or "none") + more
            raise _not_found(
                f"checkpoint {version} not found: no checkpoint of job {job}", f" (latest of each job: {have})"
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
            replica_verified=_replica_verified(self._chain, entry),
            checkpoint_format=recorded(entry)[0],
            surge_version=recorded(entry)[1],
        )


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
    view = _read_only(root)
    entry = view._resolve(version)
    cause, reason, _ = _verdict(entry)
    if cause != store_pb2.VERDICT_OK:
        raise CheckpointDamaged(reason or f"checkpoint {entry['version']}: recorded {_VERDICT_OF[cause]}", cause)
    _check_manifest(entry["version"], view._dir / entry["path"], entry["manifest_sha256"])
    if why := refusal(entry["version"], entry):
        raise CheckpointFormatRefused(why)
    return view._info(entry)


def recorded_verdicts(root: str | Path, job_id: str) -> list[store_pb2.CheckpointVerdict]:
    """The job's committed versions (oldest first) with the verdicts recorded in the catalog
    under ``root``, read-only as :func:`read_committed`: what ``VerifyCheckpoints`` answers
    before it hashes the bytes again (an operator resume's choice is the newest ok one;
    `surgectl down --force` names it once the ranks are gone). No replica rule here: a resume
    does not apply it (``read_committed``'s ``latest`` does).

    Raises:
        ValueError: the catalog is unreadable. OSError: it cannot be read."""
    view = _read_only(root)
    return [view._verdict_msg(e) for e in view._chain if e["job_id"] == job_id]


def catalog_job_ids(root: str | Path) -> set[str]:
    """The ids of the jobs with committed versions in the catalog under ``root``, read-only as
    :func:`read_committed` (a job's name given where its id is expected is resolved against
    them: `surgectl export NAME:N`).

    Raises:
        ValueError: the catalog is unreadable. OSError: it cannot be read."""
    return {e["job_id"] for e in _read_only(root)._chain}


def _read_only(root: str | Path) -> CheckpointManager:
    """A manager for the lookups only: no directory made, no lock, no metrics."""
    view = CheckpointManager.__new__(CheckpointManager)
    view._dir = Path(root) / "checkpoints"
    view._chain = _read_catalog(view._dir / CATALOG)
    view._chunks, view._transfer, view._endpoint = LocalChunks(view._dir), store_pb2.TRANSFER_PATH, ""
    return view


def _not_found(said: str, hint: str) -> CheckpointNotFound:
    """``said`` and the versions that are there (``hint``); ``bare``: without them, for a caller
    that may not name other jobs' versions (a team's token: surgectl's local reads)."""
    error = CheckpointNotFound(said + hint)
    error.bare = said
    return error


def _newest_entry(chain: list[dict[str, Any]], job: str) -> dict[str, Any] | None:
    """The catalog's newest committed version of ``job`` (None: none)."""
    mine = [e for e in chain if e["job_id"] == job]
    return max(mine, key=lambda e: e["n"]) if mine else None
