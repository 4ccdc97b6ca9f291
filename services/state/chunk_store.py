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

Reading: ``services/state/chunk_reader.py`` (``ChunkReader``).

Writing (``ChunkWriter``): ``sink(sha, data)`` is called for every chunk of this rank's part
(written or found present), on the thread that called ``write_data``, in item order; ``data``
is a read-only view valid during the call only (copy it to keep it). A sink that raises is
logged once and not called again for this save; the save itself goes on (the files are the
record).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from services.common.disk import syncfs
from services.contract.failures import writing

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
