"""Acks to a node agent per interval, not per event (issue 28 item 3: the stack's CPU per
step).

Control acknowledges a session's sequenced events (``EventAck``: the seq up to which each
event's cursor is journaled) so that the agent's outbox forgets them; an ack is cumulative
and says nothing else (a lost or late one costs a resend after a reconnect, which control
drops as a duplicate). Sent once per commit, the acks were half of control's messages on the
demo model (dp 2: 444 acks out for 316 RankBeats and 122 StepCompleted in), each a wake-up
of control's loop, its gRPC threads and the agent's session reader. Here a session gets at
most one ack per ``interval_s`` (``SURGE_CONTROL_ACK_S``, 1 s): the first after a quiet
interval goes at once; one due sooner waits on a shared deadline for the interval's end and
then says the latest journaled seq (``AgentSession.durable`` is read as the ack is sent),
covering every commit since. Nothing waits on an ack but the agent's outbox (its bound is
100,000 events) and its drain at exit (``ControlSession.close``: at most one interval more).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.common.deadlines import Deadlines


def _env_seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name) or default))
    except ValueError:
        return default


ACK_INTERVAL_S = _env_seconds("SURGE_CONTROL_ACK_S", 1.0)


class AckPacer:
    """Decides when each session's ack goes.

    Args:
        lock: the hub's lock (it guards ``ack_queued``, which the hub clears as the ack is sent).
        put: queues the ack marker of each of the given sessions (the hub's ``put_all``: one
            wake-up of the server's loop for all of them).
        interval_s: the least time between two acks of one session (0: every ack at once).
    """

    def __init__(self, lock: threading.Lock, put: Callable[[list[Any]], None], interval_s: float = ACK_INTERVAL_S):
        self._lock, self._put, self._interval = lock, put, interval_s
        self._deadlines: Deadlines | None = None  # started at the first ack held back
        self.held = 0  # acks that waited for their interval's end (a counter, for tests and reading)

    def queue(self, sessions: Iterable[Any]) -> None:
        """An ack is due for each of ``sessions`` (``AgentSession``): queue it now, or at the
        end of the session's interval; nothing for one whose ack is queued or held already
        (it will say the latest seq) or that is closed."""
        now = time.monotonic()
        now_due, later = [], []
        with self._lock:
            for s in sessions:
                if s.ack_queued or s.closed:
                    continue
                s.ack_queued = True
                wait = s.acked_at + self._interval - now
                if wait <= 0:
                    s.acked_at = now
                    now_due.append(s)
                else:
                    later.append((wait, s))
                    self.held += 1
            if later and self._deadlines is None:
                self._deadlines = Deadlines("control-acks", workers=1)
        if now_due:
            self._put(now_due)
        for wait, s in later:
            self._deadlines.after(wait, self._due, (s,))

    def _due(self, session: Any) -> None:
        with self._lock:
            if session.closed:
                return
            session.acked_at = time.monotonic()
        self._put([session])
