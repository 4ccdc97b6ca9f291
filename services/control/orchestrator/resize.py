"""Resizing a running job (`surgectl scale`, or growing back after a shrink): its ranks pause at
a common boundary, then rebuild their group at the new data-parallel size."""

from __future__ import annotations

import time
from typing import Any

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator import resize_machine as rzm
from services.control.orchestrator.activity import FOLD, ScaleAsk, begin, end, idle, moved
from services.control.orchestrator.grow_rule import Grower, arbitrate
from services.control.orchestrator.job import JobState, _Job, _Scale, _where, withdrawn
from services.control.orchestrator.layout import _layout_of, _set_layout
from services.control.orchestrator.refusals import InsufficientResources
from services.control.orchestrator.teams import kind_of, team_of
from services.control.orchestrator.undos import Before
from services.control.scheduler import admit
from services.control.scheduler.fair_share import blocks
from services.jobspec import (
    JobSpec,
    JobSpecError,
    at_data_parallel_size,
    rebuild_refusal,
    spec_to_json,
)


class Resizing:
    """Resizing a running job (`surgectl scale`, or growing back after a shrink) (a part of ``Orchestrator``, see core.py)."""

    def scale_job_request(self, msg: control_pb2.ScaleJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Resize a RUNNING job to ``dp`` data-parallel ranks without restarting the ranks
        that stay (issue 16, ``surgectl scale``): the ranks pause after a common step
        boundary (no checkpoint), L1-4 has L1-2 release the ranks >= dp or launch the new
        ones, every kept rank rebuilds its group at the new size, the new ranks heal from a
        live peer, and the job goes on at the same global batches (the global batch is kept:
        :func:`services.jobspec.at_data_parallel_size`). Where the new ranks do not fit now
        (L1-2 asked first, nothing placed), it is refused before any rank pauses; where they
        no longer fit at the rebuild, the ranks go on at the old size (the events say so).

        Raises:
            JobNotFound; IllegalTransition: the job is not RUNNING, or a pause, stop, scale or
            recovery is in flight; JobSpecError (one line naming the field): the plan cannot
            be resized in place (tp or pp > 1, FSDP2) or the global batch does not split into
            the new layout; InsufficientResources (an IllegalTransition, REFUSED_NO_CAPACITY):
            its new ranks do not fit the free slots now. Nothing changed.
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
            if spec.world_size > job.spec.world_size:
                self._check_growth(job, spec, flags)
            self._start_scale(job, spec, "scale by the operator")
            job.grow_to = ()  # the operator chose the size (after: the scale's undo puts it back)
            return self._snapshot(job)

    def _check_growth(self, job: _Job, spec: JobSpec, flags: str) -> None:
        """Under the lock, before any rank pauses: whether the new ranks of a scale to ``spec``
        may take free slots now. Raises InsufficientResources (one line; nothing changed, the
        job goes on at its size) when:

        - a queued job of the job's priority or higher waits for slots its new ranks would
          take: the slots are that job's to wait for. The rule is grow_rule.py's (2), the one a
          job growing back after a shrink follows (a head that needs more slots than are
          registered, slots of another kind or its team's quota holds back no one); one of a lower
          priority does not hold it back, as it would not hold back a submit of its priority.
          Refused, not kept waiting: a scale is the operator's, asked once (a grow-back is
          tried again at each offer);
        - its team's quota does not admit that many more slots (the submit's admission);
        - they cannot be placed now, asked of L1-2 as a probe (nothing placed): the allocator's
          reason, the one a submit that does not fit gets. (Was: the ranks paused first, then
          L1-4's rebuild found no slot and they went on.)"""
        grow = spec.world_size - job.spec.world_size
        old = job.spec.parallel.dp
        kept = f"not scaled: the job goes on at dp {old} (no rank paused)"
        priority, kind = job.status.priority, kind_of(job)
        for entry in self._queue.ordered():
            queued = self._jobs.get(entry.job_id)
            if queued is None or self._queue.beyond_cluster(entry.job_id) or entry.job_id in self._quota_held:
                continue  # (it waits for workers to join, or for its team's quota: not for free slots)
            if not blocks(kind_of(queued), kind):
                continue  # (it waits for slots of another kind)
            if entry.priority >= priority:
                raise InsufficientResources(
                    f"{flags}: job {entry.job_id} (priority {entry.priority}) waits in the queue for slots, at "
                    f"position {self._queue.position(entry.job_id)}; a running job grows only past queued jobs "
                    f"of a lower priority than its own ({priority}); {kept}"
                )
        quota = admit(self._quotas, self._usage(), team_of(job.status), grow, kind)
        if not quota.ok:
            raise InsufficientResources(f"{flags}: {grow} more slot{'' if grow == 1 else 's'}: {quota.reason}; {kept}")
        ask = control_pb2.AllocateResources(
            job_id=job.status.job_id,
            world_size=grow,
            backend=spec.parallel.backend,
            init=engine_pb2.InitJob(job_id=job.status.job_id, spec_json=spec_to_json(spec)),
            probe=True,
        )
        probe = self._allocator(ask).message
        assert isinstance(probe, control_pb2.ResourcesInsufficient), probe
        if probe.rank_memory_bytes or probe.available_ranks < grow:
            raise InsufficientResources(
                f"{flags}: needs {grow} more rank{'' if grow == 1 else 's'} (dp {old} -> {spec.parallel.dp}); "
                f"{probe.reason}; {kept}"
            )

    def _start_scale(self, job: _Job, spec: JobSpec, why: str) -> None:
        """Under the lock: pause every rank after a common boundary (no checkpoint: nothing
        is lost, no rank restarts) for a resize to ``spec``'s layout (``_resize`` goes on
        once all have paused; resize_machine.py's ``started``)."""
        before = Before.of(job)
        scale = _Scale(spec, why, old_dp=job.spec.parallel.dp, since=time.monotonic())
        job.last_resize = time.time()  # (wall clock: journaled, it holds across a control restart)
        begin(job, scale)
        pause = self._in_flight(job, "scale", engine_pb2.PauseTraining(checkpoint=False))
        job.paused.clear()
        after, effects = rzm.started(scale, job.spec, pause, _where(job))
        moved(job, scale, after)
        self._apply_effects(job, effects)
        # Undo if its record fails at its commit: no resize in flight (undos.py).
        self._undo_if_lost(job.status.job_id, lambda e: self._activity_undone(job, scale, pause, before))

    def _resize(self, job: _Job, step: int) -> None:
        """Under the lock, every rank paused after ``step`` for the scale in flight: command
        the rebuild at the new layout (L1-4, then L1-2), then have the paused ranks leave
        their pause into it (ResumeTraining.rebuild). Where it cannot be placed, they go on
        at the old size (resize_machine.py: ``all_paused``, then L1-4's answer)."""
        job_id = job.status.job_id
        scale, ask = rzm.all_paused(job.scale, job_id)
        ask.withdrawn_orders.extend(withdrawn(job))  # (the grown ranks launch as the kept ones hold)
        moved(job, job.scale, scale)
        job.status.step = step  # (its pause is over: the slot's phase moved on)
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
        job.launched = {}  # (the resized group's ranks report where they are)

    def _scaled(self, job: _Job, msg: engine_pb2.TrainingLoopStarted) -> None:
        """Under the lock: every rank of the resized group is ready: start them
        (resize_machine.py's ``all_ready``)."""
        scale = job.scale
        _, effects = rzm.all_ready(scale, msg.start_step, time.monotonic())
        end(job, scale)
        if job.grow_to and job.spec.parallel.dp >= job.grow_to[0]:
            job.grow_to = ()  # (grown back the whole way)
        self._apply_effects(job, effects)
        self._start_soon()  # (a shrink's released slots are the queue's: its head may fit now)

    def _grow_soon(self, free: int) -> None:
        """Under the lock: the jobs shrunk by a fault try growing back on the deadline pool's
        thread (no delay; never on the caller's, the thread that applies the node agents'
        events: it sends commands), after the queue's head was tried (scheduled before)."""
        self._deadlines.after(0.0, self._grow_back, (free,))

    def _grow_back(self, free: int) -> None:
        """Slots returned (``free`` of them): the jobs shrunk by a fault grow back toward their
        size, arbitrated by grow_rule.py's rule (priority, then age; never past the queue's
        head of their priority or higher; one resize per job per ``resize_min_interval_s``).
        Each takes what its new ranks need out of ``free`` (the allocator places them; none
        placed: it goes on at its size and tries again at the next registration)."""
        with self._lock:
            now = time.time()
            head = self._queue.head()
            candidates = [
                Grower(j.status.job_id, j.status.priority, j.status.created_unix, j.last_resize)
                for j in self._jobs.values()
                if j.grow_to
                and j.status.state == JobState.RUNNING
                and not j.pending
                and idle(j)
                and not j.status.preempted_by
            ]
            waiting = head.priority if head is not None and not self._queue.beyond_cluster(head.job_id) else None
            order, later = arbitrate(candidates, now, self._resize_min_interval_s, waiting)
            for job_id in order:
                if free <= 0:
                    break
                free -= self._grow_one(self._jobs[job_id], free)
            if later is not None:
                self._arm_policy_timer("grow", later, lambda: self._grow_back(max(free, 1)))

    def _grow_one(self, job: _Job, free: int) -> int:
        """Under the lock: grow ``job`` back as far as ``free`` slots allow; returns the slots
        its new ranks take (0: none tried)."""
        # The whole way back at the job's own layout, else as far as the global batch splits
        # (tried largest first: the allocator says what fits).
        full, mbs, accum = job.grow_to
        free = self._grow_room(job, free)  # (its team's quota: a hard limit holds for growth too)
        for target in range(min(full, job.spec.parallel.dp + free), job.spec.parallel.dp, -1):
            layout = {"micro_batch_size": mbs, "grad_accum": accum} if target == full else {}
            try:
                spec = at_data_parallel_size(
                    job.spec, target, largest=job.micro_batch_cap, source="grow back", **layout
                )
            except JobSpecError:
                continue
            taken = target - job.spec.parallel.dp
            self._start_scale(job, spec, "grow back (slots returned)")
            return taken
        return 0
