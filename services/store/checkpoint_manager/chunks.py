"""Part of L5-1 (the checkpoint manager): chunks, epochs and garbage collection.

Which epoch a save writes (``_next_epoch``), the commit's check of a chunked save against its
``chunks.json`` (by name and size, one listing; ``_check_chunks`` says why no re-hash), and
garbage collection: decided under the manager's lock (``_plan_sweep``: cheap, the catalog's
chunk sets), carried out off it (``_sweep``) in batches a save beginning meanwhile stops.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from services.contract import store_pb2
from services.store.checkpoint_manager.layout import (
    _SHA256,
    CHUNK_INDEX,
    CHUNK_INDEX_FORMAT,
    CHUNKS_DIR,
    CheckpointDamaged,
    CheckpointIncomplete,
    _Chunks,
    _Hashed,
    _OpenSave,
    _verdict,
)
from services.store.checkpoint_manager.verification import _check_manifest

_SWEEP_BATCH = 256  # chunk files a sweep removes between two looks for a save begun meanwhile


@dataclass(frozen=True)
class _SweepPlan:
    """A garbage collection decided under the lock (``_plan_sweep``), carried out off it."""

    job: str
    opened: int  # saves of the job begun when decided: one begun since stops the sweep
    epochs: list[int]  # no cataloged version references them: removed whole
    keep: dict[int, frozenset[str]]  # a referenced epoch -> its chunks that stay (the rest goes)


class Chunks:
    """The manager's chunk bookkeeping and garbage collection (a mixin of CheckpointManager)."""

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
        used = [e["epoch"] for e in mine] + self._chunks.epochs(job) + list(self._removing.get(job, ()))
        return max(used, default=0) + 1, True

    def _check_chunks(self, job: str, step: int, save: _OpenSave, files: dict[str, _Hashed]) -> _Chunks:
        """The staged save's ``chunks.json``, checked without reading a chunk's bytes (commit
        by manifest): the index is self-consistent (its format and epoch, each name a SHA-256
        listed once, each size > 0 and at most its ``chunk_bytes``, its ``bytes`` their sum)
        and every chunk it names is in its epoch's directory with that size (one listing).

        Why no re-hash here: the writer hashed every chunk from the bytes it wrote (its
        SHA-256 is its name) and published it whole (a temp file renamed into place; a streamed
        chunk is hashed on arrival, ``receive_files``; an object is one PUT with its SHA-256
        declared), so a torn or half-written chunk cannot carry its name; what the size check
        cannot see (bits changed in place since) the reader finds (it hashes every chunk it
        reads, and falls back or refuses) and so do ``verify``'s re-hash and the scrubber.

        ``written_bytes`` is the store's own count: the index files plus the chunks no
        earlier version of the epoch references (what this save added to the epoch); it is
        never more than the version's ``bytes`` (the ranks' own sums count a chunk written by
        two ranks twice). Outside the lock (one listing).

        Raises:
            CheckpointIncomplete: ``chunks.json`` is malformed or names another epoch, or a
                chunk is missing, or shorter or longer than it says.
        """
        what = f"checkpoint {job}: step {step}"
        try:
            index = json.loads((save.path / CHUNK_INDEX).read_bytes())
            if index.get("format") != CHUNK_INDEX_FORMAT:
                raise ValueError(f"format {index.get('format')!r}, expected {CHUNK_INDEX_FORMAT!r}")
            epoch = int(index["epoch"])
            listed = [(c["sha"], int(c["bytes"])) for c in index["chunks"]]
            sizes = dict(listed)
            chunk_bytes = int(index.get("chunk_bytes", 0))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointIncomplete(f"{what}: {CHUNK_INDEX}: unreadable ({e})", CHUNK_INDEX) from None
        if save.epoch and epoch != save.epoch:
            raise CheckpointIncomplete(
                f"{what}: {CHUNK_INDEX}: chunks of epoch {epoch}, the save was told epoch {save.epoch}", CHUNK_INDEX
            )
        for sha, size in listed:
            if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
                raise CheckpointIncomplete(f"{what}: {CHUNK_INDEX}: {sha!r} is not a SHA-256", CHUNK_INDEX)
            if size <= 0 or (chunk_bytes > 0 and size > chunk_bytes):
                raise CheckpointIncomplete(
                    f"{what}: {CHUNK_INDEX}: chunk {sha}: {size} bytes, outside 1..{chunk_bytes or 'any'}", CHUNK_INDEX
                )
        if len(sizes) != len(listed):
            raise CheckpointIncomplete(f"{what}: {CHUNK_INDEX}: a chunk is listed twice", CHUNK_INDEX)
        if "bytes" in index and int(index["bytes"]) != sum(sizes.values()):
            raise CheckpointIncomplete(
                f"{what}: {CHUNK_INDEX}: bytes {index['bytes']}, its chunks sum to {sum(sizes.values())}", CHUNK_INDEX
            )
        with self._lock:
            same = [e for e in self._chain if e["job_id"] == job and e.get("epoch") == epoch]
        earlier: set[str] = set()
        for e in same:
            earlier |= self._chunk_set(e) or frozenset()
        stored = self._chunks.sizes(job, epoch)  # one listing (an object store: one LIST, not a HEAD per chunk)
        for sha, size in sorted(sizes.items()):
            rel = f"{CHUNKS_DIR}/{epoch}/{sha}"
            have = stored.get(sha)
            if have is None:
                raise CheckpointIncomplete(f"{what}: {rel}: named by {CHUNK_INDEX}, which is not there", rel)
            if have != size:
                raise CheckpointIncomplete(f"{what}: {rel}: {have} bytes, {CHUNK_INDEX} says {size}", rel)
        added = sum(size for sha, size in sizes.items() if sha not in earlier)
        return _Chunks(epoch=epoch, sizes=sizes, written_bytes=added + sum(h.bytes for h in files.values()))

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

    def _plan_sweep(self, job: str, committing: _OpenSave | None = None) -> _SweepPlan | None:
        """Decide the job's garbage collection (mark): the epochs no cataloged version
        references (removed whole) and, for each other epoch, the chunks its versions
        reference (everything else in it goes: unreferenced chunks, killed writers' temp
        files). An epoch with a version whose manifest cannot be read is left alone (what it
        needs is unknown). None while another save of the job is open (its chunks are in no
        manifest yet). Caller holds the lock; cheap: the catalog's chunk sets (cached) and
        one listing of the job's epochs. :meth:`_sweep` removes, outside the lock."""
        if self._open.get(job) not in (None, committing):
            return None
        epochs = self._chunks.epochs(job)
        if not epochs:
            return None
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
        plan = _SweepPlan(
            job=job,
            opened=self._opened.get(job, 0),
            epochs=[n for n in epochs if n not in need],
            keep={n: frozenset(need[n] or ()) for n in epochs if need.get(n) is not None},
        )
        self._removing.setdefault(job, set()).update(plan.epochs)
        self._gates.setdefault(job, threading.Lock())
        return plan

    def _sweep(self, plan: _SweepPlan) -> tuple[int, int]:
        """Carry out a plan (sweep) outside the manager's lock; returns (files, bytes) removed.

        Epochs no version references go whole: no save writes into one again (a new save's
        epoch is the newest version's or a number above every one listed, ``_next_epoch``).
        Within a referenced epoch a new save may reuse a chunk that is still there (its
        writer skips a chunk present), so those files go in batches of ``_SWEEP_BATCH``, each
        under the job's gate and only while no save of the job has begun since the plan; a
        save beginning meanwhile waits for the batch in flight (milliseconds), never for the
        whole sweep, and what is left is decided again after the next commit."""
        job = plan.job
        removed = freed = 0
        try:
            for epoch in plan.epochs:
                n, b = self._chunks.remove_epoch(job, epoch)
                removed, freed = removed + n, freed + b
        finally:
            with self._lock:
                self._removing.get(job, set()).difference_update(plan.epochs)
        gate = self._gates[job]
        for epoch, keep in sorted(plan.keep.items()):
            listed = self._chunks.files(job, epoch)
            drop = sorted(name for name in listed if name.rsplit("/", 1)[-1] not in keep)
            for i in range(0, len(drop), _SWEEP_BATCH):
                batch = drop[i : i + _SWEEP_BATCH]
                with gate:
                    with self._lock:
                        if self._opened.get(job, 0) != plan.opened:
                            return self._swept_count(job, removed, freed)  # a save began: the rest waits
                    removed += self._chunks.remove(job, epoch, batch)
                    freed += sum(listed[name] for name in batch)
        return self._swept_count(job, removed, freed)

    def _swept_count(self, job: str, removed: int, freed: int) -> tuple[int, int]:
        if removed and job not in self._ended:  # (an ended job's series are gone: none comes back)
            self._swept.labels(job).inc(removed)
        return removed, freed
