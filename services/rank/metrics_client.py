"""The rank's relay of L5-2 (the store's metrics logger): its records go to the node agent.

Every ``StepCompleted`` / ``EvalCompleted`` (and the loop's ``LogCollectionConfig`` before
them, its ``StopLogCollection`` after them) becomes a ``MetricRecord`` numbered ``seq`` 1, 2,
... and is handed to ``send``: the rank's session to its node agent (``RankEvent{metrics}``,
queued: nothing on the step path waits). The agent sends the records of all its ranks to
the store on one ``StoreService.Record`` stream per node (``services/worker/metric_stream.py``:
it holds each record until the store acknowledged it, resends after a reconnect, and bounds
what it holds, dropping the oldest, counted); the store's ``MetricsAck`` comes back here
(``RankCommand{metrics_ack}``, this rank's ``seq``) with the failure events L5-2 sent while
taking it (LogWriteFailed of a sink), which go on the rank's bus (``on_routed``).

Why not a stream per rank: a store serving 256 ranks held 256 streams for their whole life
(issue 27); a node agent already holds the rank's session.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.contract import engine_pb2, store_pb2


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


# At the loop's end (StopLogCollection): how long it waits for the store to acknowledge every
# record (the rank may be released as soon as it reports its end).
METRICS_FLUSH_S = _env_seconds("SURGE_METRICS_FLUSH_S", 5.0)
log = structlog.get_logger()


class MetricsClient:
    """Relay for L5_METRICS_LOGGER inside a rank process.

    Args:
        send: hands one record on (the session's ``send_metrics``); must not block.
        on_routed: gets the failure events an ack brought back (``MetricsAck.routed``).
    """

    def __init__(
        self, send: Callable[[store_pb2.MetricRecord], None], on_routed: Callable[[list[Any]], Any] | None = None
    ):
        self._send = send
        self._on_routed = on_routed
        self._cond = threading.Condition()
        self._seq = 0  # the last record's seq
        self._acked = 0  # every record up to it is written (or dropped by the agent's bound)

    # ------------------------------------------------------------------ L5-2's commands and events

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        self._hand_on(store_pb2.MetricRecord(step=msg))

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        self._hand_on(store_pb2.MetricRecord(eval=msg))

    def on_sample_generated(self, msg: engine_pb2.SampleGenerated, payload: Any = None) -> None:
        self._hand_on(store_pb2.MetricRecord(sample=msg))

    def on_evaluation_scores(self, msg: engine_pb2.EvaluationScores, payload: Any = None) -> None:
        self._hand_on(store_pb2.MetricRecord(scores=msg))

    def log_collection_config(self, msg: store_pb2.LogCollectionConfig, payload: Any = None) -> None:
        """The loop's sink choice for L5-2: ahead of the records on the same path (the store
        keeps its copy across its restarts)."""
        self._hand_on(store_pb2.MetricRecord(config=msg))

    def stop_log_collection(self, msg: store_pb2.StopLogCollection, payload: Any = None) -> None:
        """The loop's end, after its last record (L5-2 closes the sinks). Returns once the
        store acknowledged it, so every record before it, or after ``METRICS_FLUSH_S``
        (logged: the rest may be lost, training is not held up for it)."""
        seq = self._hand_on(store_pb2.MetricRecord(stop=msg))
        if not self._wait_acked(seq, METRICS_FLUSH_S):
            log.warning("metrics_not_flushed", held=self.held_records, seconds=METRICS_FLUSH_S)

    # ------------------------------------------------------------------ from the session

    def acked(self, ack: store_pb2.MetricsAck) -> None:
        """The store's ack of this rank's record ``ack.seq`` (the session's reader thread)."""
        with self._cond:
            self._acked = max(self._acked, ack.seq)
            self._cond.notify_all()
        if ack.routed and self._on_routed is not None:
            self._on_routed(list(ack.routed))

    @property
    def held_records(self) -> int:
        """Records handed on whose ack has not come back."""
        with self._cond:
            return self._seq - self._acked

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the acks of every record handed on."""
        if not self._wait_acked(self._seq, timeout):
            log.warning("metrics_dropped", unacknowledged_at_exit=self.held_records)

    # ------------------------------------------------------------------ private

    def _hand_on(self, record: store_pb2.MetricRecord) -> int:
        with self._cond:  # numbered and handed on in one order (the send only queues)
            self._seq += 1
            record.seq = self._seq
            self._send(record)
            return self._seq

    def _wait_acked(self, seq: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._acked < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
