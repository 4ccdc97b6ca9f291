"""The rank's relay of the L5 store service's checkpoint manager.

(Metrics, L5_METRICS_LOGGER: ``services/rank/metrics_client.py``; the records go through the
node agent, on one Record stream per node.)

Checkpoints (as L5_CHECKPOINT_MANAGER), for the loop's commands:
    SaveCheckpoint (payload: the rank's snapshot as a nested dict of tensors, {"model",
        "optim", "train"}: a private copy the rank's state manager hands over, never live
        state; every rank, at the same step) -> wait for this rank's previous write (and, on the committing rank,
        for its commit while the store answers: ``store_liveness.py``) -> the ranks agree that every previous
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


A store outage is not a training fault, and a slow store is not an outage. ``BeginSave`` and
the wait for the previous commit carry no short deadline: they are waited for while the store
answers its health probes (``store_liveness.py``), up to a bound derived from the rank's
checkpoint-staging budget. When ``BeginSave`` or ``CommitSave`` fails with UNAVAILABLE (cause
UNREACHABLE) or DEADLINE_EXCEEDED (TIMEOUT), or the store stops answering (a probe unanswered
for ``SURGE_STORE_RPC_TIMEOUT_S``: TIMEOUT; refused: UNREACHABLE) while a save waits for it,
the save is skipped (every rank agrees; nothing half-written is
committed: a staging directory is only ever committed whole, and the next save's BeginSave
removes it), training goes on, the next interval saves again, and the rank that commits
publishes ``SnapshotFailed{operation "save", cause, step}`` up its session (one per failed
save). Causes are read from the gRPC status code, never from an error's text. A refused
``BeginSave`` (the store busy committing, an I/O error) is skipped the same way (cause
REJECTED, or WRITE_REFUSED when the store's own write was refused); a refused commit still
fails the rank (the staged files are inconsistent), unless a write was refused.

A save whose bytes a destination refused (a full disk, a quota, a permission, a read-only
filesystem, an I/O error: typed from the errno where the write failed, in this rank's chunk
writer, another rank's (DCP gathers them) or the store's staging, manifest or catalog) is
CheckpointWriteRefused: found when the write or commit settles, reported once by rank 0
(SnapshotFailed{cause WRITE_REFUSED, write_error, path}) and never raised to the loop, on any
rank: the save is lost whatever follows, and what follows is L1-1's decision by the job's
fault policy (``checkpoint_write_failed``: skip_save by default). Before, the loop failed on
every rank and waited for a release nobody sent.
(How every SnapshotFailed is typed: ``checkpoint_commit.py``; where the bytes go:
``checkpoint_io.py``.)

Checkpoint layout (DCP keys, flattened with dots): ``model.<param FQN>`` (e.g.
``model.blocks.0.attn.q.weight``), ``optim.state.<param FQN>.{exp_avg,exp_avg_sq,step}``,
``optim.param_groups``, ``train.*`` (step, data position, RNG streams, loss scale: see
``services/engine/training_loop/state.py`` ``LoopState``).

Every failed call is shown to ``on_error`` first (the rank reports a boundary violation the
store returned).

The relay's parts, one concern a file (StoreClient, here, is the commands above and the
class that joins the rest):
    ``checkpoint_errors.py``: its errors and their typed causes, the store calls' deadlines,
        and the reading of Hugging Face weights (``init_from.hf``);
    ``checkpoint_io.py``: the chunk writer of a save and the reader of a load (ChunkIO);
    ``checkpoint_commit.py``: the background write and rank 0's commit chained on it, the
        store calls and the SnapshotFailed reports (BackgroundCommit);
    ``save_agreement.py``: the ranks' agreement on a save, their generation and the relay's
        own gloo groups (SaveAgreement).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.common.grpc_server import channel
from services.compute.inference import SafeLoadPlanner, safe_load
from services.contract import Module, store_pb2, store_pb2_grpc
from services.contract.acting import run_as
from services.contract.bus import Emitter
from services.rank.checkpoint_commit import BackgroundCommit, _reported
from services.rank.checkpoint_errors import (
    FLUSH_RETRY_S,
    LOAD_TIMEOUT_S,
    OUTAGE_CAUSES,
    RECONNECT_OPTIONS,
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointWriteRefused,
    StoreUnavailable,  # noqa: F401 - re-exported: the relay's errors are imported from here
    WeightsMismatch,  # noqa: F401 - re-exported (as above)
    _digest_failure,
    _one_line,
    _write_failed,
    load_hf_weights,
)
from services.rank.checkpoint_io import ChunkIO, _manifest_digests, _RemoteIndex, payload_bytes
from services.rank.checkpoint_transfer import TransferFailed
from services.rank.profile_upload import ProfileUpload
from services.rank.save_agreement import RELAY_GROUPS, SaveAgreement  # noqa: F401 - RELAY_GROUPS re-exported
from services.rank.store_liveness import STAGING_BUDGET_S, StoreLiveness, wait_bound_s
from services.state.chunk_store import ChunkIntegrityError

log = structlog.get_logger()


class StoreClient(SaveAgreement, BackgroundCommit, ChunkIO, ProfileUpload):
    """Relay for L5_CHECKPOINT_MANAGER inside a rank process."""

    def __init__(
        self,
        address: str,
        checkpoint_events: Emitter,
        on_error: Callable[[grpc.RpcError], None] | None = None,
        copies: Any = None,
        staging_budget_s: float = STAGING_BUDGET_S,
    ):
        """``copies``: this rank's in-memory copies of its newest snapshot (optional; e.g.
        ``services/rank/memory_client.py``): ``begin(step) -> sink | None`` before a save's
        write (the chunk writer's sink), ``end(ok)`` once the write is done or failed, and
        ``sources() -> [ChunkSource]``, the sources a load tries before the store's files.
        ``staging_budget_s``: the job's ``liveness.phase_seconds.checkpoint_staging``, from
        which the bound of a save's wait for a store that answers is derived
        (``store_liveness.wait_bound_s``)."""
        self._copies = copies
        self._address = address
        self._on_error = on_error
        self._emit = checkpoint_events
        # A store that comes back is found within RECONNECT_BACKOFF_MS (gRPC's default backoff
        # grows to 120 s while it is away, and calls fail fast meanwhile).
        self._channel = channel(
            address, options=RECONNECT_OPTIONS, module=Module.L2_TRAINING_LOOP
        )  # the loop's commands, relayed
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        # Connect now, not at the first save: hundreds of ranks saving at once would otherwise
        # all open their connection in the same second, and a store slow to answer the HTTP/2
        # handshake fails BeginSave fast with UNAVAILABLE (256 simulated ranks: bench/scale.py).
        self._connecting = grpc.channel_ready_future(self._channel)
        # BeginSave and the wait for the previous commit: as long as the store answers its
        # health probes (a busy store is not an outage), up to the bound; a silent one is
        # found within SURGE_STORE_RPC_TIMEOUT_S.
        self._liveness = StoreLiveness(self._channel, address)
        self._wait_bound_s = wait_bound_s(staging_budget_s, self._liveness.silent_s)
        self._data_channel: grpc.Channel | None = None  # the checkpoint data plane, opened at first use
        self._data_stub_: store_pb2_grpc.StoreServiceStub | None = None
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
        self._rank = -1  # this rank (from its first save): rank 0 reports a refused write
        self._refused_step = -1  # the save whose refused write was reported (once per save)
        self._refused_lock = threading.Lock()  # (the main thread's and the writer thread's reports)

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
        self._rank = msg.rank
        self._skipped_step = None
        self._failed_commit = None  # a new save supersedes a commit that never reached the store
        self._liveness.set_world_size(dist.get_world_size() if dist.is_initialized() else 1)  # (all ask at once)
        failure = self._previous_settled(msg.job_id, "surge.v1.SaveCheckpoint", self._wait_bound_s)
        # A new save (the previous one settled, its refusal reported): its refusal is reported
        # even where it is of the same step, a drain's save in place of a paused step whose
        # pause's save was refused (boundary.py ``_save_while_paused``; was: taken for that
        # save's other side and never reported, so L1-1 took the drain for saved: F1).
        self._refused_step = -1
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
                staged = self._rpc("BeginSave", self._stub.BeginSave, msg, self._wait_bound_s, live=True)
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
        writer = self._writer_for(staged, msg, payload_bytes(payload))
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
            except (Exception, CheckpointException) as e:
                refused = _write_failed(e, msg.step)
                if not isinstance(refused, CheckpointWriteRefused):
                    raise
                self._skipped_step = msg.step  # nothing to commit; the loop goes on (reported)
                self._refused(refused, msg.job_id, msg.rank, "surge.v1.SaveCheckpoint")
                return store_pb2.SaveStaged(job_id=msg.job_id, step=msg.step, seconds=time.perf_counter() - t0)
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
        deadline, backoff = time.monotonic() + FLUSH_RETRY_S, 0.5
        # (no breaker: the run's end has no next interval; the store gets its window once more)
        pending = self._previous_settled(msg.job_id, "surge.v1.FlushCheckpoint", FLUSH_RETRY_S, breaker=False)
        if pending is not None:  # the store never answered the last commit: reported, not a fault
            cause, reason = pending
            self._report(
                "save",
                cause,
                f"{reason}; that save is not committed (a run that ends now ends without it)",
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

    def _previous_settled(
        self, job_id: str, handled: str, bound_s: float, breaker: bool = True
    ) -> tuple[int, str] | None:
        """Settle the previous save: this rank's write, then rank 0's commit (``bound_s``,
        ``breaker``: ``_commit_settled``'s wait). A write or commit a destination refused is reported
        (``_refused``) and settled: the save is lost, the loop goes on and L1-1 decides.
        Returns ``_commit_settled``'s (cause, reason) of a commit still waiting, else None.

        Raises:
            CheckpointError: that write failed, or its commit was refused, otherwise.
        """
        try:
            self._settle_write()
        except CheckpointWriteRefused as e:
            self._refused(e, job_id, self._rank, handled)
        try:
            return self._commit_settled(bound_s, breaker)
        except CheckpointWriteRefused as e:
            self._refused(e, job_id, self._rank, handled)
            return None

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
        # A load into live ranks (a rollback in place, issue 29 item 9; every rank loads) starts
        # a new attempt at the next save: what the loaded state's checks agree on says nothing of
        # the versions these ranks saved before it (the store's layout._replica_verified).
        self._attempt = ""
        t0 = time.perf_counter()
        try:
            # Waited for while the store answers (store_liveness.py): a store stopped under the
            # load is found silent within SURGE_STORE_RPC_TIMEOUT_S, not after LOAD_TIMEOUT_S,
            # and its typed outage is L1-1's to wait out (fault_decision.py ``load_outage``).
            loaded = self._rpc("Load", self._stub.Load, msg, LOAD_TIMEOUT_S, live=True, breaker=False)
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
        """Stop the background writer and close the channels."""
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._connecting.cancel()
        self._liveness.close()
        self._channel.close()
        if self._data_channel is not None:
            self._data_channel.close()
