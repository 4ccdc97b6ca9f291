"""The gRPC face of `control`: relays between the wire and the contract bus.

No seed module lives here and no decision is taken here. Each relay speaks on the bus for
the remote party the route table names, and holds only routing knowledge:

* ``ControlServicer``: operator RPCs become commands from EXT_USER to the orchestrator;
  its replies (JobStatus, JobList) and events (JobEvent) become responses and streams.
* ``SessionHub``: one bidi session per node agent. Stream messages become events sent as
  EXT_HARDWARE (WorkerRegistration, RankExited, MemoryPressure, RankHeartbeat),
  L2_TRAINING_LOOP (rank loop events) or
  L5_CHECKPOINT_MANAGER (SaveCompleted); commands for EXT_HARDWARE (LaunchRanks,
  ReleaseRanks) and L2_TRAINING_LOOP (Start/Pause/Resume/StopTraining) become
  ``WorkerCommand``s queued on the right sessions. A rank's BoundaryViolationReported is
  sent as EXT_CONTRACT (the contract layer of that remote process).
* ``SessionHub`` also carries operator log plumbing (``StreamLogs``): TailRankLogs /
  StopTailing down to the sessions that launched ranks of the job, RankLogLines up into a
  per-request queue (never on the bus).
* ``SessionHub`` also keeps each node agent's event stream exactly-once across a control
  restart: every ``WorkerEvent`` after ``register`` carries a per-agent-incarnation ``seq``;
  an event whose seq was already applied is dropped (counted as a duplicate); an applied
  one's seq is journaled in the same SQLite transaction as the event's effect, where it has
  one (``JobStore.applying``), or with the other effect-less events of its burst in one
  transaction (heartbeats, most steps: a group commit), and acknowledged down the stream
  (``WorkerCommand{ack}``, coalesced) once journaled. A session opens with the last applied seq in the initial-metadata header
  ``surge-last-seq``: the agent resends everything after it. A registration lists the ranks
  the agent still runs (``running``): they are the session's again (re-attach).
* ``EventApplier``: the one thread that applies every session's stream messages, in arrival
  order, a burst at a time (``SessionHub.on_worker_events``).
* ``ControlServicer.WorkerSession`` is an asyncio handler (control serves on ``grpc.aio``,
  see ``AioServiceServer``): a node agent's session costs no thread; its commands reach it
  through an asyncio queue (``_LoopQueue``). Why: with a thread per session (and one more
  reading it), 1,000 agents were 2,000 threads and a GIL hand-off per message, and control
  saturated (bench/control_scale.py). ``WatchJob`` and ``StreamLogs`` are asyncio handlers
  too: grpc.aio never tells a plain handler its caller left, so a plain follow held a pool
  thread (and delayed a SIGTERM stop) until the job's next event. The operator commands stay
  plain code in a thread pool.
* ``WatchHub``: per-job subscriber queues fed by JobEvent (no polling).
* ``StoreRelay``: VerifyCheckpoints for L5-1, forwarded to the `store` service without
  blocking; the answer comes back as L5-1's event.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from services.common.grpc_server import channel
from services.contract import control_pb2, control_pb2_grpc, engine_pb2, store_pb2, store_pb2_grpc, worker_pb2
from services.contract.bus import CommandPort, Emitter, Reply
from services.control.metrics import APPLIER_LAG, WORKER_EVENTS
from services.control.orchestrator import EVENT_LOG, IllegalTransition, JobNotFound
from services.jobspec import JobSpecError

S = control_pb2.JobState
# Initial-metadata key of WorkerSession: sent once the registration is in the registry.
REGISTERED_HEADER = "surge-registered"
# Initial-metadata key of WorkerSession: the last WorkerEvent.seq of this agent incarnation
# that control applied (0: none); the agent resends every event after it.
LAST_SEQ_HEADER = "surge-last-seq"
_log = structlog.get_logger("control.server")

# The rank loop events a node agent relays, by RankEvent oneof field.
_LOOP_EVENTS = ("started", "step", "eval", "paused", "finished", "failed")
# The RankCommand oneof field for each orchestrator command to L2-1.
_RANK_COMMAND_FIELD = {
    engine_pb2.StartTraining: "start",
    engine_pb2.PauseTraining: "pause",
    engine_pb2.ResumeTraining: "resume",
    engine_pb2.StopTraining: "stop",
}


# ---------------------------------------------------------------- node agent sessions


@dataclass(eq=False)
class _Session:
    worker_id: str
    commands: queue.Queue = field(default_factory=queue.Queue)  # WorkerCommand | None (end)
    # (job_id, rank) -> rank processes launched here and not yet reported ended. A count, not
    # a flag: a recovery relaunches a rank before the killed process's exit comes up.
    ranks: Counter[tuple[str, int]] = field(default_factory=Counter)
    # Jobs that ever had ranks launched here: their rank log files live on this node.
    jobs: set[str] = field(default_factory=set)
    closed: bool = False
    incarnation: str = ""
    applied: int = 0           # last WorkerEvent.seq applied for this incarnation
    durable: int = 0           # last seq whose cursor is journaled (what an ack says)
    ack_queued: bool = False   # an _ACK marker waits in `commands` (acks are coalesced)


# Marker in a session's command queue: send the latest journaled seq down as an EventAck.
_ACK = object()


class _LoopQueue:
    """A session's command queue as its asyncio handler reads it: ``put`` from any thread
    (bus handlers, the applier), ``get`` on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._queue = loop, asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: control is stopping, the stream is gone
            pass

    async def get(self) -> Any:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()


def _put_all(items: list[tuple[Any, Any]]) -> None:
    """``queue.put(item)`` for each ``(queue, item)``; the ``_LoopQueue``s of one loop with
    a single ``call_soon_threadsafe``."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for q, item in items:
        if isinstance(q, _LoopQueue):
            by_loop[q._loop].append((q._queue, item))
        else:
            q.put(item)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: control is stopping
            pass


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


@dataclass(eq=False)
class LogTail:
    """One StreamLogs request: the sessions asked, and the queue their answers land in:
    ``(session, RankLogLines)``, or ``(session, None)`` when a session ended without its
    ``done``."""

    request_id: str
    sessions: list[_Session]
    answers: Any  # a thread-safe ``put``; StreamLogs reads it on the server's loop


class SessionHub:
    """Node agent sessions: routing table worker id -> session, and the bus side of them.

    Args:
        hardware: emitter as EXT_HARDWARE (WorkerRegistration, RankExited, MemoryPressure,
            RankHeartbeat).
        loop: emitter as L2_TRAINING_LOOP (rank loop events relayed by node agents).
        checkpoints: emitter as L5_CHECKPOINT_MANAGER (SaveCompleted relayed by ranks).
        contract: emitter as EXT_CONTRACT (BoundaryViolationReported relayed by ranks);
            None: such reports are dropped.
    """

    def __init__(
        self, hardware: Emitter, loop: Emitter, checkpoints: Emitter, contract: Emitter | None = None,
        journal: Any = None,
    ):
        self._hardware, self._loop, self._checkpoints = hardware, loop, checkpoints
        self._contract = contract
        # Where applied seqs persist (JobStore: worker_cursor / applying); None: in memory only.
        self._journal = journal
        self.duplicates = 0  # sequenced events dropped as already applied (also a metric)
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._tails: dict[str, LogTail] = {}  # request id -> open StreamLogs request
        self._shutting_down = False

    # ------------------------------------------------------------ session lifecycle

    def open(self, reg: control_pb2.WorkerRegistration, commands: Any = None) -> _Session:
        """Register a node agent; a second session with the same worker id replaces the
        first (whose ranks are reported lost, except those the new registration says it
        still runs). The ranks in ``reg.running`` are re-attached to the new session. The
        session's ``applied`` is the last seq applied for the agent's incarnation (0 for a
        new incarnation). ``commands``: where its WorkerCommands go (anything with
        ``put``; default a ``queue.Queue`` read by ``next_command``)."""
        session = _Session(reg.worker_id, incarnation=reg.incarnation)
        if commands is not None:
            session.commands = commands
        running = [(launch.job_id, a.rank) for launch in reg.running for a in launch.ranks]
        session.ranks.update(running)
        session.jobs.update(launch.job_id for launch in reg.running)
        with self._lock:
            old = self._sessions.get(reg.worker_id)
            self._sessions[reg.worker_id] = session
            if old is not None:
                for key in running:  # alive on the new session: not lost with the old one
                    old.ranks.pop(key, None)
                if old.incarnation == reg.incarnation:
                    session.applied = max(session.applied, old.applied)
        if self._journal is not None and reg.incarnation:
            incarnation, seq = self._journal.worker_cursor(reg.worker_id)
            if incarnation == reg.incarnation:
                session.applied = max(session.applied, seq)
        session.durable = session.applied
        _log.info("worker registered", worker_id=reg.worker_id, host=reg.host, slots=reg.slots, replaces=old is not None,
                  reattached=running, last_applied_seq=session.applied)
        # The session is routable before the allocator learns of it, so no LaunchRanks
        # can arrive for a worker that has no queue yet.
        self._hardware(reg)
        if old is not None:
            self.close(old, reason=f"replaced by a new session of {reg.worker_id}")
        return session

    def close(self, session: _Session, reason: str = "session closed") -> None:
        """The node agent is gone: withdraw its slots and report its live ranks lost.
        Idempotent. During shutdown nothing is reported (control is going, not the node)."""
        with self._lock:
            if session.closed:
                return
            session.closed = True
            current = self._sessions.get(session.worker_id) is session
            if current:
                del self._sessions[session.worker_id]
            lost, session.ranks = sorted(session.ranks), Counter()
            quiet = self._shutting_down
            tails = [t for t in self._tails.values() if session in t.sessions]
        session.commands.put(None)
        for t in tails:  # it will send no done: its answer is over
            t.answers.put((session, None))
        if quiet:
            return
        _log.info("worker session ended", worker_id=session.worker_id, reason=reason, ranks_lost=len(lost))
        if current:  # zero slots: the worker withdraws (see ResourceAllocator)
            self._hardware(control_pb2.WorkerRegistration(worker_id=session.worker_id, slots=0))
        self._report_lost(session.worker_id, lost, reason)

    @property
    def stopping(self) -> bool:
        """``shutdown`` was called: a session ending now is control going, not its node."""
        return self._shutting_down

    def shutdown(self) -> None:
        """End every session without reporting anything (control is stopping)."""
        with self._lock:
            self._shutting_down = True
            sessions = list(self._sessions.values())
        for s in sessions:
            self.close(s)

    def on_worker_event(self, session: _Session, ev: control_pb2.WorkerEvent) -> None:
        """Relay one message of a node agent's stream onto the bus as the module it
        speaks for; a sequenced one (``seq`` > 0) at most once, then acknowledged.

        Raises:
            ValueError: a second registration, or an empty message.
        """
        self._accept(session, ev, defer=False)
        if ev.seq:
            self._queue_ack(session)

    def on_worker_events(self, burst: list[tuple[_Session, control_pb2.WorkerEvent]]) -> None:
        """``on_worker_event`` for a burst of messages of any sessions, applied in the
        given order (each session's own order), with one difference: the cursors of the
        sequenced events that journaled nothing (heartbeats, the steps of ranks other than
        0) are journaled together at the end, in one transaction, and every session's ack
        goes down after it. An event with an effect still has its cursor in its own
        transaction. A message refused (ValueError, or a module's error) is logged and
        skipped: one bad message must not end a node's session or the burst."""
        deferred: dict[_Session, int] = {}
        acked: dict[_Session, None] = {}
        for session, ev in burst:
            try:
                if self._accept(session, ev, defer=True):
                    deferred[session] = ev.seq
                    acked[session] = None
                    continue
            except Exception:
                _log.exception("worker event refused", worker_id=session.worker_id)
                continue
            if ev.seq and session.durable == session.applied:
                # Journaled (with its effect), with any earlier deferred cursor: ack it now,
                # not after the rest of the burst (each such event was a commit already).
                deferred.pop(session, None)
                acked.pop(session, None)
                self._queue_ack(session)
            elif ev.seq:
                acked[session] = None
        if deferred:
            if self._journal is not None:
                self._journal.write_cursors([(s.worker_id, s.incarnation, seq) for s, seq in deferred.items()])
            for s, seq in deferred.items():
                s.durable = max(s.durable, seq)
        self._queue_acks(acked)

    def _accept(self, session: _Session, ev: control_pb2.WorkerEvent, defer: bool) -> bool:
        """Apply ``ev`` unless its seq was applied already. True: its cursor is not yet
        journaled (only with ``defer``, for an event that journaled nothing)."""
        if not ev.seq:
            self._apply(session, ev)
            return False
        if ev.seq <= session.applied:
            self.duplicates += 1
            WORKER_EVENTS.labels("duplicate").inc()
            _log.info("duplicate worker event dropped", worker_id=session.worker_id, seq=ev.seq, applied=session.applied)
            return False
        if ev.seq != session.applied + 1:
            # The agent's outbox overflowed while control was away: those events are lost.
            _log.warning("worker event sequence gap", worker_id=session.worker_id, seq=ev.seq, applied=session.applied)
        written = True
        if self._journal is not None:
            with self._journal.applying(session.worker_id, session.incarnation, ev.seq, defer=defer) as ctx:
                self._apply(session, ev)
            written = ctx.written or not defer
        else:
            self._apply(session, ev)
        session.applied = ev.seq
        if written:
            session.durable = ev.seq
        WORKER_EVENTS.labels("applied").inc()
        return not written

    def _queue_acks(self, sessions: Iterable[_Session]) -> None:
        """``_queue_ack`` for many sessions, waking the server's loop once for all of them
        (a wake-up is a write to its self-pipe: one per ack was a measured 3 % of control)."""
        with self._lock:
            marked = [s for s in sessions if not (s.ack_queued or s.closed)]
            for s in marked:
                s.ack_queued = True
        _put_all([(s.commands, _ACK) for s in marked])

    def _queue_ack(self, session: _Session) -> None:
        with self._lock:
            if session.ack_queued or session.closed:
                return
            session.ack_queued = True
        session.commands.put(_ACK)

    def next_command(self, session: _Session) -> control_pb2.WorkerCommand | None:
        """The next command for the session's stream (blocks; for a ``queue.Queue``
        session); None: the session ended. An ack marker becomes an EventAck of the latest
        journaled seq."""
        return self.command(session, session.commands.get())

    def command(self, session: _Session, item: Any) -> control_pb2.WorkerCommand | None:
        """The WorkerCommand for an item taken from the session's queue (``_ACK``: an
        EventAck of the latest journaled seq; None: the session ended)."""
        if item is _ACK:
            with self._lock:
                session.ack_queued = False
            return control_pb2.WorkerCommand(ack=control_pb2.EventAck(seq=session.durable, incarnation=session.incarnation))
        return item

    def _apply(self, session: _Session, ev: control_pb2.WorkerEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "rank_exited":
            exited = ev.rank_exited
            exited.worker_id = exited.worker_id or session.worker_id
            with self._lock:
                key = (exited.job_id, exited.rank)
                session.ranks[key] -= 1
                if session.ranks[key] <= 0:
                    del session.ranks[key]
            self._hardware(exited)
        elif kind == "rank_event":
            self._relay_rank_event(session, ev.rank_event)
        elif kind == "memory_pressure":
            pressure = ev.memory_pressure
            # A node agent speaks only for its own node: the session's identity wins.
            pressure.worker_id = session.worker_id
            self._hardware(pressure)
        elif kind == "rank_log_lines":
            with self._lock:
                tail = self._tails.get(ev.rank_log_lines.request_id)
            if tail is not None:  # else: the caller left; late lines are dropped
                tail.answers.put((session, ev.rank_log_lines))
        elif kind == "register" and ev.register.departing:
            # The agent is leaving: no rank may be placed on it any more (its ranks' exits
            # follow, stated by the agent as departures).
            ev.register.worker_id = session.worker_id
            self._hardware(ev.register)
        elif kind == "register":
            raise ValueError(f"worker {session.worker_id} registered twice on one session")
        else:
            raise ValueError(f"worker {session.worker_id} sent an empty WorkerEvent")

    # ------------------------------------------------------------ bus handlers (as EXT_HARDWARE)

    def launch_ranks(self, msg: control_pb2.LaunchRanks, payload: Any = None) -> None:
        """Queue LaunchRanks on the session of worker ``payload``."""
        ranks = [(msg.job_id, r.rank) for r in msg.ranks]
        with self._lock:
            session = self._sessions.get(payload)
            if session is not None:
                session.ranks.update(ranks)  # Counter.update adds
                session.jobs.add(msg.job_id)
                session.commands.put(control_pb2.WorkerCommand(launch=msg))
        if session is None:
            # The worker left between allocation and launch. Report from another thread:
            # the commander (the orchestrator, through the allocator) is mid-decision on
            # this thread and will take the report after it.
            threading.Thread(
                target=self._report_lost, args=(payload, ranks, "session closed before launch"), daemon=True
            ).start()

    def release_ranks(self, msg: control_pb2.ReleaseRanks, payload: Any = None) -> None:
        """Queue ReleaseRanks on the session of worker ``payload`` (none: nothing to do).
        The released ranks stay counted until their exit comes up."""
        with self._lock:
            session = self._sessions.get(payload)
            if session is None:
                return
            session.commands.put(control_pb2.WorkerCommand(release=msg))

    # ------------------------------------------------------------ bus handlers (as L2_TRAINING_LOOP)

    def relay_rank_command(self, msg: Any, payload: Any = None) -> None:
        """Queue a Start/Pause/Resume/StopTraining on every session that launched (or
        re-attached) ranks of the job; the node agent hands it to each of its live ranks of
        that job (none: it logs and drops it). By job, not by live-rank count: after a
        control restart an exit resent late may be counted against a rank relaunched since."""
        command = worker_pb2.RankCommand(**{_RANK_COMMAND_FIELD[type(msg)]: msg})
        with self._lock:
            for session in self._sessions.values():
                if msg.job_id in session.jobs:
                    session.commands.put(control_pb2.WorkerCommand(rank_command=command))

    # ------------------------------------------------------------ operator logs (plumbing)

    def open_tail(self, job_id: str, follow: bool, rank: int, answers: Any) -> LogTail:
        """Ask every open session that launched ranks of ``job_id`` to tail their log
        files (``TailRankLogs``); their RankLogLines land in ``answers`` (the returned
        request's queue). No session: the request has none and is already over."""
        request_id = uuid.uuid4().hex
        with self._lock:
            sessions = [s for s in self._sessions.values() if job_id in s.jobs and not s.closed]
            tail = LogTail(request_id, sessions, answers)
            self._tails[request_id] = tail
            cmd = control_pb2.WorkerCommand(tail_rank_logs=control_pb2.TailRankLogs(
                request_id=request_id, job_id=job_id, follow=follow, rank=rank))
            for s in sessions:
                s.commands.put(cmd)
        return tail

    def close_tail(self, tail: LogTail, pending: set[_Session]) -> None:
        """Forget the request; the sessions in ``pending`` (no done yet) get StopTailing."""
        with self._lock:
            self._tails.pop(tail.request_id, None)
            cmd = control_pb2.WorkerCommand(stop_tailing=control_pb2.StopTailing(request_id=tail.request_id))
            for s in pending:
                if not s.closed:
                    s.commands.put(cmd)

    # ------------------------------------------------------------ private

    def _relay_rank_event(self, session: _Session, ev: worker_pb2.RankEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind in ("hello", "audit") or kind is None:
            return  # between a rank and its node agent only
        inner = getattr(ev, kind)
        if not inner.job_id:
            inner.job_id = ev.job_id
        if kind == "heartbeat":
            # The envelope names the rank the node agent attached; the session names the node.
            inner.rank, inner.worker_id = ev.rank, session.worker_id
            self._hardware(inner)
        elif kind == "violation":
            if self._contract is not None:
                inner.rank = inner.rank or ev.rank
                self._contract(inner)
        elif kind in ("saved", "snapshot_failed"):  # the rank's checkpoint relay speaks as L5-1
            self._checkpoints(inner)
        else:
            inner.rank = inner.rank or ev.rank
            if kind == "started":  # where the rank runs: the session knows, L1-1 journals it
                inner.worker_id = session.worker_id
            self._loop(inner)

    def _report_lost(self, worker_id: str, ranks: list[tuple[str, int]], reason: str) -> None:
        for job_id, rank in ranks:
            self._hardware(
                control_pb2.RankExited(
                    job_id=job_id, rank=rank, worker_id=worker_id, detail=reason, worker_lost=True
                )
            )


# ---------------------------------------------------------------- the applier thread


class EventApplier:
    """The one thread that applies every node agent session's messages, in the order the
    server's loop read them (so each session's own order), and opens and closes sessions
    in that same order (a session's exit reports come before its close).

    Messages are applied a burst at a time (``SessionHub.on_worker_events``: up to
    ``max_burst`` queued back to back), so a burst's effect-less cursors cost one commit.
    The thread starts with the first item (an in-process control that serves no gRPC
    starts none).

    Receipt is stamped on the server's loop, as a message is queued (``event``): a
    heartbeat carries it to the fault detector in ``RankHeartbeat.received_monotonic``, so
    its deadlines count from when control received the beat, never from when this thread
    got to it; ``surge_control_applier_lag_seconds`` is the wait of each burst's oldest
    message between the two.

    Args:
        hub: the sessions it applies to.
        max_burst: most messages applied before their cursors are journaled and acked.
    """

    def __init__(self, hub: SessionHub, max_burst: int = 1024):
        self._hub, self._max_burst = hub, max_burst
        # (session, event, received monotonic) | (None, callable) | None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def event(self, session: _Session, ev: control_pb2.WorkerEvent) -> None:
        """Queue one message of ``session``'s stream, stamped with its receipt (a
        heartbeat's ``received_monotonic``)."""
        received = time.monotonic()
        if ev.HasField("rank_event") and ev.rank_event.HasField("heartbeat"):
            ev.rank_event.heartbeat.received_monotonic = received
        self._put((session, ev, received))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the applier thread, after everything queued before it."""
        self._put((None, fn))

    async def open(self, reg: control_pb2.WorkerRegistration, commands: Any) -> _Session:
        """``SessionHub.open`` on the applier thread; awaited on the server's loop. If the
        caller is cancelled meanwhile, the session is closed again."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future = loop.create_future()

        def deliver(result: _Session | BaseException) -> None:
            if opened.cancelled():
                if isinstance(result, _Session):
                    self.call(lambda: self._hub.close(result, reason="session cancelled while opening"))
            elif isinstance(result, BaseException):
                opened.set_exception(result)
            else:
                opened.set_result(result)

        def do() -> None:
            try:
                result: _Session | BaseException = self._hub.open(reg, commands)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                result = e
            loop.call_soon_threadsafe(deliver, result)

        self.call(do)
        return await opened

    def close(self, session: _Session, reason: str = "session closed") -> None:
        """``SessionHub.close`` after the messages of ``session`` already queued."""
        self.call(lambda: self._hub.close(session, reason))

    def stop(self) -> None:
        """End the thread after what is queued (idempotent)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10.0)

    def _put(self, item: tuple) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="event-applier", daemon=True)
                    self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        get, burst, oldest = self._queue.get, [], 0.0
        while True:
            item = get()
            while True:
                if item is None:
                    self._flush(burst, oldest)
                    return
                if item[0] is None:
                    self._flush(burst, oldest)
                    burst = []
                    try:
                        item[1]()
                    except Exception:  # noqa: BLE001 - the thread must outlive one bad call
                        _log.exception("session open/close failed")
                else:
                    if not burst:
                        oldest = item[2]
                    burst.append((item[0], item[1]))
                if len(burst) >= self._max_burst or self._queue.empty():
                    break
                item = get()
            if burst:
                self._flush(burst, oldest)
                burst = []

    def _flush(self, burst: list, received: float = 0.0) -> None:
        if not burst:
            return
        if received:
            APPLIER_LAG.observe(max(0.0, time.monotonic() - received))
        try:
            self._hub.on_worker_events(burst)
        except Exception:  # noqa: BLE001 - e.g. the journal's disk is full: the acks wait
            _log.exception("worker event burst failed", size=len(burst))


# ---------------------------------------------------------------- job event subscribers


class WatchHub:
    """Per-job subscriber queues fed by the orchestrator's JobEvent (as EXT_USER)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[Any]] = defaultdict(set)

    def on_job_event(self, msg: control_pb2.JobEvent, payload: Any = None) -> None:
        with self._lock:
            for q in self._subscribers.get(msg.job_id, ()):
                q.put(msg)

    def subscribe(self, job_id: str, q: Any) -> None:
        """``q`` (anything with a thread-safe ``put``) receives each JobEvent of ``job_id``."""
        with self._lock:
            self._subscribers[job_id].add(q)

    def unsubscribe(self, job_id: str, q: Any) -> None:
        with self._lock:
            self._subscribers[job_id].discard(q)
            if not self._subscribers[job_id]:
                del self._subscribers[job_id]


# ---------------------------------------------------------------- store relay


class StoreRelay:
    """VerifyCheckpoints (and the scrub) for L5-1, forwarded to the `store` service at
    ``address`` without blocking: the command returns at once and the store's answer comes
    back as L5-1's event, ``CheckpointVerification``, or ``SnapshotFailed`` with a typed
    cause when the store could not be asked (``UNREACHABLE``: gRPC UNAVAILABLE;
    ``TIMEOUT``: DEADLINE_EXCEEDED; ``REJECTED``: any other status). Why: the recovery's
    verification ran as a blocking call on control's one event-applier thread, inside the
    orchestrator's lock, and a stopped store froze every job's heartbeats behind it.

    ``post`` runs the delivery of an answer (the composition root passes the event
    applier's ``call``, so answers are applied in order with the node agents' events;
    default: on the gRPC callback thread). ``on_error`` sees every failed call first (the
    composition root reports a boundary violation the store returned)."""

    def __init__(self, address: str, events: Emitter, timeout_s: float = 10.0,
                 on_error: Callable[[grpc.RpcError], None] | None = None,
                 post: Callable[[Callable[[], None]], None] | None = None):
        self._address, self._timeout_s = address, timeout_s
        self._events = events
        self._on_error = on_error
        self.post = post or (lambda fn: fn())
        self._stub: store_pb2_grpc.StoreServiceStub | None = None
        self._closed = threading.Event()
        self._watching: Any = None

    def verify_checkpoints(self, msg: store_pb2.VerifyCheckpoints, payload: Any = None) -> None:
        """Which committed versions of the job are intact, from the store's recorded
        verdicts; answered later as an event (see the class)."""
        self._ask("Verify", msg, "verify", msg.job_id)

    def scrub_checkpoints(self, msg: store_pb2.ScrubCheckpoints, payload: Any = None) -> None:
        """Have the store re-hash the job's versions now; answered later as
        ``CheckpointScrubbed`` (or a typed ``SnapshotFailed``, operation ``scrub``)."""
        self._ask("Scrub", msg, "scrub", msg.job_id)

    def watch(self) -> None:
        """Relay the store's ``CheckpointCorrupt`` events (its scrub found a committed
        version's bytes wrong) for as long as control runs: one server stream
        (``WatchCheckpoints``), opened again with backoff while the store is away."""
        threading.Thread(target=self._watch, name="store-watch", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        if self._watching is not None:
            self._watching.cancel()

    def _watch(self) -> None:
        backoff = 0.5
        while not self._closed.is_set():
            stub = store_pb2_grpc.StoreServiceStub(channel(self._address))
            self._watching = stub.WatchCheckpoints(store_pb2.WatchCheckpointsRequest())
            try:
                for corrupt in self._watching:
                    backoff = 0.5
                    self.post(lambda c=corrupt: self._events(c))
            except grpc.RpcError:
                pass  # the store went away (or control is closing): watch again once it is back
            self._closed.wait(backoff)  # (the relay's own reconnect backoff, not a module's poll)
            backoff = min(backoff * 2, 5.0)

    def _ask(self, method: str, msg: Any, operation: str, job_id: str) -> None:
        if self._stub is None:
            self._stub = store_pb2_grpc.StoreServiceStub(channel(self._address))
        future = getattr(self._stub, method).future(msg, timeout=self._timeout_s)
        future.add_done_callback(lambda f: self.post(lambda: self._answer(f, operation, job_id)))

    def _answer(self, future: grpc.Future, operation: str, job_id: str) -> None:
        try:
            reply = future.result()
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            cause = _STORE_CAUSES.get(e.code(), store_pb2.REJECTED)
            reply = store_pb2.SnapshotFailed(job_id=job_id, operation=operation, cause=cause,
                                             reason=f"store {self._address}: {e.code().name}: {e.details()}")
        self._events(reply)


# gRPC status -> the typed cause of a store call that failed (the status code, never its text).
_STORE_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: store_pb2.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: store_pb2.TIMEOUT,
    grpc.StatusCode.CANCELLED: store_pb2.UNREACHABLE,
}


# ---------------------------------------------------------------- the servicer


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    """ControlService over gRPC.

    ``WorkerSession``, ``WatchJob`` and ``StreamLogs`` are asyncio handlers (serve this on a
    ``grpc.aio`` server, e.g. ``AioServiceServer``); the other RPCs are plain code (its
    thread pool runs them).

    Args:
        user: command port EXT_USER -> L1_ORCHESTRATOR.
        watches: the JobEvent subscriber hub.
        sessions: the node agent session hub.
        applier: the thread that applies the sessions' messages (default: one of its own).
        max_sessions: node agent sessions held at once; the next is refused with
            RESOURCE_EXHAUSTED.
    """

    def __init__(self, user: CommandPort, watches: WatchHub, sessions: SessionHub,
                 applier: EventApplier | None = None, max_sessions: int = 8192):
        self._user, self._watches, self._sessions = user, watches, sessions
        self.applier = applier or EventApplier(sessions)
        self._max_sessions = max_sessions
        self._live = 0  # sessions being served (touched on the server's loop only)

    def SubmitJob(self, request, context):
        return self._command(context, request)

    def GetJob(self, request, context):
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GetJob: job_id is required")
        return self._command(context, request)

    def ListJobs(self, request, context):
        return self._command(context, control_pb2.JobQuery())

    def PauseJob(self, request, context):
        return self._command(context, request)

    def ResumeJob(self, request, context):
        return self._command(context, request)

    def StopJob(self, request, context):
        return self._command(context, request)

    async def WatchJob(self, request, context) -> AsyncIterator[control_pb2.JobEvent]:
        """History from ``from_seq``, then (with ``follow``) live events until TERMINATED.
        Subscribing before reading the history and skipping seen seqs closes the gap
        between the two. Runs on the server's loop: a caller leaving cancels it at once
        (a plain handler would hold a pool thread until the job's next event, since grpc.aio
        never calls a plain handler's ``add_callback``; tested)."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WatchJob: job_id is required")
        live = _LoopQueue(asyncio.get_running_loop())
        self._watches.subscribe(request.job_id, live)
        try:
            status, history = await self._history(context, request)
            last = 0
            for ev in history:
                last = ev.seq
                yield ev
            if not request.follow or status.state == S.TERMINATED:
                return
            while True:
                ev = await live.get()
                if ev.seq <= last or ev.seq < request.from_seq:
                    continue
                last = ev.seq
                yield ev
                if ev.status.state == S.TERMINATED:
                    return
        finally:
            self._watches.unsubscribe(request.job_id, live)

    async def StreamLogs(self, request, context) -> AsyncIterator[control_pb2.LogLine]:
        """The job's rank log lines, relayed from the node agents that ran its ranks (each
        tails its files, see TailRankLogs); with ``follow`` until those ranks have exited
        and their files are drained. Ends when every agent asked said done; the caller
        leaving sends them StopTailing. Blocks on the request's queue, never polls; runs on
        the server's loop, like WatchJob and for the same reason."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "StreamLogs: job_id is required")
        await self._call(context, control_pb2.JobQuery(job_id=request.job_id))  # NOT_FOUND for an unknown job
        rank = request.rank if request.rank >= 0 else -1
        tail = self._sessions.open_tail(request.job_id, request.follow, rank, _LoopQueue(asyncio.get_running_loop()))
        pending = set(tail.sessions)
        try:
            while pending:
                session, batch = await tail.answers.get()
                if batch is None and self._sessions.stopping:  # not the job's end: say so
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "control is stopping")
                if batch is None or batch.done:
                    pending.discard(session)
                    continue
                if rank >= 0 and batch.rank != rank:
                    continue
                for line in batch.lines:
                    yield control_pb2.LogLine(job_id=request.job_id, rank=batch.rank, line=line)
        finally:
            self._sessions.close_tail(tail, pending)

    async def WorkerSession(self, request_iterator, context):
        """First message: ``register``; control answers with the initial-metadata header
        ``surge-registered: <worker_id>`` once the worker's slots are allocatable. Then rank
        events up, WorkerCommands down, until either side closes; the stream closing is
        the fact that the node agent is gone. Runs on the server's loop: the messages go to
        the applier thread, the commands come from the session's asyncio queue."""
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("event") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WorkerSession: the first WorkerEvent must be register")
        reg = first.register
        if not reg.worker_id or reg.slots == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"WorkerSession: registration needs a worker_id and slots > 0 (got {reg.worker_id!r}, {reg.slots})",
            )
        if self._live >= self._max_sessions:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"WorkerSession: control holds {self._max_sessions} node agent sessions (--max-sessions); "
                f"{reg.worker_id} refused",
            )
        self._live += 1
        try:
            commands = _LoopQueue(asyncio.get_running_loop())
            session = await self.applier.open(reg, commands)
            reader = None
            try:
                # The acknowledgement: once a node agent sees this header, its slots can be
                # allocated; it resends its events after the last applied seq.
                await context.send_initial_metadata(
                    ((REGISTERED_HEADER, reg.worker_id), (LAST_SEQ_HEADER, str(session.applied))))
                reader = asyncio.create_task(self._read_session(session, requests))
                while (item := await commands.get()) is not None:
                    yield self._sessions.command(session, item)
            finally:
                if reader is not None:
                    reader.cancel()
                self.applier.close(session)  # idempotent; after the messages already read
        finally:
            self._live -= 1

    # ------------------------------------------------------------ private

    async def _read_session(self, session: _Session, requests) -> None:
        try:
            async for ev in requests:
                self.applier.event(session, ev)
        except Exception:  # noqa: BLE001 - the stream broke: same fact as closing it
            pass
        finally:
            self.applier.close(session)

    async def _history(self, context, request) -> tuple[control_pb2.JobStatus, tuple]:
        query = control_pb2.JobQuery(job_id=request.job_id, from_seq=request.from_seq)
        reply = await self._call(context, query, EVENT_LOG)
        return reply.message, reply.payload

    async def _call(self, context, request, payload: Any = None) -> Reply:
        """``self._user(request, payload)`` from a handler on the server's loop: run in a
        pool thread (it waits on the orchestrator's lock); an error aborts the RPC."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._user, request, payload)
        except Exception as e:
            await context.abort(*_status(e))

    def _command(self, context, request):
        try:
            return self._user(request).message
        except Exception as e:
            _abort(context, e)


def _abort(context, e: Exception):
    context.abort(*_status(e))


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and one-line details a control command's error is answered with."""
    if isinstance(e, JobSpecError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(e, JobNotFound):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(e, IllegalTransition):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(e, ValueError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        _log.exception("control command failed")
        code = grpc.StatusCode.INTERNAL
    return code, str(e).splitlines()[0] if str(e) else type(e).__name__
