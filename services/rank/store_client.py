"""The rank's relay of the L5 store service (checkpoint manager and metrics logger).

Metrics (as L5_METRICS_LOGGER): every ``StepCompleted`` / ``EvalCompleted`` (and the loop's
``LogCollectionConfig``, before them) becomes a
``MetricRecord`` (numbered ``seq`` 1, 2, ...) on one long-lived bidirectional
``StoreService.Record`` stream, fed by a background thread. Nothing on the step path waits
for the store. A record is held until the store's ``MetricsAck`` for its ``seq`` arrives;
when the stream breaks (store restarted, stopped, unreachable) the thread reconnects with
backoff and resends every record not yet acknowledged, in order (the store writes a resent
record once). The held records are bounded (``METRICS_BUFFER``): past it the oldest is
dropped, counted and logged.

Checkpoints (as L5_CHECKPOINT_MANAGER), for the loop's commands:
    SaveCheckpoint (payload: the rank's snapshot as a nested dict of tensors, {"model",
        "optim", "train"}: a private copy the rank's state manager hands over, never live
        state; every rank, at the same step) -> wait for this rank's previous write (and, on the committing rank,
        up to ``STORE_RPC_TIMEOUT_S`` for its commit) -> the ranks agree that every previous
        save settled (an all-reduce on a gloo group of the relay's own: the manager holds
        one open save per job) -> ``BeginSave`` naming this generation of ranks
        (``attempt``: a random token the ranks agree on at their first save, the same on
        every rank of this launch and new at every launch; all ranks of it get the same
        staging directory, and never one a killed generation was handed)
        -> the ranks agree that every rank got it -> a torch.distributed.checkpoint save of
        the payload into it -> SaveStaged, whose ``seconds`` is how long the loop was blocked.
        ``write_async``: the snapshot is written from the relay's background thread
        (``dcp.save`` there; the loop waited only for the snapshot's copy, taken before this
        call, and no second staging copy is made). Its collectives (plan
        exchange, the gather of write results, rank 0 writing ``.metadata``) run on a
        process group of their own (gloo), never on the training group: two threads issuing
        collectives on one gloo group can interleave them and deadlock.
    CommitCheckpoint (rank 0) -> ``CommitSave`` (naming the same ``attempt``) -> SaveCompleted,
        which is both the reply and an event to L1 (RankEvent{saved}). Asynchronous: the
        commit is sent from the relay's own thread once rank 0's write completes, and rank
        0's DCP save completes only after it gathered every rank's write results and wrote
        ``.metadata``, so every shard of every rank is on disk when the manager hashes it.
        The reply is then None.
    FlushCheckpoint -> returns once this rank's pending write (and commit) is done; the
        loop sends it before it reports its end. A failed background write or a refused
        commit is raised here or at the next SaveCheckpoint (CheckpointError). A final
        commit that could not reach the store is retried for ``FLUSH_RETRY_S``.
    LoadCheckpoint (payload: a nested dict of tensors to read into: the state manager's own
        copies) -> ``Load`` (the store checks the version's
        recorded verdict and manifest; a refusal is FAILED_PRECONDITION ->
        CheckpointIntegrityError, fault class ``checkpoint_integrity``) -> DCP load into the
        copies, unpickling nothing but plain data (``services.compute.inference.safe_load``)
        and checking each file's SHA-256 against the manifest as it is read: a mismatch or a
        missing file is a CheckpointIntegrityError naming the file.

Where the bytes go is the store's word, never this relay's guess: ``SaveStaged.transfer``
(and ``CheckpointInfo.transfer`` for a load) is TRANSFER_PATH (write and read the store's
directories at the paths it names: a shared filesystem), TRANSFER_STREAM (stream the chunks
and index to the store over its data plane, read them back the same way) or TRANSFER_FSSPEC
(chunks to and from the object store URL it names, the index streamed):
``services/rank/checkpoint_transfer.py``. The same ChunkWriter / ChunkReader (chunks,
digests, memory copies, DCP planners) serve all three.

A store outage is not a training fault. When ``BeginSave`` or ``CommitSave`` fails with
UNAVAILABLE (cause UNREACHABLE) or DEADLINE_EXCEEDED (TIMEOUT), or the previous commit is
still waiting for the store, the save is skipped (every rank agrees; nothing half-written is
committed: a staging directory is only ever committed whole, and the next save's BeginSave
removes it), training goes on, the next interval saves again, and the rank that commits
publishes ``SnapshotFailed{operation "save", cause, step}`` up its session (one per failed
save). Causes are read from the gRPC status code, never from an error's text. A refused
``BeginSave`` (the store busy committing, an I/O error) is skipped the same way (cause
REJECTED); a refused commit still fails the rank (the staged files are inconsistent).
Every SnapshotFailed this relay sends carries its ``failure`` typed: by the error's type
(a refused call: the cause the store sent in ``surge-failure-cause``, else its status code's;
a failed write: what the write raised) or, with no error of its own (another rank's
BeginSave failed), by the store cause; ``failure.operation`` names the command (Save-,
Commit- or FlushCheckpoint). An error a save, commit or flush raises is reported so first,
once (the bus then publishes no second, untyped one).

Checkpoint layout (DCP keys, flattened with dots): ``model.<param FQN>`` (e.g.
``model.blocks.0.attn.q.weight``), ``optim.state.<param FQN>.{exp_avg,exp_avg_sq,step}``,
``optim.param_groups``, ``train.*`` (step, data position, RNG streams, loss scale: see
``services/engine/training_loop.py`` ``LoopState``).

Every failed call is shown to ``on_error`` first (the rank reports a boundary violation the
store returned).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import json
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from google.protobuf.message import Message
from torch.distributed.checkpoint.api import CheckpointException

from services.common.grpc_server import channel
from services.compute.hf_format import HfFormatError, read_hf_tensors
from services.compute.inference import SafeLoadPlanner, safe_load
from services.contract import Module, engine_pb2, route_pb2, store_pb2, store_pb2_grpc
from services.contract.acting import run_as
from services.contract.bus import BoundaryViolation, Emitter
from services.contract.failures import (
    FailureCause,
    ModuleFailed,
    Refusal,
    Unwind,
    cause_of,
    collective,
    failure_of,
    one_line,
)
from services.rank.checkpoint_transfer import (
    FsspecSource,
    FsspecTransfer,
    StreamSource,
    StreamTransfer,
    TransferChunkWriter,
    TransferFailed,
)
from services.state.chunk_store import ChunkIntegrityError, ChunkReader, ChunkSource, ChunkWriter, DirectorySource
from services.state.snapshot import SLOT_META


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


# BeginSave (a mkdir in the store) and how long a new save waits for the previous commit:
# the loop is blocked meanwhile, so this stays well under the stall deadline.
STORE_RPC_TIMEOUT_S = _env_seconds("SURGE_STORE_RPC_TIMEOUT_S", 10.0)
COMMIT_TIMEOUT_S = 600.0  # the manager hashes every file (in the background: the loop trains on)
LOAD_TIMEOUT_S = 60.0  # the store re-hashes nothing at load: the reader checks digests
# At the end of a run: how long the last commit may wait for the store (pending, or retried
# while unreachable). Below the default stall deadline (30 s): the rank has finished training.
FLUSH_RETRY_S = _env_seconds("SURGE_CHECKPOINT_FLUSH_RETRY_S", 20.0)
METRICS_BUFFER = 100_000  # metric records held until the store acknowledged them
# At the loop's end (StopLogCollection): how long it waits for the store to acknowledge every
# record (the rank may be released as soon as it reports its end).
METRICS_FLUSH_S = _env_seconds("SURGE_METRICS_FLUSH_S", 5.0)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
STORE_CAUSE_METADATA = "surge-store-cause"  # trailing metadata of a refused Load (the store's verdict)
# gRPC status -> the typed cause of a store that could not be asked (never read from text).
OUTAGE_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: store_pb2.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: store_pb2.TIMEOUT,
}
log = structlog.get_logger()


class CheckpointError(RuntimeError):
    """A save or load that failed. ``failure_cause``: typed from what failed (the store's
    cause for a refused call, the write's error's type), FAILURE_IO by default; ``cause``:
    the StoreFailureCause SnapshotFailed carries (REJECTED: the store refused; 0: the
    failure was this rank's own, e.g. its write); ``step``: the save it belongs to (0: none)."""

    fault_class = "checkpoint_error"
    failure_cause = FailureCause.FAILURE_IO
    cause = store_pb2.STORE_FAILURE_UNSPECIFIED
    step = 0


class StoreUnavailable(CheckpointError):
    """The store could not be asked: ``cause`` UNREACHABLE (UNAVAILABLE) or TIMEOUT
    (DEADLINE_EXCEEDED)."""

    failure_cause = FailureCause.FAILURE_UNAVAILABLE

    def __init__(self, message: str, cause: int):
        super().__init__(message)
        self.cause = cause


class CheckpointIntegrityError(CheckpointError):
    """A version's files do not match its manifest (the store refused it by its recorded
    verdict, or this rank's read found a file's digest wrong or the file gone); the
    orchestrator picks another (``StoreService.Verify`` says which are intact). ``cause``:
    ``store_pb2.CORRUPT`` or ``store_pb2.MISSING_FILE``; ``file``: the file, when known."""

    fault_class = "checkpoint_integrity"
    failure_cause = FailureCause.FAILURE_DATA_CORRUPT

    def __init__(self, message: str, cause: int = store_pb2.CORRUPT, file: str = ""):
        super().__init__(message)
        self.cause, self.file = cause, file


class WeightsMismatch(CheckpointError, Refusal):
    """``init_from`` weights that do not fit this job's model (a tensor missing, or of
    another shape): the spec's fault, the same on every retry; nothing was copied into the
    model. A refusal of the load as asked, not a failure of this relay: the loop gets it as
    raised and fails with it (``config_error``, graded fatal: the job stops), and no
    SnapshotFailed is published (the orchestrator acts on those itself, for a recovery's
    load; a start's would leave the job waiting)."""

    fault_class = "config_error"
    failure_cause = FailureCause.FAILURE_INVALID_INPUT


def load_hf_weights(msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
    """``init_from.hf``: read the model slot of ``payload`` (a load template's dict, read
    into in place) from the Hugging Face directory ``msg.hf_directory`` on this node
    (safetensors: no pickle; names and shapes by services/compute/hf_format.py), as a load
    of step 0. The store is not asked: the directory is no version of its catalog.

    Raises:
        WeightsMismatch: a tensor the model needs is missing or of another shape, a file
            cannot be read, or the template holds more than the model slot (one line
            naming it); nothing of the template is changed then.
    """
    t0 = time.perf_counter()
    where = msg.hf_directory
    try:
        if set(payload) != {"model"}:
            raise HfFormatError(f"init_from.hf: {where}: holds weights only, asked for {sorted(payload)}")
        model = payload["model"]
        wanted = {k: v for k, v in model.items() if k != SLOT_META}
        tensors = read_hf_tensors(where, wanted)
    except (HfFormatError, OSError) as e:
        raise WeightsMismatch(" ".join(str(e).split()) if isinstance(e, HfFormatError) else _one_line(e)) from None
    model.update(tensors)
    model[SLOT_META] = torch.tensor([0], dtype=torch.int64)  # read as a version of step 0
    log.info("hf_weights_loaded", directory=where, tensors=len(wanted), seconds=round(time.perf_counter() - t0, 4))
    return store_pb2.CheckpointLoaded(info=store_pb2.CheckpointInfo(version=f"hf:{where}", step=0, path=where))


def _reported(handled: str):
    """A save, commit or flush handler (``handled``: its command) whose error is reported
    first, as this module's failure event for it: SnapshotFailed{operation "save", the
    store's cause when the store refused, the save's step}, its ``failure`` typed by the
    error; so the bus, which passes the error on, does not build one of its own (operation
    '', no store cause). What the bus passes on untouched (a refusal, an unwind, a deeper
    module's failure, a violation) is not this module's failure. (A decorator, not a
    wrapper method: the handler's own frame keeps its name, which the exception register's
    communication sites name.)"""

    def wrap(fn):
        @functools.wraps(fn)
        def handler(self: StoreClient, msg: Message, payload: Any = None) -> Any:
            try:
                return fn(self, msg, payload)
            except (BoundaryViolation, ModuleFailed, Refusal, Unwind):
                raise
            except Exception as e:
                if not getattr(e, "failure_reported", False):
                    mine = isinstance(e, CheckpointError)
                    self._report(
                        "save",
                        e.cause if mine else store_pb2.STORE_FAILURE_UNSPECIFIED,
                        str(e) if mine else one_line(e),
                        step=(e.step if mine else 0) or getattr(msg, "step", 0),
                        job_id=msg.job_id,
                        rank=getattr(msg, "rank", 0),
                        handled=handled,
                        error=e,
                    )
                raise

        return handler

    return wrap


# The relay's own gloo groups: "agree" (the ranks' agreement on a save, main thread) and
# "write" (an asynchronous save's DCP collectives, on the writer thread).
RELAY_GROUPS = ("agree", "write")


class StoreClient:
    """Relay for L5_CHECKPOINT_MANAGER and L5_METRICS_LOGGER inside a rank process."""

    def __init__(
        self,
        address: str,
        checkpoint_events: Emitter,
        on_error: Callable[[grpc.RpcError], None] | None = None,
        metrics_buffer: int = METRICS_BUFFER,
        copies: Any = None,
        on_routed: Callable[[list[Any]], Any] | None = None,
    ):
        """``copies``: this rank's in-memory copies of its newest snapshot (optional; e.g.
        ``services/rank/memory_client.py``): ``begin(step) -> sink | None`` before a save's
        write (the chunk writer's sink), ``end(ok)`` once the write is done or failed, and
        ``sources() -> [ChunkSource]``, the sources a load tries before the store's files.
        ``on_routed``: gets the failure events a metric ack brought back (``MetricsAck.routed``,
        e.g. LogWriteFailed of a sink), to put on the rank's bus."""
        self._copies = copies
        self._on_routed = on_routed
        self._address = address
        self._on_error = on_error
        self._emit = checkpoint_events
        # A store that comes back is found within RECONNECT_BACKOFF_MS (gRPC's default backoff
        # grows to 120 s while it is away, and calls fail fast meanwhile).
        self._channel = channel(
            address, options=RECONNECT_OPTIONS, module=Module.L2_TRAINING_LOOP
        )  # the loop's commands, relayed
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        self._data_channel: grpc.Channel | None = None  # the checkpoint data plane, opened at first use
        self._data_stub_: store_pb2_grpc.StoreServiceStub | None = None
        # Metric records held until acknowledged: (seq, record), oldest first.
        self._held: collections.deque[tuple[int, store_pb2.MetricRecord]] = collections.deque()
        self._held_cond = threading.Condition()
        self._held_max = metrics_buffer
        self._seq = 0
        self._dropped = 0
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_metrics, name="metrics", daemon=True)
        self._sender.start()
        # Asynchronous saves: one thread waits for the write and sends the commit, in order.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._write: Future | None = None  # the DCP write of the last save, until settled
        self._chain: Future | None = None  # the same write, until rank 0 chains its commit on it
        self._commit: Future | None = None  # rank 0: the background commit, until settled
        self._failed_commit: store_pb2.CommitCheckpoint | None = None  # last commit that could not reach the store
        self._skipped_step: int | None = None  # the save of this step was skipped: nothing to commit
        # The relay's own gloo groups, by use: "write" (async saves' DCP collectives) and
        # "agree" (the ranks' agreement on a save, main thread only). Weak references: torch
        # holds a group until its world is destroyed, and a group referenced after that
        # keeps its sockets open (a peer blocked in it stays blocked: a group rebuilt in
        # place, issue 16). ``_world``: the default group they (and ``_attempt``) belong to.
        self._groups: dict[str, weakref.ref] = {}
        self._world: weakref.ref | None = None
        # Where the groups come from in a rank: L2-2 makes them at every formation of the
        # world (services/engine/parallel_strategy.py, side_groups); without it (a relay on
        # its own), made here at the first save.
        self._side_group: Callable[[str], Any] | None = None
        self._attempt = ""  # this generation of ranks (SaveCheckpoint.attempt), from the first save
        self._write_step = 0  # the step of the last save's write (what its failure names)
        self._commit_step = 0  # the step of the background commit (likewise)

    # ------------------------------------------------------------------ metrics (L5-2)

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(step=msg))

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        self._enqueue(store_pb2.MetricRecord(eval=msg))

    def log_collection_config(self, msg: store_pb2.LogCollectionConfig, payload: Any = None) -> None:
        """The loop's sink choice for L5-2: sent on the metric stream ahead of the records
        (held and resent like them; the store keeps its copy across its restarts)."""
        self._enqueue(store_pb2.MetricRecord(config=msg))

    def stop_log_collection(self, msg: store_pb2.StopLogCollection, payload: Any = None) -> None:
        """The loop's end, after its last record on the same stream (L5-2 closes the sinks).
        Returns once the store acknowledged it, so every record before it (a finished rank
        may be released at once, its held records with it), or after ``METRICS_FLUSH_S``
        (logged: the rest may be lost, training is not held up for it)."""
        seq = self._enqueue(store_pb2.MetricRecord(stop=msg))
        deadline = time.monotonic() + METRICS_FLUSH_S
        with self._held_cond:
            while self._held and self._held[0][0] <= seq and time.monotonic() < deadline:
                self._held_cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            if self._held and self._held[0][0] <= seq:
                log.warning("metrics_not_flushed", held=len(self._held), seconds=METRICS_FLUSH_S)

    @property
    def held_records(self) -> int:
        """Metric records not yet acknowledged by the store."""
        with self._held_cond:
            return len(self._held)

    # ------------------------------------------------------------------ checkpoints (L5-1)

    @_reported("surge.v1.SaveCheckpoint")
    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: dict[str, Any]) -> store_pb2.SaveStaged:
        """Write this rank's part of step ``msg.step`` (in the background if
        ``msg.write_async``), or skip the save when the store cannot be asked (every rank
        skips together; SnapshotFailed goes up). Collective: every rank calls it at the same
        step.

        Raises:
            CheckpointError: the previous save's write failed, or its commit was refused
                (reported first: SnapshotFailed{save}, this module's failure event).
        """
        t0 = time.perf_counter()
        self._leave_old_world(msg.job_id, msg.rank)
        self._skipped_step = None
        self._failed_commit = None  # a new save supersedes a commit that never reached the store
        self._settle_write()
        failure = self._commit_settled(STORE_RPC_TIMEOUT_S)
        cause = self._agree(failure[0] if failure else 0)  # every rank's previous save settled
        attempt = self._generation()  # collective at the first save, so on every rank
        if not msg.attempt:
            ask = store_pb2.SaveCheckpoint()
            ask.CopyFrom(msg)
            ask.attempt = attempt
            msg = ask
        staged, error = None, None
        if not cause:
            try:
                staged = self._rpc("BeginSave", self._stub.BeginSave, msg, STORE_RPC_TIMEOUT_S)
            except CheckpointError as e:  # unreachable, or refused (busy committing, an I/O error): nothing written yet
                failure, error = (e.cause, str(e)), e
            cause = self._agree(failure[0] if failure else 0)  # every rank has the staging directory
        if cause:
            self._skipped_step = msg.step
            reason = failure[1] if failure else f"another rank could not stage step {msg.step}"
            log.warning(
                "checkpoint_save_skipped", step=msg.step, cause=store_pb2.StoreFailureCause.Name(cause), reason=reason
            )
            if msg.rank == 0:  # (typed by its own error when it had one, else by the agreed cause)
                self._report(
                    "save",
                    cause,
                    reason,
                    step=msg.step,
                    job_id=msg.job_id,
                    rank=msg.rank,
                    handled="surge.v1.SaveCheckpoint",
                    error=error,
                )
            return store_pb2.SaveStaged(job_id=msg.job_id, step=msg.step, seconds=time.perf_counter() - t0)
        self._write_step = msg.step
        writer = self._writer_for(staged, msg)
        if msg.write_async:
            group = self._relay_group("write") if dist.is_initialized() else None  # collective at the first
            # The payload is the rank's snapshot, already a private copy (services/state/
            # state_manager.py): written as it is from the relay's thread, no staging copy.
            # (The writer thread acts for L5: DCP's collectives there are the relay's.)
            self._write = self._chain = self._writer.submit(
                run_as,
                Module.L5_CHECKPOINT_MANAGER,
                dcp.save,
                payload,
                checkpoint_id=staged.staging_path,
                storage_writer=writer,
                process_group=group,
            )
            if self._copies is not None and writer is not None and writer.sink is not None:
                self._write.add_done_callback(lambda f: self._copies.end(not f.cancelled() and f.exception() is None))
        else:
            written = False
            try:
                dcp.save(payload, checkpoint_id=staged.staging_path, storage_writer=writer)
                written = True
            finally:
                if self._copies is not None and writer is not None and writer.sink is not None:
                    self._copies.end(written)
        staged.seconds = time.perf_counter() - t0
        log.info(
            "checkpoint_staged",
            step=msg.step,
            write_async=msg.write_async,
            blocked_s=round(staged.seconds, 4),
            baseline=staged.baseline,
            epoch=staged.epoch,
        )
        return staged

    @_reported("surge.v1.CommitCheckpoint")
    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload: Any = None) -> store_pb2.SaveCompleted | None:
        """Seal the save of ``msg.step`` (rank 0): now, after a synchronous write (reply
        SaveCompleted), or once the background write is done (reply None; SaveCompleted
        goes up when the commit is). A skipped save commits nothing; a commit that cannot
        reach the store is reported (SnapshotFailed) and training goes on. Raises
        CheckpointError for a refused synchronous commit (reported first, as the save's)."""
        if self._skipped_step == msg.step:
            return None
        if not msg.attempt and self._attempt:  # the save's generation: the store checks the open save is its
            named = store_pb2.CommitCheckpoint()
            named.CopyFrom(msg)
            named.attempt = self._attempt
            msg = named
        if self._chain is None:
            return self._commit_now(msg)
        write, self._chain = self._chain, None
        self._commit, self._commit_step = self._writer.submit(self._commit_after, write, msg), msg.step
        return None

    @_reported("surge.v1.FlushCheckpoint")
    def flush_checkpoint(self, msg: store_pb2.FlushCheckpoint, payload: Any = None) -> None:
        """Return once this rank's pending save (write, and commit on rank 0) is done. A
        last commit still waiting for the store, or that could not reach it, is waited for
        or retried up to ``FLUSH_RETRY_S`` (there is no next interval); if the store stays
        away, the failure is reported and the rank ends normally.

        Raises:
            CheckpointError: that save's write failed, or its commit was refused (reported
                first, as the save's).
        """
        self._leave_old_world(msg.job_id, None)
        self._settle_write()
        deadline, backoff = time.monotonic() + FLUSH_RETRY_S, 0.5
        pending = self._commit_settled(FLUSH_RETRY_S)
        if pending is not None:  # the store never answered the last commit: reported, not a fault
            cause, reason = pending
            self._report(
                "save",
                cause,
                f"{reason}; the run ends without it",
                job_id=msg.job_id,
                step=self._commit_step,
                handled="surge.v1.FlushCheckpoint",
            )
            return
        failed = self._failed_commit
        while failed is not None and time.monotonic() < deadline:
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 5.0)
            try:
                self._commit_now(failed, report=False)
            except CheckpointError as e:  # refused now (e.g. the store lost the staging): reported, not fatal
                self._report(
                    "save",
                    e.cause,
                    str(e),
                    step=failed.step,
                    job_id=failed.job_id,
                    handled="surge.v1.FlushCheckpoint",
                    error=e,
                )
                return
            failed = self._failed_commit

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
        """Load version ``msg.version`` into the payload (copies), checking every file read against
        the version's manifest as it is read.

        Raises:
            CheckpointIntegrityError: the store refused the version (recorded corrupt), or a
                file this rank read differs from the manifest or is gone (named).
            CheckpointError: any other refusal (unknown version, store unreachable), or a
                version that does not fit this job.
        """
        if msg.hf_directory:
            return self._load_hf(msg, payload)
        t0 = time.perf_counter()
        try:
            loaded = self._rpc("Load", self._stub.Load, msg, LOAD_TIMEOUT_S)
        except CheckpointError as e:  # (a plain one: the store refused the request)
            self._report("load", getattr(e, "cause", store_pb2.REJECTED), str(e), version=msg.version, error=e)
            raise
        asked = time.perf_counter()
        info = loaded.info
        reader = None
        try:
            remote = self._remote_store(info)
            index = _RemoteIndex(remote, info) if remote is not None else None
            digests = _manifest_digests(info, index)
            if info.chunk_path:
                reader = self._reader_for(info, digests, remote, index)
                reader.read_metadata()  # checked first: DCP would hide its failure in an error of its own
                dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner())
            elif remote is not None:
                raise CheckpointError(f"checkpoint {info.version}: a version of plain files is read from a path only")
            else:
                safe_load(payload, info.path, digests=digests, what=f"checkpoint {info.version}")
        except TransferFailed as e:
            error = CheckpointError(f"checkpoint {info.version}: {e}")
            error.failure_cause = e.failure_cause
            self._report(
                "load",
                store_pb2.UNREACHABLE if e.code in OUTAGE_CAUSES else 0,
                str(error),
                version=info.version,
                error=error,
            )
            raise error from None
        except ChunkIntegrityError as e:
            error = CheckpointIntegrityError(str(e), store_pb2.MISSING_FILE if e.missing else store_pb2.CORRUPT, e.file)
            self._report("load", error.cause, str(e), version=info.version, error=error)
            raise error from None
        except CheckpointIntegrityError as e:
            self._report("load", e.cause, str(e), version=info.version, error=e)
            raise
        except (Exception, CheckpointException) as e:  # e.g. another model's keys or shapes
            bad = _digest_failure(e)
            if bad is not None:
                from_me, mismatch = bad
                cause = store_pb2.MISSING_FILE if mismatch.missing else store_pb2.CORRUPT
                error = CheckpointIntegrityError(str(mismatch), cause, mismatch.file)
                if from_me:
                    self._report("load", cause, str(mismatch), version=info.version, error=error)
                else:
                    # Another rank's read found it (DCP gathers every rank's errors) and that
                    # rank reports it: one SnapshotFailed per failed read, not one per rank.
                    error.failure_reported = True
                raise error from None
            error = CheckpointError(f"checkpoint {info.version}: cannot be loaded into this job: {_one_line(e)}")
            self._report("load", store_pb2.STORE_FAILURE_UNSPECIFIED, str(error), version=info.version, error=error)
            raise error from None
        log.info(
            "checkpoint_loaded",
            version=info.version,
            step=info.step,
            ask_s=round(asked - t0, 4),
            read_verified_s=round(time.perf_counter() - asked, 4),
            **(
                {
                    "chunks_from": dict(reader.served),
                    "bytes_from": dict(reader.served_bytes),
                    "mismatches": dict(reader.mismatches),
                }
                if reader
                else {}
            ),
        )
        if reader:  # where this rank's chunks came from (for the recovery's event, via TrainingLoopStarted)
            loaded.bytes_from.update({name: int(n) for name, n in reader.served_bytes.items() if n})
        return loaded

    def _load_hf(self, msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
        """``init_from.hf`` (:func:`load_hf_weights`; a mismatch is refused: WeightsMismatch)."""
        return load_hf_weights(msg, payload)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is held (waiting up to ``timeout`` seconds for the store's acks) and
        close the channel."""
        deadline = time.monotonic() + timeout
        with self._held_cond:
            while self._held and time.monotonic() < deadline and self._sender.is_alive():
                self._held_cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            left = len(self._held)
        self._closing.set()
        with self._held_cond:
            self._held_cond.notify_all()
        self._sender.join(max(0.0, deadline - time.monotonic()) + 0.5)
        self._writer.shutdown(wait=False, cancel_futures=True)
        if self._dropped or left:
            log.warning(
                "metrics_dropped", records=self._dropped + left, over_bound=self._dropped, unacknowledged_at_exit=left
            )
        self._channel.close()
        if self._data_channel is not None:
            self._data_channel.close()

    # ------------------------------------------------------------------ private: checkpoints

    def _agree(self, cause: int) -> int:
        """The largest failure cause over every rank (0: every rank is fine). Collective on
        the relay's own gloo group, from the main thread only."""
        if not dist.is_initialized():
            return cause
        group = self._relay_group("agree")  # collective the first time: the first save, every rank
        t = torch.tensor([int(cause)], dtype=torch.int64)
        with collective():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def _generation(self) -> str:
        """This launch's ``SaveCheckpoint.attempt``: two random 63-bit numbers every rank
        agrees on (the maximum of each rank's draws), drawn at the first save. Collective then (every rank
        saves at the same step), on the relay's own gloo group, from the main thread only.
        A relaunched rank is a new process: a new draw, so a new generation never shares a
        staging directory with an old one (a rendezvous port may be reused; this is not)."""
        if not self._attempt:
            draw = torch.tensor([secrets.randbits(63), secrets.randbits(63)], dtype=torch.int64)
            if dist.is_initialized():
                group = self._relay_group("agree")  # collective the first time, as in _agree
                with collective():
                    dist.all_reduce(draw, op=dist.ReduceOp.MAX, group=group)
            self._attempt = "".join(f"{int(v):016x}" for v in draw.tolist())
        return self._attempt

    def use_side_groups(self, side_group: Callable[[str], Any]) -> None:
        """Composition root: take the relay's groups ("agree", "write") from ``side_group``
        (L2-2's, made at every formation of the world) instead of making them at the first save."""
        self._side_group = side_group

    def _relay_group(self, use: str) -> Any:
        """The relay's own gloo group for ``use`` ("agree", "write"): L2-2's side group of the
        current world, else made on first use (``new_group`` is collective, so every rank asks
        at the same point, its first save)."""
        group = self._groups[use]() if use in self._groups else None
        if group is None:
            group = self._side_group(use) if self._side_group is not None else None
            if group is None:
                group = dist.new_group(backend="gloo")
            self._groups[use] = weakref.ref(group)
            self._world = weakref.ref(dist.group.WORLD)  # (the world they belong to: _leave_old_world)
        return group

    def _leave_old_world(self, job_id: str, rank: int | None) -> None:
        """After the default group was rebuilt in place (issue 16), before anything of a save:
        the old world's groups are gone and its generation of ranks with them. The write in
        flight (its collectives ran on the broken group) and rank 0's commit chained on it are
        waited for and dropped, never committed; the groups are made anew and the attempt
        drawn anew at the next save, by every rank of the new group at the same point (a
        replacement rank starts with neither). A save that failed or was abandoned so is
        reported once, by rank 0 (``rank``; None: not known here, as in a flush, whose
        caller ends the rank), typed by its own error where that says more than
        "communication": L1 records it as the consequence of the fault that broke the group."""
        if self._world is None or (dist.is_initialized() and self._world() is dist.group.WORLD):
            return
        self._world, self._groups, self._attempt = None, {}, ""
        self._chain = None
        dropped: CheckpointError | None = None
        for what, pending in (("write", self._write), ("commit", self._commit)):
            if pending is None:
                continue
            try:
                pending.result(timeout=STORE_RPC_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                # Still blocked in the old group: left to itself on a thread of its own; the
                # next save's write gets a new one (a single worker would queue it behind).
                log.warning("checkpoint_abandoned_with_old_group", what=what, step=self._write_step)
                self._writer.shutdown(wait=False)
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
                dropped = dropped or _dropped(CheckpointError(f"checkpoint {what} abandoned, blocked in the old group"))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - the old world's save: dropped
                log.warning("checkpoint_dropped_with_old_group", what=what, step=self._write_step, error=_one_line(e))
                dropped = dropped or _dropped(_write_failed(e, self._write_step), cause_of(e))
        self._write = self._commit = None
        self._skipped_step, self._failed_commit = None, None
        if dropped is not None and rank == 0:
            reason = f"the save of step {self._write_step} was dropped with the replaced group: {dropped}"
            self._report("save", 0, reason, step=self._write_step, job_id=job_id, rank=rank, error=dropped)

    def _data_stub(self) -> store_pb2_grpc.StoreServiceStub:
        """The store's checkpoint data plane (PutCheckpointFiles, GetCheckpointFiles, ...),
        spoken as L5-1's rank side (services/common/identity.py PLUMBING_CALLERS)."""
        if self._data_stub_ is None:
            self._data_channel = channel(self._address, options=RECONNECT_OPTIONS, module=Module.L5_CHECKPOINT_MANAGER)
            self._data_stub_ = store_pb2_grpc.StoreServiceStub(self._data_channel)
        return self._data_stub_

    def _writer_for(self, staged: store_pb2.SaveStaged, msg: store_pb2.SaveCheckpoint) -> ChunkWriter | None:
        """The chunk writer of a save the store gave a chunk directory (None: an older store,
        plain DCP files into the staging directory): into the store's directories
        (TRANSFER_PATH), streamed to the store (TRANSFER_STREAM) or to an object store
        (TRANSFER_FSSPEC; services/rank/checkpoint_transfer.py)."""
        if not staged.chunk_path:
            if staged.transfer != store_pb2.TRANSFER_PATH:
                raise CheckpointError(f"checkpoint step {staged.step}: the store asked for a transfer without chunks")
            return None
        sink = None
        if self._copies is not None:
            try:
                sink = self._copies.begin(staged.step)
            except Exception as e:  # noqa: BLE001 - a memory copy is optional; the store's files are the record
                log.warning("memory_copy_skipped", step=staged.step, error=_one_line(e))
        if staged.transfer == store_pb2.TRANSFER_PATH:
            return ChunkWriter(staged.staging_path, staged.chunk_path, sink=sink)
        stream = StreamTransfer(
            self._data_stub(), staged, msg.attempt, msg.rank, chunks=staged.transfer == store_pb2.TRANSFER_STREAM
        )
        transfer = stream if staged.transfer == store_pb2.TRANSFER_STREAM else FsspecTransfer(staged, stream)
        return TransferChunkWriter(staged.staging_path, staged.chunk_path, transfer, sink=sink)

    def _remote_store(self, info: store_pb2.CheckpointInfo) -> StreamSource | None:
        """The store's data plane for a version read without its filesystem (None: TRANSFER_PATH)."""
        if info.transfer == store_pb2.TRANSFER_PATH:
            return None
        return StreamSource(self._data_stub(), info.version)

    def _reader_for(
        self,
        info: store_pb2.CheckpointInfo,
        digests: dict[str, dict[str, Any]],
        remote: StreamSource | None = None,
        index: _RemoteIndex | None = None,
    ) -> ChunkReader:
        """The reader of a chunked version: the copies' sources first, the store's files last
        (its directory, its data plane, or the object store: as ``info.transfer`` says)."""
        sources: list[ChunkSource] = []
        if self._copies is not None:
            try:
                sources = list(self._copies.sources())
            except Exception as e:  # noqa: BLE001 - the store's files suffice
                log.warning("memory_copy_sources_failed", error=_one_line(e))
        label = f"chunks/{info.chunk_path.rstrip('/').rsplit('/', 1)[-1]}"
        if info.transfer == store_pb2.TRANSFER_STREAM and remote is not None:
            sources.append(remote)
        elif info.transfer == store_pb2.TRANSFER_FSSPEC:
            sources.append(FsspecSource(info.chunk_path, info.endpoint_url))
        else:
            sources.append(DirectorySource(info.chunk_path))
        return ChunkReader(
            info.path,
            sources,
            digests=digests,
            what=f"checkpoint {info.version}",
            chunk_label=label,
            files=index.get if index is not None else None,
        )

    def _commit_after(self, write: Future, msg: store_pb2.CommitCheckpoint) -> store_pb2.SaveCompleted | None:
        write.result()  # a failed write (of any rank: DCP gathers them) is never committed
        return self._commit_now(msg)

    def _commit_now(self, msg: store_pb2.CommitCheckpoint, report: bool = True) -> store_pb2.SaveCompleted | None:
        try:
            done = self._rpc("CommitSave", self._stub.CommitSave, msg, COMMIT_TIMEOUT_S)
        except StoreUnavailable as e:
            self._failed_commit = msg  # its staging stays on disk: the final flush retries it
            if report:
                self._report(
                    "save",
                    e.cause,
                    f"{e}; training continues, saved again at the next interval",
                    step=msg.step,
                    job_id=msg.job_id,
                    handled="surge.v1.CommitCheckpoint",
                    error=e,
                )
            return None
        except CheckpointError as e:  # refused: raised (now, or from the background at the next save or flush)
            e.step = msg.step
            raise
        self._failed_commit = None
        self._emit(done)  # SaveCompleted up to L1
        log.info(
            "checkpoint_committed",
            version=done.version,
            step=done.step,
            bytes=done.bytes,
            commit_s=round(done.seconds, 4),
        )
        return done

    def _settle_write(self) -> None:
        """Wait for this rank's write in flight; raise its failure as CheckpointError."""
        write, self._write = self._write, None
        if write is None:
            return
        try:
            write.result()
        except (Exception, CheckpointException) as e:  # the background write failed (disk full, a peer died)
            raise _write_failed(e, self._write_step) from None

    def _commit_settled(self, wait_s: float | None) -> tuple[int, str] | None:
        """Wait up to ``wait_s`` (None: as long as it takes) for rank 0's background
        commit. Returns (TIMEOUT, reason) if it is still waiting for the store, else None.

        Raises:
            CheckpointError: the commit was refused, or the write under it failed.
        """
        commit = self._commit
        if commit is None:
            return None
        try:
            commit.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            return store_pb2.TIMEOUT, f"the previous save's commit is still waiting for the store at {self._address}"
        except CheckpointError:
            self._commit = None
            raise
        except (Exception, CheckpointException) as e:
            self._commit = None
            raise _write_failed(e, self._commit_step) from None
        self._commit = None
        return None

    def _report(
        self,
        operation: str,
        cause: int,
        reason: str,
        *,
        step: int = 0,
        job_id: str = "",
        rank: int = 0,
        version: str = "",
        handled: str = "",
        error: BaseException | None = None,
    ) -> None:
        """SnapshotFailed up to L1 (RankEvent{snapshot_failed}), its ``failure`` typed by
        ``error``'s type (else by the store ``cause``) and naming the command ``handled``
        (default: the ``operation``'s); never raises. With the ``error`` about to be raised:
        the event is this module's failure event for it (the bus does not publish another:
        ``failure_reported``)."""
        try:
            failed = store_pb2.SnapshotFailed(
                job_id=job_id or version.rpartition(":")[0],
                version=version,
                operation=operation,
                reason=" ".join(reason.split())[:400],
                cause=cause,
                step=step,
                rank=rank,
            )
            handled = handled or f"surge.v1.{operation.capitalize()}Checkpoint"
            if error is not None:
                failed.failure.CopyFrom(failure_of(error, Module.L5_CHECKPOINT_MANAGER, handled))
                error.failure_reported = True
            else:
                failed.failure.CopyFrom(
                    route_pb2.Failure(
                        cause=_STORE_CAUSES.get(cause, FailureCause.FAILURE_INTERNAL),
                        detail=failed.reason,
                        operation=handled,
                        module=Module.L5_CHECKPOINT_MANAGER,
                    )
                )
            failed.failure.job_id = failed.failure.job_id or failed.job_id
            if not failed.failure.HasField("rank"):
                failed.failure.rank = rank
            self._emit(failed)
        except Exception as e:  # noqa: BLE001 - a report must not turn a skipped save into a fault
            log.error("snapshot_failed_not_reported", error=f"{type(e).__name__}: {e}")

    def _rpc(self, name: str, method, msg, timeout: float):
        try:
            return method(msg, timeout=timeout)
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            code = e.code()
            details = " ".join((e.details() or "").split())
            text = f"store at {self._address}: {name}: {code.name}: {details}"
            if code in OUTAGE_CAUSES:
                error: CheckpointError = StoreUnavailable(text, OUTAGE_CAUSES[code])
            elif name == "Load" and code == grpc.StatusCode.FAILED_PRECONDITION:
                raise CheckpointIntegrityError(text, _refusal_cause(e)) from None
            else:
                error = CheckpointError(text)
                error.cause = store_pb2.REJECTED
            # Typed as the store typed it (its surge-failure-cause), else by the status code.
            error.failure_cause = cause_of(e)
            raise error from None

    # ------------------------------------------------------------------ private: metrics

    def _enqueue(self, record: store_pb2.MetricRecord) -> int:
        """Hold ``record`` for sending; its ``seq``."""
        with self._held_cond:
            self._seq += 1
            record.seq = self._seq
            self._held.append((self._seq, record))
            if len(self._held) > self._held_max:
                self._held.popleft()
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning("metrics_buffer_full", held=self._held_max, dropped=self._dropped)
            self._held_cond.notify_all()
            return self._seq

    def _acked(self, seq: int) -> None:
        with self._held_cond:
            while self._held and self._held[0][0] <= seq:
                self._held.popleft()
            self._held_cond.notify_all()

    def _records(self, stream_done: threading.Event):
        """One stream's requests: every held record not sent on this stream yet (all of
        them at first: a new stream resends what was not acknowledged), then new ones."""
        sent = 0
        while True:
            with self._held_cond:
                while True:
                    if stream_done.is_set() or self._closing.is_set():
                        return
                    if self._held and self._held[-1][0] > sent:  # held seqs are contiguous
                        nxt = self._held[max(0, sent - self._held[0][0] + 1)][1]
                        break
                    self._held_cond.wait(0.5)
            sent = nxt.seq
            yield nxt

    def _send_metrics(self) -> None:
        backoff = 0.5
        while not self._closing.is_set():
            done = threading.Event()
            call = self._stub.Record(self._records(done))
            try:
                for ack in call:
                    self._acked(ack.seq)
                    if ack.routed and self._on_routed is not None:
                        self._on_routed(list(ack.routed))
                    backoff = 0.5
                if self._closing.is_set():
                    return
            except grpc.RpcError as e:
                if self._closing.is_set():
                    return
                if self._on_error is not None:
                    self._on_error(e)
                log.warning("metrics_stream_failed", store=self._address, code=e.code().name, held=self.held_records)
            finally:
                done.set()
                call.cancel()
                with self._held_cond:
                    self._held_cond.notify_all()
            if self._closing.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)


# The store's cause of a failed save -> the FailureCause of a report with no error of its own
# (another rank's BeginSave failed; the previous commit still waits for the store).
_STORE_CAUSES = {
    store_pb2.UNREACHABLE: FailureCause.FAILURE_UNAVAILABLE,
    store_pb2.TIMEOUT: FailureCause.FAILURE_TIMEOUT,
    store_pb2.CORRUPT: FailureCause.FAILURE_DATA_CORRUPT,
    store_pb2.MISSING_FILE: FailureCause.FAILURE_DATA_CORRUPT,
    store_pb2.REJECTED: FailureCause.FAILURE_INVALID_INPUT,
}


def _dropped(error: CheckpointError, own: int = FailureCause.FAILURE_INTERNAL) -> CheckpointError:
    """An old world's save dropped at a rebuild, typed ``FAILURE_COMMUNICATION`` unless its
    own error's type (``own``) said more: its collectives ran on the group the rebuild replaced."""
    if own == FailureCause.FAILURE_INTERNAL:
        error.failure_cause = FailureCause.FAILURE_COMMUNICATION
    return error


def _write_failed(e: BaseException, step: int) -> CheckpointError:
    """A save's write that failed, typed by what it raised (I/O unless that says more)."""
    error = CheckpointError(f"checkpoint write failed: {_one_line(e)}")
    cause = cause_of(e)
    if cause != FailureCause.FAILURE_INTERNAL:
        error.failure_cause = cause
    error.step = step
    return error


class _RemoteIndex:
    """A version's index files (manifest.json, .metadata) from the store's data plane, asked
    for once: ``get(name)`` -> bytes, FileNotFoundError when the store lacks one."""

    NAMES = ("manifest.json", ".metadata")

    def __init__(self, remote: StreamSource, info: store_pb2.CheckpointInfo):
        self._files = remote.files(names=list(self.NAMES))

    def get(self, name: str) -> bytes:
        data = self._files.get(name)
        if data is None:
            raise FileNotFoundError(name)
        return data


def _manifest_digests(info: store_pb2.CheckpointInfo, index: _RemoteIndex | None = None) -> dict[str, dict[str, Any]]:
    """The manifest's files of a version (path -> {bytes, sha256}), once the manifest's own
    SHA-256 matches the catalog's (``info.manifest_sha256``); read from ``index`` (the
    store's data plane) when given, else under ``info.path``."""
    path = Path(info.path) / "manifest.json"
    try:
        data = index.get("manifest.json") if index is not None else path.read_bytes()
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"checkpoint {info.version}: manifest.json: missing", store_pb2.MISSING_FILE, "manifest.json"
        ) from None
    if hashlib.sha256(data).hexdigest() != info.manifest_sha256:
        raise CheckpointIntegrityError(
            f"checkpoint {info.version}: manifest.json: sha256 mismatch", store_pb2.CORRUPT, "manifest.json"
        )
    return {f["path"]: f for f in json.loads(data)["files"]}


def _digest_failure(e: BaseException):
    """(raised on this rank, the ShardDigestMismatch) if ``e`` is one (or DCP's wrapping of
    one, from any rank), else None."""
    from services.compute.inference import ShardDigestMismatch

    kinds = (ShardDigestMismatch, ChunkIntegrityError)
    if isinstance(e, kinds):
        return True, e
    if isinstance(e, CheckpointException):
        me = dist.get_rank() if dist.is_initialized() else 0
        found = sorted(
            ((r, exc) for r, (exc, _) in e.failures.items() if isinstance(exc, kinds)), key=lambda pair: pair[0]
        )
        if found:
            rank, exc = found[0]
            return rank == me, exc
    return None


def _refusal_cause(e: grpc.RpcError) -> int:
    """The store's typed verdict on a refused Load (trailing metadata), CORRUPT if absent."""
    for key, value in e.trailing_metadata() or ():
        if key == STORE_CAUSE_METADATA:
            try:
                return store_pb2.StoreFailureCause.Value(value)
            except ValueError:
                break
    return store_pb2.CORRUPT


def _one_line(e: BaseException) -> str:
    """The last line of an error that names its cause (DCP wraps a rank's traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
