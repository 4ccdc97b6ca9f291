"""The rank's L5 checkpoint relay (``store_client.py``): the chunk writer of a save and the
reader of a load (ChunkIO, a part of StoreClient), and a version's manifest read and checked.

Where the bytes go is the store's word, never this relay's guess: ``SaveStaged.transfer``
(and ``CheckpointInfo.transfer`` for a load) is TRANSFER_PATH (write and read the store's
directories at the paths it names: a shared filesystem), TRANSFER_STREAM (stream the chunks
and index to the store over its data plane, read them back the same way) or TRANSFER_FSSPEC
(chunks to and from the object store URL it names, the index streamed):
``services/rank/checkpoint_transfer.py``. The same ChunkWriter / ChunkReader (chunks,
digests, memory copies, DCP planners) serve all three.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from services.common.grpc_server import channel
from services.contract import Module, store_pb2, store_pb2_grpc
from services.rank.checkpoint_errors import (
    RECONNECT_OPTIONS,
    CheckpointError,
    CheckpointIntegrityError,
    _one_line,
)
from services.rank.checkpoint_transfer import (
    FsspecSource,
    FsspecTransfer,
    StreamSource,
    StreamTransfer,
    TransferChunkWriter,
)
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkSource, ChunkWriter, DirectorySource

log = structlog.get_logger()


class ChunkIO:
    """StoreClient's part that builds a save's chunk writer and a load's chunk reader
    (``_copies``, ``_address`` and the data plane's channel are StoreClient's)."""

    def _data_stub(self) -> store_pb2_grpc.StoreServiceStub:
        """The store's checkpoint data plane (PutCheckpointFiles, GetCheckpointFiles, ...),
        spoken as L5-1's rank side (services/common/identity.py PLUMBING_CALLERS)."""
        if self._data_stub_ is None:
            self._data_channel = channel(self._address, options=RECONNECT_OPTIONS, module=Module.L5_CHECKPOINT_MANAGER)
            self._data_stub_ = store_pb2_grpc.StoreServiceStub(self._data_channel)
        return self._data_stub_

    def _writer_for(
        self, staged: store_pb2.SaveStaged, msg: store_pb2.SaveCheckpoint, expected_bytes: int = 0
    ) -> ChunkWriter | None:
        """The chunk writer of a save the store gave a chunk directory (None: an older store,
        plain DCP files into the staging directory): into the store's directories
        (TRANSFER_PATH), streamed to the store (TRANSFER_STREAM) or to an object store
        (TRANSFER_FSSPEC; services/rank/checkpoint_transfer.py). ``expected_bytes``: this
        rank's part of the save, for the memory copy's room check."""
        if not staged.chunk_path:
            if staged.transfer != store_pb2.TRANSFER_PATH:
                raise CheckpointError(f"checkpoint step {staged.step}: the store asked for a transfer without chunks")
            return None
        sink = None
        if self._copies is not None:
            try:
                sink = self._copies.begin(staged.step, expected_bytes)
            except Exception as e:  # noqa: BLE001 - a memory copy is optional; the store's files are the record
                log.warning("memory_copy_skipped", step=staged.step, error=_one_line(e))
        if staged.transfer == store_pb2.TRANSFER_PATH:
            return ChunkWriter(staged.staging_path, staged.chunk_path, sink=sink)
        stream = StreamTransfer(
            self._data_stub(), staged, msg.attempt, msg.rank, chunks=staged.transfer == store_pb2.TRANSFER_STREAM
        )
        transfer = stream if staged.transfer == store_pb2.TRANSFER_STREAM else FsspecTransfer(staged, stream)
        return TransferChunkWriter(staged.staging_path, staged.chunk_path, transfer, sink=sink)

    def _remote_store(self, info: store_pb2.CheckpointInfo) -> StreamSource | None:
        """The store's data plane for a version read without its filesystem (None: TRANSFER_PATH)."""
        if info.transfer == store_pb2.TRANSFER_PATH:
            return None
        return StreamSource(self._data_stub(), info.version)

    def _reader_for(
        self,
        info: store_pb2.CheckpointInfo,
        digests: dict[str, dict[str, Any]],
        remote: StreamSource | None = None,
        index: _RemoteIndex | None = None,
    ) -> ChunkReader:
        """The reader of a chunked version: the copies' sources first, the store's files last
        (its directory, its data plane, or the object store: as ``info.transfer`` says)."""
        sources: list[ChunkSource] = []
        if self._copies is not None:
            try:
                sources = list(self._copies.sources())
            except Exception as e:  # noqa: BLE001 - the store's files suffice
                log.warning("memory_copy_sources_failed", error=_one_line(e))
        label = f"chunks/{info.chunk_path.rstrip('/').rsplit('/', 1)[-1]}"
        if info.transfer == store_pb2.TRANSFER_STREAM and remote is not None:
            sources.append(remote)
        elif info.transfer == store_pb2.TRANSFER_FSSPEC:
            sources.append(FsspecSource(info.chunk_path, info.endpoint_url))
        else:
            sources.append(DirectorySource(info.chunk_path))
        return ChunkReader(
            info.path,
            sources,
            digests=digests,
            what=f"checkpoint {info.version}",
            chunk_label=label,
            files=index.get if index is not None else None,
        )


class _RemoteIndex:
    """A version's index files (manifest.json, .metadata) from the store's data plane, asked
    for once: ``get(name)`` -> bytes, FileNotFoundError when the store lacks one."""

    NAMES = ("manifest.json", ".metadata")

    def __init__(self, remote: StreamSource, info: store_pb2.CheckpointInfo):
        self._files = remote.files(names=list(self.NAMES))

    def get(self, name: str) -> bytes:
        data = self._files.get(name)
        if data is None:
            raise FileNotFoundError(name)
        return data


def payload_bytes(payload: Any) -> int:
    """Bytes of the tensors in a save's payload (nested dicts, lists and tuples; a DTensor
    counts its local shard): this rank's part of the save, which its memory copy needs at
    most (chunks it shares with the previous save are not written again). Never raises."""
    import torch

    total, stack = 0, [payload]
    try:
        while stack:
            x = stack.pop()
            if isinstance(x, Mapping):
                stack.extend(x.values())
            elif isinstance(x, list | tuple):
                stack.extend(x)
            elif isinstance(x, torch.Tensor):
                local = x.to_local() if hasattr(x, "to_local") else x
                total += local.numel() * local.element_size()
    except Exception:  # noqa: BLE001 - an estimate: unknown is 0 (not checked)
        return 0
    return total


def _manifest_digests(info: store_pb2.CheckpointInfo, index: _RemoteIndex | None = None) -> dict[str, dict[str, Any]]:
    """The manifest's files of a version (path -> {bytes, sha256}), once the manifest's own
    SHA-256 matches the catalog's (``info.manifest_sha256``); read from ``index`` (the
    store's data plane) when given, else under ``info.path``."""
    path = Path(info.path) / "manifest.json"
    try:
        data = index.get("manifest.json") if index is not None else path.read_bytes()
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"checkpoint {info.version}: manifest.json: missing", store_pb2.MISSING_FILE, "manifest.json"
        ) from None
    if hashlib.sha256(data).hexdigest() != info.manifest_sha256:
        raise CheckpointIntegrityError(
            f"checkpoint {info.version}: manifest.json: sha256 mismatch", store_pb2.CORRUPT, "manifest.json"
        )
    return {f["path"]: f for f in json.loads(data)["files"]}
