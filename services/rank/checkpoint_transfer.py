"""A rank's checkpoint bytes without a shared filesystem (L5-1's rank side, with store_client.py).

The store says how a save's bytes travel (``SaveStaged.transfer``) and how a version's are
read (``CheckpointInfo.transfer``); the rank never guesses:

* ``TRANSFER_PATH``: the rank writes and reads the store's directories itself
  (``services/state/chunk_store.py`` ChunkWriter / DirectorySource): a filesystem mounted at
  the same path on every node. Nothing here is used.
* ``TRANSFER_STREAM``: :class:`StreamTransfer`. The rank asks the store once which chunks
  the save's epoch holds (``HeldCheckpointChunks``), streams every other chunk of its part
  on one ``PutCheckpointFiles`` call while it hashes the next ones (gRPC's flow control
  paces it; the chunks are views of the snapshot, not copies, until their message is built),
  and rank 0 streams the index files (``chunks.json``, ``.metadata``) the same way. The store
  checks each file on arrival (a chunk's SHA-256 is its name; an index file's is declared)
  and refuses a mismatch with a typed failure. A version is read back with
  ``GetCheckpointFiles`` (:class:`StreamSource`), an item's chunks in one streamed call.
* ``TRANSFER_FSSPEC``: :class:`FsspecTransfer`. Chunks are objects under ``chunk_path``, an
  fsspec URL (``s3://...``, ``endpoint_url`` from the store; credentials from this process's
  environment), each one PUT under its final name (its SHA-256) with that SHA-256 declared,
  so S3 checks it on arrival; the index files stream to the store as above. Read back with
  :class:`FsspecSource` (the index with ``GetCheckpointFiles``).

Either way the staging and chunk paths in SaveStaged are the store's, never opened here, and
every byte read is checked by the reader (ChunkReader: each chunk against its name, the index
against the manifest, the manifest against the catalog).
"""

from __future__ import annotations

import base64
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.contract import store_pb2
from services.contract.failures import FailureCause, cause_of, write_refused_from_rpc
from services.state.chunk_store import ChunkWriter

log = structlog.get_logger()

PART_BYTES = 1 << 20  # one CheckpointFileData's bytes at most
STREAM_TIMEOUT_S = 3600.0  # a save's chunk stream (the write runs off the training loop's path)
_END = object()
_CORRUPT = FailureCause.FAILURE_DATA_CORRUPT


class TransferFailed(RuntimeError):
    """A stream to or from the store failed: ``failure_cause`` typed by what the store said
    (its ``surge-failure-cause``) or the status code, never by text (``code``: the status)."""

    def __init__(
        self,
        message: str,
        failure_cause: int,
        code: grpc.StatusCode | None = None,
        write_error: int = 0,
        path: str = "",
    ):
        super().__init__(message)
        self.failure_cause = failure_cause
        self.code = code
        # The store's write was refused (failure_cause FAILURE_WRITE_REFUSED): which, and where.
        self.write_error, self.path = write_error, path

    def __reduce__(self) -> tuple[Any, ...]:  # (DCP gathers a rank's error to rank 0 pickled)
        return type(self), (str(self), self.failure_cause, self.code, self.write_error, self.path)


def _failed(what: str, e: grpc.RpcError) -> TransferFailed:
    details = " ".join((e.details() or "").split())
    cause = cause_of(e)
    kind, path = write_refused_from_rpc(e) if cause == FailureCause.FAILURE_WRITE_REFUSED else (0, "")
    return TransferFailed(f"{what}: {e.code().name}: {details}", cause, e.code(), kind, path)


def file_parts(name: str, kind: int, data: bytes | memoryview, sha256: str) -> Iterator[store_pb2.CheckpointFileData]:
    """One file as CheckpointFileData parts of at most PART_BYTES (the first names it)."""
    view = memoryview(data)
    yield store_pb2.CheckpointFileData(
        name=name, kind=kind, size=len(view), sha256=sha256, data=bytes(view[:PART_BYTES])
    )
    for i in range(PART_BYTES, len(view), PART_BYTES):
        yield store_pb2.CheckpointFileData(data=bytes(view[i : i + PART_BYTES]))


