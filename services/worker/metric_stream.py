"""The node's metric records to the store: one ``StoreService.Record`` stream per node.

Every local rank hands its L5-2 records (StepCompleted, EvalCompleted, LogCollectionConfig,
StopLogCollection, each a ``MetricRecord`` numbered by the rank) to this agent over its
``RankSession`` (``RankEvent{metrics}``, ``services/rank/metrics_client.py``). The agent
sends the records of all its ranks on one long-lived bidirectional ``Record`` stream per
store address, numbered again in the stream's own order, as ``L2_TRAINING_LOOP`` (it speaks
for its ranks' loops: the route is theirs, StepCompleted L2-1 -> L5-2; under mutual TLS a
``surge-worker`` certificate may claim it). The store's ``MetricsAck`` of each goes back to
the rank it came from with the rank's own ``seq`` (``RankCommand{metrics_ack}``), its
``routed`` failure events with it.

Why: a rank per stream made the store hold one stream per rank for the job's whole life (at
about 31 ranks the store's threads were all taken, issue 27); now it holds one per node. And
every record held and not yet sent goes in one ``MetricBatch`` (at most ``BATCH_RECORDS``):
a node's ranks finishing a step together cost the store one message and one thread hop, not
one per rank; while the store writes a batch, the next one gathers.

A record is held until the store's ack for it arrives; when the stream breaks (store
restarted, stopped, unreachable) the thread reconnects with backoff and resends every record
not yet acknowledged, in order (the store writes a resent record once: it recognises it by
content). The held records are bounded (``METRICS_BUFFER``): past it the oldest is dropped,
counted and logged (its rank's next ack covers it: the rank waits for no dropped record).

Per interval, not per step (issue 28 item 3: the stack's CPU per step): a record waits up to
``linger_s`` (``SURGE_METRICS_LINGER_S``; default 1 s; 0: at once) for others before its batch
goes (at most ``BATCH_RECORDS`` records, a few hundred bytes each), and a batch's acks go back
to each rank as one (its highest seq, the records summed, every routed failure event in order:
a rank's MetricsClient counts acks cumulatively). Measured on the demo model (dp 2, a step
every ~0.3 s): a batch to the store and its ack per step per node became one of each per
second (bench/stack_cost.py). What waits on an ack, or marks a boundary, does not linger: a
``StopLogCollection`` (the rank's loop waits for it at its end), and :meth:`flush` (the node
agent's) at every boundary of a rank: any routed event of it but a ``StepCompleted`` (a save
committed, a pause, a step fault, an eval, its loop's end: a failed rank waits for its
records' acks before it exits), its session's end (the process ended), and a ReleaseRanks
of its job; everything held at :meth:`MetricStream.close` goes at once, with every record
before them.

The trade-off (why the default was 0 from session 26 to 30): a record is held from
``submit`` until its ack only in the agent, so a node agent that dies abruptly (SIGKILL, the
node lost) takes what lingered there along: its ranks' records of at most the last
``linger_s`` that no boundary sent. Those are the steps after the job's last committed save
(the save's ``SaveCompleted`` flushed every earlier one through rank 0's agent), which a
recovery trains again and records again; what is lost for good is another node's rank's
records of those steps (one per rank per step: per-rank series, the job's loss curve is
rank 0's). The store's sinks (the metric file, Prometheus, the dashboard) see a step up to
``linger_s`` later. A pause, a stop, a failure and a finish lose nothing: each is a boundary.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import grpc

from services.common.grpc_server import SMALL_MESSAGES, channel
from services.contract import Module, store_pb2, store_pb2_grpc
from services.contract.relay import routed_from_rpc

METRICS_BUFFER = 100_000  # metric records of this node's ranks held until the store acknowledged them
BATCH_RECORDS = 1024  # records in one MetricBatch at most (a resend after a reconnect goes in several)


def _env_seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name) or default))
    except ValueError:
        return default


# How long a record waits for others before its batch goes (0: at once). The store's sinks
# (metric files, the live view) see a step at most this late; a boundary does not wait for it
# (the module docstring). At 0 (sessions 26-30) a node agent sent the store a batch, and got
# its ack, per step per node; at 1 s, once a second. (Session 26's 1 s default lost records
# that no boundary flushed then: a killed worker's steps 1-5, test_memory_recovery; a save's
# SaveCompleted flushes them now.)
METRICS_LINGER_S = _env_seconds("SURGE_METRICS_LINGER_S", 1.0)
RECONNECT_OPTIONS = (  # a store that comes back is found within 2 s (gRPC's default grows to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    *SMALL_MESSAGES,  # (what comes back is acks: grpc_server.py)
)
Ack = Callable[[store_pb2.MetricsAck], None]


class _Held(NamedTuple):
    seq: int  # this stream's number of the record
    record: store_pb2.MetricRecord
    own: int  # the rank's seq of it
    ack: Ack
    key: Hashable | None  # the rank it came from: a batch's acks to one key go as one
    since: float  # time.monotonic() when submitted (its linger counts from it)


class MetricStream:
    """One Record stream to the store at ``address``, for every rank of this node.

    Args:
        address: the store's host:port.
        log: a structlog logger.
        buffer: records held at most (the oldest dropped past it, counted).
        linger_s: how long a record waits for others before its batch goes.
    """

    def __init__(self, address: str, log: Any, buffer: int = METRICS_BUFFER, linger_s: float = METRICS_LINGER_S):
        self._address, self._log, self._max, self._linger = address, log, buffer, linger_s
        self._channel = channel(address, options=RECONNECT_OPTIONS, module=Module.L2_TRAINING_LOOP)
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        self._held: collections.deque[_Held] = collections.deque()  # until acknowledged, oldest first
        self._cond = threading.Condition()
        self._seq = 0
        self._urgent = 0  # records up to this seq go without lingering (a rank waits on one of them)
        self._idle = True  # the stream's sender waits with nothing unsent (no linger to wait for)
        self.dropped = 0
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._run, name=f"metrics-{address}", daemon=True)
        self._sender.start()

    def submit(self, record: store_pb2.MetricRecord, ack: Ack, key: Hashable | None = None) -> None:
        """Hold ``record`` (its ``seq`` the rank's) for sending; ``ack`` gets the store's
        MetricsAck of it, with the rank's seq: once per batch for the records of one ``key``
        (the rank's last, the batch's routed events with it), once per record without one.
        Never blocks."""
        with self._cond:
            own = record.seq
            self._seq += 1
            record.seq = self._seq
            if record.WhichOneof("record") == "stop":
                self._urgent = self._seq  # the rank's loop waits for this ack before it ends
            self._held.append(_Held(self._seq, record, own, ack, key, time.monotonic()))
            if len(self._held) > self._max:
                self._held.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    self._log.warning("metrics_buffer_full", store=self._address, held=self._max, dropped=self.dropped)
            # A sender that waits for an unsent record's linger to end is not woken: this record
            # lingers no shorter, so it changes nothing of that wait unless a batch is full or a
            # rank waits on it. A rank's records come a beat's worth at a time
            # (services/rank/session_batches.py): a wake-up each for nothing otherwise. (close,
            # flush, an ack and the stream's end still notify.)
            if self._idle or len(self._held) >= BATCH_RECORDS or self._urgent == self._seq:
                self._cond.notify_all()

    def flush(self) -> None:
        """Send every record held now without lingering (a rank ended its loop: it waits
        for their acks before it exits)."""
        with self._cond:
            self._urgent = self._seq
            self._cond.notify_all()

    @property
    def held_records(self) -> int:
        """Records not yet acknowledged by the store."""
        with self._cond:
            return len(self._held)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is held (waiting up to ``timeout`` seconds for the store's acks), then
        end the stream and close the channel."""
        with self._cond:
            self._urgent = self._seq  # nothing held lingers any more
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._held or not self._sender.is_alive(), timeout)
            left = len(self._held)
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        self._sender.join(1.0)
        if self.dropped or left:
            self._log.warning(
                "metrics_dropped", records=self.dropped + left, over_bound=self.dropped, unacknowledged_at_exit=left
            )
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _acked(self, acks: list[store_pb2.MetricsAck]) -> None:
        """The store's acks of one batch (in this stream's order): forget each record (and
        anything older: acks come in order), hand each ack to its rank with the rank's seq,
        one per key (its last seq, the records summed, the routed events in order)."""
        out: dict[Hashable, tuple[Ack, store_pb2.MetricsAck]] = {}  # (insertion order: the acks' order)
        with self._cond:
            for ack in acks:
                while self._held and self._held[0].seq <= ack.seq:
                    held = self._held.popleft()
                    if held.seq != ack.seq:
                        continue
                    key = ("record", held.seq) if held.key is None else ("key", held.key)
                    if key in out:
                        merged = out[key][1]
                        merged.records += ack.records
                        merged.seq = held.own
                        merged.routed.extend(ack.routed)
                        out[key] = (held.ack, merged)
                    else:
                        out[key] = (
                            held.ack,
                            store_pb2.MetricsAck(records=ack.records, seq=held.own, routed=ack.routed),
                        )
            self._cond.notify_all()
        for to, ack in out.values():
            to(ack)

    def _hand_back_routed(self, routed: list) -> None:
        """The failure events a broken stream brought back (a sink of L5-2 failed on the
        first unacknowledged record: LogWriteFailed in its trailers) go to that record's rank,
        in an ack that acknowledges nothing (seq 0); the record stays held and is resent."""
        if not routed:
            return
        with self._cond:
            head = self._held[0] if self._held else None
        if head is not None:
            head.ack(store_pb2.MetricsAck(seq=0, routed=routed))

    def _batches(self, stream_done: threading.Event):
        """One stream's requests: every held record not sent on this stream yet, in batches
        (all of them at first: a new stream resends what was not acknowledged), then new ones,
        each batch once its oldest record has waited ``linger_s`` (or a rank waits on one of
        its records, or it is full). Woken by ``submit``, ``close`` and the stream's end,
        never polled."""
        sent = 0
        while True:
            with self._cond:
                while True:
                    if stream_done.is_set() or self._closing.is_set():
                        return
                    wait = None
                    if self._held and self._held[-1].seq > sent:  # held seqs are contiguous
                        start = max(0, sent - self._held[0].seq + 1)
                        due = self._held[start].since + self._linger
                        wait = due - time.monotonic()
                        if wait <= 0 or self._urgent > sent or len(self._held) - start >= BATCH_RECORDS:
                            stop = min(len(self._held), start + BATCH_RECORDS)
                            batch = [held.record for held in itertools.islice(self._held, start, stop)]
                            break
                    self._idle = wait is None
                    self._cond.wait(wait)
            sent = batch[-1].seq
            yield store_pb2.MetricBatch(records=batch)

    def _run(self) -> None:
        backoff = 0.5
        while not self._closing.is_set():
            done = threading.Event()
            call = self._stub.Record(self._batches(done))
            try:
                for acks in call:
                    self._acked(list(acks.acks))
                    backoff = 0.5
                if self._closing.is_set():
                    return
            except grpc.RpcError as e:
                if self._closing.is_set():
                    return
                self._log.warning(
                    "metrics_stream_failed", store=self._address, code=e.code().name, held=self.held_records
                )
                self._hand_back_routed(routed_from_rpc(e))
            finally:
                done.set()
                call.cancel()
                with self._cond:
                    self._cond.notify_all()
            if self._closing.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)


class MetricStreams:
    """The agent's metric streams, one per store address, opened at a rank's first record."""

    def __init__(self, log: Any, buffer: int = METRICS_BUFFER, linger_s: float = METRICS_LINGER_S):
        self._log, self._buffer, self._linger = log, buffer, linger_s
        self._lock = threading.Lock()
        self._streams: dict[str, MetricStream] = {}

    def submit(self, address: str, record: store_pb2.MetricRecord, ack: Ack, key: Hashable | None = None) -> None:
        """``record`` of a rank (``key``) whose store is at ``address``; ``ack`` gets its
        MetricsAck (:meth:`MetricStream.submit`)."""
        with self._lock:
            stream = self._streams.get(address)
            if stream is None:
                stream = self._streams[address] = MetricStream(address, self._log, self._buffer, self._linger)
        stream.submit(record, ack, key)

    def flush(self, address: str) -> None:
        """:meth:`MetricStream.flush` of the stream to ``address``, if there is one."""
        with self._lock:
            stream = self._streams.get(address)
        if stream is not None:
            stream.flush()

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close(timeout)
