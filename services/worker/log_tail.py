"""Rank log tails (operator log plumbing for ``StreamLogs``, asked for by control with
``WorkerCommand{tail_rank_logs}``): the job's rank log lines on this node go up as
``RankLogLines`` batches, then with ``follow`` the lines appended later, ending with
``RankLogLines{done}``.

One thread per request reads the files. A followed file is re-read after a short wait when
empty: appends to a file notify nobody.

A rank's log is rotated at a size (``rank_logs.py``): ``<job>.rank<R>.log.N`` .. ``.log.1``
hold its older lines. Each launch's spans name their file by inode (a rename keeps it), so a
tail reads every span this agent's launches wrote, oldest first, in whichever file it lies
now, and follows the span being written into the next file when the log rotates under it.
A span in a file rotated out of the kept backups is gone: skipped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.rotated_files import rotated_paths
from services.contract import control_pb2
from services.worker.control_link import Emit
from services.worker.rank_process import safe_file_name

# The wait after an empty read of a followed log file, and the most lines in one
# RankLogLines.
TAIL_INTERVAL_SECONDS = 0.2
TAIL_BATCH_LINES = 500


class LogTailer:
    """The log tails of one node agent, by request id.

    Args:
        logs_dir: where rank logs are written (``<job>.rank<R>.log``).
        emit: queues one ``WorkerEvent`` for control; must not block.
        log: a structlog logger.
        spans: job id -> rank -> the byte spans ``(inode, start, end)`` of that rank's log
            files that this agent's launches of it wrote, in order (``end`` None: still
            being written). A rank's file is appended by every process of that rank; agents
            that share one run dir (the local stack) each send only their own spans, so a
            rank that moved from one to another has each line sent once.
        alive: (job id, rank) -> whether that rank process still runs here.
    """

    def __init__(
        self,
        logs_dir: Path,
        emit: Emit,
        log: Any,
        spans: Callable[[str], dict[int, list[tuple[int, int | None]]]],
        alive: Callable[[str, int], bool],
    ):
        self._logs_dir = logs_dir
        self._emit = emit
        self._log = log
        self._spans = spans
        self._alive = alive
        self._lock = threading.Lock()
        self._tails: dict[str, threading.Event] = {}  # request id -> stop flag of a log tail

    def tail(self, msg: control_pb2.TailRankLogs) -> None:
        """Operator log plumbing (StreamLogs): send up the lines of this job's rank log
        files on this node (``msg.rank`` only, unless -1) as ``RankLogLines`` batches, then
        with ``follow`` the lines appended later, until each rank process has exited and its
        file is drained (or :meth:`stop`); a final ``RankLogLines{done}`` ends it.
        Does not block: one thread per request reads the files."""
        stop = threading.Event()
        with self._lock:
            self._tails[msg.request_id] = stop
        threading.Thread(
            target=self._tail, args=(msg, stop), name=f"tail-{msg.job_id}-{msg.request_id[:8]}", daemon=True
        ).start()

    def stop(self, msg: control_pb2.StopTailing) -> None:
        """The StreamLogs caller went away: end that tail (its ``done`` still goes up)."""
        with self._lock:
            stop = self._tails.get(msg.request_id)
        if stop is not None:
            stop.set()

    def log_files(self, job_id: str, rank: int = -1) -> dict[int, Path]:
        """rank -> ``<run_dir>/logs/<job>.rank<R>.log`` of the ranks of ``job_id`` this
        agent launched (one rank unless ``rank`` is -1)."""
        prefix = f"{safe_file_name(job_id)}.rank"
        ours = set(self._spans(job_id))
        found: dict[int, Path] = {}
        if self._logs_dir.is_dir():
            for f in self._logs_dir.iterdir():
                digits = (
                    f.name[len(prefix) : -len(".log")] if f.name.startswith(prefix) and f.name.endswith(".log") else ""
                )
                if digits.isdigit() and int(digits) in ours and (rank < 0 or int(digits) == rank):
                    found[int(digits)] = f
        return dict(sorted(found.items()))

    def _tail(self, msg: control_pb2.TailRankLogs, stop: threading.Event) -> None:
        """Tail thread of one TailRankLogs request."""
        readers = {rank: _SpanReader(path) for rank, path in self.log_files(msg.job_id, msg.rank).items()}
        partials = {rank: bytearray() for rank in readers}
        try:
            while readers and not stop.is_set():
                grew = False
                for rank in list(readers):
                    reader, partial = readers[rank], partials[rank]
                    # Asked before reading (and before the spans, whose end is set before
                    # the exit is): a line written before the exit is not missed.
                    alive = msg.follow and self._alive(msg.job_id, rank)
                    chunk, boundary = reader.read(self._spans(msg.job_id).get(rank, []))
                    if boundary:  # a span ended (another process's lines may follow): its last line ended
                        self._flush(msg, rank, partial)
                    if chunk:
                        grew = True
                        partial += chunk
                        *complete, rest = bytes(partial).split(b"\n")
                        partial[:] = rest
                        self._send_lines(msg, rank, [c.decode(errors="replace") for c in complete])
                    elif not boundary and not alive and reader.drained:  # exited (or no follow) and drained
                        self._flush(msg, rank, partial)
                        reader.close()
                        del readers[rank]
                    elif boundary:
                        grew = True  # (the next span at once)
                if not grew and readers:
                    # This tails a file, it does not poll a module: the kernel offers no
                    # portable append notification, so an empty read waits a moment.
                    stop.wait(TAIL_INTERVAL_SECONDS)
        except Exception:
            self._log.exception("rank log tail failed", job_id=msg.job_id, request_id=msg.request_id)
        finally:
            for reader in readers.values():
                reader.close()
            with self._lock:
                self._tails.pop(msg.request_id, None)
            self._emit(
                control_pb2.WorkerEvent(
                    rank_log_lines=control_pb2.RankLogLines(request_id=msg.request_id, job_id=msg.job_id, done=True)
                )
            )

    def _flush(self, msg: control_pb2.TailRankLogs, rank: int, partial: bytearray) -> None:
        """Send a last line without its newline (a process ended in the middle of it)."""
        if partial:
            self._send_lines(msg, rank, [bytes(partial).decode(errors="replace")])
            partial.clear()

    def _send_lines(self, msg: control_pb2.TailRankLogs, rank: int, lines: list[str]) -> None:
        lines = [line for line in lines if line.strip()]
        for i in range(0, len(lines), TAIL_BATCH_LINES):
            self._emit(
                control_pb2.WorkerEvent(
                    rank_log_lines=control_pb2.RankLogLines(
                        request_id=msg.request_id, job_id=msg.job_id, rank=rank, lines=lines[i : i + TAIL_BATCH_LINES]
                    )
                )
            )


class _SpanReader:
    """Reads one rank's spans in order, each from the file that holds its inode now (the
    current log or a rotated one), keeping the open file across renames."""

    def __init__(self, path: Path):
        self._path = path
        self._next = 0  # index of the span being read
        self._fh: Any = None
        self._end: int | None = None
        self.drained = False  # every span known so far read to its end (the last to EOF)

    def read(self, spans: list[tuple[int, int, int | None]]) -> tuple[bytes, bool]:
        """(bytes read, whether a span was finished or skipped by this call)."""
        self.drained = False
        if self._next >= len(spans):
            self.drained = True
            return b"", False
        ino, start, end = spans[self._next]
        if self._fh is None:
            self._fh = self._open(spans, self._next)
            if self._fh is None:  # rotated out of the kept backups (or never written): gone
                self._next += 1
                return b"", True
            self._fh.seek(start)
        pos = self._fh.tell()
        data = self._fh.read() if end is None else self._fh.read(max(0, end - pos))
        if end is not None and (self._fh.tell() >= end or not data):  # (a file cut short: what is there)
            self.close()
            self._next += 1
            return data, True
        if not data:
            self.drained = self._next == len(spans) - 1
        return data, False

    def _open(self, spans: list[tuple[int, int, int | None]], k: int) -> Any:
        """The file holding span ``k`` now, open (None: gone). Files are matched to spans by
        inode, newest span first, each span in a file no newer than the next span's: the
        inode of a file rotated out can be reused by a newer file, which must not be taken
        for it."""
        files = []
        for f in rotated_paths(self._path):  # oldest first
            try:
                fh = open(f, "rb")  # noqa: SIM115 - the one matched is kept open across calls
            except OSError:
                continue
            files.append((os.fstat(fh.fileno()).st_ino, fh))
        bound, found = len(files) - 1, None
        for i in range(len(spans) - 1, k - 1, -1):
            j = next((j for j in range(bound, -1, -1) if files[j][0] == spans[i][0]), None)
            if j is None:
                continue  # (that span is gone)
            bound = j
            if i == k:
                found = j
        for j, (_, fh) in enumerate(files):
            if j != found:
                fh.close()
        return files[found][1] if found is not None else None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
