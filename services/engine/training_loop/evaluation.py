"""Evaluation: the loss on the held-out split at a step boundary. A part of ``TrainingLoop``
(loop.py)."""

from __future__ import annotations

import time

from services.common import phase as ph
from services.contract import data_pb2, engine_pb2


class Evaluation:
    """Evaluation at a boundary (a part of ``TrainingLoop``, see loop.py)."""

    def _evaluate(self, step: int) -> None:
        """Loss on the held-out split: the same eval.batches micro-batches each time (no
        shuffle, from the start), all ranks' sums reduced to one global mean."""
        self._phase = "evaluating"
        self._mark.enter(ph.EVALUATION, total=self._spec.eval.batches)
        t0 = time.perf_counter()
        self._open_stream("val", data_pb2.DataPosition(), repeat=False, max_batches=self._spec.eval.batches)
        loss_sum, tokens = 0.0, 0
        while (item := self._next_batch("val")) is not None:
            batch = item[1]
            fwd = self._p.forward(engine_pb2.RunForward(training=False), batch.input_ids)
            done = self._p.backward(
                engine_pb2.RunBackward(normalizer=1.0, loss_scale=1.0, backward=False), (fwd.payload, batch.labels)
            ).message
            loss_sum, tokens = loss_sum + done.loss_sum, tokens + done.tokens
            self._mark.advance()
        reduced = self._p.reduction(engine_pb2.ReduceGradients(local_loss_sum=loss_sum, local_tokens=tokens)).message
        n = reduced.global_tokens
        self._emit(engine_pb2.EvalCompleted(
            job_id=self._job_id, rank=self._rank, step=step,
            loss=reduced.global_loss_sum / n if n else float("nan"), tokens=n, seconds=time.perf_counter() - t0,
        ))  # fmt: skip
        self._phase = "stepping"
