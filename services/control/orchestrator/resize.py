"""Resizing a running job (`surgectl scale`, or growing back after a shrink): its ranks pause at
a common boundary, then rebuild their group at the new data-parallel size."""

from __future__ import annotations

import time
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator import resize_machine as rzm
from services.control.orchestrator.activity import FOLD, ScaleAsk, begin, end, moved
from services.control.orchestrator.job import JobState, _Job, _Scale, _where
from services.control.orchestrator.layout import _layout_of, _set_layout
from services.jobspec import (
    JobSpec,
    JobSpecError,
    at_data_parallel_size,
    rebuild_refusal,
)


class Resizing:
    """Resizing a running job (`surgectl scale`, or growing back after a shrink) (a part of ``Orchestrator``, see core.py)."""

    def scale_job_request(self, msg: control_pb2.ScaleJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Resize a RUNNING job to ``dp`` data-parallel ranks without restarting the ranks
        that stay (issue 16, ``surgectl scale``): the ranks pause after a common step
        boundary (no checkpoint), L1-4 has L1-2 release the ranks >= dp or launch the new
        ones, every kept rank rebuilds its group at the new size, the new ranks heal from a
        live peer, and the job goes on at the same global batches (the global batch is kept:
        :func:`services.jobspec.at_data_parallel_size`). Where the new ranks do not fit, the
        ranks go on at the old size (the events say so).

        Raises:
            JobNotFound; IllegalTransition: the job is not RUNNING, or a pause, stop, scale or
            recovery is in flight; JobSpecError (one line naming the field): the plan cannot
            be resized in place (tp or pp > 1, FSDP2) or the global batch does not split into
            the new layout. Nothing changed.
        """
        with self._lock:
            job = self._get(msg.job_id)
            flags = f"--dp {msg.dp}" + "".join(
                f" {flag} {v}"
                for flag, v in (("--micro-batch-size", msg.micro_batch_size), ("--grad-accum", msg.grad_accum))
                if v
            )
            if msg.dp < 1:
                raise JobSpecError(f"--dp: the new data-parallel size must be >= 1, got {msg.dp}")
            why = rebuild_refusal(job.spec, structural=True)
            if why:
                raise JobSpecError(f"{flags}: scaling in place {why}; `surgectl stop` then `surgectl resume --dp`")
            self._require(job, JobState.RUNNING)
            if self._require_idle(job, ScaleAsk(msg.dp, msg.micro_batch_size, msg.grad_accum)).verdict == FOLD:
                return self._snapshot(job)  # (asked again, e.g. a `surgectl scale` cut short: this resize is in flight)
            if msg.dp == job.spec.parallel.dp and not (msg.micro_batch_size or msg.grad_accum):
                return self._snapshot(job)  # (already at that size: nothing to do; `surgectl scale` says so)
            spec = at_data_parallel_size(
                job.spec,
                msg.dp,
                micro_batch_size=msg.micro_batch_size,
                grad_accum=msg.grad_accum,
                largest=job.micro_batch_cap,
                source=flags,
            )
            if _layout_of(spec) == _layout_of(job.spec):
                return self._snapshot(job)  # (already at that layout: nothing to do)
            job.grow_to = ()  # the operator chose the size
            self._start_scale(job, spec, "scale by the operator")
            return self._snapshot(job)

    def _start_scale(self, job: _Job, spec: JobSpec, why: str) -> None:
        """Under the lock: pause every rank after a common boundary (no checkpoint: nothing
        is lost, no rank restarts) for a resize to ``spec``'s layout (``_resize`` goes on
        once all have paused; resize_machine.py's ``started``)."""
        scale = _Scale(spec, why, old_dp=job.spec.parallel.dp, since=time.monotonic())
        begin(job, scale)
        pause = self._in_flight(job, "scale", engine_pb2.PauseTraining(checkpoint=False))
        job.paused.clear()
        after, effects = rzm.started(scale, job.spec, pause, _where(job))
        moved(job, scale, after)
        self._apply_effects(job, effects)

    def _resize(self, job: _Job, step: int) -> None:
        """Under the lock, every rank paused after ``step`` for the scale in flight: command
        the rebuild at the new layout (L1-4, then L1-2), then have the paused ranks leave
        their pause into it (ResumeTraining.rebuild). Where it cannot be placed, they go on
        at the old size (resize_machine.py: ``all_paused``, then L1-4's answer)."""
        job_id = job.status.job_id
        scale, ask = rzm.all_paused(job.scale, job_id)
        moved(job, job.scale, scale)
        job.pending, job.status.step = "", step
        old_world = job.status.world_size
        reply = self._recovery(ask).message
        if isinstance(reply, control_pb2.RecoveryFailed):
            _, effects = rzm.rebuild_refused(scale, job_id, reply.reason, step)
            end(job, scale)
            self._apply_effects(job, effects)
            return
        _, effects = rzm.rebuild_commanded(scale, job_id)
        self._apply_effects(job, effects)
        self._record_relaunch(job, reply, "a live peer's memory", old_world=old_world)

    def _take_layout(self, job: _Job, spec: JobSpec) -> None:
        """Under the lock: ``spec`` (a new data-parallel layout) is the job's now, its ranks
        above the new size released; journaled with the next event (``_record``'s spec)."""
        job.micro_batch_cap_seen = job.micro_batch_cap
        job.spec = spec
        job.status.world_size = spec.world_size
        _set_layout(job.status, spec)
        job.placement = {r: w for r, w in job.placement.items() if r < spec.world_size}

    def _scaled(self, job: _Job, msg: engine_pb2.TrainingLoopStarted) -> None:
        """Under the lock: every rank of the resized group is ready: start them
        (resize_machine.py's ``all_ready``)."""
        scale = job.scale
        _, effects = rzm.all_ready(scale, msg.start_step, time.monotonic())
        end(job, scale)
        if job.grow_to and job.spec.parallel.dp >= job.grow_to[0]:
            job.grow_to = ()  # (grown back the whole way)
        self._apply_effects(job, effects)

    def _grow_soon(self, job_id: str, free: int) -> None:
        """Under the lock: try growing the job back on the deadline pool's thread (no delay;
        never on the caller's, the thread that applies the node agents' events: it sends
        commands)."""
        self._deadlines.after(0.0, self._grow_back, (job_id, free))

    def _grow_back(self, job_id: str, free: int) -> None:
        """A worker registered: a job shrunk by a fault grows back toward its size, as far
        as the free slots allow (the allocator places the new ranks; none placed: it goes on
        at its size and tries again at the next registration)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or not job.grow_to or job.status.state != JobState.RUNNING:
                return
            if job.pending or job.incident is not None or job.scale is not None:
                return
            # The whole way back at the job's own layout, else as far as the global batch
            # splits (tried largest first: the allocator says what fits).
            full, mbs, accum = job.grow_to
            for target in range(min(full, job.spec.parallel.dp + free), job.spec.parallel.dp, -1):
                layout = {"micro_batch_size": mbs, "grad_accum": accum} if target == full else {}
                try:
                    spec = at_data_parallel_size(
                        job.spec, target, largest=job.micro_batch_cap, source="grow back", **layout
                    )
                except JobSpecError:
                    continue
                self._start_scale(job, spec, "grow back (slots returned)")
                return
