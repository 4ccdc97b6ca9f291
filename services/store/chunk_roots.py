"""Where L5-1 keeps a job's content-addressed chunks: the store's own disk, or an object store.

Part of the checkpoint manager (L5-1): ``checkpoint_manager/`` decides what a chunk is for
(which epoch, which version references it, when it is garbage); a chunk root only says where
the bytes of ``<job>/chunks/<epoch>/<sha[:2]>/<sha>`` live and reads, sizes, hashes and
removes them. Two kinds:

* :class:`LocalChunks`: ``<store root>/checkpoints/<job>/chunks/...`` on the store's disk
  (ranks write there themselves under ``TRANSFER_PATH``, the store writes what they stream
  under ``TRANSFER_STREAM``).
* :class:`FsspecChunks`: the same layout under an fsspec URL, e.g.
  ``s3://bucket/prefix/<job>/chunks/...`` (``s3fs``); ranks write and read the objects
  themselves (``TRANSFER_FSSPEC``). An object store has no directories and no rename: a chunk
  object is written whole by one PUT under its final name (its name is its SHA-256, so a
  chunk that exists is the chunk), an epoch "exists" while it holds an object.

Nothing here decides anything; every method may raise ``OSError`` (``FileNotFoundError``
for a chunk that is not there).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

_READ_BYTES = 1 << 20
CHUNKS_DIR = "chunks"


class LocalChunks:
    """Chunks under ``<checkpoints dir>/<job>/chunks/<epoch>/<sha[:2]>/<sha>``."""

    remote = False

    def __init__(self, checkpoints_dir: Path):
        self._dir = Path(checkpoints_dir)

    def job_root(self, job: str) -> Path:
        return self._dir / job / CHUNKS_DIR

    def location(self, job: str, epoch: int) -> str:
        """What a rank (TRANSFER_PATH) or a reader is told: the epoch's directory."""
        return str(self.job_root(job) / str(epoch))

    def epoch_dir(self, job: str, epoch: int) -> Path:
        return self.job_root(job) / str(epoch)

    def epoch_exists(self, job: str, epoch: int) -> bool:
        return self.epoch_dir(job, epoch).is_dir()

    def epochs(self, job: str) -> list[int]:
        root = self.job_root(job)
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []

    def sizes(self, job: str, epoch: int) -> dict[str, int]:
        """sha -> bytes of every chunk of the epoch (temp files of unfinished writes excluded)."""
        out: dict[str, int] = {}
        root = self.epoch_dir(job, epoch)
        if not root.is_dir():
            return out
        for sub in os.scandir(root):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in os.scandir(sub.path):
                if len(f.name) == 64 and not f.name.startswith("."):
                    out[f.name] = f.stat().st_size
        return out

    def hash(self, job: str, epoch: int, sha: str) -> tuple[int, str]:
        """(bytes, SHA-256) of a chunk as stored. Raises FileNotFoundError."""
        return _hash_stream(open(self.epoch_dir(job, epoch) / sha[:2] / sha, "rb"))

    def read(self, job: str, epoch: int, sha: str) -> bytes:
        with open(self.epoch_dir(job, epoch) / sha[:2] / sha, "rb") as f:
            return f.read()

    def remove_epoch(self, job: str, epoch: int) -> tuple[int, int]:
        """Remove the epoch's directory whole. Returns (files, bytes) removed."""
        root = self.epoch_dir(job, epoch)
        found = [p.stat().st_size for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
        shutil.rmtree(root, ignore_errors=True)
        return len(found), sum(found)

    def files(self, job: str, epoch: int) -> dict[str, int]:
        """Every file of the epoch as ``<sha[:2]>/<name>`` -> bytes: its chunks and the temp
        files of writes not finished (a killed writer's)."""
        root = self.epoch_dir(job, epoch)
        if not root.is_dir():
            return {}
        return {
            f"{sub.name}/{f.name}": f.stat().st_size
            for sub in os.scandir(root)
            if sub.is_dir()
            for f in os.scandir(sub.path)
        }

    def remove(self, job: str, epoch: int, names: list[str]) -> int:
        """Remove files of the epoch named as :meth:`files` names them; a sub-directory left
        empty goes too. Returns files removed."""
        root = self.epoch_dir(job, epoch)
        removed = 0
        for name in names:
            try:
                (root / name).unlink()
            except FileNotFoundError:
                continue
            removed += 1
        for sub in {name.split("/", 1)[0] for name in names}:
            try:
                (root / sub).rmdir()
            except OSError:  # not empty (or gone)
                pass
        return removed

    def tree_bytes(self, job: str) -> int:
        root = self.job_root(job)
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


class FsspecChunks:
    """Chunks under ``<url>/<job>/chunks/<epoch>/<sha[:2]>/<sha>`` of an fsspec filesystem
    (``s3://bucket/prefix`` through s3fs). ``options``: the filesystem's options for the
    store itself (``endpoint_url``, credentials; s3fs also reads the standard AWS_* variables).
    ``endpoint_url`` is what ranks are told (never a credential)."""

    remote = True

    def __init__(self, url: str, options: dict[str, Any] | None = None, endpoint_url: str = ""):
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.endpoint_url = endpoint_url
        opts = dict(options or {})
        if endpoint_url and "endpoint_url" not in opts:
            opts["endpoint_url"] = endpoint_url
        self.fs, self._base = url_to_fs(self.url, **opts)
        self._base = self._base.rstrip("/")
        self._protocol = self.url.split("://", 1)[0] if "://" in self.url else ""

    def check(self) -> None:
        """Raise unless the bucket (the URL's first component) can be listed now: a store
        refuses to start on an object store it cannot use, rather than at the first save."""
        bucket = self._base.split("/", 1)[0]
        if not self.fs.exists(bucket):
            raise FileNotFoundError(f"{self._protocol}://{bucket}: no such bucket")
        self.fs.ls(bucket, refresh=True)

    def _path(self, job: str, epoch: int | None = None, sha: str = "") -> str:
        p = f"{self._base}/{job}/{CHUNKS_DIR}"
        if epoch is not None:
            p += f"/{epoch}"
        if sha:
            p += f"/{sha[:2]}/{sha}"
        return p

    def location(self, job: str, epoch: int) -> str:
        return f"{self.url}/{job}/{CHUNKS_DIR}/{epoch}"

    def epoch_exists(self, job: str, epoch: int) -> bool:
        return bool(self.sizes(job, epoch))

    def epochs(self, job: str) -> list[int]:
        try:
            names = self.fs.ls(self._path(job), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(
            int(n.rstrip("/").rsplit("/", 1)[-1]) for n in names if n.rstrip("/").rsplit("/", 1)[-1].isdigit()
        )

    def sizes(self, job: str, epoch: int) -> dict[str, int]:
        self.fs.invalidate_cache()  # a listing, not s3fs's cached one: ranks write meanwhile
        try:
            found = self.fs.find(self._path(job, epoch), detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for path, info in found.items():
            name = path.rsplit("/", 1)[-1]
            if len(name) == 64:
                out[name] = int(info.get("size") or 0)
        return out

    def hash(self, job: str, epoch: int, sha: str) -> tuple[int, str]:
        # One GET of the whole object (a chunk is small): no cached size or ETag of an earlier
        # listing is trusted, so an object replaced since is hashed as it is now.
        data = self.fs.cat_file(self._path(job, epoch, sha))
        return len(data), hashlib.sha256(data).hexdigest()

    def read(self, job: str, epoch: int, sha: str) -> bytes:
        return self.fs.cat_file(self._path(job, epoch, sha))

    def remove_epoch(self, job: str, epoch: int) -> tuple[int, int]:
        found = self.sizes(job, epoch)
        if found:
            self.fs.rm([self._path(job, epoch, sha) for sha in found])
        return len(found), sum(found.values())

    def files(self, job: str, epoch: int) -> dict[str, int]:
        """Every chunk object of the epoch as ``<sha[:2]>/<sha>`` -> bytes (an object is whole
        or absent: no temp files)."""
        return {f"{sha[:2]}/{sha}": n for sha, n in self.sizes(job, epoch).items()}

    def remove(self, job: str, epoch: int, names: list[str]) -> int:
        if names:
            self.fs.rm([self._path(job, epoch, n.rsplit("/", 1)[-1]) for n in names])
        return len(names)

    def tree_bytes(self, job: str) -> int:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self._path(job), detail=True, withdirs=False)
        except FileNotFoundError:
            return 0
        return sum(int(i.get("size") or 0) for i in found.values())


def _hash_stream(f) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with f:
        while block := f.read(_READ_BYTES):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()
