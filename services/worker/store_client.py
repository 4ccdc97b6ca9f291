"""The rank's relay of the L5 store service (checkpoint manager and metrics logger).

Metrics (as L5_METRICS_LOGGER): every ``StepCompleted`` / ``EvalCompleted`` becomes a
``MetricRecord`` on one long-lived ``StoreService.Record`` client stream, fed by a
background thread from a bounded queue. Nothing on the step path waits for the store: a
full queue drops its oldest record (counted), an unreachable store is retried with backoff.

Checkpoints (as L5_CHECKPOINT_MANAGER), for the loop's commands:
    SaveCheckpoint (payload: {"model", "optim", "train"} Stateful handles)
        -> ``BeginSave`` (every rank; all get the same staging directory) -> a
        torch.distributed.checkpoint save of the payload into it -> barrier -> SaveStaged.
    CommitCheckpoint (rank 0, after the barrier) -> ``CommitSave`` -> SaveCompleted, which
        is both the reply and an event to L1 (RankEvent{saved}).
    LoadCheckpoint (payload: the same handles) -> ``Load`` (the manager verifies the
        version) -> DCP load into the handles (weights_only for non-tensor values).

Checkpoint layout (DCP keys, flattened with dots): ``model.<param FQN>`` (e.g.
``model.blocks.0.attn.qkv.weight``), ``optim.state.<param FQN>.{exp_avg,exp_avg_sq,step}``,
``optim.param_groups``, ``train.step``, ``train.skipped_steps``,
``train.rank<r>.data_position`` ([epoch, document, offset]), ``train.rank<r>.rng_cpu``.

Every failed call is shown to ``on_error`` first (the rank reports a boundary violation the
store returned).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import grpc
import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from services.common.grpc_server import channel
from services.compute.inference import SafeLoadPlanner
from services.contract import engine_pb2, store_pb2, store_pb2_grpc
from services.contract.bus import Emitter

BEGIN_TIMEOUT_S = 60.0
COMMIT_TIMEOUT_S = 600.0   # the manager hashes every file
LOAD_TIMEOUT_S = 600.0
METRICS_QUEUE = 4096
_CLOSE = object()
log = structlog.get_logger()


class CheckpointError(RuntimeError):
    fault_class = "checkpoint_error"


class StoreClient:
    """Relay for L5_CHECKPOINT_MANAGER and L5_METRICS_LOGGER inside a rank process."""

    def __init__(self, address: str, checkpoint_events: Emitter,
                 on_error: Callable[[grpc.RpcError], None] | None = None):
        self._address = address
        self._on_error = on_error
        self._emit = checkpoint_events
        self._channel = channel(address)
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        self._records: queue.Queue = queue.Queue(maxsize=METRICS_QUEUE)
        self._dropped = 0
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_metrics, name="metrics", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ metrics (L5-2)

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(step=msg))

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(eval=msg))

    # ------------------------------------------------------------------ checkpoints (L5-1)

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: dict[str, Any]) -> store_pb2.SaveStaged:
        """Write this rank's part of step ``msg.step``. Collective: every rank calls it."""
        staged = self._rpc("BeginSave", self._stub.BeginSave, msg, BEGIN_TIMEOUT_S)
        dcp.save(payload, checkpoint_id=staged.staging_path)
        if dist.is_initialized():
            dist.barrier()  # every rank's files are on disk before rank 0 commits
        return staged

    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload: Any = None) -> store_pb2.SaveCompleted:
        done = self._rpc("CommitSave", self._stub.CommitSave, msg, COMMIT_TIMEOUT_S)
        self._emit(done)  # SaveCompleted up to L1
        return done

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
        loaded = self._rpc("Load", self._stub.Load, msg, LOAD_TIMEOUT_S)
        dcp.load(payload, checkpoint_id=loaded.info.path, planner=SafeLoadPlanner())
        return loaded

    def close(self, timeout: float = 5.0) -> None:
        """Flush the metric stream (up to ``timeout`` seconds) and close the channel."""
        self._closing.set()
        try:
            self._records.put(_CLOSE, timeout=timeout)
        except queue.Full:
            pass
        self._sender.join(timeout)
        if self._dropped:
            log.warning("metrics_dropped", records=self._dropped)
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _rpc(self, name: str, method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            details = " ".join((e.details() or "").split())
            raise CheckpointError(f"store at {self._address}: {name}: {e.code().name}: {details}") from None

    def _enqueue(self, record: store_pb2.MetricRecord) -> None:
        while True:
            try:
                self._records.put_nowait(record)
                return
            except queue.Full:
                try:
                    self._records.get_nowait()
                    self._dropped += 1
                except queue.Empty:
                    pass

    def _send_metrics(self) -> None:
        backoff = 0.5
        done = threading.Event()

        def records():
            while True:
                item = self._records.get()
                if item is _CLOSE:
                    done.set()
                    return
                yield item

        while not done.is_set():
            try:
                self._stub.Record(records())
                backoff = 0.5
            except grpc.RpcError as e:
                if self._closing.is_set() and done.is_set():
                    return
                if self._on_error is not None:
                    self._on_error(e)
                log.warning("metrics_stream_failed", store=self._address, code=e.code().name)
                if self._closing.wait(backoff):
                    return
                backoff = min(backoff * 2, 10.0)
