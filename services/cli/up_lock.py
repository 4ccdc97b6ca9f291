"""One `surgectl up` at a time per SURGE_HOME: an advisory lock (``fcntl.flock``) on
``$SURGE_HOME/run/up.lock``, held for the whole command, the holder's pid written in it.

Why a lock and not a pid file: two `up`s started 0.3 s apart both read ``stack.json``; the
second found the first's half-written stack (store and data, no worker yet) and said "the
running stack has 0 workers, not 3 (`surgectl down` then ...)", advice that would stop the
stack the first was starting. The kernel drops a ``flock`` when its holder exits, however it
exits (Ctrl-C's ``os._exit``, SIGKILL), so a held lock is a live `up`: no stale pid to judge.
The descriptor is close-on-exec: the services `up` spawns never hold it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from services.cli.errors import CliError
from services.common import paths


def lock_path():
    return paths.run_dir() / "up.lock"


class UpInProgress(CliError):
    """Another `surgectl up` holds the lock (``pid``: its pid as it wrote it, 0 when not yet
    written). Exit 1: the state, not the input, refuses; run again once it has finished."""

    def __init__(self, pid: int, command: str):
        who = f"pid {pid}" if pid else "its pid not written yet"
        super().__init__(
            f"a `surgectl up` ({who}) is starting this stack now; {command} changed nothing: "
            "`surgectl status` once it has finished (Ctrl-C in that `up` stops what it started)",
            code=1,
        )
        self.pid = pid


def _holder(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0


@contextmanager
def held(command: str = "this `up`") -> Iterator[None]:
    """Hold the lock for the block (an `up`), or raise ``UpInProgress`` at once if another
    process holds it. The caller has checked that ``run_dir()`` is writable.

    Raises:
        UpInProgress: an `up` of this SURGE_HOME runs (its pid in the message).
    """
    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UpInProgress(_holder(fd), command) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # (releases the lock; the file stays: unlinking it would race a waiter's open)


def check_none(command: str) -> None:
    """Raise ``UpInProgress`` when an `up` of this SURGE_HOME runs now (`down`, `restart`: acting
    on a stack another process is starting would stop or double what it starts); take
    nothing. No run directory: no `up` ever ran here."""
    path = lock_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UpInProgress(_holder(fd), command) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
