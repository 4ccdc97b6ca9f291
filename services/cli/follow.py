"""`surgectl events --follow` and `logs --follow` through a control restart.

Control can be killed and started again on the same port while a job trains: the node
agents re-attach the ranks and the job goes on (README, "control plane restart"). A follow
must not end then, nor advise `surgectl down`/`up` (that would kill the ranks). On
UNAVAILABLE (the call broke or control does not answer) it prints one line to stderr,
retries on a fresh channel with capped exponential backoff (``FIRST_DELAY_S`` doubling to
``MAX_DELAY_S``, the usual gRPC client reconnect shape) for at most ``reconnect_s`` seconds
per outage, and resumes where it stopped:

* events: ``WatchJob(from_seq = last seq printed + 1)``; the event log is control's journal,
  so the new process serves the same seqs, each printed once;
* logs: ``StreamLogs`` has no cursor (``LogQuery`` carries none), but each rank's lines come
  in file order from the start of its file, so the number of lines printed per rank is the
  cursor: a new stream's first that-many lines of the rank are skipped.

A follow that was never connected fails at once (the stack is not up): only a follow that
saw control answer waits for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from services.cli import clients, observe, render
from services.cli.errors import CliError
from services.contract import control_pb2

FIRST_DELAY_S = 0.2
MAX_DELAY_S = 2.0
PROBE_TIMEOUT_S = 10.0  # a GetJob of a control that is restoring its journal may take a moment
# Codes of a call that control's going away breaks: the socket closed (UNAVAILABLE), the
# server's shutdown cancelled the stream (CANCELLED), the probe got no answer in time.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
_TERMINATED = control_pb2.JobState.TERMINATED


class Reconnect:
    """The backoff of one follow: ``lost()`` on each failed attempt (sleeps, or raises once
    the outage has lasted ``bound_s``), ``connected()`` when control answers again."""

    def __init__(
        self,
        job_id: str,
        addr: str,
        bound_s: float,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._job, self._addr, self._bound = job_id, addr, bound_s
        self._sleep, self._clock = sleep, clock
        self._since: float | None = None
        self._delay = FIRST_DELAY_S
        self.ever_connected = False

    def connected(self) -> None:
        self._since, self._delay, self.ever_connected = None, FIRST_DELAY_S, True

    def lost(self) -> None:
        now = self._clock()
        if self._since is None:
            self._since = now
            render.err_console.print(
                f"control unavailable at {self._addr}; reconnecting (up to {self._bound:.0f} s)…",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        waited = now - self._since
        if waited >= self._bound:
            raise CliError(
                f"control at {self._addr} unreachable for {waited:.0f} s; stopped following {self._job}, "
                f"which may still be running ({clients.start_again_hint('control')}, then follow again)"
            )
        self._sleep(min(self._delay, self._bound - waited))
        self._delay = min(2 * self._delay, MAX_DELAY_S)


def _lost(e: grpc.RpcError) -> bool:
    return hasattr(e, "code") and e.code() in _LOST


def job_events(
    job_id: str, reconnect_s: float, from_seq: int = 0, types: Sequence[str] = ()
) -> Iterator[control_pb2.JobEvent]:
    """Every event of ``job_id`` from seq ``from_seq`` (0: the first), of ``types`` (none:
    every type; control selects them), once each and in seq order, until the job terminates,
    across control restarts shorter than ``reconnect_s`` seconds.

    Raises:
        CliError: unknown job, control unreachable at the start, or an outage longer than
            ``reconnect_s``.
    """
    addr = clients.address("control")
    retry = Reconnect(job_id, addr, reconnect_s)
    next_seq = from_seq
    while True:
        try:
            with clients.open_channel(addr) as ch:
                stub = clients.new_stub("control", ch)
                stub.GetJob(
                    control_pb2.JobQuery(job_id=job_id), timeout=PROBE_TIMEOUT_S
                )  # NOT_FOUND for an unknown job
                retry.connected()
                query = control_pb2.JobQuery(job_id=job_id, from_seq=next_seq, follow=True, types=sorted(types))
                for ev in stub.WatchJob(query):
                    if ev.seq < next_seq:
                        continue
                    next_seq = ev.seq + 1
                    yield ev
                return  # control ends the stream after the TERMINATED event
        except grpc.RpcError as e:
            if not (retry.ever_connected and _lost(e)):
                raise clients.rpc_error(e, "control", addr) from None
        retry.lost()


def job_logs(job_id: str, rank: int, reconnect_s: float, window_s: float = 0.5) -> Iterator[observe.LogLine]:
    """``job_id``'s rank log lines (``rank`` only, unless -1) as they are written, merged by
    timestamp within each ``window_s`` seconds after a line arrives, until the job's ranks
    have exited, across control restarts shorter than ``reconnect_s`` seconds; no line is
    given twice.

    Raises:
        CliError: unknown job, control unreachable at the start, an outage longer than
            ``reconnect_s``, or ``reconnect_s`` without any node agent tailing a job that
            has not terminated.
    """
    addr = clients.address("control")
    retry = Reconnect(job_id, addr, reconnect_s)
    printed: dict[int, int] = {}  # rank -> lines given (the resume cursor)
    order = observe.TimeOrder()
    quiet_since: float | None = None
    while True:
        try:
            with clients.open_channel(addr) as ch:
                stub = clients.new_stub("control", ch)
                stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=PROBE_TIMEOUT_S)
                retry.connected()
                streamed: dict[int, int] = {}
                call = stub.StreamLogs(control_pb2.LogQuery(job_id=job_id, follow=True, rank=rank))
                for window in _windows(call, window_s):
                    fresh = []
                    for m in window:
                        streamed[m.rank] = streamed.get(m.rank, 0) + 1
                        if streamed[m.rank] > printed.get(m.rank, 0):
                            printed[m.rank] = streamed[m.rank]
                            fresh.append(observe.parse(m.rank, m.line))
                    if fresh:
                        quiet_since = None
                    yield from order.order(fresh)
                # The stream ends when the node agents asked have drained their ranks' files:
                # the job is over, or its ranks are being relaunched (a recovery), or, after
                # a control restart, the agents had not re-registered yet and none was asked.
                # Only the job's state tells which.
                state = stub.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=PROBE_TIMEOUT_S).state
                if state == _TERMINATED:
                    yield from order.order(_rest_of_local_files(job_id, rank, printed))
                    return
        except grpc.RpcError as e:
            if not (retry.ever_connected and _lost(e)):
                raise clients.rpc_error(e, "control", addr) from None
            retry.lost()
            continue
        quiet_since = quiet_since if quiet_since is not None else time.monotonic()
        if time.monotonic() - quiet_since >= reconnect_s:
            raise CliError(
                f"{job_id} has not terminated, but no node agent has tailed its rank logs "
                f"for {reconnect_s:.0f} s; stopped following"
            )
        time.sleep(FIRST_DELAY_S)


def _rest_of_local_files(job_id: str, rank: int, printed: dict[int, int]) -> list[observe.LogLine]:
    """The lines after ``printed`` of the job's rank log files on this machine (the local
    stack's run dir). Why: a job that ended while control was down has no node agent
    tailing it for the new control (they re-register only running jobs), so the lines its
    ranks wrote meanwhile cannot come through StreamLogs. A node agent's lines are the
    file's non-empty ``\\n``-separated lines, so ``printed`` counts the same lines here.
    Files of another machine are not reachable: the operator is told so, once."""
    files = observe.rank_logs(job_id)
    if rank >= 0:
        files = {r: f for r, f in files.items() if r == rank}
    if not files:
        render.err_console.print(
            f"{job_id} ended while control was down; lines its ranks wrote meanwhile are only in their "
            f"log files on the workers (<run dir>/logs/{observe.safe_name(job_id)}.rank<R>.log)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return []
    rest = []
    for r, f in files.items():
        try:
            lines = [t for t in observe.read_rank_log(f).split("\n") if t.strip()]
        except OSError:
            continue
        rest += [observe.parse(r, t) for t in lines[printed.get(r, 0) :]]
    return rest


_END = object()


def _windows(call, window_s: float) -> Iterator[list]:
    """The messages of a response stream in batches: each batch holds what arrived within
    ``window_s`` seconds of its first message. A thread reads the stream (gRPC's iterator
    blocks); the call is cancelled when the consumer stops early."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        try:
            for m in call:
                inbox.put(m)
            inbox.put(_END)
        except grpc.RpcError as e:
            inbox.put(e)

    threading.Thread(target=pump, name="stream-logs-reader", daemon=True).start()
    try:
        item = inbox.get()
        while True:
            batch: list = []
            deadline = time.monotonic() + window_s
            while item is not _END and not isinstance(item, grpc.RpcError):
                batch.append(item)
                remaining = deadline - time.monotonic()
                try:
                    item = inbox.get(timeout=remaining) if remaining > 0 else None
                except queue.Empty:
                    item = None
                if item is None:
                    break
            if batch:
                yield batch
            if item is _END:
                return
            if isinstance(item, grpc.RpcError):
                raise item
            item = inbox.get()
    finally:
        call.cancel()
