"""A job's profiles on the store's disk (issue 31 item 3, `surgectl profile`): each rank's
files of one ProfileSteps in ``<root>/metrics/<job>/profiles/cmd<seq>/`` beside the job's
metrics, so `surgectl profile` (and anyone with the store's directory) finds them by the
command's number. An upload is staged in ``metrics/.incoming/`` and moved into place whole, so a
reader never sees half a file; one over :data:`MAX_BYTES_ENV` is refused and removed.

Settings (store environment, README "Environment"): ``SURGE_STORE_PROFILE_MAX_BYTES``
(default 2 GiB per rank's upload).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from services.contract import store_pb2
from services.store.metric_files import JOB_ID

MAX_BYTES_ENV = "SURGE_STORE_PROFILE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
# The only file names a rank sends (services/engine/step_profiler.py): no directory, no other kind.
FILE_NAME = re.compile(r"^rank\d{1,6}\.(trace\.json\.gz|memory\.pickle)$")


class ProfileRefused(ValueError):
    """An upload that breaks the rules (a file name, the size bound, a job id): nothing kept."""


def max_bytes_from_env() -> int:
    raw = os.environ.get(MAX_BYTES_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_MAX_BYTES
    except ValueError:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: must be a whole number of bytes") from None
    if value <= 0:
        raise ValueError(f"{MAX_BYTES_ENV}={raw!r}: must be positive")
    return value


class ProfileFiles:
    """Stage an upload (:meth:`receive`) and keep it (:meth:`keep`). Thread-safe: each upload
    has its own staging directory."""

    def __init__(self, root: Path, max_bytes: int | None = None):
        self._root = Path(root)
        self._metrics = self._root / "metrics"
        self._incoming = self._metrics / ".incoming"
        self._max = max_bytes if max_bytes is not None else max_bytes_from_env()

    def receive(self, header: store_pb2.StoreProfile, parts: Iterable[store_pb2.ProfileUpload]) -> dict[str, str]:
        """Write the stream's files to a new staging directory; returns {name: staged path}.

        Raises:
            ProfileRefused: a bad job id or file name, or more than the size bound (the staged
                files are removed).
        """
        _check_job(header.job_id)
        self._incoming.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{header.job_id}-{header.seq}-{header.rank}-", dir=self._incoming))
        files: dict[str, str] = {}
        total = 0
        try:
            for part in parts:
                if part.HasField("header"):
                    raise ProfileRefused("PutProfile: a second header inside the stream")
                if not FILE_NAME.match(part.name):
                    raise ProfileRefused(f"PutProfile: file name {part.name!r}: must match {FILE_NAME.pattern}")
                total += len(part.data)
                if total > self._max:
                    raise ProfileRefused(
                        f"PutProfile: the upload is over {self._max} bytes ({MAX_BYTES_ENV}); nothing was kept"
                    )
                path = staging / part.name
                with path.open("ab") as f:
                    f.write(part.data)
                files[part.name] = str(path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if not files:
            shutil.rmtree(staging, ignore_errors=True)
        return files

    def keep(self, msg: store_pb2.StoreProfile, staged: Mapping[str, str]) -> tuple[list[str], int]:
        """Move the staged files into the job's ``profiles/cmd<seq>/`` (a file of the same
        name there, from an earlier try of the same rank, is replaced); returns their paths
        relative to the store's root and their bytes."""
        _check_job(msg.job_id)
        out = self._metrics / msg.job_id / "profiles" / f"cmd{msg.seq}"
        out.mkdir(parents=True, exist_ok=True)
        kept, total = [], 0
        for name, path in sorted(staged.items()):
            if not FILE_NAME.match(name):
                raise ProfileRefused(f"StoreProfile: file name {name!r}: must match {FILE_NAME.pattern}")
            target = out / name
            os.replace(path, target)  # (same filesystem: the staging directory is under metrics/)
            kept.append(str(target.relative_to(self._root)))
            total += target.stat().st_size
        self.discard(staged)
        return kept, total

    def discard(self, staged: Mapping[str, str]) -> None:
        """Remove an upload's staging directory (and whatever of it was not kept)."""
        for path in {Path(p).parent for p in staged.values()}:
            if path.parent == self._incoming:  # (only a staging directory of this store's)
                shutil.rmtree(path, ignore_errors=True)


def _check_job(job_id: str) -> None:
    if not JOB_ID.match(job_id):
        raise ProfileRefused(f'profile: job_id "{job_id}": must match {JOB_ID.pattern}')
