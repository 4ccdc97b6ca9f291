"""L4-1 dataset version manager (数据集版本管理器): versions, paths, hash checks, mounting.

It owns the registry of prepared versions under the data root (a version is the directory
``root/<name>/<version>/``, see ``prepare.py``), rescanned at start-up and on every command
so a version prepared while the service runs is found. It never reads, filters, shuffles
or packs samples, and never decides the read-ahead: mounting a split hands the prefetcher
a :class:`TokenStore` (paths and the document index), nothing more.

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

from services.contract import data_pb2
from services.contract.bus import CommandPort, Emitter
from services.data import manifest as mf
from services.data.documents import TokenStore
from services.data.errors import DatasetCorrupt, DatasetInUse, DatasetNotFound, InvalidConfig

SPLITS = ("train", "val")


class DatasetVersions:
    """Registry and mounting of dataset versions under ``root``. Thread-safe."""

    def __init__(self, root: Path, emit: Emitter, activate_source: CommandPort):
        self._root = Path(root)
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
        ready, _, _ = self._mount(msg.name, msg.version, msg.verify)
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
        ready, manifest, path = self._mount(msg.mount.name, msg.mount.version, msg.mount.verify)
        store = _token_store(path, manifest, msg.split, f"{ready.name}@{ready.version}", ready.tokenizer)
        self._activate_source(data_pb2.ActivateSource(name=ready.name, version=ready.version, split=msg.split), store)
        return ready

    # ---- private ----------------------------------------------------------------------

    def _mount(self, name: str, version: str, verify: bool) -> tuple[data_pb2.DatasetReady, dict, Path]:
        key, label = (name, version), f"{name}@{version}"
        with self._lock:
            self._scan()
            path = self._registry.get(key)
            have = ", ".join(f"{n}@{v}" for n, v in sorted(self._registry)) or f"none under {self._root}"
        try:
            if path is None:
                raise DatasetNotFound(f"dataset {label} not found (have: {have})")
            manifest = mf.read(path, label)
            mf.verify_files(path, manifest, label, hashes=verify)
            if (manifest.get("name"), manifest.get("version")) != key:
                raise DatasetCorrupt(
                    f"dataset {label}: {mf.MANIFEST} names {manifest.get('name')}@{manifest.get('version')}"
                )
        except (DatasetNotFound, DatasetCorrupt) as e:
            with self._lock:
                if path is not None:
                    self._state[key] = "corrupt"
            self._emit(data_pb2.DatasetUnavailable(name=name, version=version, reason=str(e)))
            raise
        with self._lock:
            self._state[key] = "ready"
            self._active = key
        return _ready(name, version, path, manifest), manifest, path

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


# np.load parses the .npy header with ast.literal_eval, and CPython 3.11's AST constructor is
# not safe when two threads compile at once ("SystemError: AST constructor recursion depth
# mismatch", python/cpython#106905): two ranks opening their eval streams together hit it.
_NPY_HEADER_LOCK = threading.Lock()


def _token_store(path: Path, manifest: dict, split: str, label: str, tokenizer: str) -> TokenStore:
    """Load a split's document index and check it against its token file's size.

    Raises:
        DatasetCorrupt: the index is unreadable or does not describe the token file.
    """
    entry = manifest["splits"][split]
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    tokens_path = path / entry["tokens_file"]
    index = entry["index_file"]
    try:
        with _NPY_HEADER_LOCK:
            bounds = np.load(path / index, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DatasetCorrupt(f"dataset {label}: {index}: unreadable ({e})") from None
    size = tokens_path.stat().st_size
    ok = (
        bounds.ndim == 1
        and bounds.dtype == np.int64
        and len(bounds) == entry["documents"] + 1
        and bounds[0] == 0
        and bool(np.all(np.diff(bounds) >= 0))
        and int(bounds[-1]) * dtype.itemsize == size
    )
    if not ok:
        raise DatasetCorrupt(f"dataset {label}: {index}: does not describe {entry['tokens_file']} ({size} bytes)")
    return TokenStore(label, split, tokens_path, dtype, bounds, tokenizer)
