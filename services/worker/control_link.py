"""The node agent's link to control: the ``ControlService.WorkerSession`` stream and the
outbox of events waiting to go up it.

* :class:`Outbox`: every event the agent states gets the next sequence number and is kept
  until control acknowledges it, so an event in flight when control went away is sent
  again after the agent re-registers, and control drops what it had applied already.
  Sequenced events (and the node's rank beats among them) that piled up since the last send
  go up as one ``WorkerEvent.batch`` (each keeps its seq), to a control that says it reads them.
* :class:`ControlSession`: keeps the stream open, registers first on every session,
  reconnects when it breaks (rank processes are not touched), and executes the commands
  that come down one by one, in order (so a ``release`` then ``launch`` of the same rank
  is ordered). With control's ``LivenessGrant`` (the ``surge-liveness-bin`` header) the
  agent's own beat goes as a UDP datagram (liveness_sender.py), and on the session too while
  control says it hears none of them (``BeatOnSession``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from services.common.grpc_server import SMALL_MESSAGES, channel
from services.common.liveness_progress import ProgressSplit, pack
from services.contract import Module, control_pb2, control_pb2_grpc
from services.worker.liveness_sender import LivenessSender, control_host

# What every part of the agent that states a fact is given: queues one event for control.
Emit = Callable[[control_pb2.WorkerEvent], None]
# The messages the outbox sends without a seq, acknowledges never and resends never (Outbox).
FACTS = frozenset({"rank_beats"})
# Sequenced messages that may share one stream message with the ones queued after them
# (``WorkerEvent.batch``, Outbox.get): small reports of ranks and processes. Not log lines (an
# operator's tail, large) nor a departing registration.
BATCHED = frozenset({"rank_event", "rank_exited", "routed", "memory_pressure"})
_BATCHABLE = BATCHED | FACTS
TOGETHER_MAX_S = 0.05  # the most the session waits for a block of puts to end (Outbox.together)
MAX_BATCH = 64  # events in one batch (a node's launch of 8 ranks states 16)
MAX_BATCH_BYTES = 1 << 20  # and bytes: far below the stream's message limit (4 MiB by default)


class Outbox:
    """Events going up to control, in the order they happened, kept until control
    acknowledges them.

    Every event put here gets the next sequence number of this agent incarnation
    (``WorkerEvent.seq``: 1, 2, 3, ...). A session sends them in order from the first one
    control has not acknowledged (:meth:`resume`, with the last seq control says it
    applied); :meth:`ack` forgets those control has applied and persisted. So an event
    that was in flight, or queued, when control went away is sent again after the agent
    re-registers, and control drops any it had applied already: none lost, none applied
    twice. Bounded, dropping the oldest, so a long control outage cannot exhaust the
    node's memory (``dropped`` counts what was lost; control sees the gap).

    A node's ranks' beats (``WorkerEvent.rank_beats``) are facts of now: queued in order like
    the rest (a beat never overtakes a later event of its rank, rank_beats.py) but without a
    seq, forgotten once sent and never resent (the next period's beats say more than a
    resent one; one still queued when a session ends is dropped). So control acknowledges
    none of them: they were nearly every ack it sent (256 acks/s for 258 messages at 256
    agents, issue 28), and a replay after a reconnect re-armed deadlines with old news.
    """

    def __init__(self, max_events: int = 100_000):
        self._items: collections.deque[control_pb2.WorkerEvent] = collections.deque()  # seq ascending
        self._max = max_events
        self._cond = threading.Condition()
        self._seq = 0  # last seq given
        self._next = 0  # index in _items of the next event to send in this session
        self._sent = 0  # highest seq ever handed to a session
        self._open = False  # a session resumed and may take events
        self._acked = True  # the session's control acknowledges (else: sent = delivered)
        self.dropped = 0
        self.resent = 0  # events sent again after a reconnect (sent before, never acknowledged)
        self._beat: control_pb2.WorkerEvent | None = None  # the agent's newest unsent beat (no seq)
        self._batches = False  # the session's control reads WorkerEvent.batch (resume)
        self._together = 0  # blocks inside together(): the session waits for their end

    def put(self, event: control_pb2.WorkerEvent) -> None:
        """Give ``event`` the next seq and queue it; never blocks."""
        with self._cond:
            if event.WhichOneof("event") in FACTS:
                event.seq = 0
            else:
                self._seq += 1
                event.seq = self._seq
            if len(self._items) >= self._max:
                self._items.popleft()
                self._next = max(0, self._next - 1)
                self.dropped += 1
            self._items.append(event)
            if not self._together:  # (else the block's end wakes the session, once)
                self._cond.notify_all()

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """What is put inside the block goes up as one stream message where it can (a batch):
        the session takes nothing until the block ends, or ``TOGETHER_MAX_S`` at most (it must
        never hold a report back). A rank's RankSession message (a beat period's steps and its
        beat) is relayed event by event; without this the session could wake and send after
        the first."""
        with self._cond:
            self._together += 1
        try:
            yield
        finally:
            with self._cond:
                self._together -= 1
                if not self._together:
                    self._cond.notify_all()

    def beat(self, event: control_pb2.WorkerEvent) -> None:
        """The agent's own heartbeat: sent ahead of the queue, without a seq (a fact of now,
        never resent), replacing one not sent yet; never blocks."""
        with self._cond:
            self._beat = event
            self._cond.notify_all()

    def get(self, cancelled: threading.Event) -> control_pb2.WorkerEvent | None:
        """Block until the session may send the next event (returned; it stays queued
        until acknowledged; a beat goes first and is not kept) or ``cancelled`` is set and
        :meth:`interrupt` called (None)."""
        with self._cond:
            end = None
            while True:
                while (
                    not self._open or (self._next >= len(self._items) and self._beat is None)
                ) and not cancelled.is_set():
                    self._cond.wait()
                if cancelled.is_set() or not self._together:
                    break
                # A relay in the middle of a rank's message (together): its end sends it all.
                end = end or time.monotonic() + TOGETHER_MAX_S
                if (left := end - time.monotonic()) <= 0:
                    break
                self._cond.wait(left)
            if cancelled.is_set():
                return None
            if self._beat is not None:
                beat, self._beat = self._beat, None
                return beat
            event = self._items[self._next]
            batch = self._batch() if self._batches else [event]
            for i in reversed(range(len(batch))):
                if not batch[i].seq:  # a fact: sent once, never kept for a resend
                    del self._items[self._next + i]
            kept = [e.seq for e in batch if e.seq]
            self._next += len(kept)
            if kept:
                self._sent = max(self._sent, kept[-1])
                if not self._acked:  # a control that acknowledges nothing: forget them once sent
                    self._drop_through(kept[-1])
            if len(batch) == 1:
                return event
            return control_pb2.WorkerEvent(batch=control_pb2.WorkerEvents(events=batch))

    def _batch(self) -> list[control_pb2.WorkerEvent]:
        """Under the lock: the sequenced events queued from ``_next`` on that go up together
        (``BATCHED`` kinds and facts, consecutive, at most ``MAX_BATCH``): whatever piled up
        since the last send, so a launch's reports of all its ranks (a process state and a start
        each) are one stream message, not one per rank (issue 28), and a beat's rank-0 step
        summaries and the node's rank beats that follow them are one message per beat period,
        not two. Each keeps its own seq (a fact none: it keeps its place among them and is not
        resent): control applies, acknowledges and deduplicates them one by one, as if sent
        alone."""
        first = self._items[self._next]
        if first.WhichOneof("event") not in _BATCHABLE:
            return [first]
        batch, size = [first], first.ByteSize()
        i = self._next + 1
        while i < len(self._items) and len(batch) < MAX_BATCH:
            event = self._items[i]
            if event.WhichOneof("event") not in _BATCHABLE:
                break
            size += event.ByteSize()
            if size > MAX_BATCH_BYTES:
                break
            batch.append(event)
            i += 1
        return batch

    def resume(self, applied: int | None, batches: bool = False) -> tuple[int, int]:
        """A session opened and control has applied every event up to seq ``applied``:
        forget those, send the rest from the first. Returns (events to send, of which
        resent: sent before and never acknowledged). ``applied`` None: this control does not
        track sequences (no ``surge-last-seq`` header): what was sent counts as delivered,
        as it would never be deduplicated, and events are forgotten once sent. ``batches``:
        this control reads ``WorkerEvent.batch`` (its ``surge-batches`` header): consecutive
        events may go up as one message."""
        with self._cond:
            self._acked = applied is not None
            self._batches = batches
            if any(not e.seq for e in self._items):  # facts of the last session: old news now
                self._items = collections.deque(e for e in self._items if e.seq)
            self._drop_through(self._sent if applied is None else applied)
            self._next = 0
            self._open = True
            resend = sum(1 for e in self._items if e.seq <= self._sent)
            self.resent += resend
            self._cond.notify_all()
            return len(self._items), resend

    def pause(self) -> None:
        """The session ended: nothing is taken until the next :meth:`resume`."""
        with self._cond:
            self._open = False
            self._cond.notify_all()

    def ack(self, seq: int) -> None:
        """Control applied and persisted every event up to ``seq``: forget them."""
        with self._cond:
            self._drop_through(seq)
            self._cond.notify_all()

    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def interrupt(self) -> None:
        """Wake every :meth:`get` so it re-checks its cancel flag."""
        with self._cond:
            self._cond.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        """Block until every queued event was acknowledged (or ``timeout`` s)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)

    def _drop_through(self, seq: int) -> None:
        while self._items and 0 < self._items[0].seq <= seq:  # (a fact first is not sent yet)
            self._items.popleft()
            self._next = max(0, self._next - 1)


