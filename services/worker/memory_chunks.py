"""Where a node agent's in-memory checkpoint copies live (services/worker/memory_copies.py):
one file per chunk in a shared-memory directory of the agent process (tmpfs), or bytes in
the process without one; the directory's life (made fresh at start, those of dead agents
removed); the two environment variables that configure the copies.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from services.common.pids import pid_alive

LIMIT_ENV = "SURGE_WORKER_MEMORY_COPY_BYTES"
SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "surge-memory-"
SHM_ENV = "SURGE_WORKER_MEMORY_COPY_SHM"  # "off": chunks as bytes in the agent's process


def env_problem() -> str | None:
    """What is wrong with this module's two environment variables (one line), or None; the
    node agent refuses to start on it, before anything runs."""
    limit = os.environ.get(LIMIT_ENV, "")
    if limit and not limit.isdigit():
        return f"{LIMIT_ENV}: expected a whole number of bytes >= 0 (0: no in-memory copies), got {limit!r}"
    if os.environ.get(SHM_ENV, "").strip().lower() not in ("", "on", "off"):
        return f"{SHM_ENV}: expected on or off, got {os.environ[SHM_ENV]!r}"
    return None


def limit_from_env(meminfo_total_bytes: int) -> int:
    """The memory bound: ``SURGE_WORKER_MEMORY_COPY_BYTES`` (0: off), else a quarter of the
    host's memory. (Checked by :func:`env_problem` at start-up.)"""
    text = os.environ.get(LIMIT_ENV)
    if text:
        return int(text)
    return meminfo_total_bytes // 4


def shm_from_env(worker_id: str) -> Path | None:
    """The shared-memory directory of this agent (None: ``SURGE_WORKER_MEMORY_COPY_SHM=off``,
    or no writable ``/dev/shm``)."""
    if os.environ.get(SHM_ENV, "").strip().lower() == "off":
        return None
    return shared_memory_dir(worker_id)


class ChunkHolder:
    """Where held chunks live: one file per chunk in a shared-memory directory (tmpfs, the
    same host memory) that this node's ranks may read directly, or, without one, bytes in
    this process. Files are written once (temp name, rename) and never changed; a freed
    chunk's file is unlinked (a reader that opened it keeps its bytes). Not thread-safe:
    the owner's lock guards it."""

    def __init__(self, shm_dir: Path | None):
        self.dir = shm_dir
        self._sizes: dict[str, int] = {}
        self._bytes: dict[str, bytes] = {}

    def __contains__(self, sha: str) -> bool:
        return sha in self._sizes

    def size(self, sha: str) -> int:
        return self._sizes[sha]

    def put(self, sha: str, data: bytes) -> None:
        if self.dir is None:
            self._bytes[sha] = data
        else:
            tmp = self.dir / f".{sha}.tmp"
            try:
                tmp.write_bytes(data)
                os.replace(tmp, self.dir / sha)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
        self._sizes[sha] = len(data)

    def get(self, sha: str) -> bytes | None:
        if sha not in self._sizes:
            return None
        if self.dir is None:
            return self._bytes[sha]
        try:
            return (self.dir / sha).read_bytes()
        except FileNotFoundError:
            return None

    def adopt(self, sha: str, src: Path) -> int:
        """Take a chunk file written by a local rank (a rename within shared memory)."""
        assert self.dir is not None
        n = src.stat().st_size
        os.replace(src, self.dir / sha)
        self._sizes[sha] = n
        return n

    def path(self, sha: str) -> str:
        return str(self.dir / sha) if self.dir is not None and sha in self._sizes else ""

    def free(self, sha: str) -> int:
        n = self._sizes.pop(sha, 0)
        if self.dir is None:
            self._bytes.pop(sha, None)
        else:
            (self.dir / sha).unlink(missing_ok=True)
        return n


def shared_memory_dir(worker_id: str, root: Path = SHM_ROOT) -> Path | None:
    """A fresh directory of this agent process under ``root`` (``/dev/shm``), after removing
    those of agent processes no longer alive (a SIGKILLed agent leaves its own); None when
    ``root`` is not a writable directory."""
    if not root.is_dir() or not os.access(root, os.W_OK):
        return None
    remove_dead_dirs(root)
    safe = "".join(ch if ch.isalnum() or ch in "._" else "_" for ch in worker_id)
    path = root / f"{SHM_PREFIX}{safe}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o755)
    return path


def remove_dead_dirs(root: Path = SHM_ROOT) -> list[Path]:
    """Remove the shared-memory directories of agent processes no longer alive (a SIGKILLed
    agent leaves its own); the next agent to start, and `surgectl down`, call it. Returns
    what was removed."""
    removed = []
    for old in root.glob(f"{SHM_PREFIX}*"):
        pid = old.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed
