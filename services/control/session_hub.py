"""Node agent sessions as the bus sees them (``SessionHub``), one per node agent.

A rank's events come up as ``RankEvent{routed}``: any routed message by its full name, from
the module that sent it (services/contract/relay.py). The hub's link checks that a node may
speak for that module (a rank module, or an L4 / L5 module its relays speak for, or
EXT_HARDWARE / EXT_CONTRACT) and that the route lets it send the message, stamps where it
came from (job, rank, node) and publishes it on control's bus as that module. Commands from
an L1 module to a rank module (Start/Pause/Resume/StopTraining, StepVerdict, ...) go down
the same way: the link stands in for every such route (``stand_in``) and queues
``WorkerCommand{routed, job_id}`` on each session that launched ranks of the job. So an
event or command that crosses takes a message, a route and a handler, no field here.

The agent's own facts (RankExited, MemoryPressure, a departing registration) and heartbeats
keep their stream fields: the hub does bookkeeping on them (ranks per session, the time a
beat was received). LaunchRanks and ReleaseRanks go to one named node (the bus payload).

Fencing (issue 29 item 4, services/common/fencing.py): the hub learns the newest generation of
each (job, rank) from the LaunchRanks it queues; a rank event stamped with an older one (a
replaced incarnation that woke up, its agent's backlog after a freeze) is dropped before the
bus, and that agent is told to end the process (``ReleaseRanks.below_generation``): the
replacement L1-1 decided is already running, so this only carries that decision out.
An agent back after its session broke re-attaches no rank that was replaced meanwhile (it is
told to end it instead). The agent's own beat (``AgentHeartbeat``) goes to L1-3, which keeps
the agent's deadline (a silent agent's node gets no rank: L1-1 holds it out of placement).

The hub also carries operator log plumbing (``StreamLogs``): TailRankLogs / StopTailing
down to the sessions that launched ranks of the job, RankLogLines up into a per-request
queue (never on the bus).

And it keeps each node agent's event stream exactly-once across a control restart: every
``WorkerEvent`` after ``register`` carries a per-agent-incarnation ``seq``; an event whose
seq was already applied is dropped (counted as a duplicate: ``admit``, as the event applier
queues it); an applied one's seq is journaled in the same SQLite transaction as the event's
effect, where it has one (``JobStore.applying``), and acknowledged down the stream
(``WorkerCommand{ack}``, coalesced) once that write is committed: the journal's writer
commits every queued write in one transaction (services/control/journal_writer.py: a group
commit) and the ack is queued from its commit (the write's future), so the applier's thread
never waits for a disk and no ack covers an effect a control killed now would lose. An
event with no journaled effect (a rank's step other than rank 0's; a node's rank beats carry no seq at all) writes nothing:
it is done once applied, and acknowledged at once (``on_worker_events``). The
applier applies a job's events on the job's own queue, so one agent's events are done
in seq order per job only: the session's ``WorkerCursor`` (services/control/worker_cursor.py)
is the seq up to which all are done (the ack, the resend point) and those done above it.
A registration lists the ranks the agent still runs (``running``): they are the
session's again (re-attach).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.common.fencing import GenerationFence
from services.contract import Module, control_pb2, route_pb2, worker_pb2
from services.contract.bus import Bus, Emitter
from services.contract.relay import L1, L4, L5, RANK, Link, Routed, stamp_origin
from services.control.ack_pacer import AckPacer
from services.control.loop_queue import put_all
from services.control.metrics import WORKER_EVENTS
from services.control.session_fence import admit_generation, without_replaced
from services.control.worker_cursor import WorkerCursor

_log = structlog.get_logger("control.server")

# Whom a node agent's session may speak for: the modules of its ranks, the L4 / L5 modules
# the ranks' data and store relays speak for, the agent (EXT_HARDWARE) and the contract
# layer of either (EXT_CONTRACT, its refusals).
NODE_SPEAKS = RANK | L4 | L5 | {Module.EXT_HARDWARE, Module.EXT_CONTRACT}


@dataclass(eq=False)
class AgentSession:
    worker_id: str
    commands: queue.Queue = field(default_factory=queue.Queue)  # WorkerCommand | None (end)
    # (job_id, rank) -> rank processes launched here and not yet reported ended. A count, not
    # a flag: a recovery relaunches a rank before the killed process's exit comes up.
    ranks: Counter[tuple[str, int]] = field(default_factory=Counter)
    # Jobs that ever had ranks launched here: their rank log files live on this node.
    jobs: set[str] = field(default_factory=set)
    closed: bool = False
    incarnation: str = ""
    applied: int = 0  # highest WorkerEvent.seq applied for this incarnation
    dispatched: int = 0  # highest seq admitted to the applier's queues (``SessionHub.admit``)
    cursor: WorkerCursor | None = None  # the journaled seqs (shared by the incarnation's sessions)
    ack_queued: bool = False  # an _ACK marker waits in `commands` (acks are coalesced)
    acked_at: float = float("-inf")  # time.monotonic() of its last ack queued (ack_pacer.py)
    # (job, rank, generation) of replaced incarnations whose events came up here: ended once
    fenced: set[tuple[str, int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cursor is None:
            self.cursor = WorkerCursor(self.worker_id, self.incarnation)

    @property
    def durable(self) -> int:
        """The seq up to which every event's cursor is journaled (what an ack says)."""
        return self.cursor.watermark


