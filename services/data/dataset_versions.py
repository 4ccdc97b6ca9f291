"""L4-1 dataset version manager (数据集版本管理器): versions, paths, hash checks, mounting.

It owns the registry of prepared versions under the data root (a version is the directory
``root/<name>/<version>/``, see ``prepare.py``), rescanned at start-up and on every command
so a version prepared while the service runs is found. It never reads, filters, shuffles
or packs samples, and never decides the read-ahead: mounting a split hands the prefetcher
a :class:`TokenStore` (paths and the document index), nothing more.

Versions in object storage (``remote_versions.py``, when the service has ``--remote``) are
listed and mounted beside the local ones. A local version of the same ``name@version`` wins
and the remote one is not consulted (both are immutable and ``push`` refuses other content
under one name: a local copy is the same data, read without the network). A remote split's
token file is read through the block cache; its small files are checked and kept locally.

Commands it takes (its public methods): ``mount_dataset`` (L2-1 or the operator),
``dataset_query`` (the operator), ``open_stream`` (L2-1: mount, then activate one split).
Events it publishes: ``DatasetReady`` (the reply), ``DatasetUnavailable`` (to L2-1, when a
mount fails; the failing command also raises, so a commander without an event route, the
operator, still gets the one-line reason). It commands only the prefetcher
(``ActivateSource``).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np

from services.contract import Module, data_pb2, route_pb2
from services.contract.bus import CommandPort, Emitter
from services.contract.failures import FailureCause, failure_of
from services.data import manifest as mf
from services.data.block_cache import CachedFile
from services.data.documents import TokenStore
from services.data.errors import DatasetCorrupt, DatasetInUse, DatasetNotFound, InvalidConfig
from services.data.remote_versions import REMOTE_DIR, RemoteVersions
from services.data.sample_index import INDEX_DIR, forget, mapped

SPLITS = ("train", "val")


def _failure(e: DatasetNotFound | DatasetCorrupt, reason: str) -> route_pb2.Failure:
    """The typed failure part of the DatasetUnavailable a failed mount publishes: a version
    that is not there is unavailable to the job (FAILURE_UNAVAILABLE: the job's spec was
    checked against it at submit, so a stream that finds it gone finds it removed, not
    misnamed); a corrupt one by its own type. (Without it, the relay that carries the event
    stamps a failure part holding only where it came from, and L1-3's report said nothing.)"""
    failure = failure_of(e, Module.L4_DATASET_VERSIONS, "surge.v1.MountDataset")
    failure.detail = f"{type(e).__name__}: {reason}"  # (a missing version: where it was looked for)
    if isinstance(e, DatasetNotFound):
        failure.cause = FailureCause.FAILURE_UNAVAILABLE
    return failure


class DatasetVersions:
    """Registry and mounting of dataset versions under ``root``. Thread-safe."""

    def __init__(self, root: Path, emit: Emitter, activate_source: CommandPort, remote: RemoteVersions | None = None):
        self._root = Path(root)
        self._remote = remote  # the process's, shared by every stream (None: local versions only)
        self._emit = emit
        self._activate_source = activate_source
        self._lock = threading.Lock()
        self._registry: dict[tuple[str, str], Path] = {}
        # "registered" | "ready" | "corrupt" per version; the version last mounted.
        self._state: dict[tuple[str, str], str] = {}
        self._active: tuple[str, str] | None = None
        self._scan()

    # ---- commands -------------------------------------------------------------------

    def mount_dataset(self, msg: data_pb2.MountDataset, payload: object = None) -> data_pb2.DatasetReady:
        """Find ``msg.name@msg.version`` and check it against its manifest: always the
        manifest's own hash and every file's size; with ``msg.verify`` also every file's
        SHA-256 (stdlib: ~60 MB hashed, ~0.2 s).

        Raises:
            DatasetNotFound: ``dataset stdlib@v9 not found (have: stdlib@v1)``.
            DatasetCorrupt: ``dataset stdlib@v1: train.bin: sha256 mismatch (manifest …, file …)``.
        """
        ready, _, _, _ = self._mount(msg.name, msg.version, msg.verify)
        return ready

    def dataset_query(self, msg: data_pb2.DatasetQuery, payload: object = None) -> data_pb2.DatasetList:
        """Every version under the root whose manifest reads and self-checks (data files are
        not hashed here; ``mount_dataset`` does that)."""
        with self._lock:
            self._scan()
            entries = sorted(self._registry.items())
        out = data_pb2.DatasetList()
        for (name, version), path in entries:
            try:
                out.datasets.append(_ready(name, version, path, mf.read(path, f"{name}@{version}")))
            except DatasetCorrupt:
                continue  # listed versions are usable ones; mount_dataset names the fault
        if self._remote is not None:  # those only in object storage (a local copy wins)
            for name, version in self._remote.versions():
                if (name, version) in self._registry:
                    continue
                try:
                    manifest = self._remote.manifest(name, version)  # the manifest alone
                except DatasetCorrupt:
                    continue
                if manifest is not None:
                    out.datasets.append(_ready(name, version, self._remote.local_dir(name, version), manifest))
        return out

    def delete_dataset(self, msg: data_pb2.DeleteDataset, payload: object = None) -> data_pb2.DatasetDeleted:
        """Remove the version ``msg.name@msg.version`` (its directory; the name's directory
        too once it holds no version). ``payload``: how many streams read it now (the
        servicer's count; a stream's own L4-1 is another instance).

        Raises:
            DatasetNotFound: no such version.
            DatasetInUse: a stream of it is open; nothing changed.
        """
        key, label = (msg.name, msg.version), f"{msg.name}@{msg.version}"
        with self._lock:
            self._scan()
            path = self._registry.get(key)
            if path is None:
                have = ", ".join(f"{n}@{v}" for n, v in sorted(self._registry)) or f"none under {self._root}"
                raise DatasetNotFound(f"dataset {label} not found (have: {have})")
            if isinstance(payload, int) and payload > 0:
                raise DatasetInUse(
                    f"dataset {label} is in use: {payload} stream{'s' if payload > 1 else ''} of it open "
                    "(a running job reads it); stop the job first"
                )
            freed = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
            shutil.rmtree(index_root(self._root, *key), ignore_errors=True)  # its sample indices
            if path.parent != self._root and path.parent.is_dir() and not any(path.parent.iterdir()):
                path.parent.rmdir()
            del self._registry[key]
            self._state.pop(key, None)
            if self._active == key:
                self._active = None
        return data_pb2.DatasetDeleted(name=msg.name, version=msg.version, bytes_freed=freed)

    def open_stream(self, msg: data_pb2.OpenStream, payload: object = None) -> data_pb2.DatasetReady:
        """Mount ``msg.mount`` and activate ``msg.split`` in the prefetcher (which reads it
        and hands it on before this returns). The other parts of ``msg`` are commands for the
        other L4 modules; the loop sends those to them directly.

        Raises:
            InvalidConfig: split not "train"/"val". Plus those of :meth:`mount_dataset`,
            and whatever the prefetcher raises while reading.
        """
        if msg.split not in SPLITS:
            raise InvalidConfig(f"open_stream.split: must be 'train' or 'val', got {msg.split!r}")
        ready, manifest, path, verified = self._mount(
            msg.mount.name, msg.mount.version, msg.mount.verify, split=msg.split
        )
        label, indices = f"{ready.name}@{ready.version}", index_root(self._root, ready.name, ready.version)
        remote = None
        if self._remote is not None and path.is_relative_to(self._root / REMOTE_DIR):
            remote = self._remote.token_file(ready.name, ready.version, manifest, msg.split)
        store = _token_store(path, manifest, msg.split, label, ready.tokenizer, indices, remote, verified)
        self._activate_source(data_pb2.ActivateSource(name=ready.name, version=ready.version, split=msg.split), store)
        return ready

    # ---- private ----------------------------------------------------------------------

    def _mount(
        self, name: str, version: str, verify: bool, split: str = ""
    ) -> tuple[data_pb2.DatasetReady, dict, Path, mf.FileIdentity | None]:
        """Find and check a version; with ``split`` (a stream's open, local versions), also
        that split's shards by their digests (``manifest.verify_shard``: hashed once per
        process while unchanged), returning the token file's identity checked (else None)."""
        key, label = (name, version), f"{name}@{version}"
        with self._lock:
            self._scan()
            path = self._registry.get(key)
            have = ", ".join(f"{n}@{v}" for n, v in sorted(self._registry)) or f"none under {self._root}"
        try:
            mounted = None
            if path is None and self._remote is not None:
                mounted = self._remote.mount(name, version, verify=verify)
                if mounted is None:
                    where = self._remote.where(name, version)
                    raise DatasetNotFound(f"dataset {label} not found here (have: {have}) nor at {where}")
            if path is None and mounted is None:
                # Where it was looked for, for the event L1-3 reports: a version removed under a
                # running job (its next stream, e.g. an evaluation's, mounts it again) names the
                # directory that went. (The refusal's own line, a typo's too, stays as it was.)
                missing = DatasetNotFound(f"dataset {label} not found (have: {have})")
                missing.path = str(self._root / name / version)
                raise missing
            if mounted is not None:  # checked by the remote mount (small files hashed, sizes)
                path, manifest = mounted
            else:
                manifest = mf.read(path, label)
                mf.verify_files(path, manifest, label, hashes=verify)
            if (manifest.get("name"), manifest.get("version")) != key:
                raise DatasetCorrupt(
                    f"dataset {label}: {mf.MANIFEST} names {manifest.get('name')}@{manifest.get('version')}"
                )
            verified = None
            if split and mounted is None:  # (a remote split's token object: its size, at mount)
                entry = manifest["splits"][split]
                mf.verify_shard(
                    path / entry["index_file"], entry["index_file"], _sha(manifest, entry["index_file"]), label
                )
                tokens = entry["tokens_file"]
                verified = mf.verify_shard(path / tokens, tokens, _sha(manifest, tokens), label)
        except (DatasetNotFound, DatasetCorrupt) as e:
            with self._lock:
                if path is not None:
                    self._state[key] = "corrupt"
            reason = f"{e}: {e.path} does not exist" if getattr(e, "path", "") else str(e)
            self._emit(
                data_pb2.DatasetUnavailable(name=name, version=version, reason=reason, failure=_failure(e, reason))
            )
            e.failure_reported = True  # (this is the module's failure event for it: the bus sends no second)
            raise
        with self._lock:
            self._state[key] = "ready"
            self._active = key
        return _ready(name, version, path, manifest), manifest, path, verified

    def _scan(self) -> None:
        """Refresh the registry from the directory tree (caller holds the lock or is __init__)."""
        found: dict[tuple[str, str], Path] = {}
        if self._root.is_dir():
            for name_dir in self._root.iterdir():
                if name_dir.name.startswith(".") or not name_dir.is_dir():
                    continue
                for version_dir in name_dir.iterdir():
                    if not version_dir.name.startswith(".") and (version_dir / mf.MANIFEST).is_file():
                        found[(name_dir.name, version_dir.name)] = version_dir
        self._registry = found
        for key in found:
            self._state.setdefault(key, "registered")


def _sha(manifest: dict, name: str) -> str:
    """The SHA-256 the manifest pins ``name`` to (a file it does not list: DatasetCorrupt)."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise DatasetCorrupt(f"dataset {manifest.get('name')}@{manifest.get('version')}: {name}: not in the manifest")
    return entry["sha256"]


def _ready(name: str, version: str, path: Path, manifest: dict) -> data_pb2.DatasetReady:
    splits = manifest["splits"]
    tokenizer = manifest["tokenizer"]
    return data_pb2.DatasetReady(
        name=name,
        version=version,
        manifest_sha256=manifest["manifest_sha256"],
        train_documents=splits["train"]["documents"],
        train_tokens=splits["train"]["tokens"],
        val_documents=splits["val"]["documents"],
        val_tokens=splits["val"]["tokens"],
        tokenizer=tokenizer if tokenizer == "bytes" else str(path / tokenizer),
        vocab_size=manifest["vocab_size"],
        source=manifest.get("source", ""),
        created_unix=manifest.get("created_unix", 0.0),
    )


def index_root(root: Path, name: str, version: str) -> Path:
    """Where a version's sample indices live: next to it, outside its immutable directory
    (``sample_index.py``)."""
    return root / INDEX_DIR / name / version


_CHECK = 1 << 20  # bounds checked a million at a time (bounded memory)


def _token_store(
    path: Path,
    manifest: dict,
    split: str,
    label: str,
    tokenizer: str,
    indices: Path,
    remote: CachedFile | None,
    verified: mf.FileIdentity | None = None,
) -> TokenStore:
    """Load a split's document index and check it against its token file's size (a remote
    one's: the manifest's, which its mount checked against the object's).

    Raises:
        DatasetCorrupt: the index is unreadable or does not describe the token file.
    """
    entry = manifest["splits"][split]
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    tokens_path = path / entry["tokens_file"]
    index = entry["index_file"]
    try:
        # Mapped, one mapping shared by the process's streams: no stream holds a copy.
        bounds, fresh = mapped(path / index)
    except (OSError, ValueError) as e:
        raise DatasetCorrupt(f"dataset {label}: {index}: unreadable ({e})") from None
    size = remote.file.size if remote is not None else tokens_path.stat().st_size
    ok = (
        bounds.ndim == 1
        and bounds.dtype == np.int64
        and len(bounds) == entry["documents"] + 1
        and bounds[0] == 0
        and int(bounds[-1]) * dtype.itemsize == size
        # (the whole index in chunks, once per mapping: a mapping is dropped if it fails)
        and (
            not fresh
            or all(bool(np.all(np.diff(bounds[i : i + _CHECK + 1]) >= 0)) for i in range(0, len(bounds), _CHECK))
        )
    )
    if not ok:
        forget(path / index)
        raise DatasetCorrupt(f"dataset {label}: {index}: does not describe {entry['tokens_file']} ({size} bytes)")
    return TokenStore(
        label, split, tokens_path, dtype, bounds, tokenizer, manifest["manifest_sha256"], indices, remote,
        tokens_sha256=_sha(manifest, entry["tokens_file"]) if verified is not None else "", verified=verified,
    )  # fmt: skip
