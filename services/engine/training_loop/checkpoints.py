"""Checkpoint triggering and the rank's state (package docstring, "Exact resume"): a save and
its commit, a snapshot of the rank's state, a restore from one, a start from another job's
weights (``init_from``). A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import time

import structlog

from services.common import phase as ph
from services.contract import Module, engine_pb2, route_pb2, store_pb2
from services.contract.failures import ModuleFailed
from services.engine.training_loop.faults import TrainingFault
from services.engine.training_loop.state import LoopState, _own_hyperparameters
from services.jobspec import InitFromSpec
from services.state.snapshot import RANK_SLOTS, InconsistentSnapshot, Slot, Snapshot

_log = structlog.get_logger("training_loop")


class Checkpoints:
    """Saves, snapshots, restores and ``init_from`` (a part of ``TrainingLoop``, see loop.py)."""

    def _save(self, step: int) -> None:
        """Every rank writes its part of the checkpoint; rank 0 commits the version."""
        self._phase = "saving"
        self._mark.enter(ph.CHECKPOINT_STAGING)
        spec = self._spec
        self._p.store(store_pb2.SaveCheckpoint(
            job_id=self._job_id, step=step, rank=self._rank, write_async=spec.checkpoint.async_,
            baseline_every=spec.checkpoint.baseline_every,
        ), self._snapshot(step))  # fmt: skip
        if self._rank == 0:
            checked = spec.integrity.replica_check_every_steps > 0 and self._dp_size > 1
            self._p.store(store_pb2.CommitCheckpoint(
                job_id=self._job_id, step=step, world_size=self._world, spec_json=self._spec_json,
                keep_last=spec.checkpoint.keep_last, keep_every=spec.checkpoint.keep_every,
                # Whether this version's replicas agreed: a check at its step (before the save), or
                # a later commit of these ranks naming a later check (the store's catalog decides).
                replica_checked=checked, replica_agreed_step=self._agreed_step or 0,
                # Retention never deletes the version this generation of ranks resumed from.
                keep_versions=[self._init.resume_version] if self._init.resume_version else [],
            ))  # fmt: skip
        self._phase = "stepping"

    def _snapshot(self, step: int) -> Snapshot:
        """A copy of the rank's state at ``step``: the model's and the optimizer's slots
        (ExportState) and the loop's own, under one version, to be written or read into (no
        digests: the writer hashes what it writes, a load's snapshot is digested when read).
        Raises InconsistentSnapshot if a reply is not a slot of that step and version."""
        self._snapshots += 1
        version = f"{self._job_id}@{step}#{self._snapshots}"
        ask = engine_pb2.ExportState(step=step, version=version)
        state = LoopState(self).state_dict()
        own = Slot.copy_of("train", Module.L2_TRAINING_LOOP, step, version, state, digest=False)
        return Snapshot.of([self._p.shard_loader(ask).payload, self._p.optimizer(ask).payload, own])

    def _restore(self, snapshot: Snapshot) -> None:
        """Restore every slot of ``snapshot``: the model's and the optimizer's by RestoreState
        (each owner copies its slot in), the loop's own here.

        Raises:
            InconsistentSnapshot, SlotDigestMismatch: not one snapshot of one step and version
                (checked before anything is restored), or a slot changed since it was taken
                (its owner refuses it; what was restored before it is not to be trained on:
                the loop fails and L1 decides).
        """
        if not isinstance(snapshot, Snapshot):
            raise InconsistentSnapshot(f"restore: expected a Snapshot, got {type(snapshot).__name__}")
        snapshot.check(RANK_SLOTS, verify=False)  # structure; each owner checks its slot's digest
        for key, port in (("model", self._p.shard_loader), ("optim", self._p.optimizer)):
            slot = snapshot.slots[key]
            port(engine_pb2.RestoreState(step=slot.step, version=slot.version, digest=slot.digest), slot)
        own = snapshot.slots["train"]
        own.check_restore("train", Module.L2_TRAINING_LOOP, snapshot.step, snapshot.version, own.digest)
        LoopState(self).load_state_dict(own.state_dict())

    def _reload(self, version: str) -> bool:
        """A rollback in place (``ResumeTraining.reload_version``, issue 29 item 9), from the
        pause every rank agreed on: load the committed ``version`` into this live process as a
        relaunched rank's start-up would (a template of the current state handed to L5-1's
        rank side, every slot restored: model and optimizer by RestoreState, the loop's step,
        data position, RNG streams and loss scale here), reopen the train stream at the loaded
        position (a batch of the old stream still on its way is dropped by its token), report
        TrainingLoopStarted at the version's step and wait for StartTraining. The process,
        its group and its parallel plan stay; the steps after the version are trained again,
        bit-exactly as after a relaunch from it. Returns False when a StopTraining came instead.

        Raises: the load's errors (CheckpointError: unreadable, corrupt; InconsistentSnapshot),
        TrainingFault (config_error: a data position that would not resume exactly): the rank
        fails and L1 decides, as for a failed relaunch's load."""
        t0 = time.perf_counter()
        self._phase = "loading"
        if self._frozen is not None:  # (held for inspection before this rollback: the hold is over)
            self._frozen = None
            self._mark.thaw()
        self._mark.enter(ph.CHECKPOINT_STAGING)
        before = self._step
        loaded = self._p.store(store_pb2.LoadCheckpoint(version=version), self._snapshot(self._step))
        self._restore(loaded.payload)
        self._check_position(version)
        self._durable_step, self._agreed_step, self._last_report = self._step, None, None
        self._consecutive_skips = 0
        with self._lock:
            self._verdicts.clear()
        self._open_stream("train", self._position, repeat=True, max_batches=0)
        self._emit(engine_pb2.TrainingLoopStarted(
            job_id=self._job_id, rank=self._rank, start_step=self._step, num_parameters=self._num_parameters,
            startup_seconds=time.perf_counter() - t0,
            restored_bytes_from=dict(getattr(loaded.message, "bytes_from", {})),
            peak_tflops=self._peak.tflops, peak_source=self._peak.source,
        ))  # fmt: skip
        _log.info(
            "reloaded_in_place", version=version, step=self._step, paused_at=before, seconds=time.perf_counter() - t0
        )
        self._phase = "standby"
        self._mark.enter(ph.IDLE)
        return self._await_start()

    def _start_from(self, init_from: InitFromSpec) -> None:
        """``init_from``: the model's weights (and with ``weights+optimizer`` the optimizer's
        state) of a committed version of another job, or of a Hugging Face directory, read by
        L5-1's rank side into copies of the fresh state like a resume load (only those slots),
        then handed to their owners (RestoreState). Nothing else is taken: the step stays 0,
        the data position, the LR schedule, the RNG streams and the loss scale are the new
        job's. (``model.freeze`` already applied by the shard loader, whatever was loaded.)

        Raises: the load's errors (CheckpointError: refused, unreadable, corrupt, or weights
        that do not fit this model, naming the tensor), InconsistentSnapshot."""
        keys = ("model", "optim") if init_from.load == "weights+optimizer" else ("model",)
        fresh = self._snapshot(self._step)
        template = Snapshot.of([fresh.slots[k] for k in keys])
        ask = (
            store_pb2.LoadCheckpoint(version=init_from.checkpoint)
            if init_from.checkpoint
            else store_pb2.LoadCheckpoint(hf_directory=init_from.hf)
        )
        try:
            reply = self._p.store(ask, template)
            loaded = reply.payload
            info = getattr(reply.message, "info", None)  # (an evaluation job hands its path on)
            self._evaluated_path, self._evaluated_step = (info.path, info.step) if info is not None else ("", 0)
        except ModuleFailed as e:
            if e.failure_cause != route_pb2.FAILURE_INVALID_INPUT:
                raise  # corrupt, unreachable, ...: L5-1's failure, reported and decided as any load's
            # Refused as asked (an unknown version, weights of another shape): the spec names a
            # source this job cannot start from, the same on every relaunch. The loop's own
            # fault, so it is graded (a load's SnapshotFailed alone is left to L1-1, which acts
            # on it for a recovery's load only: a start would wait).
            source = f"init_from.checkpoint: {init_from.checkpoint}" if init_from.checkpoint else "init_from.hf"
            raise TrainingFault("config_error", f"{source}: {e.error}") from None
        loaded.check({k: fresh.slots[k].owner for k in keys}, verify=False)
        for key, port in (("model", self._p.shard_loader), ("optim", self._p.optimizer)):
            if key in keys:
                slot = loaded.slots[key]
                if key == "optim":
                    slot = _own_hyperparameters(slot, fresh.slots[key])
                port(engine_pb2.RestoreState(step=slot.step, version=slot.version, digest=slot.digest), slot)
        _log.info("init_from loaded", source=loaded.version, step_of_source=loaded.step, slots=list(keys))
