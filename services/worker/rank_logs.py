"""Rank log files with a size bound: the node agent writes each rank's output (stdout and
stderr, one pipe) to ``<run_dir>/logs/<job>.rank<R>.log``, rotated at a size.

* :class:`RankLog`: one rank process's log. The file is rotated by
  ``logging.handlers.RotatingFileHandler`` (the standard library's rotation: at
  ``max_bytes`` the file becomes ``.log.1``, ``.log.1`` becomes ``.log.2``, ..., and the
  oldest beyond ``backups`` is removed), between whole lines, so one rank's log bytes stay
  within ``(backups + 1) x max_bytes`` (plus at most one line). It records the byte spans it
  wrote by file identity (inode, start, end), which a rename keeps: a log tail
  (``log_tail.py``) finds every line this process wrote, across rotations, each once. It
  measures its rate: over a window of ``FLOOD_WINDOW_SECONDS``, faster than
  ``flood_bytes_per_s`` calls ``on_flood`` once (the agent states ``RankLogFlood``).
* :class:`LogPump`: one thread of the agent reads every rank's pipe (a selector: no thread per
  rank) and hands complete lines to that rank's :class:`RankLog`; at the end of a pipe (the
  process and every helper holding it ended) it writes the last partial line and closes the
  log.

Why a pipe and not the file as the rank's stdout: only a writer that sees every byte can
rotate between lines without losing any (``copytruncate`` loses what is written between
the copy and the truncation) and measure a rate without sampling the file. The pipe's
buffer is raised to ``PIPE_BYTES`` so a rank does not wait on a busy agent.

Settings (node agent environment, README "Environment"): ``SURGE_WORKER_RANK_LOG_MAX_BYTES``
(default 64 MiB; 0: never rotated), ``SURGE_WORKER_RANK_LOG_BACKUPS`` (default 3),
``SURGE_WORKER_RANK_LOG_FLOOD_BYTES_PER_S`` (default 1 MiB/s; 0: no warning) over
``SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S`` (default 10 s).
"""

from __future__ import annotations

import fcntl
import logging
import logging.handlers
import os
import re
import selectors
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.rotated_files import rotated_paths  # noqa: F401 - re-exported for the tail

MAX_BYTES_ENV = "SURGE_WORKER_RANK_LOG_MAX_BYTES"
BACKUPS_ENV = "SURGE_WORKER_RANK_LOG_BACKUPS"
FLOOD_ENV = "SURGE_WORKER_RANK_LOG_FLOOD_BYTES_PER_S"
FLOOD_WINDOW_ENV = "SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S"
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_BACKUPS = 3
# A healthy rank logs a few lines a step (~1 KiB/s); 1 MiB/s sustained fills a 64 MiB file
# in about a minute, so its older lines go within minutes: worth one warning.
DEFAULT_FLOOD_BYTES_PER_S = 1 << 20
FLOOD_WINDOW_SECONDS = 10.0  # the rate is measured over this much time (bursts within it are no flood)
READ_BYTES = 1 << 20  # the most read from one pipe at once
DRAIN_BYTES = 8 << 20  # the most a finish reads from a pipe before ending it
PIPE_BYTES = 1 << 20  # F_SETPIPE_SZ: a rank's output the pipe holds while the agent is busy
_LINES = re.compile(rb"[^\n]*\n|[^\n]+")  # each line with its newline; a last one without
_F_SETPIPE_SZ = 1031  # (Linux; fcntl has no name for it before Python 3.10 on every build)


@dataclass(frozen=True)
class LogSettings:
    """Rotation and flood bound of every rank log of one node agent.

    Raises:
        ValueError: a negative value (names the environment variable).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    backups: int = DEFAULT_BACKUPS
    flood_bytes_per_s: float = DEFAULT_FLOOD_BYTES_PER_S
    flood_window_s: float = FLOOD_WINDOW_SECONDS

    def __post_init__(self) -> None:
        for name, value in ((MAX_BYTES_ENV, self.max_bytes), (BACKUPS_ENV, self.backups)):
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if not self.flood_bytes_per_s >= 0:
            raise ValueError(f"{FLOOD_ENV}: must be >= 0, got {self.flood_bytes_per_s}")
        if not self.flood_window_s > 0:
            raise ValueError(f"rank log flood window: must be > 0 seconds, got {self.flood_window_s}")


def env_problem(env: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with this module's environment variables (one line), or None; the node
    agent refuses to start on it."""
    env = os.environ if env is None else env
    for name in (MAX_BYTES_ENV, BACKUPS_ENV, FLOOD_ENV):
        text = env.get(name, "").strip()
        if text and not text.isdigit():
            return f"{name}: expected a whole number >= 0, got {text!r}"
    window = env.get(FLOOD_WINDOW_ENV, "").strip()
    try:
        if window and not float(window) > 0:
            raise ValueError
    except ValueError:
        return f"{FLOOD_WINDOW_ENV}: expected seconds > 0, got {window!r}"
    return None