# Marker in a session's command queue: send the latest journaled seq down as an EventAck.
_ACK = object()


@dataclass(eq=False)
class LogTail:
    """One StreamLogs request: the sessions asked, and the queue their answers land in:
    ``(session, RankLogLines)``, or ``(session, None)`` when a session ended without its
    ``done``."""

    request_id: str
    sessions: list[AgentSession]
    answers: Any  # a thread-safe ``put``; StreamLogs reads it on the server's loop


class SessionHub:
    """Node agent sessions: routing table worker id -> session, and the bus side of them.

    Args:
        bus: control's bus: the nodes' routed events are published on it, as the modules
            that sent them, and the commands of L1 modules to rank modules taken from it
            (``stand_in``).
        hardware: emitter as EXT_HARDWARE (WorkerRegistration, RankExited, MemoryPressure,
            RankHeartbeat: the node agent's own facts, kept as stream fields).
        journal: where applied seqs persist (JobStore); None: in memory only.
    """

    def __init__(self, bus: Bus, hardware: Emitter, journal: Any = None):
        self._hardware = hardware
        self._link = Link(
            bus, name="node agent sessions", near=L1, beyond=RANK, speaks=NODE_SPEAKS, send=self._to_ranks
        )
        # Where applied seqs persist (JobStore: worker_cursor / applying); None: in memory only.
        self._journal = journal
        self.duplicates = 0  # sequenced events dropped as already applied (also a metric)
        self._lock = threading.Lock()
        self._sessions: dict[str, AgentSession] = {}
        self._acks = AckPacer(self._lock, lambda sessions: put_all([(s.commands, _ACK) for s in sessions]))
        self._tails: dict[str, LogTail] = {}  # request id -> open StreamLogs request
        self._shutting_down = False
        # Workers whose agent said it is leaving (a departing registration on its session),
        # and workers whose session ended without that (lost: killed, its host gone): listed
        # with the cordons (server.py ListJobs) until an agent of it registers again.
        self._departing: set[str] = set()
        self._lost: dict[str, control_pb2.WorkerCordoned] = {}
        # The newest incarnation (RankAssignment.generation) of each (job, rank) launched.
        self._fence = GenerationFence()

    # ------------------------------------------------------------ session lifecycle

    def open(self, reg: control_pb2.WorkerRegistration, commands: Any = None) -> AgentSession:
        """Register a node agent; a second session with the same worker id replaces the
        first (whose ranks are reported lost, except those the new registration says it
        still runs). The ranks in ``reg.running`` are re-attached to the new session. The
        session's ``applied`` is the last seq applied for the agent's incarnation (0 for a
        new incarnation). ``commands``: where its WorkerCommands go (anything with
        ``put``; default a ``queue.Queue`` read by ``next_command``)."""
        session = AgentSession(reg.worker_id, incarnation=reg.incarnation)
        if commands is not None:
            session.commands = commands
        stale = without_replaced(self._fence, reg)
        running = [(launch.job_id, a.rank) for launch in reg.running for a in launch.ranks]
        session.ranks.update(running)
        session.jobs.update(launch.job_id for launch in reg.running)
        with self._lock:
            old = self._sessions.get(reg.worker_id)
            self._sessions[reg.worker_id] = session
            self._lost.pop(reg.worker_id, None)
            self._departing.discard(reg.worker_id)
            if old is not None:
                for key in running:  # alive on the new session: not lost with the old one
                    old.ranks.pop(key, None)
                if old.incarnation == reg.incarnation:
                    session.cursor = old.cursor  # (the applier opens it once old's events are applied)
        if old is None or old.incarnation != reg.incarnation:
            if self._journal is not None and reg.incarnation:
                journaled = self._journal.cursor(reg.worker_id)
                if journaled.incarnation == reg.incarnation:
                    session.cursor = journaled
        # The agent resends everything after the watermark; those journaled above it are dropped.
        session.applied = session.dispatched = session.cursor.watermark
        _log.info(
            "worker registered",
            worker_id=reg.worker_id,
            host=reg.host,
            slots=reg.slots,
            replaces=old is not None,
            reattached=running,
            last_applied_seq=session.applied,
        )
        # The session is routable before the allocator learns of it, so no LaunchRanks
        # can arrive for a worker that has no queue yet.
        self._hardware(reg)
        if old is not None:
            self.close(old, reason=f"replaced by a new session of {reg.worker_id}")
        for release in stale:  # (after the registration: the agent executes them in order)
            session.commands.put(control_pb2.WorkerCommand(release=release))
        return session

    def close(self, session: AgentSession, reason: str = "session closed") -> None:
        """The node agent is gone: withdraw its slots and report its live ranks lost.
        Idempotent. During shutdown nothing is reported (control is going, not the node)."""
        with self._lock:
            if session.closed:
                return
            session.closed = True
            current = self._sessions.get(session.worker_id) is session
            if current:
                del self._sessions[session.worker_id]
                if session.worker_id not in self._departing and not self._shutting_down:
                    self._lost[session.worker_id] = control_pb2.WorkerCordoned(
                        worker_id=session.worker_id,
                        incarnation=session.incarnation,
                        reason=f"node agent lost: {reason} without notice",
                        unix_time=time.time(),
                        lost=True,
                    )
                self._departing.discard(session.worker_id)
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

    def lost_workers(self) -> list[control_pb2.WorkerCordoned]:
        """The workers whose node agent session ended without notice and that no agent of has
        registered since (``WorkerCordoned.lost``), oldest first."""
        with self._lock:
            return sorted(self._lost.values(), key=lambda c: c.unix_time)

    def worker_ids(self) -> list[str]:
        """The node agents with a session open now (`surgectl drain` names one of them)."""
        with self._lock:
            return sorted(self._sessions)

    def shutdown(self) -> None:
        """End every session without reporting anything (control is stopping)."""
        with self._lock:
            self._shutting_down = True
            sessions = list(self._sessions.values())
        for s in sessions:
            self.close(s)

    def on_worker_event(self, session: AgentSession, ev: control_pb2.WorkerEvent) -> None:
        """Relay one message of a node agent's stream onto the bus as the module it
        speaks for; a sequenced one (``seq`` > 0) at most once, then acknowledged (once its
        cursor is journaled). Returns once every journal write it queued is committed.

        Raises:
            ValueError: a second registration, or an empty message.
            sqlite3.Error: the journal did not take the event's write.
        """
        later, durable = self._accept(session, ev, defer=True)
        if later:  # no journaled effect: done once applied (see on_worker_events)
            session.cursor.mark((ev.seq,))
        if ev.seq:
            self._ack_when(session, durable)
        if durable is not None:
            durable.result()
        if self._journal is not None:
            self._journal.flush()  # (and the writes the event queued without a cursor: a step's)

    def admit(self, session: AgentSession, ev: control_pb2.WorkerEvent) -> bool:
        """Whether ``ev`` is to be applied: False for a seq already admitted or journaled (a
        duplicate: counted, and the ack sent again). Called in stream order, as the event
        applier queues the message (its queues apply admitted events only)."""
        if not ev.seq:
            return True
        if ev.seq <= session.dispatched or session.cursor.has(ev.seq):
            session.dispatched = max(session.dispatched, ev.seq)
            self._duplicate(session, ev.seq)
            self._queue_ack(session)
            return False
        if ev.seq != session.dispatched + 1:
            self._gap(session, session.dispatched, ev.seq)
        session.dispatched = ev.seq
        return True

    def _gap(self, session: AgentSession, before: int, seq: int) -> None:
        """The stream went from seq ``before`` to ``seq``: the agent sends in order, so the
        seqs between will never come. After a control restart that is expected: the agent
        was acknowledged the effect-less events after its last journaled effect (they left
        no row, see ``on_worker_events``); else its outbox overflowed while control was away
        and those events are lost. Either way they must not hold the watermark back."""
        session.cursor.skip(before + 1, seq - 1)
        _log.info("worker event sequence gap", worker_id=session.worker_id, seq=seq, applied=before)

    def on_worker_events(
        self, burst: list[tuple[AgentSession, control_pb2.WorkerEvent]], admitted: bool = False, wait: bool = True
    ) -> None:
        """``on_worker_event`` for a burst of messages of any sessions, applied in the
        given order, every session acked at most once for the burst. A sequenced event that
        journaled nothing (the step of a rank other than 0; beats are unsequenced) is done once applied: its
        seq is marked in the session's cursor in memory, never written alone (it reaches the
        journal with the agent's next effect's row), and its ack goes down at once. Nothing
        of it needs to survive a restart: a restarted control that never saw its seq skips
        it when the agent's resend starts past it (``admit``; worker_cursor.py). So beats
        and non-rank-0 traffic cost no journal write (issue 28: they were one write per
        burst, ~520-730 commits/s at 1,000 agents). An event with an effect has its cursor in
        its effect's write, and its ack goes down once that is committed (until then the
        watermark, hence the ack, stays below it). A message refused (ValueError, or a
        module's error) is logged and skipped for good: one bad message must not end a
        node's session or the burst. ``admitted``: duplicates were dropped already
        (``admit``; the applier's queues apply one agent's events in seq order per job
        only). ``wait``: return once the burst's writes are committed (raising the first
        one's error); the applier does not wait (the acks follow the commits).

        Raises:
            sqlite3.Error: with ``wait``, the journal did not take a write of the burst.
        """
        acked: dict[AgentSession, None] = {}
        writes: list[Future] = []
        for session, ev in burst:
            try:
                later, durable = self._accept(session, ev, defer=True, admitted=admitted, goes_on=not wait)
            except Exception:
                _log.exception("worker event refused", worker_id=session.worker_id)
                later, durable = True, None  # skipped for good: its seq must not hold the watermark back
            if not ev.seq:
                continue
            if later:
                session.cursor.mark((ev.seq,))
                acked[session] = None
            elif durable is not None:
                writes.append(durable)
                self._ack_when(session, durable)
            else:
                acked[session] = None
        self._queue_acks(acked)
        if wait:
            for write in writes:
                write.result()
            if self._journal is not None:
                self._journal.flush()  # (and the writes queued without a cursor: a step's)

    def _ack_when(self, session: AgentSession, durable: Future | None) -> None:
        """Queue the session's ack once ``durable`` (the write carrying an event's cursor) is
        committed; at once if there is none (nothing journaled, or journaled already)."""
        if durable is None or durable.done():
            self._queue_ack(session)
        else:
            # (also after a failed write: an ack says only what is journaled, ``durable``)
            durable.add_done_callback(lambda done: self._queue_ack(session))

    def _accept(
        self,
        session: AgentSession,
        ev: control_pb2.WorkerEvent,
        defer: bool,
        admitted: bool = False,
        goes_on: bool = False,
    ) -> tuple[bool, Future | None]:
        """Apply ``ev`` unless its seq was applied already. Returns (later, durable): later
        True: its cursor is not yet marked (only with ``defer``, for an event that
        journaled nothing: the caller marks it); durable: the future of the journal write
        that carries its cursor (None: none, or none needed). ``goes_on``: the caller waits for
        none of its writes (the applier's bursts): a decision it causes may go on before its
        commit (orchestrator/commit_later.py), its ack following that commit all the same."""
        if not ev.seq:
            self._apply(session, ev)
            return False, None
        if not admitted:
            if ev.seq <= session.applied or session.cursor.has(ev.seq):
                self._duplicate(session, ev.seq)
                return False, None
            if ev.seq != session.applied + 1:
                self._gap(session, session.applied, ev.seq)
        written, durable = True, None
        if self._journal is not None:
            with self._journal.applying(
                session.worker_id, session.incarnation, ev.seq, defer=defer, cursor=session.cursor, goes_on=goes_on
            ) as ctx:
                self._apply(session, ev)
            written, durable = ctx.written or not defer, ctx.durable
        else:
            self._apply(session, ev)
            if not defer:
                session.cursor.mark((ev.seq,))
            written = not defer
        session.applied = max(session.applied, ev.seq)
        if not admitted:  # (else the applier's admit keeps it, on the server's loop)
            session.dispatched = max(session.dispatched, ev.seq)
        WORKER_EVENTS.labels("applied").inc()
        return not written, durable

    def _duplicate(self, session: AgentSession, seq: int) -> None:
        self.duplicates += 1
        WORKER_EVENTS.labels("duplicate").inc()
        _log.info("duplicate worker event dropped", worker_id=session.worker_id, seq=seq, applied=session.durable)

    def _queue_acks(self, sessions: Iterable[AgentSession]) -> None:
        """``_queue_ack`` for many sessions, waking the server's loop once for all of them
        (a wake-up is a write to its self-pipe: one per ack was a measured 3 % of control);
        at most one ack per session per interval (ack_pacer.py)."""
        self._acks.queue(sessions)

    def _queue_ack(self, session: AgentSession) -> None:
        self._acks.queue((session,))

    def next_command(self, session: AgentSession) -> control_pb2.WorkerCommand | None:
        """The next command for the session's stream (blocks; for a ``queue.Queue``
        session); None: the session ended. An ack marker becomes an EventAck of the latest
        journaled seq."""
        return self.command(session, session.commands.get())

    def command(self, session: AgentSession, item: Any) -> control_pb2.WorkerCommand | None:
        """The WorkerCommand for an item taken from the session's queue (``_ACK``: an
        EventAck of the latest journaled seq; None: the session ended)."""
        if item is _ACK:
            with self._lock:
                session.ack_queued = False
            return control_pb2.WorkerCommand(
                ack=control_pb2.EventAck(seq=session.durable, incarnation=session.incarnation)
            )
        return item

    def _apply(self, session: AgentSession, ev: control_pb2.WorkerEvent) -> None:
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
        elif kind == "rank_beats":  # a node's beats of one job, each applied as if alone
            for beat in ev.rank_beats.beats:
                if beat.HasField("heartbeat"):
                    self._relay_rank_event(session, beat)
            if ev.rank_beats.HasField("agent"):  # (unless the applier split it off on receipt)
                self._agent_beat(session, ev.rank_beats.agent)
        elif kind == "routed":  # the node agent's own (its contract layer's refusals, ...), by name
            self._link.deliver(ev.routed, stamp=lambda msg: stamp_origin(msg, worker_id=session.worker_id))
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
        elif kind == "heartbeat":
            self._agent_beat(session, ev.heartbeat)
        elif kind == "register" and ev.register.departing:
            # The agent is leaving: no rank may be placed on it any more (its ranks' exits
            # follow, stated by the agent as departures); its session's end is no loss.
            ev.register.worker_id = session.worker_id
            with self._lock:
                self._departing.add(session.worker_id)
            self._hardware(ev.register)
        elif kind == "register":
            raise ValueError(f"worker {session.worker_id} registered twice on one session")
        elif kind == "batch":  # (the server unpacks a batch on receipt: services/control/server.py)
            raise ValueError(f"worker {session.worker_id}: a batch of events is applied one by one")
        else:
            raise ValueError(f"worker {session.worker_id} sent an empty WorkerEvent")

    # ------------------------------------------------------------ bus handlers (as EXT_HARDWARE)

    def launch_ranks(self, msg: control_pb2.LaunchRanks, payload: Any = None) -> None:
        """Queue LaunchRanks on the session of worker ``payload``."""
        ranks = [(msg.job_id, r.rank) for r in msg.ranks]
        for r in msg.ranks:  # the newest incarnation of each: an older one's events are dropped from now on
            self._fence.tell(msg.job_id, r.rank, r.generation)
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

    # ------------------------------------------------------------ bus handlers (as the rank modules)

    def stand_in(self) -> list[tuple[str, int]]:
        """Subscribe the hub, on control's bus, as the receiver of every command an L1 module
        may send a rank module (InitJob and RankAssignment included, though LaunchRanks
        carries the set-up ones); returns the subscriptions. Raises RouteError (see
        ``Link.stand_in``)."""
        return self._link.stand_in(kinds=(route_pb2.COMMAND,))

    def _to_ranks(self, routed: Routed, msg: Any, payload: Any = None) -> None:
        """Queue a routed command on every session that launched (or re-attached) ranks of
        its job; the node agent hands it to each of its live ranks of that job (none: it
        logs and drops it). By job, not by live-rank count: after a control restart an exit
        resent late may be counted against a rank relaunched since."""
        job_id = getattr(msg, "job_id", "")
        if not job_id:
            raise ValueError(f"{routed.type} names no job: it cannot be relayed to a job's ranks")
        command = control_pb2.WorkerCommand(routed=routed, job_id=job_id)
        with self._lock:
            for session in self._sessions.values():
                if job_id in session.jobs:
                    session.commands.put(command)

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
            cmd = control_pb2.WorkerCommand(
                tail_rank_logs=control_pb2.TailRankLogs(request_id=request_id, job_id=job_id, follow=follow, rank=rank)
            )
            for s in sessions:
                s.commands.put(cmd)
        return tail

    def close_tail(self, tail: LogTail, pending: set[AgentSession]) -> None:
        """Forget the request; the sessions in ``pending`` (no done yet) get StopTailing."""
        with self._lock:
            self._tails.pop(tail.request_id, None)
            cmd = control_pb2.WorkerCommand(stop_tailing=control_pb2.StopTailing(request_id=tail.request_id))
            for s in pending:
                if not s.closed:
                    s.commands.put(cmd)

    # ------------------------------------------------------------ private

    def _relay_rank_event(self, session: AgentSession, ev: worker_pb2.RankEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind in ("hello", "audit") or kind is None:
            return  # between a rank and its node agent only
        if not admit_generation(self._fence, session, ev, self._lock, self.release_ranks):
            return
        if kind == "routed":
            # The envelope names the rank the node agent attached; the session names the node.
            self._link.deliver(
                ev.routed,
                stamp=lambda msg: stamp_origin(msg, job_id=ev.job_id, rank=ev.rank, worker_id=session.worker_id),
            )
            return
        # kind == "heartbeat": liveness plumbing, relayed as the node agent (EXT_HARDWARE) speaks
        # for its processes; the envelope names the rank the agent attached, the session the node.
        beat = ev.heartbeat
        beat.job_id, beat.rank, beat.worker_id = beat.job_id or ev.job_id, ev.rank, session.worker_id
        self._hardware(beat)

    def _agent_beat(self, session: AgentSession, beat: control_pb2.AgentHeartbeat) -> None:
        """The agent itself is alive (alone, or riding its ranks' RankBeats): L1-3 re-arms its deadline."""
        beat.worker_id = session.worker_id  # (a node agent speaks only for its own node)
        self._hardware(beat)

    def _report_lost(self, worker_id: str, ranks: list[tuple[str, int]], reason: str) -> None:
        # Each with the launch that ran there, read before any report: the first one relaunches
        # the job at once (a newer generation), and a node lost with all its ranks of one launch
        # counts once against it (sick_nodes.py).
        launched = [(job_id, rank, self._fence.newest(job_id, rank)) for job_id, rank in ranks]
        for job_id, rank, gen in launched:
            self._hardware(
                control_pb2.RankExited(
                    job_id=job_id, rank=rank, worker_id=worker_id, detail=reason, worker_lost=True, generation=gen
                )
            )
