"""A rollback in place (issue 29 item 9, `surgectl rollback JOB [--version V]`): a RUNNING job's
ranks go back to a committed version without being relaunched.

The ranks pause at a boundary they agree on (PauseTraining, no checkpoint: the state after it
is being thrown away), then each loads the version into its live process
(ResumeTraining.reload_version: the model's and optimizer's slots restored by RestoreState,
the loop's step, data position and RNG streams; services/engine/training_loop/checkpoints.py
``_reload``) and reports TrainingLoopStarted at the version's step; once every rank has, they
start again (StartTraining) and train the steps after it again, bit-exactly as a relaunch from
the version would. The versions committed after it become another branch of the job's
history (``abandoned``: never chosen by a recovery or a plain resume). A fault on the way (a
rank lost while they pause or load) is decided by the policy as usual: its relaunch replaces
the rollback (said in the events), loading the newest usable version, which is this one or
older only if the policy's own choice says so.
"""

from __future__ import annotations

import time

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator import rollback_machine as rbm
from services.control.orchestrator.activity import FOLD, ReloadAsk, admit, begin, end, moved
from services.control.orchestrator.job import JobState, _Job, _Reload, _where
from services.control.orchestrator.refusals import IllegalTransition, UnknownVersion
from services.control.orchestrator.undos import Before


class RollingBack:
    """A rollback in place (a part of ``Orchestrator``, see core.py)."""

    def _rollback_in_place(self, job: _Job, msg: control_pb2.ResumeJobRequest) -> control_pb2.JobStatus:
        """Under the lock, the operator's rollback of ``job`` to ``msg.from_version`` ("":
        its newest committed version not known bad). Asked again while in flight (that version,
        or none named): its status, with ``rollback_in_flight`` and ``rollback_asked_unix`` set.

        Raises:
            UnknownVersion (one line): the job never had the version named.
            IllegalTransition (one line): the job is not RUNNING, a pause, stop, resize or
            recovery is in flight, it has no usable version (or the one named is struck or on
            an abandoned branch), or it runs in fp16 (its loss
            scaler's state cannot be given to live ranks again: stop, then resume --from)."""
        job_id = job.status.job_id
        ask = ReloadAsk(msg.from_version)
        if admit(job_id, job.activity, ask).verdict == FOLD:
            # Typed for `surgectl rollback`: "already rolling back to V (asked at ...)", not the
            # line of a new rollback (the reply was the same status either way).
            folded = self._snapshot(job)
            folded.rollback_in_flight, folded.rollback_asked_unix = job.reload.version, job.reload.asked_unix
            return folded
        self._require(job, JobState.RUNNING)
        self._require_idle(job, ask)
        if job.spec.precision.dtype == "fp16":
            raise IllegalTransition(
                f"rollback: job {job_id} trains in fp16, whose loss scaler's state cannot be given to live ranks "
                f"again; `surgectl stop {job_id}` then `surgectl resume {job_id} --from VERSION`"
            )
        steps = dict((v, s) for s, v in job.versions)
        version = msg.from_version or self._pick_version(job, None)
        if not version:
            raise IllegalTransition(f"rollback: job {job_id} has no committed checkpoint to go back to")
        if version not in steps or version in job.unusable or version in job.abandoned:
            known = ", ".join(v for _, v in job.versions if v not in job.unusable and v not in job.abandoned)
            # A version the job never had is the operator's input (INVALID_ARGUMENT, exit 2, as
            # `resume --from` answers it); one it has but cannot use is its state (exit 1).
            raise (IllegalTransition if version in steps else UnknownVersion)(
                f"--version {version}: not a usable committed checkpoint of job {job_id} (usable: {known or 'none'})"
            )
        reload = _Reload(version, steps[version], since=time.monotonic(), asked_unix=time.time())
        before = Before.of(job)
        begin(job, reload)
        pause = self._in_flight(job, "reload", engine_pb2.PauseTraining(checkpoint=False))
        job.paused.clear()
        after, effects = rbm.started(reload, pause, _where(job))
        moved(job, reload, after)
        self._apply_effects(job, effects)
        # Undo if its record fails at its commit: no rollback in flight (undos.py).
        self._undo_if_lost(job_id, lambda e: self._activity_undone(job, reload, pause, before))
        return self._snapshot(job)

    def _reload_paused(self, job: _Job, step: int) -> None:
        """Under the lock, every rank paused after ``step`` for the rollback in flight: they
        load its version (ResumeTraining.reload_version; rollback_machine.py's ``all_paused``)."""
        job.status.step = step  # (its pause is over: the slot's phase moved on)
        reload, effects = rbm.all_paused(job.reload, job.status.job_id, step)
        moved(job, job.reload, reload)
        self._apply_effects(job, effects)

    def _reloaded(self, job: _Job, msg: engine_pb2.TrainingLoopStarted) -> None:
        """Under the lock: every rank loaded the version and is ready at its step: start them.
        The versions committed after it are another branch from now on (``all_ready``)."""
        reload = job.reload
        _, effects = rbm.all_ready(
            reload, job.versions, job.abandoned, job.status.world_size, msg.start_step, time.monotonic()
        )
        end(job, reload)
        self._apply_effects(job, effects)
