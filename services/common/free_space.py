"""How much a file written into memory (tmpfs, ``/dev/shm``) can still take: the filesystem's
free space (``statvfs``) and, where this process's cgroup (v2) bounds its memory, the room
left under that bound (tmpfs pages are charged to the cgroup of the process that writes them,
and cannot be reclaimed without swap: past the bound the kernel's OOM killer ends a process
instead of the write failing). Used before an in-memory checkpoint copy is written
(services/rank/memory_client.py) and shown by `surgectl submit --dry-run`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from services.common.sizes import human_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Room:
    """Bytes a write into memory at ``path`` can take: the least of ``free_bytes`` (statvfs)
    and ``cgroup_bytes`` (None: no cgroup bound read)."""

    path: str
    free_bytes: int
    cgroup_bytes: int | None = None

    @property
    def bytes(self) -> int:
        return self.free_bytes if self.cgroup_bytes is None else min(self.free_bytes, self.cgroup_bytes)

    def describe(self) -> str:
        """One line for people, e.g. ``1.5 GiB free in /dev/shm (cgroup memory: 900.0 MiB left)``."""
        text = f"{human_bytes(self.free_bytes)} free in {self.path}"
        if self.cgroup_bytes is not None:
            text += f" (cgroup memory: {human_bytes(self.cgroup_bytes)} left)"
        return text


def room(path: str | Path, cgroup_root: Path = CGROUP_ROOT) -> Room | None:
    """The room at ``path`` (None: ``path`` cannot be asked). Never raises."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return Room(str(path), st.f_bavail * st.f_frsize, cgroup_headroom(cgroup_root))


def cgroup_headroom(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The memory this process's cgroup may still take: ``memory.max - memory.current``
    (cgroup v2), or ``memory.limit_in_bytes - memory.usage_in_bytes`` (v1: the cgroup's
    directory, else the hierarchy's root as a container sees it); None when unbounded or
    not readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if line.startswith("0::"):
            found = _headroom(root / rel.strip().lstrip("/"), "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            v1 = root / "memory"
            found = _headroom(v1 / rel.strip().lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes")
            if found is None:
                found = _headroom(v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        if found is not None:
            return found
    return None


def _headroom(where: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        limit = (where / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= _UNBOUNDED:
            return None
        return max(0, int(limit) - int((where / usage_file).read_text().strip()))
    except (OSError, ValueError):
        return None


_UNBOUNDED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1
