"""A dataset version's ``manifest.json``: how it is sealed (``prepare/``) and checked
(``dataset_versions.py``).

Two hashes, both SHA-256 of canonical JSON (sorted keys, no spaces, UTF-8):

* ``content_sha256`` covers what a reader gets: the format, the tokenizer kind, the vocab
  size, the token dtype and every file's name, size and SHA-256. Two preparations with the
  same content hash are the same dataset, whatever their source path or time.
* ``manifest_sha256`` covers the whole manifest except itself, so an edited manifest (a
  file hash patched to match a changed file) is caught too.

A version is pinned by its files' SHA-256 (issue 29 item 7): a shard (a split's token file,
its index) is hashed when a stream first opens it in this process (:func:`verify_shard`)
and then only stat'ed: its identity (device, inode, size, mtime, ctime) is remembered with
the digest its bytes had. A read that finds the identity changed (a rewrite in place or a
new file renamed over it: ctime moves whatever mtime says) hashes the file again, and a
digest other than the manifest's is :class:`DatasetCorrupt` naming the version and the shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from services.data.errors import DatasetCorrupt

FORMAT = "surge-dataset/1"
MANIFEST = "manifest.json"
_CHUNK = 4 << 20  # bytes per read while hashing: large enough that hashlib drops the GIL


def canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def content_sha256(manifest: dict) -> str:
    keys = ("format", "tokenizer_kind", "vocab_size", "dtype", "files")
    return sha256_bytes(canonical({k: manifest[k] for k in keys}))


def seal(manifest: dict) -> dict:
    """Return ``manifest`` with ``content_sha256`` and ``manifest_sha256`` filled in."""
    out = {k: v for k, v in manifest.items() if k not in ("content_sha256", "manifest_sha256")}
    out["content_sha256"] = content_sha256(out)
    out["manifest_sha256"] = sha256_bytes(canonical(out))
    return out


def read(directory: Path, label: str) -> dict:
    """Read and self-check ``directory/manifest.json`` (cheap: no data file is opened).

    Raises:
        DatasetCorrupt: missing or unparsable manifest, or its own hash does not match.
    """
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        claimed = manifest["manifest_sha256"]
        body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    except FileNotFoundError:
        raise DatasetCorrupt(f"dataset {label}: {MANIFEST}: missing") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DatasetCorrupt(f"dataset {label}: {MANIFEST}: unreadable ({type(e).__name__}: {e})") from None
    actual = sha256_bytes(canonical(body))
    if actual != claimed:
        raise DatasetCorrupt(
            f"dataset {label}: {MANIFEST}: sha256 mismatch (recorded {claimed[:12]}…, content {actual[:12]}…)"
        )
    if manifest.get("format") != FORMAT:
        raise DatasetCorrupt(f"dataset {label}: {MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify_files(directory: Path, manifest: dict, label: str, *, hashes: bool) -> None:
    """Check every file the manifest lists: present and of the recorded size; with
    ``hashes``, also the SHA-256 of its bytes (stdlib dataset: ~60 MB, ~0.2 s).

    Raises:
        DatasetCorrupt: first mismatch, e.g. ``dataset stdlib@v1: train.bin: sha256
            mismatch (manifest ab12cd34ef56…, file 9f3c0a1b2c3d…)``.
    """
    for name, entry in sorted(manifest["files"].items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DatasetCorrupt(f"dataset {label}: {name}: missing") from None
        if size != entry["bytes"]:
            raise DatasetCorrupt(
                f"dataset {label}: {name}: size mismatch (manifest {entry['bytes']} bytes, file {size} bytes)"
            )
        if hashes:
            actual = sha256_file(path)
            if actual != entry["sha256"]:
                raise DatasetCorrupt(
                    f"dataset {label}: {name}: sha256 mismatch (manifest {entry['sha256'][:12]}…, file {actual[:12]}…)"
                )


@dataclass(frozen=True)
class FileIdentity:
    """What a stat says of a file's bytes without reading them: a write in place moves
    ``mtime_ns`` and ``ctime_ns`` (ctime cannot be set back by ``touch``), a file renamed
    over it has another ``ino``."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def identity(path: Path) -> FileIdentity:
    """``path``'s identity (raises ``OSError``, e.g. ``FileNotFoundError``, as ``os.stat``)."""
    st = os.stat(path)
    return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# (path, identity) -> the SHA-256 its bytes had when hashed: process-wide, so every stream of a
# version (each rank's, each epoch's, a resume's) hashes a shard once while it is unchanged.
_digests: dict[tuple[str, FileIdentity], str] = {}
_hashing: dict[str, threading.Lock] = {}  # one hash of a path at a time (streams open together)
_lock = threading.Lock()


def verify_shard(path: Path, name: str, sha256: str, label: str) -> FileIdentity:
    """Check that ``path`` (the version's file ``name``) holds the bytes the manifest pinned
    (``sha256``): hashed the first time this process sees it with this identity, a stat
    after (cost: docs/LOG.md, "shard digest check"). Returns the identity checked.

    Raises:
        DatasetCorrupt: ``dataset stdlib@v1: shard train.bin changed since it was prepared
            (sha256 9f3c0a1b2c3d…, manifest ab12cd34ef56…)``, or the file is missing.
    """
    try:
        with _lock:
            hashing = _hashing.setdefault(str(path), threading.Lock())
        with hashing:
            ident = identity(path)
            actual = _digests.get((str(path), ident))
            if actual is None:
                actual = sha256_file(path)
                if identity(path) == ident:  # (written while hashed: hashed again next time)
                    with _lock:
                        _digests[(str(path), ident)] = actual
    except FileNotFoundError:
        raise DatasetCorrupt(f"dataset {label}: shard {name}: missing ({path})") from None
    if actual != sha256:
        raise DatasetCorrupt(
            f"dataset {label}: shard {name} changed since it was prepared "
            f"(sha256 {actual[:12]}…, manifest {sha256[:12]}…)"
        )
    return ident
