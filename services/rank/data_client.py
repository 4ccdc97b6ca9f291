"""The rank's relay of the L4 data service (L4 modules live in the `data` service).

Inside the rank process this relay stands where L4 would: it receives the loop's
``MountDataset`` / ``OpenStream`` commands (as L4_DATASET_VERSIONS) and relays them to
``DataService.Mount`` / ``DataService.Stream`` at the job's data address; the batches that
come back are published to the loop as ``MicroBatch`` DATA messages (as L4_BATCH_PACKER)
with the decoded tensors as payload (:class:`services.engine.training_loop.Batch`).

Each stream is read by a background thread: gRPC receive and decoding (little-endian
int32 bytes, row-major [B, T] -> int64 tensors) happen off the training step, and the loop
finds the next batch already decoded. Read-ahead is bounded by the loop's inbox (a full
inbox blocks this thread, which stops reading, which applies gRPC flow control upstream).
The relay asks for up to ``BATCHES_PER_MESSAGE`` micro-batches per stream message
(``OpenStream.batches_per_message``; the later ones ride in the first's ``MicroBatch.more``)
and hands them to the loop one by one, in order, each as if it had come alone: one message
per step per rank woke the channel's threads and this one per step (issue 28 item 3).

One stream per split: ``OpenStream`` of a split whose stream is still open cancels that
one (the loop reopens its train stream at another position after a group rebuilt in
place). ``OpenStream``'s reply payload is the new stream's token, and every batch carries
its stream's (``Batch.stream``): a batch of the cancelled stream may already sit in the
loop's inbox, or be on its way into it from that stream's thread, and the loop drops it.

End of a finite stream -> ``DataExhausted(split, position)``. A stream that fails brings back
the failure events the data service's modules sent this side (ShuffleFailed, PrefetchFailed,
L4-1's DatasetUnavailable, ...: the call's trailing metadata, by name): they go on the rank's
bus as those modules (``back``), so the loop and, through the session, L1-3 get them, and
L1-1 decides (the loop only hears them: it waits for batches that do not come). A gRPC error
that brought none back (and, for UNAVAILABLE, outlasted the reconnection below) -> the loop gets
``DatasetUnavailable`` (its ``failure`` typed by the cause the service sent) whose reason is the server's one-line message (NOT_FOUND /
FAILED_PRECONDITION from Mount: unknown dataset or version, manifest mismatch) or
"data service unreachable at ADDR" for a connection failure. Every failed call is shown
to ``on_error`` first (the rank reports a boundary violation the service returned). A loop
that fails on a batch (its own failure event, published by the bus) stops this relay reading
that stream.

A data service that restarts, fails over or is down for a while is no failure (issue 27, item 5): a stream that
breaks with UNAVAILABLE (the connection lost, the server stopping: typed by the status code,
never by its text) is opened again, with the same OpenStream but for its ``start`` (and
its shuffle's epoch, the start's: the stream may have crossed an epoch since): the
``next`` position of the last batch handed to the loop (every rank's batch of a round
carries the round's ``next``, and a stream opened there continues exactly: no batch repeated
or skipped; batches the service had read ahead but not sent are simply not asked for) and,
for a bounded stream, the batches still owed. The reopened stream keeps its token: the
batches already in the loop's inbox are consumed as before. Attempts wait a jittered,
doubling backoff ("full jitter", 0.2 s growing to 5 s); the budget starts again whenever a
batch arrives. Only once it is spent does the failure go up as above (DatasetUnavailable, typed
unavailable: L1-3's ``data_outage``, decided by L1-1).

A job's relay (``outage_s``: the job's ``fault_policy.data_outage_seconds``) says so while it
waits: ``DataServiceUnreachable`` when a stream's reconnection begins, and again with ``back``
(the position it continues at, the seconds it waited) once a batch of the reopened stream
arrives; L1-1 waits for the service that long, says so in the job's status, and decides when
the wait is over (a pause by default), before this relay's own budget, ``outage_s`` +
``RECONNECT_S`` (the margin), is spent: that report is the backstop should L1-1's decision not
come. A mount (the job's start, a relaunch) that finds the service unreachable waits the same
way. Without ``outage_s`` (tests, tools) the budget is ``RECONNECT_S`` and a mount fails at once.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import structlog
import torch

from services.common.grpc_server import SINGLE_THREADED_STREAM, channel
from services.contract import Module, data_pb2, data_pb2_grpc
from services.contract.bus import Emitter, Reply
from services.contract.failures import ModuleFailed, failure_of
from services.contract.relay import Routed, routed_from_rpc
from services.engine.training_loop import Batch

MOUNT_TIMEOUT_S = 120.0


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


# How long a stream broken by UNAVAILABLE is tried again before its failure goes up: a
# data-service restart (stop, start, mount) takes seconds. Below the fault detector's default
# progress deadline (stall_min_seconds, 30 s) of a rank waiting for data, so that a service
# that does not come back is reported as what it is (DatasetUnavailable), not as a stall.
RECONNECT_S = _env_seconds("SURGE_DATA_RECONNECT_S", 25.0)
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.2, 5.0  # the backoff's first cap and its ceiling
# The channel finds a service that came back within this (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# The most micro-batches the relay asks the data service to put in one stream message (it
# sends what it holds, up to this): a step's micro-batches (grad_accum) and the loop's
# read-ahead (4) come in one message where they came in one each. 1: one per message.
BATCHES_PER_MESSAGE = max(1, int(_env_seconds("SURGE_DATA_BATCHES_PER_MESSAGE", 4.0)))  # (a count: whole)
log = structlog.get_logger()


class DataClient:
    """Relay for L4_DATASET_VERSIONS (commands in) and L4_BATCH_PACKER (batches out)."""

    def __init__(
        self,
        address: str,
        versions: Emitter,
        packer: Emitter,
        on_error: Callable[[grpc.RpcError], None] | None = None,
        back: Callable[[Routed], Any] | None = None,
        *,
        job_id: str = "",
        rank: int = 0,
        outage_s: float | None = None,
    ):
        self._address = address
        self._job_id, self._rank, self._outage_s = job_id, rank, outage_s
        # (RECONNECT_S read here: a test may set it on the module)
        self._budget = RECONNECT_S if outage_s is None else outage_s + RECONNECT_S
        self._on_error = on_error
        self._back = back
        self._versions = versions
        self._packer = packer
        # the loop's commands, relayed
        # (its stream's reader takes the messages off gRPC itself: grpc_server.SINGLE_THREADED_STREAM)
        self._channel = channel(
            address, options=(*RECONNECT_OPTIONS, *SINGLE_THREADED_STREAM), module=Module.L2_TRAINING_LOOP
        )
        self._stub = data_pb2_grpc.DataServiceStub(self._channel)
        self._calls: dict[str, grpc.Future] = {}  # split -> its open stream
        self._closing = False
        self._closed = threading.Event()  # wakes a reconnection's backoff at close
        self._lock = threading.Lock()

    def mount(
        self, msg: data_pb2.MountDataset, payload: Any = None
    ) -> data_pb2.DatasetReady | data_pb2.DatasetUnavailable:
        """挂载指定数据集版本指令 -> DatasetReady, or DatasetUnavailable with the reason. A
        job's relay (``outage_s``) tries a service it cannot reach again, as a stream does."""
        retry, since = _Backoff(self._budget), 0.0
        while True:
            try:
                ready = self._stub.Mount(msg, timeout=MOUNT_TIMEOUT_S)
                if since:
                    self._told(True, "", reason="", at=None, since=since)
                return ready
            except grpc.RpcError as e:
                if self._outage_s is not None and not self._closing and _unreachable(e):
                    wait = retry.next()
                    if wait is not None:
                        if not since:
                            since = time.monotonic()
                            self._told(False, "", reason=self._reason(e), at=None, since=since)
                        log.warning("data_mount_reconnecting", attempt=retry.attempts, wait=round(wait, 3))
                        if not self._closed.wait(wait):
                            continue
                self._failed(e)
                return data_pb2.DatasetUnavailable(
                    name=msg.name,
                    version=msg.version,
                    reason=self._reason(e),
                    failure=_failure(e, "surge.v1.MountDataset"),
                )

    def open_stream(self, msg: data_pb2.OpenStream, payload: Any = None) -> Reply:
        """Open a stream (cancelling the split's previous one) and start its reader thread;
        batches arrive as MicroBatch events. Reply payload: the stream's token."""
        split = msg.split or "train"
        token = StreamToken(split)
        if not msg.batches_per_message:  # (the loop's command is its own: the ask goes on a copy)
            asked = data_pb2.OpenStream()
            asked.CopyFrom(msg)
            asked.batches_per_message = BATCHES_PER_MESSAGE
            msg = asked
        call = self._stub.Stream(msg)  # no deadline: a training stream lives as long as the job
        with self._lock:
            previous, self._calls[split] = self._calls.get(split), call
        if previous is not None:
            previous.cancel()  # its reader ends quietly (CANCELLED); what it still hands on is dropped
        threading.Thread(target=self._pump, args=(split, msg, call, token), name=f"data-{split}", daemon=True).start()
        return Reply(None, token)

    def close(self) -> None:
        """Cancel every open stream and close the channel (composition root, at exit)."""
        self._closing = True
        self._closed.set()
        with self._lock:
            for call in self._calls.values():
                call.cancel()
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _pump(self, split: str, opened: data_pb2.OpenStream, call, token: StreamToken) -> None:
        mount = opened.mount
        if opened.mixture:  # (a mixture's failure names its datasets)
            mount = data_pb2.MountDataset(
                name="+".join(c.mount.name for c in opened.mixture),
                version="+".join(c.mount.version for c in opened.mixture),
            )
        last = data_pb2.DataPosition()
        handed = 0  # batches handed to the loop (a bounded stream owes the rest)
        resumed = False  # a batch came since the last reconnection: the stream delivers again
        retry = _Backoff(self._budget)
        since = 0.0  # time.monotonic() this stream's outage was told (0: none)
        while True:
            try:
                for mb in _each(call):
                    batch = Batch(split, _decode(mb.input_ids, mb), _decode(mb.labels, mb), token)
                    mb.ClearField("input_ids")  # the tensors travel as payload; don't copy bytes
                    mb.ClearField("labels")
                    at = last if handed else opened.start  # where this batch's stream began
                    last, handed = mb.next, handed + 1
                    if not resumed:
                        resumed, retry = True, _Backoff(self._budget)
                        if since:  # (before the batch: handing it on may wait for the loop)
                            self._told(True, split, reason="", at=at, since=since)
                            since = 0.0
                    self._packer(mb, batch)
                with self._lock:
                    replaced = self._calls.get(split) is not call
                if not replaced:  # (the end of a stream another one replaced is no news to the loop)
                    self._packer(data_pb2.DataExhausted(split=split, position=last))
                return
            except ModuleFailed as e:
                # The loop failed on a batch (its failure event is published): the stream it was
                # fed is broken, so stop reading it; a DatasetUnavailable would blame L4-1.
                log.warning("data_stream_stopped", split=split, failed=e.event.DESCRIPTOR.name)
                call.cancel()
                return
            except grpc.RpcError as e:
                if self._closing or e.code() == grpc.StatusCode.CANCELLED:
                    return
                if e.code() == grpc.StatusCode.UNAVAILABLE and not routed_from_rpc(e):
                    if opened.max_batches and handed >= opened.max_batches:  # it broke at its end
                        self._packer(data_pb2.DataExhausted(split=split, position=last))
                        return
                    if not since and self._outage_s is not None:
                        since = time.monotonic()
                        self._told(
                            False, split, reason=self._reason(e), at=last if handed else opened.start, since=since
                        )
                    again = self._reopen(split, opened, call, last if handed else None, handed, retry, e)
                    if again is not None:
                        call, resumed = again, False
                        continue
                    if self._closing:
                        return
                    with self._lock:
                        if self._calls.get(split) is not call:
                            return  # the loop opened another stream meanwhile: this one's end is no news
                self._failed(e)
                if self._relay_back(e):
                    # The module that failed said so itself (its event, on the bus as that module):
                    # a DatasetUnavailable built here would be a second report, in L4-1's name.
                    return
                self._versions(
                    data_pb2.DatasetUnavailable(
                        name=mount.name,
                        version=mount.version,
                        reason=self._reason(e),
                        failure=_failure(e, "surge.v1.OpenStream"),
                    )
                )
                return
            except Exception as e:  # noqa: BLE001 - a malformed batch, or a bug: the loop must hear of it
                reason = str(e) if isinstance(e, ValueError) else f"data relay: {type(e).__name__}: {e}"
                self._versions(
                    data_pb2.DatasetUnavailable(
                        name=mount.name,
                        version=mount.version,
                        reason=reason,
                        failure=_failure(e, "surge.v1.OpenStream"),
                    )
                )
                return

    def _reopen(
        self,
        split: str,
        opened: data_pb2.OpenStream,
        call,
        at: data_pb2.DataPosition | None,
        handed: int,
        retry: _Backoff,
        error: grpc.RpcError,
    ):
        """After the backoff's next wait, the split's stream opened again where the loop's
        batches end (``at``: the last handed batch's ``next``; None: none was handed, the
        original start); None when the budget is spent, the relay closes, or the loop opened
        another stream meanwhile (this one is then dropped)."""
        wait = retry.next()
        if wait is None:
            log.error("data_stream_reconnect_gave_up", split=split, address=self._address, seconds=retry.budget)
            return None
        log.warning(
            "data_stream_reconnecting",
            split=split,
            code=error.code().name,
            attempt=retry.attempts,
            wait=round(wait, 3),
            epoch=at.epoch if at is not None else opened.start.epoch,
            row=at.row if at is not None else opened.start.row,
        )
        if self._closed.wait(wait):
            return None
        again = data_pb2.OpenStream()
        again.CopyFrom(opened)
        if at is not None:
            # The order of the epoch it resumes in: a stream that crossed an epoch since it
            # was opened continues in a later one than the one it opened (the data service
            # refuses a start whose epoch is not its shuffle's).
            again.start.CopyFrom(at)
            again.shuffle.epoch = at.epoch
        if opened.max_batches:
            again.max_batches = opened.max_batches - handed  # > 0: all handed ends it in _pump
        with self._lock:
            if self._closing or self._calls.get(split) is not call:
                return None  # closed, or replaced by the loop's own OpenStream
            self._calls[split] = new = self._stub.Stream(again)
        return new

    def _told(self, back: bool, split: str, *, reason: str, at: data_pb2.DataPosition | None, since: float) -> None:
        """Tell L1 (through L1-3) that this relay waits for the data service, or (``back``)
        that it answers again; never raises (a report that cannot go must not end the stream)."""
        msg = data_pb2.DataServiceUnreachable(
            job_id=self._job_id, rank=self._rank, split=split, address=self._address, reason=reason, back=back
        )
        if at is not None:
            msg.at.CopyFrom(at)
        if back:
            msg.waited_seconds = time.monotonic() - since
        log.warning("data_service_back" if back else "data_service_unreachable", split=split, address=self._address,
                    waited=round(msg.waited_seconds, 3))  # fmt: skip
        try:
            self._versions(msg)
        except Exception as error:  # noqa: BLE001 - logged; the reconnection goes on
            log.error("data_outage_not_told", error=f"{type(error).__name__}: {error}")

    def _failed(self, e: grpc.RpcError) -> None:
        if self._on_error is not None:
            self._on_error(e)

    def _relay_back(self, e: grpc.RpcError) -> bool:
        """Put the failure events the data service's modules sent this side (the call's
        trailing metadata, services/contract/relay.py) on the rank's bus, as their modules
        (``back``: the rank's link checks the route); whether one was delivered."""
        delivered = False
        for routed in routed_from_rpc(e) if self._back is not None else ():
            try:
                self._back(routed)
            except Exception as error:  # noqa: BLE001 - refused or unreadable: logged, the stream's failure still goes on
                log.error("data_event_not_relayed", type=routed.type, error=f"{type(error).__name__}: {error}")
                continue
            delivered = True
        return delivered

    def _reason(self, e: grpc.RpcError) -> str:
        """The server's one-line message (it names dataset, version and cause), or where
        the service could not be reached."""
        details = " ".join((e.details() or "").split())
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return f"data service unreachable at {self._address}: {details}"
        if (
            e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)
            or not details
        ):
            return f"data service at {self._address}: {e.code().name}: {details}"
        return details


