"""Applying the node agent sessions' messages: each job's in order on the job's own queue,
jobs in parallel on a small bounded pool of threads (``EventApplier``).

Why: one thread applied every session's messages, so one job's slow apply (a journal
commit, a recovery decision) delayed every other job's steps and every beat behind it
(issue 28: step events p99 12.7 s at 3,000 agents). Now a message is queued on the queue of
the job it is about (a rank's routed event, heartbeat or exit names its job); messages about
no one job (the agent's own facts: memory pressure, a departing registration, its contract
layer's refusals, log lines) and the sessions' opening and closing go on one ordered node
queue, as do the calls posted with ``call`` (the store's answers). A queue is a deque, not a
thread: a queue with messages is handed to the pool's next free thread, which applies a
burst of it (``SessionHub.on_worker_events``: up to ``max_burst`` messages, the effect-less
cursors in one journal write) and hands the queue back if more came; so at most one thread applies
a queue's messages at a time (the job's order), ``workers`` threads serve any number of jobs,
and an idle job costs nothing.

Order across queues: one agent's messages about two jobs are applied in stream order per job
only; exactly-once survives it (services/control/worker_cursor.py). A session opens after,
and closes after, every message of its worker already queued on any queue (its exit reports
come before its close; a replacing session's resend never overtakes the old one's messages).

Locks (control's order, outermost first; no thread takes them the other way round):

1. a job's serial queue (not a lock: one pool thread at a time holds it);
2. the orchestrator's decision lock (``Orchestrator._lock``: one job's transition and the
   cluster-wide state it touches, short; services/control/orchestrator/core.py), then a
   job's journal lock (the order its journal writes are queued in), then the allocator's
   and the fault detector's own (taken inside a decision, never around one): one lock per
   job's state there, then its small cluster-wide lock for the agents and nodes (a leaf;
   services/control/fault_detector/detector.py), so two jobs' beats never wait for each
   other;
3. leaf locks, held for bookkeeping only, with no call out under them: this applier's
   ``_lock`` (its queues), ``SessionHub._lock``, the journal writer's queue, a
   ``WorkerCursor``'s.

The journal's writer thread (services/control/journal_writer.py) takes ``JobStore._lock``
around each group's SQLite transaction, and runs what follows a commit (a JobEvent's
emission, an ack) with leaf locks only, so a decision waiting on a write's commit (its
future) under the decision lock never waits on a lock of its own. A burst's journal writes
are queued, not waited for (``SessionHub.on_worker_events(wait=False)``): a pool thread never
waits for a disk; the burst's acks are queued from the commits.

Beats are facts of now: a session's beat still waiting on a queue (nothing of the session
queued behind it there) is superseded by its next one, rank by rank (``_fold``), so a backlog
holds at most one beat per session, kind and queue, and applies each agent's newest.

Receipt is stamped on the server's loop, as a message is queued (``event``): a heartbeat
carries it to the fault detector in ``RankHeartbeat.received_monotonic``, so its deadlines
count from when control received the beat, never from when a pool thread got to it. Health
and lag are metrics (services/control/metrics.py): ``surge_control_applier_lag_seconds``
(each burst's oldest message's wait), ``surge_control_apply_seconds`` (a burst's apply),
``surge_control_queue_depth``, ``surge_control_job_queues`` and
``surge_control_oldest_unapplied_seconds``.

Args (``EventApplier``):
    hub: the sessions it applies to.
    workers: the pool's threads (started with the first message: an in-process control
        that serves no gRPC starts none).
    max_burst: most messages of one queue applied before their cursors are journaled and
        acked and the thread moves on to another queue.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.contract import control_pb2
from services.control.beat_stamps import BeatStamps
from services.control.control_health import ControlHealth
from services.control.metrics import (
    APPLIER_LAG,
    APPLY_SECONDS,
    BEATS_COALESCED,
    BEATS_STAMPED,
    JOB_QUEUES,
    OLDEST_UNAPPLIED,
    QUEUE_DEPTH,
)
from services.control.session_hub import AgentSession, SessionHub

_log = structlog.get_logger("control.server")

NODE = ""  # the key of the queue of messages about no one job


@dataclass(eq=False)
class _Queue:
    key: str  # a job id, or NODE
    # (session, event, received monotonic) | (None, callable, queued monotonic)
    items: deque = field(default_factory=deque)
    scheduled: bool = False  # waiting for a thread, or being applied by one


def job_of(ev: control_pb2.WorkerEvent) -> str:
    """The job a node agent's message is about (NODE: none)."""
    kind = ev.WhichOneof("event")
    if kind == "rank_event":
        return ev.rank_event.job_id or ev.rank_event.heartbeat.job_id
    if kind == "rank_exited":
        return ev.rank_exited.job_id
    if kind == "rank_beats":
        return ev.rank_beats.job_id
    if kind == "routed" and ev.routed.type == _PROCESS_STATE:
        # A rank's process, stated by its agent: on its job's queue, in order with the rank's
        # beats and exit (a launch states every rank's: 8,192 on the node queue held every
        # agent's beat behind them, issue 28).
        state = control_pb2.RankProcessState()
        state.ParseFromString(ev.routed.body)
        return state.job_id
    return NODE


