"""Survivors keep training and resize in place (package docstring): a broken group rebuilt,
the rank healed from a peer, a new data-parallel layout taken. A part of ``TrainingLoop``
(loop.py)."""

from __future__ import annotations

import time

import structlog

from services.common import phase as ph
from services.contract import engine_pb2, route_pb2
from services.contract.failures import cause_of
from services.engine import rng_streams
from services.engine.training_loop.faults import TrainingFault, _one_line, _Released
from services.jobspec import JobSpecError, spec_to_json, with_layout

_log = structlog.get_logger("training_loop")


class Recovery:
    """A group rebuilt in place, a heal, a resize (a part of ``TrainingLoop``, see loop.py)."""

    def _rebuilds(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a broken group this rank survives (module docstring): the job
        rebuilds in place and the failure is a communication failure (typed cause)."""
        if isinstance(exc, (_Released, TrainingFault)) or not self._init.rebuild_in_place or self._p.parallel is None:
            return False
        return cause_of(exc) == route_pb2.FAILURE_COMMUNICATION

    @staticmethod
    def _waits_in_loop(exc: BaseException) -> bool:
        """Whether ``exc`` leaves the rank waiting in its loop for L1-1's decision instead of
        failing: a replica divergence (issue 29 items 3 and 9). Every rank finds it alike at
        the same boundary (the check's answer is the group's), so the group and every process
        are intact, and L1-1 can roll the job back in place (:meth:`_await_decision`)."""
        return isinstance(exc, TrainingFault) and exc.fault_class == "replica_divergence"

    def _await_decision(self, exc: TrainingFault) -> bool:
        """Report ``exc`` as this rank's failure (TrainingLoopFailed: L1-3 grades it, L1-1
        decides) and wait here, alive with the group, phase FAULT_WAIT (no progress deadline),
        for the decision: a rollback in place (``ResumeTraining.reload_version``: the version
        loaded, :meth:`_reload`; True once started again), an ignore (``go_on_at_step``, this
        step: True, training goes on as it is) or a stop (False: finished). A relaunch or a stop
        of the job kills the process where it waits."""
        # Out of the check's collective first: a failure classified while the rank's phase says
        # it waits in one is a broken communicator (services/contract/failures.cause_of), and
        # the group is not broken: every rank answered the check.
        self._phase = "fault_wait"
        self._mark.enter(ph.FAULT_WAIT)
        self.fail(exc)
        self._failed = False  # (a later failure of this rank is reported too)
        self._phase = "fault_wait"
        _log.warning("waiting_for_l1_decision", step=self._step, fault_class=exc.fault_class)
        with self._go_on_lock:
            early, self._early = self._early, None
            msg = early[1] if early is not None and early[0] == self._step else None
            self._waiting_at = 0 if msg is not None else self._step
        while True:
            if msg is None:
                msg = self._control.get()
            if isinstance(msg, engine_pb2.ResumeTraining) and msg.go_on_at_step == self._step:
                _log.warning("fault_ignored_going_on", step=self._step, fault_class=exc.fault_class)
                return True
            if isinstance(msg, engine_pb2.ResumeTraining) and msg.reload_version:
                self._end_fault_wait()
                return self._reload(msg.reload_version)
            if isinstance(msg, engine_pb2.StopTraining):
                self._end_fault_wait()
                self._finish(stopped=True)
                return False
            msg = None

    def _end_fault_wait(self) -> None:
        """The fault wait is over: a decision that comes later is dropped, not queued."""
        with self._go_on_lock:
            self._waiting_at, self._early = 0, None

    def _recover(self, reason: str, in_step: bool, *, resize: bool = False) -> bool:
        """Roll back to the last completed step, have the group rebuilt (at a new layout when
        L1-2's rendezvous names one), heal, reopen the data and wait to start again (module
        docstring, "Survivors keep training", "Resize in place"). ``in_step``: the fault cut
        a step short (its RNG draws are taken back). ``resize``: no fault, a paused loop left
        for an operator's resize. Returns False when a StopTraining came instead of
        StartTraining (the loop finished).

        Raises:
            whatever is not a communication failure (a rendezvous that never came, a heal with
            no state to take, a layout the spec refuses: L1 decides, as for any failure).
        """
        t0 = time.perf_counter()
        self._phase = "rebuilding"
        self._mark.enter(ph.FAULT_WAIT)  # no progress deadline while the group is rebuilt
        if resize:
            _log.info("group_left_for_resize", step=self._step, reason=reason)
        else:
            _log.warning("group_broke", step=self._step, in_step=in_step, reason=reason)
        if in_step and self._rng_at_step is not None:
            rng_streams.restore(self._rng_at_step)
        completed = self._step
        healed: engine_pb2.StateHealed | None = None
        while healed is None:
            self._await_thaw()
            try:
                joined = self._p.parallel(engine_pb2.RebuildParallelGroup(job_id=self._job_id, reason=reason)).payload
                self._generation = joined.generation
                self._await_ready()
                if joined.layout.dp:
                    self._take_layout(joined.layout)
                healed = self._heal(has_state=True)
            except Exception as e:
                if self._frozen is not None and cause_of(e) == route_pb2.FAILURE_RENDEZVOUS:
                    # Held for inspection (fault_policy.freeze_seconds, up to days) while waiting
                    # for the rebuild's rendezvous, whose wait is minutes: the hold is not the
                    # rendezvous's fault. It is waited for again once the hold ends.
                    _log.info("rendezvous_wait_outlasted_by_hold", step=self._step, error=_one_line(e))
                    continue
                if not self._rebuilds(e):  # (a peer lost again while healing: rebuilt again)
                    raise
                reason = _one_line(e)
        if healed.step > completed:
            self._report_taken_over(healed, completed)
        self._open_stream("train", self._position, repeat=True, max_batches=0)
        self._emit(engine_pb2.TrainingLoopStarted(
            job_id=self._job_id, rank=self._rank, start_step=self._step, num_parameters=self._num_parameters,
            startup_seconds=time.perf_counter() - t0, rebuild_generation=self._generation,
            healed=True, healed_from_rank=healed.source_rank,
            peak_tflops=self._peak.tflops, peak_source=self._peak.source,
        ))  # fmt: skip
        _log.info(
            "group_rebuilt_and_healed",
            step=self._step,
            generation=self._generation,
            world_size=self._world,
            layout=self._layout_text(),
            source=healed.source_rank,
            healed_bytes=healed.bytes,
            heal_s=round(healed.seconds, 4),
            recovery_s=round(time.perf_counter() - t0, 4),
        )
        self._phase = "standby"
        return self._await_start()

    def _await_thaw(self) -> None:
        """Held for inspection (FreezeTraining) before a rebuild: wait for L1-1's thaw (a
        rebuild in place) or the end of the process (a relaunch, a stop), so that the
        rendezvous's wait starts only when the decided recovery runs."""
        if self._frozen is not None:
            _log.warning("rebuild_held_for_inspection", step=self._step)
            self._thawed.wait()

    def _report_taken_over(self, healed: engine_pb2.StateHealed, completed: int) -> None:
        """This rank healed onto a step it did not complete (a peer finished the step in flight
        before the group broke: a gloo all-reduce can return on some ranks and fail on
        others). That step trained, so it is reported here too, as the source reported it
        (every field is global but the rank): else this rank's record of it, rank 0's the
        job's journal and the store's, would be missing. A source with no report of it
        (never seen: the source heals only at a step it completed) leaves it unreported, logged."""
        report = healed.last_step
        if report.step != healed.step:
            _log.warning("taken_over_step_unreported", step=healed.step, completed=completed, source=healed.source_rank)
            return
        done = engine_pb2.StepCompleted()
        done.CopyFrom(report)
        done.rank = self._rank
        self._last_report = done
        self._emit(done)
        _log.info("taken_over_step_reported", step=done.step, completed=completed, source=healed.source_rank)

    def _take_layout(self, layout: engine_pb2.DataParallelLayout) -> None:
        """The layout of the group just joined (L1's command) is the job's from now on
        (module docstring, "Resize in place").

        Raises:
            TrainingFault: config_error, a layout the spec's rules refuse or that is not the
                group's size (L1 checks both before it commands a resize).
        """
        try:
            spec = with_layout(
                self._spec, dp=layout.dp, micro_batch_size=layout.micro_batch_size, grad_accum=layout.grad_accum,
                source="RebuildParallelGroup.layout",
            )  # fmt: skip
        except JobSpecError as e:
            raise TrainingFault("config_error", _one_line(e)) from None
        if spec.world_size != self._world:
            raise TrainingFault(
                "config_error",
                f"RebuildParallelGroup.layout: dp {layout.dp} needs {spec.world_size} ranks, the group has {self._world}",
            )
        before = self._layout_text()
        self._spec, self._spec_json = spec, spec_to_json(spec)
        _log.info("layout_taken", step=self._step, before=before, now=self._layout_text())

    def _layout_text(self) -> str:
        d = self._spec.data
        return f"dp {self._spec.parallel.dp} x micro_batch_size {d.micro_batch_size} x grad_accum {d.grad_accum}"

    def _await_ready(self) -> None:
        """Take the ParallelReady of a rebuilt group off the control inbox (other commands
        stay queued, in order) and take its coordinates."""
        kept = []
        while not isinstance(msg := self._control.get(), engine_pb2.ParallelReady):
            kept.append(msg)
        for other in kept:
            self._control.put(other)
        self._rank, self._world = msg.rank, msg.world_size
        self._dp_rank, self._dp_size = msg.dp_rank, max(msg.dp_size, 1)

    def _heal(self, *, has_state: bool) -> engine_pb2.StateHealed:
        """HealState with a template of this rank's state; restore what came unless this
        rank is the source. ``has_state`` false: a replacement, nothing to give."""
        ask = engine_pb2.HealState(job_id=self._job_id, step=self._step, has_state=has_state)
        if has_state and self._last_report is not None and self._last_report.step == self._step:
            ask.last_step.CopyFrom(self._last_report)  # for a peer one step behind (_report_taken_over)
        reply = self._p.store(ask, self._snapshot(self._step))
        healed = reply.message
        if healed.source_rank != self._rank or not has_state:
            self._restore(reply.payload)
        return healed
