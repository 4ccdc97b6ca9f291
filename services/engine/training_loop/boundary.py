"""The work at a step boundary (package docstring, "Boundary commands", "Replica check"): the
replica check, evaluation, samples and checkpoint when due, then the boundary commands the ranks agreed
on (revoke, stop, pause, a resize). A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import time

import structlog

from services.common import phase as ph
from services.contract import engine_pb2, store_pb2
from services.engine.training_loop.faults import TrainingFault
from services.engine.training_loop.summary import _due

_log = structlog.get_logger("training_loop")

# What follows a step boundary besides the next step (TrainingLoop._boundary): the end, a resize,
# a rollback in place (the version to load is ``TrainingLoop._reload_version``).
_STOP, _RESIZE, _RELOAD = "stop", "resize", "reload"


class Boundary:
    """The work at a step boundary and the boundary commands (a part of ``TrainingLoop``, see loop.py)."""

    def _boundary(self, step: int) -> str:
        """The work due at the boundary after ``step``: evaluation, checkpoint, then an
        operator's stop or pause. What follows: :data:`_STOP`, :data:`_RESIZE` (a pause left
        into a resize), or "" (the next step)."""
        spec = self._spec
        last = step == spec.steps
        self._profile_boundary(step)  # (a profile ends before the boundary's own work: its trace is of steps)
        if _due(step, spec.integrity.replica_check_every_steps, last) and self._dp_size > 1:
            self._check_replicas(step)  # before the save: a save at a check step is of agreeing replicas
        if _due(step, spec.eval.every_steps, last and spec.eval.at_end):
            self._evaluate(step)
        if _due(step, spec.eval.sample_every_steps, False):
            self._sample(step)
        if _due(step, spec.checkpoint.every_steps, last and spec.checkpoint.at_end):
            self._save(step)
            self._durable_step = step
        return "" if last else self._stop_requested_at_boundary(step)

    def _check_replicas(self, step: int) -> None:
        """The replica check at the boundary of ``step`` (module docstring, "Replica check").

        Raises:
            TrainingFault: replica_divergence, naming the first differing tensor and the odd
                dp ranks (every rank raises it alike: the answer is the group's).
        """
        # (L3-5 marks the rank "in a collective" while it waits for its peers)
        found = self._p.reduction(engine_pb2.ReduceGradients(check_replicas=True)).message
        if not found.replicas_checked or not found.diverged_tensor:
            # (not checked: FSDP2 holds no dp replicas of a parameter, so none can differ)
            self._agreed_step = step
            return
        odd = list(found.odd_dp_ranks)
        who = f"dp rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} " + (
            f"{'differ' if len(odd) > 1 else 'differs'} from the majority"
            if len(odd) < self._dp_size
            else "differ and no majority says which is right"
        )
        more = f" (and {found.diverged_tensors - 1} more tensors)" if found.diverged_tensors > 1 else ""
        agreed = f"step {self._agreed_step}" if self._agreed_step is not None else "none since this generation started"
        raise TrainingFault(
            "replica_divergence",
            f"data-parallel replicas differ after step {step} in {found.diverged_tensor}{more}: {who}; "
            f"last agreeing check: {agreed}",
        )

    def _stop_requested_at_boundary(self, step: int) -> str:
        """At the boundary after ``step``, the boundary commands in force here (agreed by
        every rank in this step's reduction or before: the same on every rank): a revoke
        withdraws its standing order after ``step``; then stop (:data:`_STOP`), or pause
        until resumed (""), resumed into a resize (:data:`_RESIZE`: ``ResumeTraining.rebuild``)
        or a rollback in place (:data:`_RELOAD`: ``ResumeTraining.reload_version``), or
        stopped. An operator's stop or pause that asks for it checkpoints ``step`` first
        (every rank is at the same boundary, so the save's collectives meet); every pause
        waits for the save in flight, this one or a periodic one, to be committed before it
        reports paused (``_settle_saves``; a stop's ``_finish`` waits for it likewise). A
        paused rank stops on the stop it holds, agreed or not: every rank paused here."""
        due = self._commands.due(step)
        with self._lock:
            for msg in due:
                if isinstance(msg, engine_pb2.RevokeStandingOrder):
                    self._revoked[msg.order] = step
        for msg in due:
            if isinstance(msg, engine_pb2.ProfileSteps):
                self._begin_profile(msg, step)
        stop = next((m for m in due if isinstance(m, engine_pb2.StopTraining)), None)
        pause = next((m for m in due if isinstance(m, engine_pb2.PauseTraining)), None)
        if stop is not None or pause is None:
            if stop is not None and stop.checkpoint:
                self._checkpoint_boundary(step)
            return _STOP if stop is not None else ""
        if pause.checkpoint:
            self._checkpoint_boundary(step)
        self._settle_saves()
        self._phase = "paused"
        self._emit(engine_pb2.TrainingLoopPaused(job_id=self._job_id, rank=self._rank, step=step))
        while (stop := self._commands.take(engine_pb2.StopTraining, step)) is None:
            if self._save_while_paused(step):
                continue
            msg = self._control.get()
            if isinstance(msg, engine_pb2.ResumeTraining) and not msg.go_on_at_step:  # (a fault wait's, late)
                self._phase = "stepping"
                if msg.reload_version:
                    self._reload_version = msg.reload_version
                    return _RELOAD
                return _RESIZE if msg.rebuild else ""
        if stop.checkpoint:
            if stop.save_again:  # (the pause's save failed: L1-1 holds no checkpoint of ``step``)
                self._durable_step = None
            self._checkpoint_boundary(step)
        return _STOP

    def _save_while_paused(self, step: int) -> bool:
        """Paused after ``step``: a PauseTraining with ``checkpoint`` held here (L1-1 drains a
        job whose pause has no checkpoint of its step: its save failed, the store away, or the
        operator paused it without one) saves ``step`` in place and reports paused again, at
        the same step: every rank is paused at that boundary, so it needs no agreement (its
        number is taken as agreed: the next command's agreement starts after it), and the
        save's collectives meet. Saved even where ``step`` was saved before: a save whose
        write failed left it marked durable here. (Was: the ranks resumed and paused again at
        the next boundary, one step more trained before the save, a fresh operator's trial.)
        Returns whether one was taken."""
        again = self._commands.take(engine_pb2.PauseTraining, step)
        if again is None:
            return False
        self._commands.agree(again.seq)
        if again.checkpoint:
            self._save(step)
            self._durable_step = step
        self._settle_saves()
        self._phase = "paused"  # (the save set it to stepping)
        self._emit(engine_pb2.TrainingLoopPaused(job_id=self._job_id, rank=self._rank, step=step))
        return True

    def _settle_saves(self) -> None:
        """Before a pause is reported, wait for the save in flight (an asynchronous one of this
        boundary or an earlier one: written on every rank, committed by rank 0; nothing to do
        without one). What L1-1 does once every rank paused may replace the process group (a
        resize, a grow back, a departure's move) or end the ranks (a paused job's release):
        a write still running its collectives on the old group would be dropped with it, and
        the checkpoint of that step lost. A failure is the store relay's, reported as at the
        next save (L1-1 decides); the wait is the save's own, so its phase is staging."""
        self._mark.enter(ph.CHECKPOINT_STAGING)
        t0 = time.perf_counter()
        self._p.store(store_pb2.FlushCheckpoint(job_id=self._job_id))
        # (what a pause, hence a resize, waited for the save: bench/resize_save.py reads it)
        _log.info("saves_settled_for_pause", step=self._step, seconds=round(time.perf_counter() - t0, 4))

    def _checkpoint_boundary(self, step: int) -> None:
        """Save ``step`` unless its state is durable already (saved at this step, loaded from
        a checkpoint of it, or the initial state). Checked first where replicas are checked:
        an operator's last version is one a check covers, so it can be ``latest``."""
        if self._durable_step != step:
            if self._spec.integrity.replica_check_every_steps and self._dp_size > 1 and self._agreed_step != step:
                self._check_replicas(step)
            self._save(step)
            self._durable_step = step
