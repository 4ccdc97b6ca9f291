"""One `surgectl up` at a time per SURGE_HOME, and never beside a `down`: an advisory lock
(``fcntl.flock``) on ``$SURGE_HOME/run/up.lock``, held for the whole command, the holder's pid and
command written in it. `up` holds it exclusively; `down` shared (two `down`s may overlap, as
before); `restart` only checks that neither runs.

Why a lock and not a pid file: two `up`s started 0.3 s apart both read ``stack.json``; the
second found the first's half-written stack (store and data, no worker yet) and said "the
running stack has 0 workers, not 3 (`surgectl down` then ...)", advice that would stop the
stack the first was starting. The kernel drops a ``flock`` when its holder exits, however it
exits (Ctrl-C's ``os._exit``, SIGKILL), so a held lock is a live command: no stale pid to judge.
The descriptor is close-on-exec: the services `up` spawns never hold it.

Why `down` holds it too (an operator's trial, session 41): an `up` run while a `down` drained
undid the drain (the job went on), left that `down` waiting out its whole 300 s drain deadline,
and, started as the `down` stopped the services, left a second control running on the same
journal after the `down` removed stack.json (the next `up` started another beside it).
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
    """Another `surgectl up` (or a `down`) holds the lock (``pid``: its pid as it wrote it, 0
    when not yet written). Exit 1: the state, not the input, refuses; run again once it has
    finished."""

    def __init__(self, pid: int, command: str, holder: str = "up"):
        who = f"pid {pid}" if pid else "its pid not written yet"
        holder = holder if holder in _SAID else "up"
        doing, then = _SAID[holder]
        super().__init__(
            f"a `surgectl {holder}` ({who}) is {doing} this stack now; {command} changed nothing: {then}",
            code=1,
        )
        self.pid, self.holder = pid, holder


# What the lock's holder is doing, and what to do meanwhile, by its command
_SAID = {
    "up": ("starting", "`surgectl status` once it has finished (Ctrl-C in that `up` stops what it started)"),
    "down": (
        "stopping",
        "run it again once that `down` has finished (Ctrl-C in that `down` while it drains leaves the stack running)",
    ),
}


def _holder(fd: int) -> tuple[int, str]:
    """(pid, command) as the holder wrote them (``"<pid> <command>"``; 0 and "up" when not yet)."""
    try:
        pid, _, command = os.pread(fd, 64, 0).decode().strip().partition(" ")
        return int(pid or 0), command or "up"
    except (OSError, ValueError):
        return 0, "up"


@contextmanager
def held(command: str = "this `up`", name: str = "up") -> Iterator[None]:
    """Hold the lock for the block: exclusively for an `up`, shared for a `down` (``name``);
    or raise ``UpInProgress`` at once if a command it may not run beside holds it. The caller
    has checked that ``run_dir()`` is writable (a `down` with no run directory has nothing to
    stop: it holds nothing).

    Raises:
        UpInProgress: an `up` (or, for an `up`, a `down`) of this SURGE_HOME runs (its pid in
            the message).
    """
    path = lock_path()
    if name == "down" and not path.parent.is_dir():
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        if name != "down":
            raise
        yield  # (a run directory it cannot write: a `down` still stops what it can)
        return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if name == "down" else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, holder = _holder(fd)
            raise UpInProgress(pid, command, holder) from None
        mine = f"{os.getpid()} {name}\n".encode()
        os.pwrite(fd, mine, 0)  # (then cut to it: a reader never sees the file empty)
        os.ftruncate(fd, len(mine))
        yield
    finally:
        os.close(fd)  # (releases the lock; the file stays: unlinking it would race a waiter's open)


def _running() -> tuple[int, str] | None:
    """(pid, command) of an `up` or a `down` of this SURGE_HOME holding the lock now (any
    process), else None; takes nothing. No run directory: no `up` ever ran here."""
    try:
        fd = os.open(lock_path(), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_none(command: str) -> None:
    """Raise ``UpInProgress`` when an `up` or a `down` of this SURGE_HOME runs now (`restart`:
    a copy of a service `up` starts or `down` stops); take nothing."""
    if (running := _running()) is not None:
        raise UpInProgress(running[0], command, running[1])


def other_command() -> tuple[int, str] | None:
    """(pid, "up" | "down") of another process's `up` or `down` of this SURGE_HOME running now,
    else None (what an unreachable service's hint names first: it is being started or stopped)."""
    running = _running()
    return None if running is None or running[0] == os.getpid() else running
