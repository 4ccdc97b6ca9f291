"""A node agent's ranks' beats, sent up to control as one message per job per beat period
(issue 28 item 3: coalesced step traffic).

Its ranks beat on the node's grid (services/common/beat_grid.py), so each period their beats
reach the agent within a few milliseconds of each other. ``RankBeats`` keeps each job's
beats and sends them as one ``WorkerEvent.rank_beats`` when every live rank of the job on
this node has beaten, or ``window_s`` after the first of them (a rank late or gone holds the
others no longer than that). Control applies each beat as if it had come alone.

Order: every other message the agent sends goes through :meth:`emit`, which first sends the
beats kept of the job it is about (of every job, for a message about none). So a beat never
overtakes a later event of its rank: an exit's report, a failure, a step summary reach control
after the beats that preceded them, as they did one by one (a beat applied after its rank's
exit would arm a silence deadline for a rank already gone).

The agent's own beat (``AgentHeartbeat``, every ``ControlSession.BEAT_SECONDS``) rides with
them (:meth:`keep_agent_beat`): a flush at least half a period after the agent's last beat
carries it in ``RankBeats.agent``, so a node whose ranks beat on the agent's period sends one
message per period, not two. Otherwise it goes alone, as ``WorkerEvent.heartbeat``, as
before: a period after the last on an idle node (no flush within the period before it), else
``1 + GRACE`` periods after it (ranks late or on a longer period). Two beats of the agent are
at least half a period and at most one and a half apart (control's deadline is five
periods, at least 3 s). Phase-locking needs no clock of the grid's: a beat that went alone at
a moment of its own is followed by the first flush half a period on, and from then on each
flush carries one.

One thread per agent (the window's and the agent beat's clock), not per rank; nothing is sent
under a rank's thread but its own batch's completion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.contract import control_pb2, worker_pb2

WINDOW_S = 0.05  # how long the first beat of a period waits for the rest of its job's
# A flush this long (a fraction of the agent's period) after the agent's last beat carries
# the next: the grid's jitter tolerated, and ranks on half the period carry it every other flush.
RIDE_AFTER = 0.5
# How long past its period (a fraction of it) the agent's beat waits for a flush to ride; half
# a period, so a beat sent alone out of phase with its ranks' flushes is followed by a riding one.
GRACE = 0.5


@dataclass
class _Pending:
    first: float  # monotonic time of the first beat kept
    beats: dict[int, worker_pb2.RankEvent] = field(default_factory=dict)  # rank -> its newest beat


def job_of(ev: control_pb2.WorkerEvent) -> str:
    """The job a message of the agent is about ("": none, or several)."""
    kind = ev.WhichOneof("event")
    if kind == "rank_event":
        return ev.rank_event.job_id
    if kind == "rank_exited":
        return ev.rank_exited.job_id
    return ""


class RankBeats:
    """The agent's outgoing messages: its ranks' beats kept and sent a job's at a time, and
    every other message after the beats it must follow.

    Args:
        emit: sends one WorkerEvent up (the agent's session with control).
        window_s: the most a beat waits for the rest of its job's.
    """

    def __init__(self, emit: Callable[[control_pb2.WorkerEvent], None], window_s: float = WINDOW_S):
        self._send, self._window = emit, window_s
        self._lock = threading.Condition()  # the pending beats; sends are made under it (their order)
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._clock: threading.Thread | None = None
        self.sent = 0  # RankBeats messages sent (each carries one or more beats)
        # The agent's own beat (keep_agent_beat): its period, where an unaccompanied one goes,
        # and when (monotonic) the last went; period 0: the session sends it (not kept here).
        self._agent_period = 0.0
        self._agent_alone: Callable[[control_pb2.WorkerEvent], None] | None = None
        self._agent_last = 0.0
        self._ride = True  # it rides with the ranks' beats (keep_agent_beat)
        # The liveness datagram's hook (keep_agent_beat's ``progress``): takes a job's beats that
        # may ride a datagram, sends one (the agent's beat too) and returns those for the session.
        self._progress: Callable[[str, list], tuple[list, bool]] | None = None
        self._flushed = -float("inf")  # when (monotonic) the last RankBeats went
        self.agent_riding = 0  # agent beats sent inside a RankBeats
        self.agent_alone = 0  # agent beats sent on their own

    def keep_agent_beat(
        self,
        period: float,
        alone: Callable[[control_pb2.WorkerEvent], None],
        ride: bool = True,
        progress: Callable[[str, list], tuple[list, bool]] | None = None,
    ) -> None:
        """From now on the agent's own beat, every ``period`` seconds, goes with a flush of
        its ranks' beats (``RankBeats.agent``) at least ``RIDE_AFTER`` of a period after the
        last, else alone through ``alone`` (the outbox's unsequenced beat slot) a period after
        the last (``1 + GRACE`` where ranks beat here). The first rides with the first flush,
        or goes alone at once. ``ride`` False: every beat goes through ``alone``, a period
        apart (a liveness datagram: control expects one each period, liveness_sender.py).
        ``progress`` (datagrams): at each flush, ``progress(job, beats)`` sends the beats that
        only move their ranks' progress in a datagram of the agent's and returns (the rest, for
        the session; whether a datagram went: then it was the agent's beat of the period)."""
        with self._lock:
            self._agent_period, self._agent_alone, self._ride = period, alone, ride
            self._progress = progress
            self._agent_last = time.monotonic() - period
            self._start_clock()
            self._lock.notify()

    def beat(self, event: worker_pb2.RankEvent, ranks_here: int) -> None:
        """Keep rank ``event.rank``'s beat (a heartbeat RankEvent, its envelope set); sent
        at once with the others of its job once ``ranks_here`` (the job's live ranks on this
        node) have beaten, else by the window's clock."""
        with self._lock:
            if self._closed:
                return
            pending = self._pending.get(event.job_id)
            if pending is None:
                pending = self._pending[event.job_id] = _Pending(time.monotonic())
                self._start_clock()
                self._lock.notify()
            pending.beats[event.rank] = event  # (a second beat of one rank in a window: the newer)
            if len(pending.beats) >= ranks_here:
                self._flush(event.job_id)

    def emit(self, ev: control_pb2.WorkerEvent) -> None:
        """Send ``ev`` up after the beats it must follow (of its job; of every job if it is
        about none)."""
        job = job_of(ev)
        with self._lock:
            for kept in [job] if job else list(self._pending):
                self._flush(kept)
            self._send(ev)

    def close(self) -> None:
        """Send what is kept and stop the clock."""
        with self._lock:
            for job in list(self._pending):
                self._flush(job)
            self._closed = True
            self._lock.notify_all()

    # ------------------------------------------------------------ private

    def _flush(self, job: str) -> None:
        """Under the lock: send the job's kept beats as one message (none kept: nothing)."""
        pending = self._pending.pop(job, None)
        if pending is None or not pending.beats:
            return
        kept = [pending.beats[r] for r in sorted(pending.beats)]
        now = self._flushed = time.monotonic()
        if self._progress is not None:  # (a datagram of the agent's carries those it can)
            kept, sent = self._progress(job, kept)
            if sent:
                self._agent_last = now
                self.agent_riding += 1
            if not kept:
                return
        beats = control_pb2.RankBeats(job_id=job)
        beats.beats.extend(kept)
        if self._agent_period and self._ride and now - self._agent_last >= RIDE_AFTER * self._agent_period:
            beats.agent.CopyFrom(self._agent_beat(now))
            self.agent_riding += 1
        self.sent += 1
        self._send(control_pb2.WorkerEvent(rank_beats=beats))

    def _alone_at(self) -> float:
        """Under the lock: when the agent's beat goes alone if no flush carries it: a period
        after the last on an idle node, ``1 + GRACE`` where its ranks' beats flow (a flush
        within the period before the last, or since)."""
        flowing = self._ride and self._flushed >= self._agent_last - self._agent_period
        return self._agent_last + (1 + (GRACE if flowing else 0.0)) * self._agent_period

    def _agent_beat(self, now: float) -> control_pb2.AgentHeartbeat:
        """Under the lock: the agent's beat, sent now."""
        self._agent_last = now
        return control_pb2.AgentHeartbeat(interval_seconds=self._agent_period, unix_time=time.time())

    def _start_clock(self) -> None:
        if self._clock is None:
            self._clock = threading.Thread(target=self._run, name="rank-beats", daemon=True)
            self._clock.start()

    def _run(self) -> None:
        """Sends each job's beats ``window_s`` after its first, if nothing sent them before,
        and the agent's own beat alone when no flush carried it (``_alone_at``)."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                due = [job for job, p in self._pending.items() if now - p.first >= self._window]
                for job in due:
                    self._flush(job)
                wake = [p.first + self._window for p in self._pending.values()]
                if self._agent_period:
                    if now >= self._alone_at() and self._agent_alone is not None:
                        self.agent_alone += 1
                        self._agent_alone(control_pb2.WorkerEvent(heartbeat=self._agent_beat(now)))
                    wake.append(self._alone_at())
                if wake:
                    self._lock.wait(max(0.0, min(wake) - time.monotonic()))
                else:
                    self._lock.wait()
