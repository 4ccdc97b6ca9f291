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

And it keeps each node agent's event stream exactly-once across a control restart (seqs,
cursors, acks): exactly_once.py, a part of the hub.
A registration lists the ranks the agent still runs (``running``): they are the
session's again (re-attach).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.common.fencing import GenerationFence
from services.contract import Module, control_pb2, route_pb2, worker_pb2
from services.contract.bus import Bus, Emitter
from services.contract.relay import L1, L4, L5, RANK, Link, Routed, stamp_origin
from services.control import session_fence
from services.control.ack_pacer import AckPacer
from services.control.exactly_once import _ACK, ExactlyOnce
from services.control.loop_queue import put_all
from services.control.session_fence import admit_generation, lost_exits, reattached, replaced, without_replaced
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
    # (job_id, rank) -> the newest generation launched (or re-attached) here: what a rank lost
    # with this session was launched as (a replaced one's loss is stated ``replaced``).
    generations: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cursor is None:
            self.cursor = WorkerCursor(self.worker_id, self.incarnation)

    @property
    def durable(self) -> int:
        """The seq up to which every event's cursor is journaled (what an ack says)."""
        return self.cursor.watermark


@dataclass(eq=False)
class LogTail:
    """One StreamLogs request: the sessions asked, and the queue their answers land in:
    ``(session, RankLogLines)``, or ``(session, None)`` when a session ended without its
    ``done``."""

    request_id: str
    sessions: list[AgentSession]
    answers: Any  # a thread-safe ``put``; StreamLogs reads it on the server's loop


class SessionHub(ExactlyOnce):
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
        session.generations.update(reattached(self._fence, reg))
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
            generations = dict(session.generations)
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
        self._report_lost(session.worker_id, lost, reason, generations)

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
            # A fact, not a verdict: its launch is older than the newest of its rank. L1-3
            # grades it, L1-1 decides (never dropped here: the old incarnation's end is news).
            exited.replaced = replaced(self._fence, exited.job_id, exited.rank, exited.generation)
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
                for r in msg.ranks:
                    key = (msg.job_id, r.rank)
                    session.generations[key] = max(session.generations.get(key, 0), r.generation)
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
            mark = session_fence.replaced_failure(ev, session.worker_id)  # (its failure events, for the record)
            if mark is not None:
                self._link.deliver(ev.routed, stamp=mark)
            return
        if kind == "routed":
            # The envelope names the rank the node agent attached; the session names the node.
            self._link.deliver(ev.routed, stamp=session_fence.admitted_stamp(ev, session.worker_id))
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

    def _report_lost(
        self,
        worker_id: str,
        ranks: list[tuple[str, int]],
        reason: str,
        generations: dict[tuple[str, int], int] | None = None,
    ) -> None:
        # Read before any report: the first one relaunches the job at once (a newer generation).
        for lost in lost_exits(self._fence, worker_id, ranks, reason, generations or {}):
            self._hardware(lost)