def read_files(parts: Iterable[store_pb2.CheckpointFileData]) -> dict[str, bytes | None]:
    """Reassemble a GetCheckpointFiles stream: name -> bytes (None: the store lacks it)."""
    out: dict[str, bytes | None] = {}
    name, size, buf = "", 0, bytearray()
    for part in parts:
        if part.name:
            if name and len(buf) != size:
                raise TransferFailed(f"{name}: {len(buf)} of {size} bytes, then {part.name}", _CORRUPT)
            name = part.name
            if part.missing:
                out[name], name = None, ""
                continue
            size, buf = part.size, bytearray(part.data)
        else:
            buf += part.data
        if name and len(buf) == size:
            out[name], name = bytes(buf), ""
    if name:
        raise TransferFailed(f"{name}: the stream ended after {len(buf)} of {size} bytes", _CORRUPT)
    return out


class StreamTransfer:
    """One rank's save streamed to the store (TRANSFER_STREAM; the index files under
    TRANSFER_FSSPEC too). ``begin`` asks which chunks the epoch holds; ``put_chunk`` queues a
    chunk on the save's one PutCheckpointFiles call (opened at the first); ``end_chunks``
    closes it and waits for the store's verdict; ``put_index`` sends one index file."""

    def __init__(self, stub: Any, staged: store_pb2.SaveStaged, attempt: str, rank: int, chunks: bool = True):
        self._stub = stub
        self.header = store_pb2.CheckpointUploadHeader(
            job_id=staged.job_id, step=staged.step, attempt=attempt, rank=rank, epoch=staged.epoch
        )
        self._chunks = chunks
        self._held: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._call: Any = None
        self._lock = threading.Lock()
        self.sent_bytes = 0

    def begin(self) -> None:
        if not self._chunks:
            return
        q = store_pb2.HeldCheckpointChunksQuery(
            job_id=self.header.job_id, step=self.header.step, attempt=self.header.attempt, epoch=self.header.epoch
        )
        try:
            raw = self._stub.HeldCheckpointChunks(q, timeout=60).sha256
        except grpc.RpcError as e:
            raise _failed("HeldCheckpointChunks", e) from None
        self._held = {raw[i : i + 32].hex() for i in range(0, len(raw), 32)}

    def put_chunk(self, sha: str, piece: memoryview) -> bool | None:
        """None: the store holds it; True: queued on the stream."""
        if sha in self._held:
            return None
        with self._lock:
            if self._call is None:
                self._call = self._stub.PutCheckpointFiles.future(self._requests(), timeout=STREAM_TIMEOUT_S)
            elif self._call.done():
                self._raise("PutCheckpointFiles")
        self._queue.put((sha, piece))
        return True

    def end_chunks(self) -> None:
        with self._lock:
            call, self._call = self._call, None
        if call is None:
            return
        self._queue.put(_END)
        self._result(call, "PutCheckpointFiles")

    def abort(self) -> None:
        with self._lock:
            call, self._call = self._call, None
        if call is not None:
            call.cancel()
            self._queue.put(_END)

    def put_index(self, name: str, data: bytes | memoryview) -> None:
        import hashlib

        sha = hashlib.sha256(data).hexdigest()

        def requests() -> Iterator[store_pb2.CheckpointUpload]:
            yield store_pb2.CheckpointUpload(header=self.header)
            for part in file_parts(name, store_pb2.CHECKPOINT_FILE_INDEX, data, sha):
                yield store_pb2.CheckpointUpload(file=part)

        self._result(self._stub.PutCheckpointFiles.future(requests(), timeout=STREAM_TIMEOUT_S), "PutCheckpointFiles")

    def _requests(self) -> Iterator[store_pb2.CheckpointUpload]:
        yield store_pb2.CheckpointUpload(header=self.header)
        while (item := self._queue.get()) is not _END:
            sha, piece = item
            for part in file_parts(sha, store_pb2.CHECKPOINT_FILE_CHUNK, piece, sha):
                yield store_pb2.CheckpointUpload(file=part)
            self.sent_bytes += len(piece)

    def _result(self, call: Any, what: str) -> store_pb2.CheckpointFilesPut:
        try:
            return call.result()
        except grpc.RpcError as e:
            raise _failed(what, e) from None

    def _raise(self, what: str) -> None:
        call, self._call = self._call, None
        self._result(call, what)
        raise TransferFailed(f"{what}: the store closed the stream early", FailureCause.FAILURE_IO)


