"""DCP StorageReader of a chunked version (the layout: ``services/state/chunk_store.py``).

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
"""

from __future__ import annotations

import collections
import enum
import hashlib
import io
import math
import os
import pickle
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from services.state.chunk_race import TailRead
from services.state.chunk_store import (
    _IO_THREADS,
    METADATA_FILE,
    ChunkIntegrityError,
    ChunkSource,
    _piece_len,
)

log = structlog.get_logger()


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
