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
that brought none back -> the loop gets
``DatasetUnavailable`` (its ``failure`` typed by the cause the service sent) whose reason is the server's one-line message (NOT_FOUND /
FAILED_PRECONDITION from Mount: unknown dataset or version, manifest mismatch) or
"data service unreachable at ADDR" for a connection failure. Every failed call is shown
to ``on_error`` first (the rank reports a boundary violation the service returned). A loop
that fails on a batch (its own failure event, published by the bus) stops this relay reading
that stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import structlog
import torch

from services.common.grpc_server import channel
from services.contract import Module, data_pb2, data_pb2_grpc
from services.contract.bus import Emitter, Reply
from services.contract.failures import ModuleFailed, failure_of
from services.contract.relay import Routed, routed_from_rpc
from services.engine.training_loop import Batch

MOUNT_TIMEOUT_S = 120.0
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
    ):
        self._address = address
        self._on_error = on_error
        self._back = back
        self._versions = versions
        self._packer = packer
        self._channel = channel(address, module=Module.L2_TRAINING_LOOP)  # the loop's commands, relayed
        self._stub = data_pb2_grpc.DataServiceStub(self._channel)
        self._calls: dict[str, grpc.Future] = {}  # split -> its open stream
        self._closing = False
        self._lock = threading.Lock()

    def mount(
        self, msg: data_pb2.MountDataset, payload: Any = None
    ) -> data_pb2.DatasetReady | data_pb2.DatasetUnavailable:
        """挂载指定数据集版本指令 -> DatasetReady, or DatasetUnavailable with the reason."""
        try:
            return self._stub.Mount(msg, timeout=MOUNT_TIMEOUT_S)
        except grpc.RpcError as e:
            self._failed(e)
            return data_pb2.DatasetUnavailable(
                name=msg.name, version=msg.version, reason=self._reason(e), failure=_failure(e, "surge.v1.MountDataset")
            )

    def open_stream(self, msg: data_pb2.OpenStream, payload: Any = None) -> Reply:
        """Open a stream (cancelling the split's previous one) and start its reader thread;
        batches arrive as MicroBatch events. Reply payload: the stream's token."""
        split = msg.split or "train"
        token = StreamToken(split)
        call = self._stub.Stream(msg)  # no deadline: a training stream lives as long as the job
        with self._lock:
            previous, self._calls[split] = self._calls.get(split), call
        if previous is not None:
            previous.cancel()  # its reader ends quietly (CANCELLED); what it still hands on is dropped
        threading.Thread(
            target=self._pump, args=(split, msg.mount, call, token), name=f"data-{split}", daemon=True
        ).start()
        return Reply(None, token)

    def close(self) -> None:
        """Cancel every open stream and close the channel (composition root, at exit)."""
        self._closing = True
        with self._lock:
            for call in self._calls.values():
                call.cancel()
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _pump(self, split: str, mount: data_pb2.MountDataset, call, token: StreamToken) -> None:
        last = data_pb2.DataPosition()
        try:
            for mb in call:
                batch = Batch(split, _decode(mb.input_ids, mb), _decode(mb.labels, mb), token)
                mb.ClearField("input_ids")  # the tensors travel as payload; don't copy bytes
                mb.ClearField("labels")
                last = mb.next
                self._packer(mb, batch)
            with self._lock:
                replaced = self._calls.get(split) is not call
            if not replaced:  # (the end of a stream another one replaced is no news to the loop)
                self._packer(data_pb2.DataExhausted(split=split, position=last))
        except ModuleFailed as e:
            # The loop failed on a batch (its failure event is published): the stream it was
            # fed is broken, so stop reading it; a DatasetUnavailable would blame L4-1.
            log.warning("data_stream_stopped", split=split, failed=e.event.DESCRIPTOR.name)
            call.cancel()
        except grpc.RpcError as e:
            if self._closing or e.code() == grpc.StatusCode.CANCELLED:
                return
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
        except Exception as e:  # noqa: BLE001 - a malformed batch, or a bug: the loop must hear of it
            reason = str(e) if isinstance(e, ValueError) else f"data relay: {type(e).__name__}: {e}"
            self._versions(
                data_pb2.DatasetUnavailable(
                    name=mount.name, version=mount.version, reason=reason, failure=_failure(e, "surge.v1.OpenStream")
                )
            )

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


class StreamToken:
    """Names one opened stream (compared by identity): OpenStream's reply payload, and
    every batch of that stream's ``Batch.stream``."""

    __slots__ = ("split",)

    def __init__(self, split: str):
        self.split = split

    def __repr__(self) -> str:
        return f"StreamToken({self.split!r}, {id(self):#x})"


def _failure(e: BaseException, operation: str):
    """The data service's failure as L4-1's, typed: a gRPC error's cause is the one the
    service sent in its trailing metadata (its module's exception type), else its status
    code's (services/contract/failures.py); never read from the message text."""
    return failure_of(e, Module.L4_DATASET_VERSIONS, operation)


def _decode(buf: bytes, mb: data_pb2.MicroBatch) -> torch.Tensor:
    """Little-endian int32 bytes, row-major [B, T] -> int64 tensor [B, T]."""
    B, T = mb.batch_size, mb.seq_len
    if len(buf) != 4 * B * T:
        raise ValueError(f"malformed micro-batch: {len(buf)} bytes for [{B}, {T}] int32")
    return torch.from_numpy(np.frombuffer(buf, dtype="<i4").reshape(B, T).astype(np.int64))