class FsspecTransfer:
    """One rank's save under TRANSFER_FSSPEC: chunks to the object store (one PUT each, its
    SHA-256 declared so the object store checks it), the index files to the store's stream."""

    def __init__(self, staged: store_pb2.SaveStaged, index: StreamTransfer):
        self.fs, self.base = fsspec_fs(staged.chunk_path, staged.endpoint_url)
        self._index = index
        self._held: set[str] = set()

    def begin(self) -> None:
        self.fs.invalidate_cache(self.base)  # fsspec shares one filesystem object per options: list afresh
        try:
            found = self.fs.find(self.base, withdirs=False)
        except FileNotFoundError:
            found = []
        self._held = {p.rsplit("/", 1)[-1] for p in found}

    def put_chunk(self, sha: str, piece: memoryview) -> bool | None:
        if sha in self._held:
            return None
        checksum = base64.b64encode(bytes.fromhex(sha)).decode()
        self.fs.pipe_file(f"{self.base}/{sha[:2]}/{sha}", bytes(piece), ChecksumSHA256=checksum)
        return True

    def end_chunks(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def put_index(self, name: str, data: bytes | memoryview) -> None:
        self._index.put_index(name, data)


def fsspec_fs(url: str, endpoint_url: str = "") -> tuple[Any, str]:
    """(filesystem, path without the protocol) of an fsspec URL; ``endpoint_url`` for s3."""
    from fsspec.core import url_to_fs

    options = {"endpoint_url": endpoint_url} if endpoint_url else {}
    fs, path = url_to_fs(url, **options)
    return fs, path.rstrip("/")


class TransferChunkWriter(ChunkWriter):
    """The ChunkWriter (same chunks, same index, same DCP planners) whose bytes go through a
    transfer instead of the filesystem: ``path`` and ``chunk_dir`` are only names here."""

    def __init__(self, path: str | os.PathLike, chunk_dir: str, transfer: StreamTransfer | FsspecTransfer, **kw: Any):
        super().__init__(path, "/nonexistent-chunk-dir", **kw)
        self.chunk_dir = Path(chunk_dir.rsplit("/", 1)[-1])  # the epoch's name, for chunks.json
        self.transfer = transfer

    def prepare_local_plan(self, plan):
        self.transfer.begin()
        return plan

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except BaseException:
            self.transfer.abort()
            raise

    def _put(self, sha: str, piece: memoryview):  # noqa: D401 - ChunkWriter's hook
        return self.transfer.put_chunk(sha, piece)

    def _publish(self, temps) -> None:
        self.transfer.end_chunks()

    def _durable(self, path: Path, data: bytes | memoryview) -> None:
        self.transfer.put_index(Path(path).name, data)


class StreamSource:
    """A committed version's chunks from the store's GetCheckpointFiles (the reader's last,
    authoritative source under TRANSFER_STREAM). ``get_many``: an item's chunks, one call."""

    name = "store"

    def __init__(self, stub: Any, version: str):
        self._stub, self._version = stub, version

    def files(self, names: list[str] | None = None, chunks: list[str] | None = None) -> dict[str, bytes | None]:
        q = store_pb2.CheckpointFilesQuery(version=self._version, names=names or [], chunks=chunks or [])
        try:
            return read_files(self._stub.GetCheckpointFiles(q, timeout=STREAM_TIMEOUT_S))
        except grpc.RpcError as e:
            raise _failed("GetCheckpointFiles", e) from None

    def get(self, sha: str, nbytes: int) -> bytes | None:
        return self.files(chunks=[sha]).get(sha)

    def get_many(self, items: list[tuple[str, int]]) -> dict[str, bytes | None]:
        return self.files(chunks=list(dict.fromkeys(sha for sha, _ in items)))


class FsspecSource:
    """A version's chunks as objects under ``chunk_path`` (TRANSFER_FSSPEC)."""

    name = "store"

    def __init__(self, chunk_url: str, endpoint_url: str = ""):
        self.fs, self.base = fsspec_fs(chunk_url, endpoint_url)

    def _path(self, sha: str) -> str:
        return f"{self.base}/{sha[:2]}/{sha}"

    def get(self, sha: str, nbytes: int) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(sha))
        except FileNotFoundError:
            return None

    def get_many(self, items: list[tuple[str, int]]) -> dict[str, bytes | None]:
        paths = {self._path(sha): sha for sha, _ in items}
        got = self.fs.cat(list(paths), on_error="omit")
        return {paths[p]: data for p, data in got.items() if p in paths}
