"""A version's directory appears whole or not at all.

Files are written into a hidden temp dir beside the target (``root/<name>/.<version>.tmp-*``;
the data service skips names starting with a dot), fsynced, and the dir is renamed onto
``root/<name>/<version>`` at the end. A failure removes the temp dir, and the ``root`` and
``root/<name>`` directories if this preparation created them, so bad input leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from services.data import manifest as mf
from services.data.errors import DatasetCorrupt, VersionConflict


class VersionDir:
    """``with VersionDir(root, name, version) as v:`` write into ``v.tmp``, then
    ``v.commit(manifest)``; leaving the block without a commit removes what was written."""

    def __init__(self, root: Path, name: str, version: str):
        self._parent = Path(root) / name
        self._target = self._parent / version
        self._label = f"{name}@{version}"
        self._version = version
        self._made = [p for p in (Path(root), self._parent) if not p.exists()]
        self.tmp: Path | None = None

    def __enter__(self) -> VersionDir:
        self._parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self._version}.tmp-", dir=self._parent))
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it private; a version is readable by all
        return self

    def write(self, name: str, data: bytes) -> None:
        """Write the small file ``name`` into the temp dir, fsynced (the splits' big files
        are written by ``split_files.py``)."""
        assert self.tmp is not None
        _write(self.tmp / name, data)

    def commit(self, manifest: dict) -> tuple[Path, bool]:
        """Write the manifest and rename the temp dir into place. -> (path, created):
        ``created`` False when the version already exists with the same content.

        Raises:
            VersionConflict: the version exists with different content.
        """
        assert self.tmp is not None
        self._made = []  # from here on the parents stay, whatever happens
        if self._target.exists():
            return self._same_or_conflict(manifest), False
        _write(self.tmp / mf.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")
        _fsync_dir(self.tmp)
        try:
            os.rename(self.tmp, self._target)  # atomic; fails if another writer got there first
        except OSError:
            if not self._target.exists():
                raise
            return self._same_or_conflict(manifest), False
        self.tmp = None
        _fsync_dir(self._parent)
        return self._target, True

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        for made in reversed(self._made):  # innermost first; only if still empty
            try:
                made.rmdir()
            except OSError:
                pass

    def _same_or_conflict(self, manifest: dict) -> Path:
        try:
            existing = mf.read(self._target, self._label)
        except DatasetCorrupt as e:
            raise VersionConflict(f"{e}; refusing to overwrite an existing version") from None
        if existing["content_sha256"] != manifest["content_sha256"]:
            raise VersionConflict(
                f"dataset {self._label} already exists with different content (content "
                f"{existing['content_sha256'][:12]}…, new {manifest['content_sha256'][:12]}…); "
                f"versions are immutable, prepare a new version"
            )
        return self._target


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
