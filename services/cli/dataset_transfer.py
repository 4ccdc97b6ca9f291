"""``surgectl dataset push`` / ``pull``: a prepared version to and from S3-compatible storage.

A version is its directory's files under ``<url>/<name>/<version>/`` (``s3://bucket/prefix``
through fsspec's s3fs, the client the store's checkpoint chunks use; credentials from the
standard ``AWS_*`` variables). ``manifest.json`` is uploaded last, so a version whose upload
was cut short has no manifest and is not one. A pull downloads into a temp dir beside the
target, checks every file's size and SHA-256 against the manifest, and renames it into place
(``prepare.version_dir``), so the data root never holds half a version. Versions are
immutable on both sides: the same content again is a no-op, different content is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from services.cli.errors import CliError
from services.data import manifest as mf
from services.data.errors import DataError
from services.data.prepare.version_dir import VersionDir

_DATASET = re.compile(r"^(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*)@(?P<version>[A-Za-z0-9_][A-Za-z0-9_.-]*)$")


def push(root: Path, ref: str, url: str, endpoint_url: str = "") -> str:
    """Upload ``name@version`` from ``root`` to ``url``. -> the line to print.

    Raises:
        CliError: a bad reference or URL, a version missing or corrupt here, a different
            version of that name already there, or the storage refusing (one line).
    """
    name, version = _ref(ref)
    local = Path(root) / name / version
    label = f"{name}@{version}"
    try:
        manifest = mf.read(local, label)
        mf.verify_files(local, manifest, label, hashes=False)  # sizes: hashes are checked at pull
    except DataError as e:
        raise CliError(" ".join(str(e).split()) + f" (under {root})") from None
    fs, base = _fs(url, endpoint_url)
    remote = f"{base}/{name}/{version}"
    try:
        if fs.exists(f"{remote}/{mf.MANIFEST}"):
            there = json.loads(fs.cat_file(f"{remote}/{mf.MANIFEST}"))
            if there.get("content_sha256") != manifest["content_sha256"]:
                raise CliError(
                    f"{url.rstrip('/')}/{name}/{version} already holds another {label} (content "
                    f"{str(there.get('content_sha256'))[:12]}…, here {manifest['content_sha256'][:12]}…); "
                    "versions are immutable"
                )
            return f"{label} is already at {url.rstrip('/')}/{name}/{version}, unchanged"
        total = 0
        for fname, entry in sorted(manifest["files"].items()):
            fs.put_file(str(local / fname), f"{remote}/{fname}")
            total += entry["bytes"]
        fs.put_file(str(local / mf.MANIFEST), f"{remote}/{mf.MANIFEST}")  # last: the version is whole
    except CliError:
        raise
    except Exception as e:  # s3fs's OSErrors, and botocore's own (no credentials, a bad endpoint)
        raise CliError(f"{url}: cannot write ({type(e).__name__}: {e})") from None
    return f"pushed {label} to {url.rstrip('/')}/{name}/{version} ({len(manifest['files']) + 1} files, {total:,} bytes)"


def pull(root: Path, ref: str, url: str, endpoint_url: str = "") -> str:
    """Download ``name@version`` from ``url`` into ``root``, verified. -> the line to print.

    Raises:
        CliError: a bad reference or URL, no such version there, a file that does not match
            the manifest, or a different version of that name already here (one line);
            nothing is left under ``root`` then.
    """
    name, version = _ref(ref)
    label = f"{name}@{version}"
    fs, base = _fs(url, endpoint_url)
    remote = f"{base}/{name}/{version}"
    where = f"{url.rstrip('/')}/{name}/{version}"
    try:
        with VersionDir(root, name, version) as out:
            try:
                fs.get_file(f"{remote}/{mf.MANIFEST}", str(out.tmp / mf.MANIFEST))
            except FileNotFoundError:
                raise CliError(f"{where}: no {mf.MANIFEST} (not a pushed version)", code=2) from None
            manifest = mf.read(out.tmp, label)
            for fname in sorted(manifest["files"]):
                fs.get_file(f"{remote}/{fname}", str(out.tmp / fname))
            mf.verify_files(out.tmp, manifest, f"{label} at {where}", hashes=True)
            path, created = out.commit(manifest)
    except DataError as e:
        raise CliError(" ".join(str(e).split())) from None
    except FileNotFoundError as e:
        raise CliError(f"{where}: {Path(str(e.filename or e)).name}: missing") from None
    except CliError:
        raise
    except Exception as e:  # s3fs's OSErrors, and botocore's own (no credentials, a bad endpoint)
        raise CliError(f"{url}: cannot read ({type(e).__name__}: {e})") from None
    if not created:
        return f"{label} is already at {path}, unchanged"
    size = sum(entry["bytes"] for entry in manifest["files"].values())
    return f"pulled {label} from {where} to {path} ({size:,} bytes, every file's SHA-256 checked)"


def _ref(ref: str) -> tuple[str, str]:
    m = _DATASET.match(ref)
    if m is None:
        raise CliError(f"DATASET: expected 'name@version' (see `surgectl dataset list`), got {ref!r}", code=2)
    return m["name"], m["version"]


def _fs(url: str, endpoint_url: str):
    if not url.startswith("s3://") or len(url.rstrip("/")) <= len("s3://"):
        raise CliError(f"URL: expected s3://BUCKET[/PREFIX], got {url!r}", code=2)
    from fsspec.core import url_to_fs

    fs, base = url_to_fs(url.rstrip("/"), **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    return fs, base.rstrip("/")
