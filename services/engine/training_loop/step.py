"""One optimizer step (``Step._run_step``): data -> (forward, backward) x grad_accum -> reduce
-> unscale/check -> update or skip -> report. A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import time

import structlog

from services.common import phase as ph
from services.contract import engine_pb2
from services.engine import rng_streams
from services.engine.training_loop.summary import _due, mixture_line, step_line

_log = structlog.get_logger("training_loop")


class Step:
    """One optimizer step (a part of ``TrainingLoop``, see loop.py)."""

    def _run_step(self, step: int) -> None:
        """One optimizer step: data -> (forward, backward) x grad_accum -> reduce ->
        unscale/check -> update or skip -> report."""
        p, accum = self._p, self._spec.data.grad_accum
        t0 = time.perf_counter()
        if self._init.rebuild_in_place:  # what a step cut short by a broken group takes back
            self._rng_at_step = rng_streams.capture()
        mark, warm = self._mark, self._warm
        mark.enter(ph.DATA_WAIT)
        batches = [self._next_batch("train") for _ in range(accum)]
        data_wait = time.perf_counter() - t0
        local_tokens = sum(mb.tokens for mb, _ in batches)
        # Global normalisation (module docstring): back-propagate with a normaliser every rank
        # knows now (its token capacity); L2-4 corrects the gradients by the global count later.
        normalizer = float(self._spec.data.micro_batch_size * self._spec.data.seq_len * accum)
        fwd_s = bwd_s = loss_sum = 0.0
        for i, (_, batch) in enumerate(batches):
            p.reduction(engine_pb2.ArmReduction(sync=i == accum - 1))
            mark.enter(ph.FORWARD if warm else ph.COMPILE)
            fwd = p.forward(engine_pb2.RunForward(training=True), batch.input_ids)
            mark.enter(ph.BACKWARD if warm else ph.COMPILE)
            bwd = p.backward(
                engine_pb2.RunBackward(
                    normalizer=normalizer, loss_scale=self._loss_scale, backward=True, micro_steps=accum
                ),
                (fwd.payload, batch.labels),
            ).message
            fwd_s, bwd_s, loss_sum = fwd_s + fwd.message.seconds, bwd_s + bwd.seconds, loss_sum + bwd.loss_sum
            # The logits (micro-batch x sequence x vocabulary, the largest activation) and
            # their graph: freed now, not while the next micro-batch's forward runs.
            del fwd
        # This rank's overflow verdict and norm pieces first; L3-5 all-reduces them with the
        # token count and loss sum (one collective), so every rank (every mesh axis) skips or
        # applies together; L2-4 then unscales (and renormalises) and moves the scale.
        mark.enter(ph.OPTIMIZER)
        check = p.precision(engine_pb2.UnscaleAndCheck(step=step)).message
        reduced = p.reduction(engine_pb2.ReduceGradients(
            local_loss_sum=loss_sum, local_tokens=local_tokens, local_found_inf=check.found_inf,
            replicated_squares=check.replicated_squares, sharded_squares=check.sharded_squares,
            held_commands=self._commands.window(),
        )).message  # fmt: skip
        self._commands.agree(reduced.commands_agreed)  # (in force at this step's boundary: _stop_requested_at_boundary)
        mark.enter(ph.OPTIMIZER)
        self._warm = True
        adjusted = p.precision(engine_pb2.ScaleLoss(
            step=step, found_inf=reduced.found_inf, grad_squares=reduced.grad_squares,
            grad_scale=self._dp_size * normalizer / max(reduced.global_tokens, 1),
        )).message  # fmt: skip
        self._loss_scale, self._scaler_state = adjusted.loss_scale, adjusted.state
        fault, action, order, skip_reason = self._judge(step, reduced, adjusted)  # blocks on a fault: L1 decides
        lr = self._lr_at(step)
        opt_s = 0.0
        if skip_reason:
            self._skipped += 1
        else:
            opt_s = p.optimizer(engine_pb2.ApplyUpdate(step=step, learning_rate=lr)).message.seconds
        self._position = batches[-1][0].next
        self._components = batches[-1][0].components  # a mixture's: each dataset's own position
        step_s = time.perf_counter() - t0
        tokens = reduced.global_tokens
        self._emit(done := engine_pb2.StepCompleted(
            job_id=self._job_id, rank=self._rank, step=step,
            loss=reduced.global_loss_sum / tokens if tokens else float("nan"),
            learning_rate=lr, grad_norm=adjusted.grad_norm, tokens=tokens,
            tokens_per_second=tokens / step_s, step_seconds=step_s, data_wait_seconds=data_wait,
            forward_seconds=fwd_s, backward_seconds=bwd_s, reduction_seconds=reduced.seconds,
            optimizer_seconds=opt_s, loss_scale=check.loss_scale, skipped=bool(skip_reason), skip_reason=skip_reason,
            fault=fault, action=action, standing_order=order, commands_agreed=self._commands.agreed_seq,
            epoch=self._position.epoch, unix_time=time.time(), world_size=self._world,
            flops_per_token=self._flops_per_token,
            mfu=tokens / step_s * self._flops_per_token / (self._peak_flops * self._world),
        ))  # fmt: skip
        self._last_report = done
        every = self._spec.metrics.log_every
        if every and _due(step, every, step == self._spec.steps):
            _log.info(step_line(done), once=True)  # the same on every rank: rank 0 writes it
            if self._components:
                _log.info(mixture_line(step, self._components), once=True)
