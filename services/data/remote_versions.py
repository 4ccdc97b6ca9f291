"""Dataset versions kept in object storage (``--remote s3://bucket/prefix``), as
``surgectl dataset push`` leaves them: ``<url>/<name>/<version>/`` holding the version's
files, ``manifest.json`` written last.

Mounting one fetches its manifest and checks it as a local one is (its own hash, its format,
the name it gives), then downloads the small files whole (the document bounds ``.npy``, the
tokenizer) into ``<data_root>/.remote/<name>/<version>/``, each checked against the
manifest's SHA-256 before it is renamed into place (so that directory never holds a file the
manifest does not vouch for). The token files are never downloaded: their size is checked
against the object's and they are read through the process's :class:`BlockCache`.

A local version of the same ``name@version`` wins: the remote one is not consulted (versions
are immutable on both sides and ``push`` refuses different content under one name, so a
local copy is the same data, read without the network).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from services.data import manifest as mf
from services.data.block_cache import BlockCache, CachedFile, RemoteFile
from services.data.errors import DataReadError, DatasetCorrupt

REMOTE_DIR = ".remote"  # under the data root: the small files of mounted remote versions


class RemoteVersions:
    """The versions under one object-storage URL, mounted through ``blocks``. Thread-safe."""

    def __init__(self, url: str, root: Path, blocks: BlockCache, endpoint_url: str = ""):
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.blocks = blocks
        self._fs, base = url_to_fs(self.url, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
        self._base = base.rstrip("/")
        self._local = Path(root) / REMOTE_DIR
        self._lock = threading.Lock()  # one download of a version's small files at a time

    def check(self) -> None:
        """The storage answers a listing (at start-up: a wrong URL or endpoint is one line).

        Raises:
            DataReadError: it does not.
        """
        try:
            self._fs.ls(self._base)
        except Exception as e:  # noqa: BLE001 - s3fs's OSErrors and botocore's own
            raise DataReadError(f"{self.url}: cannot list ({type(e).__name__}: {e})") from None

    def versions(self) -> list[tuple[str, str]]:
        """Every ``(name, version)`` with a manifest under the URL (one listing)."""
        self._fs.invalidate_cache()  # s3fs keeps listings; a version pushed since must show
        try:
            found = self._fs.glob(f"{self._base}/*/*/{mf.MANIFEST}")
        except Exception as e:  # noqa: BLE001 - as in check()
            raise DataReadError(f"{self.url}: cannot list ({type(e).__name__}: {e})") from None
        out = []
        for path in found:
            name, version = path[len(self._base) + 1 :].split("/")[:2]
            out.append((name, version))
        return sorted(out)

    def manifest(self, name: str, version: str) -> dict | None:
        """``name@version``'s manifest, self-checked (nothing else fetched: a listing), or
        None when the URL holds no such version.

        Raises:
            DatasetCorrupt: it does not check.
            DataReadError: the storage does not answer.
        """
        raw = self._manifest_bytes(name, version)
        if raw is None:
            return None
        with tempfile.TemporaryDirectory(prefix="manifest-") as tmp:
            (Path(tmp) / mf.MANIFEST).write_bytes(raw)
            return mf.read(Path(tmp), f"{name}@{version} at {self.where(name, version)}")

    def local_dir(self, name: str, version: str) -> Path:
        """Where a mounted version's small files are kept."""
        return self._local / name / version

    def where(self, name: str, version: str) -> str:
        return f"{self.url}/{name}/{version}"

    def mount(self, name: str, version: str, *, verify: bool) -> tuple[Path, dict] | None:
        """Fetch and check ``name@version``'s manifest and small files. -> (the local
        directory holding them, the manifest), or None when the URL holds no such version.
        ``verify``: hash the small files already cached again (downloads are always hashed).

        Raises:
            DatasetCorrupt: the manifest or a file does not check, or a token object's size
                differs from the manifest's.
            DataReadError: the storage does not answer.
        """
        label, remote = f"{name}@{version}", f"{self._base}/{name}/{version}"
        at = f"{label} at {self.where(name, version)}"
        raw = self._manifest_bytes(name, version)
        if raw is None:
            return None
        local = self.local_dir(name, version)
        with self._lock:
            manifest = self._small_files(remote, local, raw, at, verify)
        for split in manifest["splits"].values():
            entry = manifest["files"][split["tokens_file"]]
            try:
                size = self._fs.size(f"{remote}/{split['tokens_file']}")
            except FileNotFoundError:
                raise DatasetCorrupt(f"dataset {at}: {split['tokens_file']}: missing") from None
            except Exception as e:  # noqa: BLE001 - as in check()
                raise DataReadError(f"{self.where(name, version)}: cannot read ({type(e).__name__}: {e})") from None
            if size != entry["bytes"]:
                raise DatasetCorrupt(
                    f"dataset {at}: {split['tokens_file']}: size mismatch "
                    f"(manifest {entry['bytes']} bytes, object {size} bytes)"
                )
        return local, manifest

    def token_file(self, name: str, version: str, manifest: dict, split: str) -> CachedFile:
        """The split's token object, read through the block cache."""
        fname = manifest["splits"][split]["tokens_file"]
        entry = manifest["files"][fname]
        return CachedFile(
            self.blocks,
            RemoteFile(
                self._fs,
                f"{self._base}/{name}/{version}/{fname}",
                entry["bytes"],
                entry["sha256"],
                f"{self.where(name, version)}/{fname}",
            ),
        )

    # ---- private ----------------------------------------------------------------------

    def _manifest_bytes(self, name: str, version: str) -> bytes | None:
        try:
            return self._fs.cat_file(f"{self._base}/{name}/{version}/{mf.MANIFEST}")
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - as in check()
            raise DataReadError(f"{self.where(name, version)}: cannot read ({type(e).__name__}: {e})") from None

    def _small_files(self, remote: str, local: Path, raw: bytes, at: str, verify: bool) -> dict:
        """Bring ``local`` up to the manifest ``raw`` (caller holds the lock). -> the manifest."""
        local.mkdir(parents=True, exist_ok=True)
        held = local / mf.MANIFEST
        if not held.is_file() or held.read_bytes() != raw:
            # A first mount, or the version was deleted and pushed again: start afresh.
            shutil.rmtree(local)
            local.mkdir(parents=True)
            (local / (mf.MANIFEST + ".part")).write_bytes(raw)
            os.replace(local / (mf.MANIFEST + ".part"), local / mf.MANIFEST)
        manifest = mf.read(local, at)
        tokens = {split["tokens_file"] for split in manifest["splits"].values()}
        for fname, entry in sorted(manifest["files"].items()):
            if fname in tokens:
                continue
            path = local / fname
            if path.is_file() and path.stat().st_size == entry["bytes"] and not verify:
                continue  # hashed when it came
            if path.is_file() and path.stat().st_size == entry["bytes"] and mf.sha256_file(path) == entry["sha256"]:
                continue
            part = local / (fname + ".part")
            try:
                self._fs.get_file(f"{remote}/{fname}", str(part))
            except FileNotFoundError:
                raise DatasetCorrupt(f"dataset {at}: {fname}: missing") from None
            except Exception as e:  # noqa: BLE001 - as in check()
                part.unlink(missing_ok=True)
                raise DataReadError(f"{at}: {fname}: cannot read ({type(e).__name__}: {e})") from None
            actual = mf.sha256_file(part)
            if part.stat().st_size != entry["bytes"] or actual != entry["sha256"]:
                part.unlink()
                raise DatasetCorrupt(
                    f"dataset {at}: {fname}: sha256 mismatch (manifest {entry['sha256'][:12]}…, object {actual[:12]}…)"
                )
            os.replace(part, path)
        return manifest
