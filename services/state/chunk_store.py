"""Content-addressed chunk storage for torch.distributed.checkpoint (DCP): incremental saves.

A DCP StorageWriter / StorageReader pair. DCP's planners stay as they are (so resharding:
a dp change, FSDP2 <-> DDP, still goes through DCP's load planner); only where the bytes go
changes. Every stored item (a tensor shard, or a non-tensor value DCP serialized to bytes)
is cut into fixed-size chunks of its raw bytes (``chunk_bytes``, default 1 MiB; a tensor's
bytes are its contiguous storage in row-major order, no header); each chunk is a file named
by its SHA-256 under the chunk directory::

    <chunk_dir>/<sha[:2]>/<sha>          one chunk (written to a temp name, synced, renamed)
    <version_dir>/.metadata              DCP's index (rank 0, last): per item, its chunks
    <version_dir>/chunks.json            every chunk the version references (rank 0)

A chunk already present in ``chunk_dir`` is never written again, so a save writes only the
chunks that changed since the versions that share the directory (an "epoch" of the store:
a full baseline, then deltas; which directory is the store's decision, see
``services/store/checkpoint_manager/``). ``.metadata`` holds plain data only for each
item (a dict of lists, strings and ints: ``chunks``, ``nbytes``, ``shape``, ``dtype``), so it
is read back with an unpickler that allows DCP's own metadata classes and nothing else.

``chunks.json`` (plain JSON, for the store, which never unpickles)::

    {"format": "surge.checkpoint.chunks/1", "epoch": "<chunk_dir name>", "chunk_bytes": N,
     "chunks": [{"sha": ..., "bytes": ...}, ...],     # unique, sorted by sha
     "bytes": <sum over those>, "written_bytes": <newly written by this save, all ranks>,
     "written_chunks": <count>, "items": <stored items>,
     "slots": {"model": <sha256>, "optim": ..., "train": ...}}

A slot is a top-level key of the saved state dict (the first component of a flattened DCP
key); its digest is the SHA-256 over its items sorted by (key, offsets), each as
``<key>@<offsets>:<sha>,<sha>,...\\n``: two snapshots whose slot digests match hold the same
bytes for that slot.

Reading (``ChunkReader``): every chunk comes from the first of ``sources`` that has it and
whose bytes hash to its name; a source that returns wrong bytes is counted
(``mismatches[source]``), logged, and the next source is asked. The last source is the
authority (the store's files): wrong bytes there, or no source having the chunk, raise
:class:`ChunkIntegrityError` naming the chunk. The ``.metadata`` index is checked against
the version's manifest (``digests``) before it is unpickled. A source that reads in bulk
(``prefetch``: the peer's memory) is told every chunk of the load first, so they travel on
one stream rather than one round trip each; the chunks it is asked for are read from both
ends at once, it from the front and the last source from the back (``chunk_race.py``), so
the load takes about the faster source's time.

Writing (``ChunkWriter``): ``sink(sha, data)`` is called for every chunk of this rank's part
(written or found present), on the thread that called ``write_data``, in item order; ``data``
is a read-only view valid during the call only (copy it to keep it). A sink that raises is
logged once and not called again for this save; the save itself goes on (the files are the
record).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import io
import json
import math
import os
import pickle
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from services.common.disk import syncfs
from services.contract.failures import writing
from services.state.chunk_race import TailRead

log = structlog.get_logger()

CHUNK_BYTES = 1 << 20  # 1 MiB: a frozen tensor dedupes whole; a changed one costs ~its size
CHUNKS_FILE = "chunks.json"
CHUNKS_FORMAT = "surge.checkpoint.chunks/1"
METADATA_FILE = ".metadata"
_IO_THREADS = 4  # hashlib and file writes release the GIL: chunks hash and write in parallel
_SHA_HEX = frozenset("0123456789abcdef")

Sink = Callable[[str, "memoryview | bytes"], None]


@runtime_checkable
class ChunkSource(Protocol):
    """Where a reader may find a chunk. ``get`` returns the chunk's bytes, or None if this
    source does not have it; it need not verify them (the reader does)."""

    name: str

    def get(self, sha: str, nbytes: int) -> bytes | None: ...


class ChunkIntegrityError(Exception):
    """A chunk (or the version's ``.metadata``) that the authoritative source does not have
    (``missing``) or holds with a wrong SHA-256 or size. ``file``: what is named, e.g.
    ``chunks/<epoch>/<sha>`` or ``.metadata``. Picklable: DCP gathers a rank's read failure
    to every rank."""

    def __init__(self, message: str, file: str = "", missing: bool = False):
        super().__init__(message, file, missing)
        self.file, self.missing = file, missing

    def __str__(self) -> str:
        return str(self.args[0])


def chunk_path(chunk_dir: str | os.PathLike, sha: str) -> Path:
    """Where chunk ``sha`` lives under ``chunk_dir``."""
    return Path(chunk_dir) / sha[:2] / sha


def is_sha(name: str) -> bool:
    """Whether ``name`` is a lowercase hex SHA-256 (a chunk's file name)."""
    return len(name) == 64 and set(name) <= _SHA_HEX


class DirectorySource:
    """The chunk files of one chunk directory (the store's: the last, authoritative source)."""

    def __init__(self, chunk_dir: str | os.PathLike, name: str = "store"):
        self.name = name
        self.root = Path(chunk_dir)

    def get(self, sha: str, nbytes: int) -> bytes | None:
        try:
            with open(chunk_path(self.root, sha), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


@dataclasses.dataclass
class SaveStats:
    """What one rank's ``write_data`` did: ``chunks``/``bytes`` over every chunk of its part
    (a repeated chunk each time), ``written_*`` over those it wrote (absent before)."""

    chunks: int = 0
    bytes: int = 0
    written_chunks: int = 0
    written_bytes: int = 0


# ---------------------------------------------------------------------- writer


class ChunkWriter(StorageWriter, BlockingAsyncStager):
    """DCP StorageWriter: the version's ``.metadata`` and ``chunks.json`` under ``path``,
    every chunk under ``chunk_dir`` unless it is there already.

    Args:
        path: the version's (staging) directory.
        chunk_dir: the chunk directory of the version's epoch (created if missing).
        chunk_bytes: chunk size (bytes); the last chunk of an item may be shorter.
        sink: called for every chunk of this rank's part, see the module docstring.
        sync_files: fsync every chunk and index file before it is renamed into place.
        thread_count: threads hashing and writing chunks.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        chunk_dir: str | os.PathLike,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        sink: Sink | None = None,
        sync_files: bool = True,
        thread_count: int = _IO_THREADS,
        cache_staged_state_dict: bool = False,
    ):
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: must be > 0, got {chunk_bytes}")
        self.path = Path(path)
        self.chunk_dir = Path(chunk_dir)
        self.chunk_bytes = chunk_bytes
        self.sink = sink
        self.sync_files = sync_files
        self.thread_count = max(1, thread_count)
        self.rank: int | None = None
        self.is_coordinator = True
        self.save_id = secrets.token_hex(8)
        self.stats = SaveStats()

    # -- StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = secrets.token_hex(8)
        self.stats = SaveStats()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        self.chunk_dir.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        stats = SaveStats()
        claimed: set[str] = set()  # chunks a task of this save writes (or found present): once each
        temps: dict[str, Path] = {}  # sha -> its temp file, for the chunks this save wrote
        lock = threading.Lock()
        sink_failed = False

        def hash_put(piece: memoryview) -> tuple[str, Path | None]:
            sha = _sha256(piece)
            with lock:
                if sha in claimed:
                    return sha, None
                claimed.add(sha)
            return sha, self._put(sha, piece)

        with ThreadPoolExecutor(max_workers=self.thread_count, thread_name_prefix="chunk-write") as pool:
            # Every chunk of every item is hashed and written by the pool at once (hashing one
            # item overlaps writing another); the results are taken in item order. Bytes items
            # first (small), then tensors, as FileSystemWriter orders them. The items' bytes
            # stay alive until the end: DCP holds the state dict through the save.
            items = sorted(plan.items, key=lambda wi: wi.type != WriteItemType.BYTE_IO)
            queued = []
            for item in items:
                view, shape, dtype = _raw_bytes(item, planner.resolve_data(item))
                pieces = [view[i : i + self.chunk_bytes] for i in range(0, len(view), self.chunk_bytes)]
                queued.append((item, view, shape, dtype, pieces, [pool.submit(hash_put, p) for p in pieces]))
            for item, view, shape, dtype, pieces, futures in queued:
                hashed, written, new = [], 0, 0
                for piece, done in zip(pieces, futures):
                    sha, tmp = done.result()
                    hashed.append(sha)
                    if tmp is not None:
                        temps[sha] = tmp
                        written += len(piece)
                        new += 1
                stats.chunks += len(pieces)
                stats.bytes += len(view)
                stats.written_chunks += new
                stats.written_bytes += written
                for sha, piece in zip(hashed, pieces):
                    if self.sink is not None and not sink_failed:
                        try:
                            self.sink(sha, piece)
                        except Exception as e:  # noqa: BLE001 - a copy elsewhere is optional, the files are not
                            sink_failed = True
                            log.warning("chunk_sink_failed", error=f"{type(e).__name__}: {e}")
                info = {
                    "chunks": hashed,
                    "nbytes": len(view),
                    "chunk_bytes": self.chunk_bytes,
                    "shape": shape,
                    "dtype": dtype,
                }
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=len(view),
                        storage_data={**info, "written": [written, new]},
                    )
                )
        # Every chunk is in a temp file now: made durable in one go, then renamed into place
        # (a chunk file that exists is always whole).
        self._publish(temps)
        self.stats = stats
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: ``chunks.json``, then ``.metadata`` (each temp + fsync + rename)."""
        storage: dict[MetadataIndex, dict[str, Any]] = {}
        written = [0, 0]  # bytes, chunks
        for per_rank in results:
            for wr in per_rank:
                info = dict(wr.storage_data)
                w_bytes, w_chunks = info.pop("written", (0, 0))
                written = [written[0] + w_bytes, written[1] + w_chunks]
                storage[wr.index] = info
        metadata.version = "1.0.0"
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        sizes: dict[str, int] = {}
        for info in storage.values():
            for i, sha in enumerate(info["chunks"]):
                sizes[sha] = _piece_len(info["nbytes"], info["chunk_bytes"], i)
        index = {
            "format": CHUNKS_FORMAT,
            "epoch": self.chunk_dir.name,
            "chunk_bytes": self.chunk_bytes,
            "chunks": [{"sha": s, "bytes": sizes[s]} for s in sorted(sizes)],
            "bytes": sum(sizes.values()),
            "written_bytes": written[0],
            "written_chunks": written[1],
            "items": len(storage),
            "slots": slot_digests(storage),
        }
        self._durable(self.path / CHUNKS_FILE, json.dumps(index, indent=1, sort_keys=True).encode())
        self._durable(self.path / METADATA_FILE, pickle.dumps(metadata))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # constructed explicitly (it needs a chunk directory), never picked by DCP

    # -- private

    def _put(self, sha: str, piece: memoryview) -> Path | None:
        """Write chunk ``sha`` to a temp file beside its place, unless it is there with its
        size. Returns the temp file (None: present). Not fsynced here: see ``_publish``."""
        final = chunk_path(self.chunk_dir, sha)
        try:
            if final.stat().st_size == len(piece):
                return None
        except FileNotFoundError:
            pass
        tmp = final.with_name(f".{sha}.{secrets.token_hex(4)}.tmp")
        try:
            with writing(final.parent):  # refused (full, read-only, ...): WriteRefused, by its errno
                final.parent.mkdir(exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(piece)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _publish(self, temps: Mapping[str, Path]) -> None:
        """Rename each chunk's temp file into place, its data durable first and the renames
        after (``sync_files``): one ``syncfs`` of the chunk directory's filesystem before and
        one after, where Linux has it (a save writes hundreds of small files: one fsync each
        costs ~10x the write), else an fsync of every file and directory."""
        if not temps:
            return
        one_sync = self.sync_files and syncfs(self.chunk_dir)
        if self.sync_files and not one_sync:
            for tmp in temps.values():
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        for sha, tmp in temps.items():
            os.replace(tmp, chunk_path(self.chunk_dir, sha))
        if self.sync_files and not (one_sync and syncfs(self.chunk_dir)):
            for parent in {chunk_path(self.chunk_dir, sha).parent for sha in temps}:
                _fsync_dir(parent)

    def _durable(self, path: Path, data: bytes | memoryview) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with writing(path), open(tmp, "wb") as f:  # refused: WriteRefused, typed by its errno
                f.write(data)
                if self.sync_files:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


# ---------------------------------------------------------------------- reader


class ChunkReader(StorageReader):
    """DCP StorageReader of a chunked version: ``.metadata`` from ``path`` (checked against
    ``digests[".metadata"]`` when given: {"bytes", "sha256"}), every chunk from ``sources``
    in order, verified by its SHA-256 (see the module docstring).

    After a load: ``served[name]`` chunks (``served_bytes[name]`` bytes) came from each
    source, ``mismatches[name]`` of them were refused for wrong bytes.

    Args:
        path: the version's directory.
        sources: where chunks are looked for, in order; the last is the authority.
        digests: the version's manifest files (relative path -> {"bytes", "sha256"}).
        what: how errors name the version (e.g. "checkpoint job:3").
        chunk_label: how errors name a chunk's place (e.g. "chunks/2"): ``<label>/<sha>``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        sources: Sequence[ChunkSource],
        *,
        digests: Mapping[str, Mapping[str, Any]] | None = None,
        what: str = "checkpoint",
        chunk_label: str = "chunks",
        thread_count: int = _IO_THREADS,
        files: Callable[[str], bytes] | None = None,
    ):
        super().__init__()
        self._files = files  # the version's index files by name (None: read under ``path``)
        if not sources:
            raise ValueError("ChunkReader: sources: at least one (the store's files, last)")
        self.path = Path(path)
        self.sources = list(sources)
        self.digests = digests
        self.what = what
        self.chunk_label = chunk_label
        self.thread_count = max(1, thread_count)
        self.storage_data: dict[MetadataIndex, dict[str, Any]] = {}
        self.served: collections.Counter[str] = collections.Counter()
        self.served_bytes: collections.Counter[str] = collections.Counter()
        self.mismatches: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._index: bytes | None = None  # the checked .metadata bytes
        self._race: TailRead | None = None  # this load's two-ended read (None: none)
        self._bulk: Any = None  # the bulk source the race's front reads
        self.load_id = secrets.token_hex(8)

    # -- StorageReader

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id and Path(checkpoint_id) != self.path:
            self.path, self._index = Path(checkpoint_id), None
        self.load_id = secrets.token_hex(8)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The version's DCP index, checked against the manifest first. DCP turns a failure
        here into an AssertionError of its own: call this before ``dcp.load`` to get the
        ChunkIntegrityError (the checked bytes are kept for DCP's call)."""
        if self._index is None:
            self._index = self._index_bytes(METADATA_FILE)
        data = self._index
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if self.storage_data is None:
            raise ChunkIntegrityError(f"{self.what}: {METADATA_FILE}: no storage data", METADATA_FILE)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_item: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            by_item.setdefault(req.storage_index, []).append(req)
        self._prefetch(plan)
        try:
            self._read_items(by_item, planner)
        finally:
            self._end_bulk()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_items(self, by_item: Mapping[MetadataIndex, list[ReadItem]], planner: LoadPlanner) -> None:
        with ThreadPoolExecutor(max_workers=self.thread_count, thread_name_prefix="chunk-read") as pool:
            for index, reqs in by_item.items():
                info = self.storage_data[index]
                if reqs[0].type == LoadItemType.BYTE_IO:
                    data = self._bytes_of(info, 0, info["nbytes"], pool)
                    for req in reqs:
                        planner.load_bytes(req, io.BytesIO(data))
                    continue
                for req in reqs:
                    tensor = self._tensor_of(info, req, pool)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise AssertionError(
                            f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    # -- chunks

    def fetch(self, sha: str, nbytes: int) -> bytes:
        """Chunk ``sha`` (``nbytes`` long) from the first source whose bytes hash to it.

        Raises:
            ChunkIntegrityError: the last source has it wrong, or no source has it.
        """
        race = self._race
        if race is not None and race.covers(sha):
            return self._fetch_raced(race, sha, nbytes)
        data = self._early(sha, nbytes)
        if data is not None:
            return data
        return self._from_last(sha, nbytes, self.sources[-1].get(sha, nbytes))

    def _fetch_raced(self, race: TailRead, sha: str, nbytes: int) -> bytes:
        """Chunk ``sha`` of the two-ended read: the tail's (read from the last source, verified),
        else the bulk source's once it brought it, else (it lacks it, its copy is wrong, or
        the tail can read no more while it is still on its way) the last source's."""
        last, bulk = self.sources[-1], self._bulk
        if not race.claim(sha):
            ok, data = race.take(sha)
            if ok and data is not None:
                bulk.discard(sha)  # (if the peer brings it too, it is not kept)
                return data
            early = bulk.get(sha, nbytes)  # the store lacks it or has it wrong: the peer's copy
            if early is not None and self._accept(bulk, sha, nbytes, early):
                return early
            raise self._last_failure(sha, nbytes, data)
        if race.wait_front(sha, bulk.resolved):
            data = bulk.get(sha, nbytes)
            if data is not None and self._accept(bulk, sha, nbytes, data):
                return data
        else:
            bulk.discard(sha)  # read from the store now: the peer's copy on its way is not kept
        return self._from_last(sha, nbytes, last.get(sha, nbytes))

    def _early(self, sha: str, nbytes: int) -> bytes | None:
        """Chunk ``sha`` from the first source before the last whose bytes hash to it."""
        for source in self.sources[:-1]:
            data = source.get(sha, nbytes)
            if data is not None and self._accept(source, sha, nbytes, data):
                return data
        return None

    def _accept(self, source: ChunkSource, sha: str, nbytes: int, data: bytes) -> bool:
        if len(data) == nbytes and hashlib.sha256(data).hexdigest() == sha:
            with self._count_lock:
                self.served[source.name] += 1
                self.served_bytes[source.name] += nbytes
            return True
        with self._count_lock:
            self.mismatches[source.name] += 1
        log.warning(
            "chunk_digest_mismatch",
            what=self.what,
            chunk=f"{self.chunk_label}/{sha}",
            source=source.name,
            bytes=len(data),
        )
        return False

    def _from_last(self, sha: str, nbytes: int, data: bytes | None) -> bytes:
        """The last (authoritative) source's ``data`` for chunk ``sha``, checked."""
        if data is not None and self._accept(self.sources[-1], sha, nbytes, data):
            return data
        raise self._last_failure(sha, nbytes, data)

    def _last_failure(self, sha: str, nbytes: int, data: bytes | None) -> ChunkIntegrityError:
        """The error for chunk ``sha`` that the last source lacks (``data`` None) or holds
        wrong (``data``, already refused)."""
        name = f"{self.chunk_label}/{sha}"
        source = self.sources[-1]
        if data is None:
            return ChunkIntegrityError(f"{self.what}: {name}: missing", name, missing=True)
        return ChunkIntegrityError(
            f"{self.what}: {name}: sha256 mismatch (source {source.name})"
            if len(data) == nbytes
            else f"{self.what}: {name}: size {len(data)} bytes, expected {nbytes} (source {source.name})",
            name,
        )

    def _fetch_all(self, shas: list[str], lens: list[int], pool: ThreadPoolExecutor) -> list[bytes]:
        """Chunks ``shas`` in order, as :meth:`fetch` gets each; a last source with
        ``get_many`` (a remote store: one streamed call) is asked once for every chunk the
        sources before it did not serve."""
        many = getattr(self.sources[-1], "get_many", None)
        if many is None or len(shas) < 2 or self._race is not None:  # (a two-ended read: chunk by chunk)
            return list(pool.map(self.fetch, shas, lens)) if len(shas) > 1 else [self.fetch(shas[0], lens[0])]
        early = list(pool.map(self._early, shas, lens)) if len(self.sources) > 1 else [None] * len(shas)
        need = [(s, n) for s, n, d in zip(shas, lens, early) if d is None]
        batch = many(need) if need else {}
        return [d if d is not None else self._from_last(s, n, batch.get(s)) for s, n, d in zip(shas, lens, early)]

    def _prefetch(self, plan: LoadPlan) -> None:
        """Name every chunk this load reads (sha -> bytes) to the sources before the last that
        read in bulk (a ``prefetch`` method: the peer's memory, one streamed read instead of a
        round trip per chunk), before the first is asked for. What they return is still
        verified chunk by chunk as it is taken."""
        bulk = [getattr(source, "prefetch", None) for source in self.sources[:-1]]
        if not any(bulk):
            return
        wanted: dict[str, int] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            size, total = info["chunk_bytes"], info["nbytes"]
            start, stop = _byte_range(info, req)
            if stop <= start:
                continue
            for i in range(start // size, (stop - 1) // size + 1):
                wanted.setdefault(info["chunks"][i], _piece_len(total, size, i))
        for prefetch in bulk:
            if prefetch is not None and wanted:
                prefetch(wanted)
        self._race = self._two_ended(wanted)

    def _two_ended(self, wanted: Mapping[str, int]) -> TailRead | None:
        """The two-ended read of the chunks the bulk source (``reads_in_bulk``) was asked for
        that no local source before the last holds (``holds``: the own agent's memory), or
        None: no bulk source (or more than one), one that cannot take part
        (``resolved``/``has``/``listen``/``discard``), or a
        local source that cannot say what it holds (its chunks are not read twice)."""
        bulk = [s for s in self.sources[:-1] if getattr(s, "reads_in_bulk", False)]
        if (
            len(bulk) != 1
            or not wanted
            or not all(hasattr(bulk[0], a) for a in ("resolved", "has", "listen", "discard"))
        ):
            return None
        peer = bulk[0]
        local = [s for s in self.sources[:-1] if s is not peer]
        order = []
        for sha, n in wanted.items():
            held = [s.holds(sha) if hasattr(s, "holds") else None for s in local]
            if None in held:
                return None
            if not any(held):
                order.append((sha, n))
        if not order:
            return None
        self._bulk = peer
        race = TailRead(order, self.sources[-1], self._accept, peer.has, threads=self.thread_count)
        peer.listen(race.notify, race.tail_took)
        return race

    def _end_bulk(self) -> None:
        """The load is over: stop the tail and the bulk reads (what they still bring is not needed)."""
        race, self._race = self._race, None
        if race is not None:
            race.close()
            log.info("chunk_race", tail_chunks=race.tail_chunks, front_from_store=race.stolen)
        for source in self.sources[:-1]:
            cancel = getattr(source, "cancel", None)
            if cancel is not None:
                cancel()

    # -- private

    def _index_bytes(self, rel: str) -> bytes:
        try:
            data = self._files(rel) if self._files is not None else (self.path / rel).read_bytes()
        except FileNotFoundError:
            raise ChunkIntegrityError(f"{self.what}: {rel}: missing", rel, missing=True) from None
        if self.digests is not None:
            expected = self.digests.get(rel)
            if expected is None:
                raise ChunkIntegrityError(f"{self.what}: {rel}: not in the manifest", rel)
            if len(data) != expected["bytes"]:
                raise ChunkIntegrityError(
                    f"{self.what}: {rel}: size {len(data)} bytes, manifest says {expected['bytes']}", rel
                )
            if hashlib.sha256(data).hexdigest() != expected["sha256"]:
                raise ChunkIntegrityError(f"{self.what}: {rel}: sha256 mismatch", rel)
        return data

    def _bytes_of(self, info: Mapping[str, Any], start: int, stop: int, pool: ThreadPoolExecutor) -> bytes | bytearray:
        """Bytes [start, stop) of a stored item, fetching only the chunks that cover them."""
        size, total = info["chunk_bytes"], info["nbytes"]
        if stop <= start:
            return b""
        first, last = start // size, (stop - 1) // size
        shas = info["chunks"][first : last + 1]
        lens = [_piece_len(total, size, first + k) for k in range(len(shas))]
        parts = self._fetch_all(shas, lens, pool)
        if len(parts) == 1 and start == first * size and len(parts[0]) == stop - start:
            return parts[0]
        # One copy of each chunk's part into the item's buffer (a join, a slice and the
        # tensor's own buffer were three; at a heal's GB/s each costs a tenth of a second a GB).
        out = bytearray(stop - start)
        pos = first * size
        for part in parts:
            lo, hi = max(start, pos), min(stop, pos + len(part))
            out[lo - start : hi - start] = memoryview(part)[lo - pos : hi - pos]
            pos += len(part)
        return out

    def _tensor_of(self, info: Mapping[str, Any], req: ReadItem, pool: ThreadPoolExecutor) -> torch.Tensor:
        """The part of a stored tensor ``req`` asks for (``storage_offsets``, ``lengths``)."""
        shape = list(info["shape"])
        dtype = _dtype(info["dtype"])
        offsets, lengths = list(req.storage_offsets), list(req.lengths)
        if not shape:
            data = self._bytes_of(info, 0, info["nbytes"], pool)
            return _from_bytes(data, dtype, [])
        # A narrowing along dim 0 only (the usual reshard of a row-sharded tensor) is one
        # contiguous byte range: read just the chunks that cover it.
        if all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:])):
            row = math.prod(shape[1:]) * _element_size(dtype)
            data = self._bytes_of(info, offsets[0] * row, (offsets[0] + lengths[0]) * row, pool)
            return _from_bytes(data, dtype, [lengths[0], *shape[1:]])
        whole = _from_bytes(self._bytes_of(info, 0, info["nbytes"], pool), dtype, shape)
        for dim, (o, n) in enumerate(zip(offsets, lengths)):
            whole = torch.narrow(whole, dim, o, n)
        return whole


# ---------------------------------------------------------------------- helpers


def slot_digests(storage: Mapping[MetadataIndex, Mapping[str, Any]]) -> dict[str, str]:
    """Each slot's digest (see the module docstring) from a version's storage data."""
    lines: dict[str, list[str]] = {}
    for index, info in storage.items():
        key = f"{index.fqn}@{','.join(str(o) for o in (index.offset or ()))}"
        lines.setdefault(index.fqn.split(".", 1)[0], []).append(f"{key}:{','.join(info['chunks'])}\n")
    return {slot: hashlib.sha256("".join(sorted(ls)).encode()).hexdigest() for slot, ls in sorted(lines.items())}


def read_chunk_index(version_dir: str | os.PathLike) -> dict[str, Any]:
    """A version's ``chunks.json`` (plain JSON; no check against a manifest here)."""
    return json.loads((Path(version_dir) / CHUNKS_FILE).read_bytes())


def iter_chunk_files(chunk_dir: str | os.PathLike) -> Iterator[Path]:
    """Every chunk file under ``chunk_dir`` (temp files of unfinished writes excluded)."""
    root = Path(chunk_dir)
    if not root.is_dir():
        return
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and len(sub.name) == 2:
            for f in sorted(sub.iterdir()):
                if is_sha(f.name):
                    yield f


def _byte_range(info: Mapping[str, Any], req: ReadItem) -> tuple[int, int]:
    """Bytes [start, stop) of a stored item that ``req`` reads (``ChunkReader._tensor_of``'s
    rule: a narrowing along dim 0 only is one contiguous range, anything else the whole)."""
    shape = list(info["shape"])
    if req.type == LoadItemType.BYTE_IO or not shape:
        return 0, info["nbytes"]
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:])):
        row = math.prod(shape[1:]) * _element_size(_dtype(info["dtype"]))
        return offsets[0] * row, (offsets[0] + lengths[0]) * row
    return 0, info["nbytes"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(piece: memoryview | bytes) -> str:
    return hashlib.sha256(piece).hexdigest()


def _piece_len(total: int, size: int, i: int) -> int:
    return min(size, total - i * size)


def _raw_bytes(item: WriteItem, data: Any) -> tuple[memoryview, list[int], str]:
    """(read-only bytes, shape, dtype name) of what DCP resolved for ``item``."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise AssertionError("Data must be io.BytesIO for BYTE_IO write items")
        return data.getbuffer().toreadonly(), [], ""
    if not isinstance(data, torch.Tensor):
        raise AssertionError("Data must be torch.Tensor for non-BYTE_IO write items")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        return memoryview(b""), list(t.shape), dtype
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).toreadonly(), list(t.shape), dtype


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ChunkIntegrityError(f"{METADATA_FILE}: unknown dtype {name!r}", METADATA_FILE)
    return dtype


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _from_bytes(data: bytes | bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    # (a bytearray is the reader's own buffer, used once: no copy; bytes are read-only)
    flat = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


# What a chunked ``.metadata`` pickle may name: DCP's metadata dataclasses, torch.Size,
# dtypes and layouts; per item, storage data is plain dicts, lists, strings and ints.
CHUNKED_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def enum_member(cls: Any, name: Any) -> enum.Enum:
    """What stands in for ``builtins.getattr`` in a ``.metadata`` pickle: some Python 3.11
    releases (Debian 12's 3.11.2 among them) pickle an enum member as ``getattr(cls, name)``.
    Only a member of an Enum among the allowed classes is returned; anything else is refused
    (a getattr of any other attribute could reach code)."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__qualname__) in CHUNKED_METADATA_CLASSES
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(f"checkpoint {METADATA_FILE}: refusing getattr({cls!r}, {name!r})")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in CHUNKED_METADATA_CLASSES:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint {METADATA_FILE}: refusing to load {module}.{name}")
