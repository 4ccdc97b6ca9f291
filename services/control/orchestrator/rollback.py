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

from services.contract import Module, control_pb2, engine_pb2
from services.control.orchestrator.activity import FOLD, ReloadAsk, admit, begin, end
from services.control.orchestrator.job import ORCH, JobState, _Job, _Reload, _where
from services.control.orchestrator.refusals import IllegalTransition


class RollingBack:
    """A rollback in place (a part of ``Orchestrator``, see core.py)."""

    def _rollback_in_place(self, job: _Job, msg: control_pb2.ResumeJobRequest) -> control_pb2.JobStatus:
        """Under the lock, the operator's rollback of ``job`` to ``msg.from_version`` ("":
        its newest committed version not known bad). Asked again while in flight: its status.

        Raises:
            IllegalTransition (one line): the job is not RUNNING, a pause, stop, resize or
            recovery is in flight, it has no such version, or it runs in fp16 (its loss
            scaler's state cannot be given to live ranks again: stop, then resume --from)."""
        job_id = job.status.job_id
        ask = ReloadAsk(msg.from_version)
        if admit(job_id, job.activity, ask).verdict == FOLD:
            return self._snapshot(job)
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
            raise IllegalTransition(
                f"--version {version}: not a usable committed checkpoint of job {job_id} (usable: {known or 'none'})"
            )
        begin(job, _Reload(version, steps[version], since=time.monotonic()))
        cmd = self._in_flight(job, "reload", engine_pb2.PauseTraining(checkpoint=False))
        job.paused.clear()
        self._record(
            job, ORCH, "decision",
            f"rollback in place to checkpoint {version} (step {steps[version]}) by the operator: ranks pause "
            f"{_where(job)} (no checkpoint), then load it into their live processes and train on from its step",
        )  # fmt: skip
        self._loop(cmd)
        return self._snapshot(job)

    def _reload_paused(self, job: _Job, step: int) -> None:
        """Under the lock, every rank paused after ``step`` for the rollback in flight: they
        load its version (ResumeTraining.reload_version)."""
        reload = job.reload
        job.pending, reload.phase, job.status.step = "", "loading", step
        job.started = set()
        self._record(
            job, ORCH, "recovery",
            f"all ranks paused after step {step}; loading checkpoint {reload.version} (step {reload.step}) "
            "into their live processes",
        )  # fmt: skip
        self._loop(engine_pb2.ResumeTraining(job_id=job.status.job_id, reload_version=reload.version))

    def _reloaded(self, job: _Job, msg: engine_pb2.TrainingLoopStarted) -> None:
        """Under the lock: every rank loaded the version and is ready at its step: start them.
        The versions committed after it are another branch from now on."""
        reload = job.reload
        end(job, reload)
        later = sorted(v for s, v in job.versions if s > reload.step and v not in job.abandoned)
        job.abandoned.update(later)
        self._start_group(job)
        self._faults(control_pb2.ResetFaultLedger(job_id=msg.job_id))
        then = f"; {', '.join(later)} kept, never chosen by a recovery or a plain resume" if later else ""
        self._record(
            job, Module.L2_TRAINING_LOOP, "recovery",
            f"rollback in place done: all {job.status.world_size} ranks loaded checkpoint {reload.version} in "
            f"their live processes (none relaunched) and go on from step {msg.start_step}, "
            f"{time.monotonic() - reload.since:.1f} s after it was asked{then}",
            status_message=f"rolled back in place to checkpoint {reload.version} at step {msg.start_step}",
        )  # fmt: skip