_PROCESS_STATE = control_pb2.RankProcessState.DESCRIPTOR.full_name


def split_agent_beat(ev: control_pb2.WorkerEvent) -> control_pb2.WorkerEvent | None:
    """The node agent's own beat that rode in a ``RankBeats`` (taken out of it), as the
    ``WorkerEvent.heartbeat`` it stands for; None if it carries none. So control applies it
    exactly as one sent alone: on the node queue, not behind the job's, and unsequenced (it
    is a fact of now, as the RankBeats is: unsequenced, services/worker/control_link.py)."""
    if not ev.rank_beats.HasField("agent"):
        return None
    alone = control_pb2.WorkerEvent(heartbeat=ev.rank_beats.agent)
    ev.rank_beats.ClearField("agent")
    return alone


def _fold(waiting: control_pb2.WorkerEvent, newer: control_pb2.WorkerEvent) -> bool:
    """Fold ``newer`` into ``waiting`` (a message still queued) if both are beats of one kind
    (unsequenced): the agent's own beat is replaced; ranks' beats of one job are merged rank by
    rank, the newer beat of each rank kept (a rank absent from the newer keeps its last one, so
    no rank's beat is lost). False: not beats of one kind; nothing changed."""
    kind = newer.WhichOneof("event")
    if newer.seq or waiting.seq or kind not in ("heartbeat", "rank_beats") or waiting.WhichOneof("event") != kind:
        return False
    if kind == "heartbeat":
        waiting.heartbeat.CopyFrom(newer.heartbeat)
        return True
    if waiting.rank_beats.job_id != newer.rank_beats.job_id or newer.rank_beats.HasField("agent"):
        return False  # (the agent's beat is split off on receipt: one riding still is not folded)
    if _by_datagram(waiting) != _by_datagram(newer):
        # Beats that rode a liveness datagram never replace the session's (a rank's first beat
        # of a session is what starts its watch; one by datagram starts none): queued behind.
        return False
    fresh = {b.rank for b in newer.rank_beats.beats}
    kept = [b for b in waiting.rank_beats.beats if b.rank not in fresh]
    del waiting.rank_beats.beats[:]
    waiting.rank_beats.beats.extend(kept)
    waiting.rank_beats.beats.extend(newer.rank_beats.beats)
    return True


def _by_datagram(ev: control_pb2.WorkerEvent) -> bool:
    """Whether a RankBeats rode a liveness datagram (its beats all did, or none did)."""
    beats = ev.rank_beats.beats
    return bool(beats) and beats[0].heartbeat.by_datagram


class InOrder:
    """What a module may hold of the applier: ``in_order(fn, key)`` runs the holder's own
    ``fn`` on the queue ``key`` (a job id, or NODE) after everything queued there before
    (``EventApplier.call``), and offers nothing else: no session, message or module is
    reachable through it (tests/redlines/wiring.py does not enter it, as it does not enter a
    port). L1-3 decides a silence deadline that fired so, behind the beats control received
    before it fired (services/control/fault_detector/detector.py)."""

    __slots__ = ("_call",)

    def __init__(self, applier: EventApplier):
        self._call = applier.call

    def __call__(self, fn: Callable[[], None], key: str) -> None:
        self._call(fn, key, after_receipt=True)


