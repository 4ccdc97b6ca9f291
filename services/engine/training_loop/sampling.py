"""Periodic samples (``eval.sample_every_steps``): at those step boundaries rank 0 asks L3-3,
the forward unit that runs the model, to continue each of the spec's prompts (GenerateSample;
services/compute/samples.py: the loop never holds the weights) and reports each continuation
as a ``SampleGenerated`` record to L5-2 (the store's records, a line of kind ``sample``) and a
line in its log. The other ranks do nothing here: no collective, they wait in the next step's
first collective only as long as the generation takes (rank 0 is marked as evaluating
meanwhile, one unit per prompt, so the liveness check reads it as busy, not stalled). A sample
is a measurement: one that could not be generated is a record with its ``note``; training goes
on. A part of ``TrainingLoop`` (loop.py)."""

from __future__ import annotations

import structlog

from services.common import phase as ph
from services.contract import engine_pb2

_log = structlog.get_logger("training_loop")


class Sampling:
    """Sample generation at a boundary (a part of ``TrainingLoop``, see loop.py)."""

    _tokenizer = "bytes"  # the (first) dataset's tokenizer, set when it is mounted

    def _sample(self, step: int) -> None:
        if self._rank != 0:
            return
        ev = self._spec.eval
        self._phase = "sampling"
        self._mark.enter(ph.EVALUATION, total=len(ev.sample_prompts))
        try:
            for i, prompt in enumerate(ev.sample_prompts):  # one at a time: the phase shows progress
                s = self._p.forward(engine_pb2.GenerateSample(
                    prompt=prompt, max_new_tokens=ev.sample_tokens, temperature=ev.sample_temperature,
                    seed=ev.sample_seed + i, tokenizer=self._tokenizer, context_len=self._spec.data.seq_len,
                )).message  # fmt: skip
                self._mark.advance()
                _log.info(
                    "sample", step=step, prompt_index=i, prompt=prompt, text=s.text, tokens=s.tokens,
                    seconds=round(s.seconds, 3), **({"note": s.note} if s.note else {}),
                )  # fmt: skip
                self._emit(engine_pb2.SampleGenerated(
                    job_id=self._job_id, rank=self._rank, step=step, prompt_index=i, prompt=prompt, text=s.text,
                    tokens=s.tokens, seconds=s.seconds, temperature=ev.sample_temperature, note=s.note,
                ))  # fmt: skip
        finally:
            self._phase = "stepping"
