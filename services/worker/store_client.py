"""The rank's relay of the L5 store service (checkpoint manager and metrics logger).

Metrics (as L5_METRICS_LOGGER): every ``StepCompleted`` / ``EvalCompleted`` becomes a
``MetricRecord`` on one long-lived ``StoreService.Record`` client stream, fed by a
background thread from a bounded queue. Nothing on the step path waits for the store: a
full queue drops its oldest record (counted), an unreachable store is retried with backoff.

Checkpoints (as L5_CHECKPOINT_MANAGER), for the loop's commands:
    SaveCheckpoint (payload: {"model", "optim", "train"} Stateful handles; every rank, at
        the same step) -> wait for this rank's previous save to settle -> barrier (every
        rank's previous save, and its commit, are done: the manager holds one open save per
        job) -> ``BeginSave`` (all ranks get the same staging directory) -> a
        torch.distributed.checkpoint save of the payload into it -> SaveStaged, whose
        ``seconds`` is how long the loop was blocked.
        ``write_async``: ``dcp.async_save`` copies the state to host memory (the only part
        the loop waits for) and writes it from a background thread. Its collectives (plan
        exchange, the gather of write results, rank 0 writing ``.metadata``) run on a
        process group of their own (gloo), never on the training group: two threads issuing
        collectives on one gloo group can interleave them and deadlock.
    CommitCheckpoint (rank 0) -> ``CommitSave`` -> SaveCompleted, which is both the reply
        and an event to L1 (RankEvent{saved}). Asynchronous: the commit is sent from the
        relay's own thread once rank 0's write completes, and rank 0's DCP save completes
        only after it gathered every rank's write results and wrote ``.metadata``, so every
        shard of every rank is on disk when the manager hashes it. The reply is then None.
    FlushCheckpoint -> returns once this rank's pending write (and commit) is done; the
        loop sends it before it reports its end. A failed background write or commit is
        raised here or at the next SaveCheckpoint (CheckpointError).
    LoadCheckpoint (payload: the same handles) -> ``Load`` (the manager verifies the
        version; a version that fails is FAILED_PRECONDITION -> CheckpointIntegrityError,
        fault class ``checkpoint_integrity``) -> DCP load into the handles, unpickling
        nothing but plain data (``services.compute.inference.safe_load``).

Checkpoint layout (DCP keys, flattened with dots): ``model.<param FQN>`` (e.g.
``model.blocks.0.attn.q.weight``), ``optim.state.<param FQN>.{exp_avg,exp_avg_sq,step}``,
``optim.param_groups``, ``train.*`` (step, data position, RNG streams, loss scale: see
``services/engine/training_loop.py`` ``LoopState``).

Every failed call is shown to ``on_error`` first (the rank reports a boundary violation the
store returned).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.common.grpc_server import channel
from services.compute.inference import safe_load
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


class CheckpointIntegrityError(CheckpointError):
    """The store refused to load a version whose files fail verification; the orchestrator
    picks another (``StoreService.Verify`` says which are intact)."""

    fault_class = "checkpoint_integrity"


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
        # Asynchronous saves: one thread waits for the write and sends the commit, in order.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None     # this rank's save in flight (write [+ commit])
        self._write: Future | None = None       # its DCP write, until the commit is chained
        self._group: Any = None                 # the checkpoint's own gloo group (async saves)

    # ------------------------------------------------------------------ metrics (L5-2)

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(step=msg))

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(eval=msg))

    # ------------------------------------------------------------------ checkpoints (L5-1)

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: dict[str, Any]) -> store_pb2.SaveStaged:
        """Write this rank's part of step ``msg.step`` (in the background if
        ``msg.write_async``). Collective: every rank calls it at the same step.

        Raises:
            CheckpointError: the previous save failed in the background, or the store
                refused to open this one.
        """
        t0 = time.perf_counter()
        self._settle()
        distributed = dist.is_initialized()
        if distributed:
            dist.barrier()  # every rank's previous save settled: its commit is done
        staged = self._rpc("BeginSave", self._stub.BeginSave, msg, BEGIN_TIMEOUT_S)
        if msg.write_async:
            if distributed and self._group is None:
                self._group = dist.new_group(backend="gloo")  # collective: same point on every rank
            self._write = dcp.async_save(payload, checkpoint_id=staged.staging_path, process_group=self._group)
            self._pending = self._writer.submit(self._write.result)
        else:
            dcp.save(payload, checkpoint_id=staged.staging_path)
        staged.seconds = time.perf_counter() - t0
        log.info("checkpoint_staged", step=msg.step, write_async=msg.write_async, blocked_s=round(staged.seconds, 4))
        return staged

    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload: Any = None) -> store_pb2.SaveCompleted | None:
        """Seal the save of ``msg.step`` (rank 0): now, after a synchronous write (reply
        SaveCompleted), or once the background write is done (reply None; SaveCompleted
        goes up when the commit is). Raises CheckpointError for a refused synchronous commit."""
        if self._write is None:
            return self._commit(msg)
        write, self._write = self._write, None
        self._pending = self._writer.submit(self._commit_after, write, msg)
        return None

    def flush_checkpoint(self, msg: store_pb2.FlushCheckpoint, payload: Any = None) -> None:
        """Return once this rank's pending save (write, and commit on rank 0) is done.

        Raises:
            CheckpointError: that save failed.
        """
        self._settle()

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
        """Load version ``msg.version`` (verified by the store first) into the handles.

        Raises:
            CheckpointIntegrityError: the version fails verification (the store refused it).
            CheckpointError: any other refusal (unknown version, store unreachable).
        """
        t0 = time.perf_counter()
        loaded = self._rpc("Load", self._stub.Load, msg, LOAD_TIMEOUT_S)
        verified = time.perf_counter()
        try:
            safe_load(payload, loaded.info.path)
        except (Exception, CheckpointException) as e:  # e.g. another model's keys or shapes
            raise CheckpointError(f"checkpoint {loaded.info.version}: cannot be loaded into this job: {_one_line(e)}") from None
        log.info("checkpoint_loaded", version=loaded.info.version, step=loaded.info.step,
                 verify_s=round(verified - t0, 4), read_s=round(time.perf_counter() - verified, 4))
        return loaded

    def close(self, timeout: float = 5.0) -> None:
        """Flush the metric stream (up to ``timeout`` seconds) and close the channel."""
        self._closing.set()
        try:
            self._records.put(_CLOSE, timeout=timeout)
        except queue.Full:
            pass
        self._sender.join(timeout)
        self._writer.shutdown(wait=False, cancel_futures=True)
        if self._dropped:
            log.warning("metrics_dropped", records=self._dropped)
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _commit_after(self, write: Future, msg: store_pb2.CommitCheckpoint) -> store_pb2.SaveCompleted:
        write.result()  # a failed write (of any rank: DCP gathers them) is never committed
        return self._commit(msg)

    def _commit(self, msg: store_pb2.CommitCheckpoint) -> store_pb2.SaveCompleted:
        done = self._rpc("CommitSave", self._stub.CommitSave, msg, COMMIT_TIMEOUT_S)
        self._emit(done)  # SaveCompleted up to L1
        log.info("checkpoint_committed", version=done.version, step=done.step, bytes=done.bytes,
                 commit_s=round(done.seconds, 4))
        return done

    def _settle(self) -> None:
        """Wait for this rank's save in flight; raise its failure as CheckpointError."""
        pending, self._pending, self._write = self._pending, None, None
        if pending is None:
            return
        try:
            pending.result()
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # the background write failed (disk full, a peer died)
            raise CheckpointError(f"checkpoint write failed: {_one_line(e)}") from None

    def _rpc(self, name: str, method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            details = " ".join((e.details() or "").split())
            error = CheckpointError
            if name == "Load" and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                error = CheckpointIntegrityError
            raise error(f"store at {self._address}: {name}: {e.code().name}: {details}") from None

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


def _one_line(e: BaseException) -> str:
    """The last line of an error that names its cause (DCP wraps a rank's traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
