"""Rank log tails (operator log plumbing for ``StreamLogs``, asked for by control with
``WorkerCommand{tail_rank_logs}``): the job's rank log lines on this node go up as
``RankLogLines`` batches, then with ``follow`` the lines appended later, ending with
``RankLogLines{done}``.

One thread per request reads the files. A followed file is re-read after a short wait when
empty: appends to a file notify nobody.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        spans: job id -> rank -> the byte spans ``(start, end)`` of that rank's log file
            that this agent's launches of it wrote, in order (``end`` None: still being
            written). A rank's file is appended by every process of that rank; agents that
            share one run dir (the local stack) each send only their own spans, so a rank
            that moved from one to another has each line sent once.
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
        files: dict[int, tuple[Any, bytearray]] = {}
        try:
            for rank, path in self.log_files(msg.job_id, msg.rank).items():
                try:
                    files[rank] = (open(path, "rb"), bytearray())
                except OSError as e:
                    self._log.warning("rank log unreadable", job_id=msg.job_id, rank=rank, error=str(e))
            while files and not stop.is_set():
                grew = False
                for rank in list(files):
                    fh, partial = files[rank]
                    # Asked before reading (and before the spans, whose end is set before
                    # the exit is): a line written before the exit is not missed.
                    alive = msg.follow and self._alive(msg.job_id, rank)
                    chunk = self._read_own(fh, self._spans(msg.job_id).get(rank, []), partial)
                    if chunk is None:  # a span of another agent's process skipped: its last line ended
                        self._flush(msg, rank, partial)
                        continue
                    if chunk:
                        grew = True
                        partial += chunk
                        *complete, rest = bytes(partial).split(b"\n")
                        partial[:] = rest
                        self._send_lines(msg, rank, [c.decode(errors="replace") for c in complete])
                    elif not alive:  # exited (or no follow) and drained
                        self._flush(msg, rank, partial)
                        fh.close()
                        del files[rank]
                if not grew and files:
                    # This tails a file, it does not poll a module: the kernel offers no
                    # portable append notification, so an empty read waits a moment.
                    stop.wait(TAIL_INTERVAL_SECONDS)
        except Exception:
            self._log.exception("rank log tail failed", job_id=msg.job_id, request_id=msg.request_id)
        finally:
            for fh, _ in files.values():
                fh.close()
            with self._lock:
                self._tails.pop(msg.request_id, None)
            self._emit(
                control_pb2.WorkerEvent(
                    rank_log_lines=control_pb2.RankLogLines(request_id=msg.request_id, job_id=msg.job_id, done=True)
                )
            )

    @staticmethod
    def _read_own(fh: Any, spans: list[tuple[int, int | None]], partial: bytearray) -> bytes | None:
        """The next bytes of ``fh`` within this agent's ``spans``; None (nothing read) when
        the position was moved to the start of the next span (after another writer's)."""
        pos = fh.tell()
        span = next(((start, end) for start, end in spans if end is None or end > pos), None)
        if span is None:
            return b""
        start, end = span
        if pos < start:
            fh.seek(start)
            return None
        return fh.read() if end is None else fh.read(end - pos)

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
