"""When the store's acks of a rank's metric records go down to the rank: at once only when
the rank waits on them, otherwise with its next heartbeat (issue 28 item 3: the stack's CPU
per step).

A rank's ``MetricsClient`` counts acks cumulatively (``MetricsAck.seq``: every record up to
it is written) and waits on them only twice: its ``StopLogCollection`` (the loop's end) and
its ``close`` at exit, after it reported its loop's end. Sent per batch, an ack went down
every step (one per rank per step at dp 2: a wake-up of the agent's server thread, the
rank's gRPC threads and its session reader) to move a counter nobody read. Here the acks of
a rank are merged (the highest seq, the records summed, the routed failure events in order)
and held until one of:

* the merged ack carries routed events (a sink of L5-2 failed: the rank's bus hears it now);
* it covers the rank's ``StopLogCollection`` record (its loop waits for that ack);
* the rank reported its loop's end (``loop_ended``: it waits for every ack before exiting);
* the rank's ``BEATS_PER_ACK``-th heartbeat since its last ack went down reached the agent
  (``beat``; ``SURGE_METRIC_ACK_BEATS``, default 10): at most that many beat periods late.

Why not every beat: the rank reads its acks only at its loop's end (above, at once) and in
its exit's log line; a message down a second per rank woke the agent's rank session threads,
both ends' gRPC threads and the rank's session reader to move that counter. The agent holds the records themselves
(below), so an ack held longer costs the rank nothing; the held ack is cumulative, so the one
that goes covers every record before it, and one lost with a broken session is covered by the
next (a rank whose acks stop coming says so at its end: ``metrics_not_flushed``, unchanged).

The agent's own hold on the records (until the store acknowledged them, resent after a
reconnect: metric_stream.py) is unchanged; only the news of it to the rank is paced.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from dataclasses import dataclass

from services.contract import store_pb2


def _beats_per_ack() -> int:
    try:
        return max(1, int(os.environ.get("SURGE_METRIC_ACK_BEATS") or 10))
    except ValueError:
        return 10


BEATS_PER_ACK = _beats_per_ack()


@dataclass
class _Rank:
    held: store_pb2.MetricsAck | None = None  # merged acks not yet sent down
    waits_on: int = 0  # the rank's seq of its StopLogCollection record (0: none seen)
    at_once: bool = False  # the loop ended: every ack goes as it comes
    beats: int = 0  # the rank's beats since its last ack went down


class MetricAcks:
    """Per rank (a hashable key: the agent's ``(job, rank, pid)``), what ack goes down now."""

    def __init__(self, beats_per_ack: int = BEATS_PER_ACK) -> None:
        self._beats_per_ack = beats_per_ack
        self._lock = threading.Lock()  # rank session threads and the metric stream's thread
        self._ranks: dict[Hashable, _Rank] = {}
        self.held = 0  # acks merged into a later one instead of going down (a counter, for tests)

    def submitted(self, key: Hashable, record: store_pb2.MetricRecord) -> None:
        """The rank handed on ``record`` (its seq the rank's): a ``stop`` record's ack is
        awaited by the rank's loop."""
        if record.WhichOneof("record") == "stop":
            with self._lock:
                self._ranks.setdefault(key, _Rank()).waits_on = record.seq

    def loop_ended(self, key: Hashable) -> store_pb2.MetricsAck | None:
        """The rank reported its loop's end: from now on every ack goes at once; returns the
        held one, to send now."""
        with self._lock:
            state = self._ranks.setdefault(key, _Rank())
            state.at_once = True
            held, state.held = state.held, None
            return held

    def acked(self, key: Hashable, ack: store_pb2.MetricsAck) -> store_pb2.MetricsAck | None:
        """The store's ack of the rank's records: the (merged) ack to send now, or None
        (held for the rank's next beat)."""
        with self._lock:
            state = self._ranks.setdefault(key, _Rank())
            if state.held is not None:
                merged = state.held
                merged.records += ack.records
                merged.seq = max(merged.seq, ack.seq)
                merged.routed.extend(ack.routed)
                self.held += 1
            else:
                merged = ack
            if merged.routed or state.at_once or (state.waits_on and merged.seq >= state.waits_on):
                state.held, state.beats = None, 0
                return merged
            state.held = merged
            return None

    def beat(self, key: Hashable) -> store_pb2.MetricsAck | None:
        """The rank's heartbeat reached the agent: the held ack, to send now, at every
        ``beats_per_ack``-th beat since the last one went (None: none, or not yet)."""
        with self._lock:
            state = self._ranks.get(key)
            if state is None:
                return None
            state.beats += 1
            if state.held is None or state.beats < self._beats_per_ack:
                return None
            held, state.held, state.beats = state.held, None, 0
            return held

    def forget(self, key: Hashable) -> None:
        """The rank's session ended: nobody waits on its acks any more."""
        with self._lock:
            self._ranks.pop(key, None)