_UNREACHABLE = "unreachable"
# Initial-metadata key with which control acknowledges a registration (its value: the
# worker id). Mirrors services/control/server.py REGISTERED_HEADER; the agent does not
# import control's code.
REGISTERED_HEADER = "surge-registered"
LAST_SEQ_HEADER = "surge-last-seq"  # mirrors services/control/server.py LAST_SEQ_HEADER
BATCHES_HEADER = "surge-batches"  # mirrors services/control/server.py BATCHES_HEADER
# A serialized LivenessGrant: send the agent's own beat as datagrams (liveness_sender.py).
# Mirrors services/control/liveness_datagrams.py LIVENESS_HEADER.
LIVENESS_HEADER = "surge-liveness-bin"


class ControlSession:
    """Keeps the ``ControlService.WorkerSession`` stream open and executes what comes down.

    Every session starts with ``WorkerEvent{register}`` (the node's hardware and the ranks
    it runs now) and then carries the outbox from the first event control has not applied
    (the ``surge-last-seq`` header control answers the registration with). When control is
    unreachable or the stream breaks (control killed: its calls fail), it reconnects (the
    channel's own backoff, 200 ms doubling to ``max_backoff_seconds``) and registers again,
    declaring the ranks it still runs; rank processes are not touched, they keep training.
    ``WorkerCommand{ack}`` forgets acknowledged events. Failed attempts are logged at most
    once every ``log_every_seconds``.

    Args:
        address: host:port of the control service.
        registration: sent first on every session (a callable: built anew for each).
        outbox: events to send up.
        execute: runs one ``WorkerCommand`` (called on this session's thread, in order).
        log: a structlog logger.
        beats: the agent's ranks' beats keeper (services/worker/rank_beats.py): the agent's own
            beat rides with its ranks' (one message per node and period) and goes alone only
            when none is due. None: a thread of this session sends it alone every period.
    """

    HEALTHY_SESSION_SECONDS = 10.0  # a session that lived this long resets the backoff
    BEAT_SECONDS = 1.0  # the agent's own heartbeat (AgentHeartbeat): no rank is placed on a silent agent

    def __init__(
        self,
        address: str,
        registration: control_pb2.WorkerRegistration | Callable[[], control_pb2.WorkerRegistration],
        outbox: Outbox,
        execute: Callable[[control_pb2.WorkerCommand], None],
        log: Any,
        max_backoff_seconds: float = 2.0,
        log_every_seconds: float = 5.0,
        beats: Any = None,
    ):
        self._address = address
        self._registration = registration
        self._outbox = outbox
        self._execute = execute
        self._log = log
        self._max_backoff = max_backoff_seconds
        self._log_every = log_every_seconds
        self._keeper = beats
        self._stop = threading.Event()
        self._open = threading.Event()  # a session is open now (registered)
        self._lock = threading.Lock()
        self._call: Any = None
        self._ready: grpc.Future | None = None
        # This session's liveness datagrams (control's grant); None: the beat goes on the session.
        self._liveness: LivenessSender | None = None
        self._on_session = False  # control hears no datagrams of it: beat on the session too
        # Which ranks' beats may ride the datagrams (what control was told of each on this session)
        self._split = ProgressSplit()
        self._thread = threading.Thread(target=self._run, name="control-session", daemon=True)
        self._beats = threading.Thread(target=self._beat, name="agent-heartbeat", daemon=True)
        self._channel = channel(  # TLS and the bearer token when SURGE_TLS_* / SURGE_AUTH_TOKEN are set
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", int(max_backoff_seconds * 1000)),
                *SMALL_MESSAGES,  # (what comes down is commands and acks, at a pace: grpc_server.py)
            ],
            module=Module.EXT_HARDWARE,  # the node agent speaks for its node (and relays its ranks)
        )

    def start(self) -> None:
        self._thread.start()
        if self._keeper is not None:
            self._keeper.keep_agent_beat(self.BEAT_SECONDS, self._alone)
        else:
            self._beats.start()

    def connected(self) -> bool:
        """A session with control is open now (a departing agent waits for control only then)."""
        return self._open.is_set()

    def close(self, drain_seconds: float = 1.0) -> None:
        """Give queued events ``drain_seconds`` to go up, then end the session for good."""
        self._outbox.wait_empty(drain_seconds)
        self._stop.set()
        with self._lock:
            if self._ready is not None:
                self._ready.cancel()
            if self._call is not None:
                self._call.cancel()
        self._outbox.interrupt()
        self._thread.join(timeout=5.0)
        self._channel.close()

    # ------------------------------------------------------------ private

    def _beat(self) -> None:
        """Every ``BEAT_SECONDS``, the agent's own beat (sent only while a session is open)."""
        while not self._stop.wait(self.BEAT_SECONDS):
            self._alone(
                control_pb2.WorkerEvent(
                    heartbeat=control_pb2.AgentHeartbeat(interval_seconds=self.BEAT_SECONDS, unix_time=time.time())
                )
            )

    def _alone(self, ev: control_pb2.WorkerEvent) -> None:
        """The agent's own beat, not riding with its ranks': a datagram while control's grant
        holds, else on the session (the outbox's beat slot)."""
        sender = self._liveness
        if sender is not None:
            sender.send(ev.heartbeat.interval_seconds, ev.heartbeat.unix_time)
        if sender is None or self._on_session:
            self._outbox.beat(ev)

    def _ride(self, job: str, beats: list) -> tuple[list, bool]:
        """The keeper's flush (rank_beats.py): the beats of ``job`` that only move their ranks'
        progress go in one datagram of the agent's beat (services/common/liveness_progress.py);
        returns (the rest, for the session; whether a datagram went)."""
        sender = self._liveness
        if sender is None:
            return beats, False
        riding, left = self._split.split(job, beats)
        if not riding:
            return beats, False
        packed, unfit = pack(job, riding)
        sender.send(self.BEAT_SECONDS, time.time(), packed)
        if self._on_session:
            # Control hears none of its datagrams: every beat on the session too. The datagram
            # still carries them: a session whose writes lag (a starved agent) would otherwise
            # leave its ranks unheard while control hears the agent (hb37's restart bench).
            return beats, True
        return left + unfit, True

    def _datagrams(self, grant: bytes | None) -> None:
        """Beat as datagrams with ``grant`` (a serialized LivenessGrant), or on the session
        (None). The keeper's beat stops riding with the ranks' while datagrams go: control
        expects one each period."""
        sender = None
        if grant:
            parsed = control_pb2.LivenessGrant.FromString(grant)
            try:
                sender = LivenessSender(parsed, control_host(self._address))
            except OSError as e:
                self._log.warning("liveness datagrams off: control's host", control=self._address, error=str(e))
        with self._lock:
            old, self._liveness = self._liveness, sender
            self._on_session = False
            self._split = ProgressSplit()  # (a new session: each rank's first beat on it)
        if old is not None:
            old.close()
        if self._keeper is not None:
            self._keeper.keep_agent_beat(
                self.BEAT_SECONDS, self._alone, ride=sender is None, progress=self._ride if sender else None
            )

    def _beat_on_session(self, cmd: control_pb2.BeatOnSession) -> None:
        """Control hears none of this session's datagrams: beat on the session too (datagrams
        still going, so control can tell when it hears them again); heard again: datagrams alone."""
        self._on_session = not cmd.datagrams_heard
        if self._on_session:
            self._log.warning(
                "control hears no liveness datagrams; beating on the session",
                control=self._address,
                unheard_seconds=round(cmd.unheard_seconds, 1),
            )
        else:
            self._log.info("control hears the liveness datagrams again; beating as datagrams", control=self._address)

    def _run(self) -> None:
        attempts, last_log, delay = 0, -math.inf, 0.2
        while not self._stop.is_set():
            opened = time.monotonic()
            problem = self._session_once()
            if self._stop.is_set():
                return
            if time.monotonic() - opened > self.HEALTHY_SESSION_SECONDS:
                attempts, delay = 0, 0.2
            attempts += 1
            now = time.monotonic()
            if now - last_log >= self._log_every:
                self._log.warning(
                    "control session down; retrying", control=self._address, attempts=attempts, problem=problem
                )
                last_log = now
            if problem != _UNREACHABLE:
                # Control answered and ended the session at once: back off here, as the
                # channel's own reconnect backoff only paces connection attempts.
                self._stop.wait(delay)
                delay = min(delay * 2, self._max_backoff)

    def _session_once(self) -> str:
        """One session: wait for the channel, register, relay until it ends. Returns why
        it ended (for the log)."""
        ready = grpc.channel_ready_future(self._channel)
        with self._lock:
            if self._stop.is_set():
                return "stopping"
            self._ready = ready
        try:
            ready.result(timeout=self._max_backoff)
        except grpc.FutureTimeoutError:
            return _UNREACHABLE
        except grpc.FutureCancelledError:
            return "stopping"
        finally:
            with self._lock:
                self._ready = None
        ended = threading.Event()
        stub = control_pb2_grpc.ControlServiceStub(self._channel)
        try:
            with self._lock:
                if self._stop.is_set():
                    return "stopping"
                self._call = stub.WorkerSession(self._requests(ended))
            # Control acknowledges the registration with an initial-metadata header; a
            # control that sends none answers with its first command or when it closes.
            header = dict(self._call.initial_metadata() or ())
            applied = int(header[LAST_SEQ_HEADER]) if header.get(LAST_SEQ_HEADER, "").isdigit() else None
            pending, resent = self._outbox.resume(applied, batches=header.get(BATCHES_HEADER) == "1")
            self._datagrams(header.get(LIVENESS_HEADER))
            self._open.set()
            if REGISTERED_HEADER in header:
                self._log.info(
                    "registered with control",
                    control=self._address,
                    acknowledged=header[REGISTERED_HEADER],
                    last_applied_seq=applied,
                    events_to_send=pending,
                    events_resent=resent,
                    events_resent_total=self._outbox.resent,
                    last_seq=self._outbox.last_seq(),
                    liveness_datagrams=self._liveness is not None,
                )
            else:
                self._log.info("session open; no registration acknowledgement", control=self._address)
            for cmd in self._call:
                if cmd.WhichOneof("command") == "ack":
                    self._outbox.ack(cmd.ack.seq)
                    continue
                if cmd.WhichOneof("command") == "beat_on_session":  # control's word on its datagrams
                    self._beat_on_session(cmd.beat_on_session)
                    continue
                self._run_command(cmd)
            return "stream closed by control"
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return f"{getattr(code, 'name', 'error')}: {e.details() if hasattr(e, 'details') else e}"
        finally:
            self._open.clear()
            self._datagrams(None)  # (the grant was this session's)
            ended.set()
            self._outbox.pause()
            with self._lock:
                self._call = None

    def _requests(self, ended: threading.Event) -> Iterator[control_pb2.WorkerEvent]:
        reg = self._registration() if callable(self._registration) else self._registration
        yield control_pb2.WorkerEvent(register=reg)
        while (event := self._outbox.get(ended)) is not None:
            yield event

    def _run_command(self, cmd: control_pb2.WorkerCommand) -> None:
        try:
            self._execute(cmd)
        except Exception:  # a command that fails must not drop the node's session
            self._log.exception("worker command failed", kind=cmd.WhichOneof("command"))