class EventApplier:
    """Applies the node agent sessions' messages, per job in order, jobs in parallel on a
    bounded pool (see the module docstring for the queues, the order and the locks)."""

    def __init__(self, hub: SessionHub, workers: int = 4, max_burst: int = 1024, stamps: BeatStamps | None = None):
        self._hub, self._workers, self._max_burst = hub, max(1, workers), max_burst
        # An agent's beat that changes nothing is taken as it is read (beat_stamps.py): the
        # composition root's stamps, which L1-3 arms; None: every beat is queued.
        self._stamps = stamps
        self.health = ControlHealth()  # control's own lag, probed on the loop (receive_on)
        self._lock = threading.Lock()  # the queues and counts below; nothing is called under it
        self._work = threading.Condition(self._lock)  # a queue became ready, or stop
        self._idle = threading.Condition(self._lock)  # nothing queued or being applied
        self._queues: dict[str, _Queue] = {}  # a job's is dropped once empty
        self._ready: deque[_Queue] = deque()  # queues waiting for a thread, in turn
        self._busy = 0  # queues being applied
        self._queued = 0  # messages and calls waiting in the queues
        self._in_flight: Counter[str] = Counter()  # worker id -> its messages queued, not yet applied
        # (session, queue key) -> the session's last message queued there, until a thread takes it
        self._last: dict[tuple[int, str], list] = {}
        self._after: dict[str, list[Callable[[], None]]] = {}  # worker id -> opens / closes waiting for them
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None  # receive_on
        _publish(self)

    # ------------------------------------------------------------ producers (any thread)

    def event(self, session: AgentSession, ev: control_pb2.WorkerEvent) -> None:
        """Queue one message of ``session``'s stream on its job's queue, stamped with its
        receipt (a heartbeat's ``received_monotonic``); a duplicate is dropped here
        (``SessionHub.admit``: called in stream order)."""
        self.events(((session, ev),))

    def events(self, messages: Iterable[tuple[AgentSession, control_pb2.WorkerEvent]]) -> None:
        """``event`` for each of ``messages`` in order (several sessions' messages, each
        session's in its stream order), all queued under one take of the lock: a pool thread
        is woken once per queue they schedule, not once per message (the liveness reader hands
        over every datagram of one read: services/control/liveness_datagrams.py)."""
        received = time.monotonic()
        queued: list[tuple[str, AgentSession, control_pb2.WorkerEvent]] = []
        for session, ev in messages:
            self._receipt(session, ev, received, queued)
        if queued:
            with self._lock:
                for key, session, ev in queued:
                    self._queue_message(key, session, ev, received)

    def _receipt(
        self,
        session: AgentSession,
        ev: control_pb2.WorkerEvent,
        received: float,
        queued: list[tuple[str, AgentSession, control_pb2.WorkerEvent]],
    ) -> None:
        """Stamp ``ev``'s receipt; append what of it goes on a queue to ``queued`` (key,
        session, message): nothing for a beat the stamps take or a duplicate."""
        agent = None
        stamps = self._stamps
        if ev.HasField("rank_event") and ev.rank_event.HasField("heartbeat"):
            ev.rank_event.heartbeat.received_monotonic = received
        elif ev.HasField("rank_beats"):  # a node's beats of one job, sent together
            for beat in ev.rank_beats.beats:
                beat.heartbeat.received_monotonic = received
            if (  # the agent's own beat riding, liveness only: taken here (beat_stamps.py)
                stamps is not None
                and ev.rank_beats.HasField("agent")
                and stamps.beat(session.worker_id, ev.rank_beats.agent.interval_seconds or 1.0, received)
            ):
                ev.rank_beats.ClearField("agent")
                BEATS_STAMPED.inc()
            agent = split_agent_beat(ev)
            if agent is None and not ev.rank_beats.beats:  # (the agent's beat, taken, was all it carried)
                return
        elif ev.HasField("heartbeat"):  # the node agent's own beat (L1-2's placement reads its receipt)
            if stamps is not None and stamps.beat(session.worker_id, ev.heartbeat.interval_seconds or 1.0, received):
                BEATS_STAMPED.inc()
                return  # liveness only: taken here, never queued
            ev.heartbeat.received_monotonic = received
        if agent is not None:  # as if it had come alone, just before: on the node queue, unsequenced
            agent.heartbeat.received_monotonic = received
            queued.append((NODE, session, agent))
        if self._hub.admit(session, ev):
            queued.append((job_of(ev), session, ev))

    def receive_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """The gRPC server's loop, which receives the sessions' messages (the composition
        root's): a call posted ``after_receipt`` goes through it first; control's health
        (``health``: the loop's lag, the oldest unapplied message) is probed on it."""
        self._loop = loop
        self.health.watch(loop, self.oldest_unapplied)

    def call(self, fn: Callable[[], None], key: str = NODE, after_receipt: bool = False) -> None:
        """Run ``fn`` on a pool thread, after everything queued before it on the queue
        ``key`` (default: the node queue). ``after_receipt``: after what the server's loop
        has received by then too: the call is queued from that loop, behind the messages it
        had ready (a deadline that fired while control's loop was starved, 1,024 agents'
        beats waiting in its reads, must not find their senders silent: issue 28)."""
        loop = self._loop if after_receipt else None
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._queue_call, fn, key)
                return
            except RuntimeError:  # the loop closed meanwhile (control stopping): queued now
                pass
        self._queue_call(fn, key)

    def _queue_call(self, fn: Callable[[], None], key: str) -> None:
        with self._lock:
            self._put(key, (None, fn, time.monotonic()))

    async def open(self, reg: control_pb2.WorkerRegistration, commands: Any) -> AgentSession:
        """``SessionHub.open`` on the node queue, once the worker's messages already queued
        are applied; awaited on the server's loop. If the caller is cancelled meanwhile,
        the session is closed again."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future = loop.create_future()

        def deliver(result: AgentSession | BaseException) -> None:
            if opened.cancelled():
                if isinstance(result, AgentSession):
                    self.close(result, reason="session cancelled while opening")
            elif isinstance(result, BaseException):
                opened.set_exception(result)
            else:
                opened.set_result(result)

        def do() -> None:
            try:
                result: AgentSession | BaseException = self._hub.open(reg, commands)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                result = e
            loop.call_soon_threadsafe(deliver, result)

        self._after_worker(reg.worker_id, do)
        return await opened

    def close(self, session: AgentSession, reason: str = "session closed") -> None:
        """``SessionHub.close`` after every message of the worker already queued."""
        self._after_worker(session.worker_id, lambda: self._hub.close(session, reason))

    def stop(self, timeout: float = 10.0) -> None:
        """End the threads after what is queued (idempotent)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (self._ready or self._busy) and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            self._stopping = True
            self._work.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))

    # ------------------------------------------------------------ health (the metrics read these)

    def depth(self) -> tuple[int, int]:
        """(messages waiting on job queues, on the node queue)."""
        with self._lock:
            node = self._queues.get(NODE)
            on_node = len(node.items) if node is not None else 0
            return self._queued - on_node, on_node

    def job_queues(self) -> int:
        """Job queues with messages waiting or being applied."""
        with self._lock:
            return sum(1 for q in self._queues.values() if q.key != NODE and q.scheduled)

    def oldest_unapplied(self) -> float:
        """Seconds the oldest message or call still waiting has waited (0: none waits)."""
        with self._lock:
            oldest = min((q.items[0][2] for q in self._queues.values() if q.items), default=None)
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    # ------------------------------------------------------------ private

    def _after_worker(self, worker_id: str, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._in_flight[worker_id]:
                self._after.setdefault(worker_id, []).append(fn)
            else:
                self._in_flight.pop(worker_id, None)
                self._put(NODE, (None, fn, time.monotonic()))

    def _queue_message(self, key: str, session: AgentSession, ev: control_pb2.WorkerEvent, received: float) -> None:
        """Under ``_lock``: queue one message of ``session`` on the queue ``key``, or fold it into
        the session's beat still waiting there. A beat (the agent's own, or its ranks' beats of
        one job: unsequenced facts of now) supersedes a beat of the same kind that the session
        queued there last and no thread has taken yet: rank by rank, the newer beat wins
        (``_fold``). So a queue holds at most one waiting beat per session and kind, whatever
        control's backlog: 10,000 agents on a control behind by seconds queued 10,000 beats a
        second it would apply late (its memory grew to 13 GB, OOM-killed, session 34), and
        each agent's newest beat waited behind its stale ones. Nothing else is folded: a
        sequenced event, or any message queued after the beat, keeps every message in order."""
        last = (id(session), key)  # (the item holds the session: its id is not reused meanwhile)
        waiting = self._last.get(last)
        if waiting is not None and _fold(waiting[1], ev):
            BEATS_COALESCED.inc()
            return
        item = [session, ev, received]
        self._last[last] = item
        self._in_flight[session.worker_id] += 1
        self._put(key, item)

    def _put(self, key: str, item: tuple | list) -> None:
        """Under ``_lock``: queue ``item`` on the queue ``key``; hand the queue to the pool
        if no thread has it."""
        if not self._threads:
            for i in range(self._workers):
                t = threading.Thread(target=self._run, name=f"event-applier-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue(key)
        q.items.append(item)
        self._queued += 1
        if not q.scheduled:
            q.scheduled = True
            self._ready.append(q)
            self._work.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._ready:
                    if self._stopping:
                        return
                    self._work.wait()
                q = self._ready.popleft()
                burst = self._take(q)
                self._busy += 1
            done = self._apply(q.key, burst)
            with self._lock:
                self._busy -= 1
                for worker_id in done:
                    self._in_flight[worker_id] -= 1
                    if self._in_flight[worker_id] <= 0:
                        del self._in_flight[worker_id]
                        for fn in self._after.pop(worker_id, ()):
                            self._put(NODE, (None, fn, time.monotonic()))
                if q.items:
                    self._ready.append(q)  # (behind the others: a busy job does not starve them)
                    self._work.notify()
                else:
                    q.scheduled = False
                    if q.key != NODE:
                        del self._queues[q.key]
                if not self._ready and not self._busy:
                    self._idle.notify_all()

    def _take(self, q: _Queue) -> list[tuple]:
        """Under ``_lock``: the next burst of ``q``: messages up to ``max_burst``, or one call."""
        burst: list[tuple] = []
        while q.items and len(burst) < self._max_burst:
            if q.items[0][0] is None and burst:
                break  # a call runs after the messages before it, alone
            burst.append(q.items.popleft())
            if burst[-1][0] is None:
                break
            last = (id(burst[-1][0]), q.key)
            if self._last.get(last) is burst[-1]:  # (taken: a later beat of the session is queued anew)
                del self._last[last]
        self._queued -= len(burst)
        return burst

    def _apply(self, key: str, burst: list[tuple]) -> list[str]:
        """Apply one burst; returns the worker id of each message applied (or dropped)."""
        call = burst[0][0] is None  # (a session's open or close, a posted deadline, a store answer)
        which = ("node" if key == NODE else "job") + ("_call" if call else "")
        started = time.monotonic()
        APPLIER_LAG.labels(which).observe(max(0.0, started - burst[0][2]))
        if call:
            try:
                burst[0][1]()
            except Exception:  # noqa: BLE001 - the pool must outlive one bad call
                _log.exception("session open/close or posted call failed")
            APPLY_SECONDS.labels(which).observe(time.monotonic() - started)
            return []
        try:
            self._hub.on_worker_events([(s, ev) for s, ev, _ in burst], admitted=True, wait=False)
        except Exception:  # noqa: BLE001 - e.g. the journal's disk is full: the acks wait
            _log.exception("worker event burst failed", size=len(burst), queue=which)
        APPLY_SECONDS.labels(which).observe(time.monotonic() - started)
        return [s.worker_id for s, _, _ in burst]


def _publish(applier: EventApplier) -> None:
    """The gauges read the newest applier (one per control process; tests make more)."""
    ref = weakref.ref(applier)

    def read(fn: Callable[[EventApplier], float]) -> Callable[[], float]:
        return lambda: fn(a) if (a := ref()) is not None else 0.0

    QUEUE_DEPTH.labels("job").set_function(read(lambda a: a.depth()[0]))
    QUEUE_DEPTH.labels("node").set_function(read(lambda a: a.depth()[1]))
    JOB_QUEUES.set_function(read(EventApplier.job_queues))
    OLDEST_UNAPPLIED.set_function(read(EventApplier.oldest_unapplied))