class _Backoff:
    """Jittered, doubling waits within a budget: each wait is uniform in [0, cap], the cap
    doubling from RECONNECT_FIRST_S to RECONNECT_MAX_S ("full jitter": many ranks that lost one
    service do not come back in step); ``next()`` is None once ``budget`` seconds passed."""

    def __init__(self, budget: float):
        self.budget = budget
        self.attempts = 0
        self._end = time.monotonic() + budget

    def next(self) -> float | None:
        left = self._end - time.monotonic()
        if left <= 0:
            return None
        cap = min(RECONNECT_MAX_S, RECONNECT_FIRST_S * 2**self.attempts)
        self.attempts += 1
        return min(left, random.uniform(0.0, cap))


class StreamToken:
    """Names one opened stream (compared by identity): OpenStream's reply payload, and
    every batch of that stream's ``Batch.stream``."""

    __slots__ = ("split",)

    def __init__(self, split: str):
        self.split = split

    def __repr__(self) -> str:
        return f"StreamToken({self.split!r}, {id(self):#x})"


def _unreachable(e: grpc.RpcError) -> bool:
    """The service could not be reached (UNAVAILABLE, typed by the status code, never by its
    text) and sent no failure event of its own module."""
    return e.code() == grpc.StatusCode.UNAVAILABLE and not routed_from_rpc(e)


def _failure(e: BaseException, operation: str):
    """The data service's failure as L4-1's, typed: a gRPC error's cause is the one the
    service sent in its trailing metadata (its module's exception type), else its status
    code's (services/contract/failures.py); never read from the message text."""
    return failure_of(e, Module.L4_DATASET_VERSIONS, operation)


def _each(call) -> Iterator[data_pb2.MicroBatch]:
    """The stream's micro-batches, in order: each message's first, then those it carries in
    ``more`` (taken off it: the loop gets each batch alone, as if it had come alone)."""
    for message in call:
        if not message.more:
            yield message
            continue
        behind = list(message.more)
        message.ClearField("more")  # (the batches keep their contents: they are detached, not cleared)
        yield message
        yield from behind


def _decode(buf: bytes, mb: data_pb2.MicroBatch) -> torch.Tensor:
    """Little-endian int32 bytes, row-major [B, T] -> int64 tensor [B, T]."""
    B, T = mb.batch_size, mb.seq_len
    if len(buf) != 4 * B * T:
        raise ValueError(f"malformed micro-batch: {len(buf)} bytes for [{B}, {T}] int32")
    return torch.from_numpy(np.frombuffer(buf, dtype="<i4").reshape(B, T).astype(np.int64))
