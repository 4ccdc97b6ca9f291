"""L3-4 backward unit: loss from logits and labels, then gradients.

Receives: ``RunBackward`` from the training loop (payload: ``(logits_BTV, labels_BT)``;
labels int64 on the CPU, -100 marks padding). Replies ``BackwardDone`` with the unscaled
loss sum (nats) and the number of non-padding tokens.

    loss = sum_t CE(logits_t, label_t) / normalizer * loss_scale     (padding excluded)

Cross entropy is computed in float32 whatever the compute dtype. ``backward=False`` computes
the loss sum only, without autograd (evaluation).

Gradient buffers are this unit's product: they start from zero at the first micro-step of
each accumulation window (every ``micro_steps`` backward passes: ``RunBackward.micro_steps``,
the loop's current ``data.grad_accum``; 0 means the count given at construction) and
accumulate within it. A count other than the window's starts a fresh window (a resize in
place changed the layout; issue 16), as does ``attach``. Nothing here scales, clips or
reduces them.

One host sync per call (the loss sum as a Python float); the token count is taken from the
CPU labels, no device sync.

Red lines kept (seed L3-4): no gradient reduction or communication, no weight update, no
gradient edits beyond the loss scale it is told, no reading of other modules' state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn import functional

from services.contract import engine_pb2
from services.contract.bus import Emitter

IGNORE_INDEX = -100


class BackwardUnit:
    """L3-4."""

    def __init__(self, emit: Emitter, *, micro_steps: int = 1):
        if micro_steps < 1:
            raise ValueError(f"backward unit: micro_steps must be >= 1, got {micro_steps}")
        self._emit = emit
        self._micro_steps = micro_steps  # the count when RunBackward names none
        self._window = micro_steps  # the current accumulation window's length
        self._params: list[torch.Tensor] = []
        self._passes = 0  # backward passes run, for the accumulation window
        self._state = "idle"  # idle | running | grads_ready | error
        self._pipeline: Any = None

    def attach(self, parameters: Iterable[torch.Tensor], pipeline: Any = None) -> None:
        """Composition root: the parameters whose gradients this unit produces.

        ``pipeline`` (pp > 1): RunBackward runs the pipeline schedule of the micro-step
        (a services.compute.pipeline_stage.PipelineRunner: forward and backward of its
        pipeline micro-batches, the same loss formula on the last stage).
        The payload is then (input ids, labels) (the forward unit handed the ids through),
        and the loss sum is this stage's: the batch's on the last stage, 0 elsewhere.
        The activation and gradient sends/receives between neighbouring stages inside
        torch's schedule are the one communication here: pipeline parallelism cannot
        separate them from the backward pass (the same kind of exception as DDP's
        overlapped all-reduce)."""
        self._params = list({id(p): p for p in parameters}.values())
        self._pipeline = pipeline
        # An attach starts a new accumulation window: attached again after a group was
        # rebuilt in place, the step cut short by the fault may have left one half done.
        self._passes = 0

    def run_backward(
        self, msg: engine_pb2.RunBackward, payload: tuple[torch.Tensor, torch.Tensor]
    ) -> engine_pb2.BackwardDone:
        """启动反向计算指令. Raises ValueError for a non-positive normalizer or loss scale."""
        if msg.normalizer <= 0:
            raise ValueError(f"backward unit: normalizer must be > 0, got {msg.normalizer}")
        if msg.backward and msg.loss_scale <= 0:
            raise ValueError(f"backward unit: loss_scale must be > 0, got {msg.loss_scale}")
        t0 = time.perf_counter()
        if msg.backward:
            self._take_window(msg.micro_steps or self._micro_steps)
        if self._pipeline is not None:
            return self._run_pipeline(msg, payload, t0)
        logits_BTV, labels_BT = payload
        tokens = int((labels_BT != IGNORE_INDEX).sum())  # CPU labels: no device sync
        labels_N = labels_BT.to(logits_BTV.device, non_blocking=True).reshape(-1)
        logits_NV = logits_BTV.reshape(-1, logits_BTV.shape[-1]).float()
        if not msg.backward:
            with torch.no_grad():
                loss_sum = functional.cross_entropy(logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
            return engine_pb2.BackwardDone(loss_sum=float(loss_sum), tokens=tokens, seconds=time.perf_counter() - t0)
        self._state = "running"
        if self._passes % self._window == 0:  # a new accumulation window starts from zero
            for p in self._params:
                p.grad = None
        loss_sum = functional.cross_entropy(logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
        (loss_sum * (msg.loss_scale / msg.normalizer)).backward()
        self._passes += 1
        self._state = "grads_ready"
        return engine_pb2.BackwardDone(
            loss_sum=float(loss_sum.detach()), tokens=tokens, seconds=time.perf_counter() - t0
        )

    def _take_window(self, micro_steps: int) -> None:
        """Accumulate over ``micro_steps`` passes from now on; a changed count starts a
        fresh window (its first pass zeroes the gradients)."""
        if micro_steps != self._window:
            self._window, self._passes = micro_steps, 0

    def _run_pipeline(
        self, msg: engine_pb2.RunBackward, payload: tuple[torch.Tensor, torch.Tensor], t0: float
    ) -> engine_pb2.BackwardDone:
        ids_BT, labels_BT = payload
        tokens = int((labels_BT != IGNORE_INDEX).sum())
        if not msg.backward:
            loss_sum = self._pipeline.forward_only(ids_BT, labels_BT)
        else:
            self._state = "running"
            first = self._passes % self._window == 0  # a new accumulation window starts from zero
            loss_sum = self._pipeline.forward_backward(
                ids_BT, labels_BT, normalizer=msg.normalizer, loss_scale=msg.loss_scale, zero_grad=first
            )
            self._passes += 1
            self._state = "grads_ready"
        return engine_pb2.BackwardDone(loss_sum=loss_sum or 0.0, tokens=tokens, seconds=time.perf_counter() - t0)