def settings_from_env(env: Mapping[str, str] | None = None) -> LogSettings:
    """The node agent's :class:`LogSettings` (checked by :func:`env_problem` first)."""
    env = os.environ if env is None else env

    def number(name: str, default: int) -> int:
        text = env.get(name, "").strip()
        return int(text) if text else default

    return LogSettings(
        max_bytes=number(MAX_BYTES_ENV, DEFAULT_MAX_BYTES),
        backups=number(BACKUPS_ENV, DEFAULT_BACKUPS),
        flood_bytes_per_s=number(FLOOD_ENV, DEFAULT_FLOOD_BYTES_PER_S),
        flood_window_s=float(env.get(FLOOD_WINDOW_ENV, "").strip() or FLOOD_WINDOW_SECONDS),
    )


class _Rotating(logging.handlers.RotatingFileHandler):
    """The standard library's rotation, with the size counted in bytes (records here are
    bytes decoded losslessly: ``surrogateescape``), no rollover of an empty file, and a
    hook after each rollover (the spans move to the new file)."""

    def __init__(self, path: Path, settings: LogSettings, rolled: Callable[[int], None], failed: Callable[[], None]):
        super().__init__(
            path,
            mode="a",
            maxBytes=settings.max_bytes,
            backupCount=settings.backups,
            encoding="utf-8",
            errors="surrogateescape",
        )
        self.terminator = ""  # records are whole lines with their newlines
        self._rolled = rolled
        self._failed = failed

    def shouldRollover(self, record: logging.LogRecord) -> bool:  # noqa: N802 (logging's name)
        if self.maxBytes <= 0 or self.stream is None:
            return False
        pos = self.stream.tell()
        return pos > 0 and pos + record.nbytes > self.maxBytes  # type: ignore[attr-defined]

    def doRollover(self) -> None:  # noqa: N802
        try:
            self.stream.flush()
            size = os.fstat(self.stream.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            size = 0
        super().doRollover()
        self._rolled(size)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802
        self._failed()  # (a full disk under the logs: the agent says so once, not per line)


class RankLog:
    """The log file of one rank process, written by the agent (:class:`LogPump`).

    Args:
        path: ``<run_dir>/logs/<job>.rank<R>.log`` (appended: every process of the rank
            writes the same file, each its own spans).
        settings: rotation and flood bound.
        on_flood: called once (from the pump's thread) with the rate in bytes/s when a
            window's rate exceeds ``settings.flood_bytes_per_s``; must not block.
        log: a structlog logger (the agent's), for a log file that cannot be written.
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        path: Path,
        settings: LogSettings,
        on_flood: Callable[[float], None] | None = None,
        log: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.settings = settings
        self._on_flood = on_flood
        self._log = log
        self._clock = clock
        self._lock = threading.Lock()
        self._spans: list[list] = []  # [inode, start, end or None], in the order written
        self._write_failed = False
        self._handler = _Rotating(path, settings, self._rolled, self._failed)
        self._open_span()
        self.closed = threading.Event()
        self.flooded = False
        self.bytes_written = 0
        self._window_start = clock()
        self._window_bytes = 0

    def spans(self) -> list[tuple[int, int, int | None]]:
        """The byte spans this process's output occupies, ``(inode, start, end)`` (``end``
        None: being written), in order. A span in a file rotated out of ``backups`` is gone."""
        with self._lock:
            return [tuple(s) for s in self._spans]  # type: ignore[misc]

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines, except a process's last partial one), rotating
        first when it would pass the size bound. Never raises."""
        if not data or self.closed.is_set():
            return
        with self._lock:
            for piece in self._pieces(data):
                record = logging.LogRecord(
                    "rank", logging.INFO, "", 0, piece.decode("utf-8", "surrogateescape"), None, None
                )
                record.nbytes = len(piece)  # type: ignore[attr-defined]
                self._handler.handle(record)
            self.bytes_written += len(data)
            self._window_bytes += len(data)
        self._measure()

    def _pieces(self, data: bytes) -> list[bytes]:
        """``data`` cut between lines into pieces that each fit one file: the first what is
        left of the current file, the others a whole file (a line longer than a file alone).
        The handler rotates before a piece that does not fit; so a file never passes the
        bound except by one line longer than it."""
        limit = self.settings.max_bytes
        stream = self._handler.stream
        room = limit - (stream.tell() if stream is not None else 0)
        if limit <= 0 or len(data) <= room:
            return [data]
        pieces: list[bytes] = []
        piece: list[bytes] = []
        size = 0
        for line in _LINES.findall(data):
            if size + len(line) > room:
                if piece:
                    pieces.append(b"".join(piece))
                piece, size, room = [], 0, limit
            piece.append(line)
            size += len(line)
        if piece:
            pieces.append(b"".join(piece))
        return pieces

    def close(self) -> None:
        """No more output: end the last span. Idempotent. The last window, cut short, is
        measured over a whole window's time (a burst before an exit is named, a rate is never
        overestimated)."""
        if not self.closed.is_set():
            self._measure(final=True)
        with self._lock:
            if self.closed.is_set():
                return
            end = self._size()
            if self._spans and self._spans[-1][2] is None:
                self._spans[-1][2] = max(end, self._spans[-1][1])
            self._handler.close()
            self.closed.set()

    def _measure(self, final: bool = False) -> None:
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.settings.flood_window_s and not final:
            return
        rate = self._window_bytes / max(elapsed, self.settings.flood_window_s)
        self._window_start, self._window_bytes = now, 0
        limit = self.settings.flood_bytes_per_s
        if limit > 0 and rate > limit and not self.flooded:
            self.flooded = True  # once per process: the warning names it, the rotation bounds it
            if self._on_flood is not None:
                self._on_flood(rate)

    def _size(self) -> int:
        """The size of the file being written (all of it: another writer may have appended)."""
        stream = self._handler.stream
        try:
            stream.flush()
            return os.fstat(stream.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            return 0

    def _open_span(self) -> None:
        stream = self._handler.stream
        try:
            ino = os.fstat(stream.fileno()).st_ino
        except (OSError, ValueError, AttributeError):
            return
        self._spans.append([ino, self._size(), None])

    def _rolled(self, old_size: int) -> None:
        """(Lock held, from the handler.) The file this process wrote became ``.log.1``:
        its span there ends at ``old_size``; the next begins at 0 in the new file."""
        if self._spans and self._spans[-1][2] is None:
            self._spans[-1][2] = old_size
        self._open_span()

    def _failed(self) -> None:
        if not self._write_failed and self._log is not None:
            self._log.error("rank log not written", path=str(self.path))
        self._write_failed = True


class LogPump:
    """Reads every rank's output pipe on one thread and writes it to its :class:`RankLog`.

    Args:
        log: a structlog logger.
    """

    def __init__(self, log: Any = None):
        self._log = log
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._sinks: dict[int, RankLog] = {}  # read end -> its log
        self._partial: dict[int, bytearray] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._finishing: set[int] = set()  # read ends to drain and end (finish)
        self._thread = threading.Thread(target=self._run, name="rank-log-pump", daemon=True)
        self._thread.start()

    def pipe(self) -> tuple[int, int]:
        """A new pipe for a process's output: (read end for :meth:`attach`, write end for
        the child's stdout and stderr; the caller closes it once the child has it)."""
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # (over /proc/sys/fs/pipe-max-size for this user: the default 64 KiB)
        return r, w

    def attach(self, fd: int, sink: RankLog) -> None:
        """Write what arrives on read end ``fd`` to ``sink``; the pump closes ``fd`` and
        ``sink`` at the pipe's end."""
        os.set_blocking(fd, False)  # (a drain reads until the pipe is empty: finish)
        with self._lock:
            self._sinks[fd] = sink
            self._partial[fd] = bytearray()
            self._selector.register(fd, selectors.EVENT_READ)
        self._wake()

    def finish(self, sink: RankLog) -> None:
        """End ``sink``'s pipe now, on the pump's thread: what the pipe holds is written
        first, then the log is closed (its process ended, but a helper that left its
        process group still holds the pipe open). Does not wait: ``sink.closed`` tells."""
        with self._lock:
            self._finishing.update(fd for fd, s in self._sinks.items() if s is sink)
        self._wake()

    def close(self) -> None:
        """Stop reading (the agent is stopping): every log is closed."""
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # (full: a wake-up is pending anyway)

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                fd = key.fd
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                    continue
                try:
                    data = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    continue  # (drained by a finish meanwhile)
                except OSError:
                    data = b""
                self._deliver(fd, data)
            with self._lock:
                finishing, self._finishing = self._finishing, set()
                if self._closed:
                    finishing = set(self._sinks)
            for fd in finishing:
                self._drain(fd)
            if self._closed:  # (with no pipe left open too: else close() waited out its join)
                return

    def _drain(self, fd: int) -> None:
        """What ``fd`` holds now (at most ``DRAIN_BYTES``: a helper may go on writing), then
        its end."""
        taken = 0
        while taken < DRAIN_BYTES:
            try:
                data = os.read(fd, READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                break
            taken += len(data)
            self._deliver(fd, data)
        self._deliver(fd, b"")

    def _deliver(self, fd: int, data: bytes) -> None:
        """Whole lines of ``data`` to ``fd``'s sink; at the end (``data`` empty), its rest and
        the end of the pipe."""
        with self._lock:
            sink = self._sinks.get(fd)
            partial = self._partial.get(fd)
            if sink is None or partial is None:
                return
            if data and not sink.closed.is_set():
                partial += data
                cut = partial.rfind(b"\n") + 1
                # (a line longer than a read is written in pieces: the bound holds)
                if not cut and len(partial) >= READ_BYTES:
                    cut = len(partial)
                chunk = bytes(partial[:cut])
                del partial[:cut]
                end = False
            else:  # the pipe's end, or a sink closed under it (helpers still hold the pipe)
                chunk = bytes(partial)
                del self._sinks[fd], self._partial[fd]
                self._selector.unregister(fd)
                os.close(fd)
                end = True
        sink.write(chunk)
        if end:
            sink.close()
