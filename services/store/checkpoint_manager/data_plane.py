"""Part of L5-1 (the checkpoint manager): the data plane, bytes without a shared filesystem.

``held_chunks``, ``receive_files`` and ``send_files`` are called by the store's relay for the
plumbing RPCs ``HeldCheckpointChunks``, ``PutCheckpointFiles`` and ``GetCheckpointFiles``
(bytes, not routed messages; exception checkpoint-bytes-stream); nothing is decided here.
Every streamed file is checked as it arrives (its name stays inside its directory, its size
is bounded and as declared, its bytes hash to the declared SHA-256: a chunk's is its name)
and refused whole otherwise (CheckpointTransferRefused, its cause typed). See "Where the
bytes live" in the package docstring.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from services.common.disk import syncfs
from services.contract import store_pb2
from services.contract.failures import FailureCause, writing
from services.store.checkpoint_manager.layout import (
    _SHA256,
    _VERDICT_OF,
    MANIFEST,
    MAX_STREAMED_CHUNK_BYTES,
    MAX_STREAMED_INDEX_BYTES,
    TRANSFER_PART_BYTES,
    CheckpointDamaged,
    CheckpointNotFound,
    CheckpointTransferRefused,
    _check_job_id,
    _fsync_dir,
    _verdict,
)
from services.store.checkpoint_manager.verification import _check_manifest
from services.store.chunk_roots import LocalChunks


class DataPlane:
    """The manager's data-plane methods (a mixin of CheckpointManager: its lock, open saves and chunk root)."""

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
            with writing(staging):  # a full or read-only store: WriteRefused, typed from the errno
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
