"""A node agent's event stream exactly-once across a control restart (a part of ``SessionHub``,
services/control/session_hub.py, which applies each event: ``_apply``).

Every ``WorkerEvent`` after ``register`` carries a per-agent-incarnation ``seq``; an event whose
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
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import structlog

from services.contract import control_pb2
from services.control.metrics import WORKER_EVENTS

if TYPE_CHECKING:
    from services.control.session_hub import AgentSession

_log = structlog.get_logger("control.server")

# Marker in a session's command queue: send the latest journaled seq down as an EventAck.
_ACK = object()


class ExactlyOnce:
    """Seq admission, the cursor journaled with each event's effect, and the acks once
    committed (a part of ``SessionHub``, see session_hub.py)."""

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
