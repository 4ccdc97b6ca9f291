"""Step faults (package docstring, "Step faults"): what to do with a step whose loss or
gradients are not finite, by a standing order or L1-1's verdict, blocking until it comes. A
part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import math
import time

import structlog

from services.common import phase as ph
from services.contract import engine_pb2
from services.engine.training_loop.faults import _Released

_log = structlog.get_logger("training_loop")


class StepFaults:
    """Step faults: a standing order or L1-1's verdict (a part of ``TrainingLoop``, see loop.py)."""

    def _judge(
        self, step: int, reduced: engine_pb2.GradientsReduced, adjusted: engine_pb2.LossScaleAdjusted
    ) -> tuple[int, int, int, str]:
        """What to do with the step: (StepFaultKind, StepVerdictAction, standing order id,
        skip reason: "" to apply it, "non_finite_loss" or "overflow" to skip its update).
        Both inputs are all-rank values (the loss sum and the overflow flag came through
        L3-5's all-reduce, the scale moved by that verdict), so every rank finds the same
        fault at the same step and gets the same verdict.

        A fault (a non-finite loss; non-finite gradients; those at the minimum loss scale)
        follows its kind's standing order, else blocks here until L1-1's verdict
        (:meth:`_verdict`). The ``fault_policy.overflow_storm_steps``-th consecutive skipped
        step is a fault of its own (overflow_storm), decided likewise: apply or skip goes on
        with the step skipped and the count restarted.

        Raises:
            _Released: the verdict stops the job or relaunches its ranks.
        """
        loss = reduced.global_loss_sum
        if not math.isfinite(loss):
            kind, reason = engine_pb2.STEP_FAULT_NON_FINITE_LOSS, "non_finite_loss"
            detail = f"training loss is {loss} at step {step} ({reduced.global_tokens} tokens)"
        elif reduced.found_inf and adjusted.at_minimum:
            kind, reason = engine_pb2.STEP_FAULT_LOSS_SCALE_AT_MINIMUM, "overflow"
            detail = (
                f"gradients are not finite at step {step} and the loss scale backed off to its minimum "
                f"{adjusted.loss_scale:g} (precision.loss_scale.min_scale); fp16 cannot hold these gradients"
            )
        elif reduced.found_inf:
            kind, reason = engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW, "overflow"
            detail = f"gradients are not finite at step {step} (loss scale {adjusted.loss_scale:g} after it)"
        else:
            self._consecutive_skips = 0
            return engine_pb2.STEP_FAULT_KIND_UNSPECIFIED, engine_pb2.STEP_VERDICT_ACTION_UNSPECIFIED, 0, ""
        action, order = self._verdict(step, kind, detail, reduced, adjusted)
        if action == engine_pb2.STEP_APPLY:
            self._consecutive_skips = 0
            return kind, action, order, ""
        self._consecutive_skips += 1
        storm_steps = self._spec.fault_policy.overflow_storm_steps
        if self._consecutive_skips >= storm_steps:
            kind = engine_pb2.STEP_FAULT_OVERFLOW_STORM
            self._verdict(step, kind, (
                f"{self._consecutive_skips} consecutive steps skipped (up to step {step}, last: {reason}, loss scale "
                f"{adjusted.loss_scale:g}); fault_policy.overflow_storm_steps is {storm_steps}"
            ), reduced, adjusted)  # fmt: skip
            self._consecutive_skips = 0
        return kind, engine_pb2.STEP_SKIP, order, reason

    def _verdict(
        self,
        step: int,
        kind: int,
        detail: str,
        reduced: engine_pb2.GradientsReduced,
        adjusted: engine_pb2.LossScaleAdjusted,
    ) -> tuple[int, int]:
        """(StepVerdictAction, standing order id) for a fault of ``kind`` at ``step``: its
        standing order in force, else L1-1's verdict. Blocked state (seed L2-1: 异常阻塞,
        循环阻塞等待事件): report StepFaultReported and wait at this boundary, nothing applied.
        No verdict within ``fault_policy.verdict_seconds``: report it again (a reminder) and
        keep waiting; the loop never decides a fault itself.

        Raises:
            _Released: the verdict is STEP_RELAUNCH or STEP_STOP.
        """
        with self._lock:
            order = self._orders.get(kind)
            if order is not None and step <= self._revoked.get(order.id, step):
                return order.action, order.id
        tokens = reduced.global_tokens
        report = engine_pb2.StepFaultReported(
            job_id=self._job_id, rank=self._rank, step=step, kind=kind, detail=detail,
            loss=reduced.global_loss_sum / tokens if tokens else float("nan"), loss_scale=adjusted.loss_scale,
            consecutive_skips=self._consecutive_skips,
        )  # fmt: skip
        phase, self._phase = self._phase, "blocked"
        self._mark.enter(ph.FAULT_WAIT)  # no progress deadline while L1 decides
        wait_s = self._spec.fault_policy.verdict_seconds
        t0 = time.monotonic()
        self._emit(report)  # (not under the lock: an in-process L1 may answer inside this call)
        while True:
            with self._verdict_ready:
                self._verdict_ready.wait_for(lambda: (step, kind) in self._verdicts, timeout=wait_s)
                verdict = self._verdicts.pop((step, kind), None)
            if verdict is not None:
                break
            report.reminder += 1
            report.waited_seconds = time.monotonic() - t0
            _log.warning(
                "no verdict on a step fault yet",
                step=step,
                kind=engine_pb2.StepFaultKind.Name(kind),
                waited_s=round(report.waited_seconds, 1),
                reminder=report.reminder,
            )
            self._emit(report)
        self._phase = phase
        self._mark.enter(ph.OPTIMIZER)
        if verdict.action in (engine_pb2.STEP_APPLY, engine_pb2.STEP_SKIP):
            return verdict.action, 0
        raise _Released(verdict)
