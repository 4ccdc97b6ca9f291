"""Part of L5-1 (the checkpoint manager): verification, off the critical path.

A version is re-hashed against its manifest (and the manifest against the catalog) on
demand (``verify_checkpoints`` with ``rehash``, ``scrub_checkpoints``: the orchestrator's
command, the operator's ``surgectl checkpoints --verify`` or the store's schedule); the
verdicts are recorded in the catalog and each version newly found corrupt is published
(``CheckpointCorrupt``). One pass hashes a chunk shared by several versions once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.contract import store_pb2
from services.store.checkpoint_manager.commit import _hash_one, _list_files
from services.store.checkpoint_manager.layout import (
    _FAILURE_CAUSE,
    _HASH_THREADS,
    _VERDICT_OF,
    MANIFEST,
    CheckpointDamaged,
    CheckpointRejected,
    _verdict,
)
from services.store.chunk_roots import FsspecChunks, LocalChunks


class Verification:
    """The manager's verification (a mixin of CheckpointManager)."""

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
