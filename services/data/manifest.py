"""A dataset version's ``manifest.json``: how it is sealed (``prepare.py``) and checked
(``dataset_versions.py``).

Two hashes, both SHA-256 of canonical JSON (sorted keys, no spaces, UTF-8):

* ``content_sha256`` covers what a reader gets: the format, the tokenizer kind, the vocab
  size, the token dtype and every file's name, size and SHA-256. Two preparations with the
  same content hash are the same dataset, whatever their source path or time.
* ``manifest_sha256`` covers the whole manifest except itself, so an edited manifest (a
  file hash patched to match a changed file) is caught too.
"""

from __future__ import annotations

import hashlib
import json
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
