"""Periodic samples (``eval.sample_every_steps``, issue 31 item 4): rank 0's loop continues the
spec's prompts with the rank's own model at a step boundary, by the KV-cache decoding
``surgectl generate`` uses (services/compute/decode.py).

No collective: only rank 0 generates, from its own parameters, so the other ranks go on to the
next step and wait in its first collective no longer than the generation takes. That holds for
a model whose rank-0 parameters are the whole model (one rank, or DDP's replicas). A sharded
model (FSDP2 or tensor parallelism: DTensor parameters; a pipeline stage) is not gathered for
a sample (gathering is a collective every rank would have to join at every sample boundary):
its samples are skipped, each record saying so in one line.

The forward unit (L3-3, which runs the model) holds one and attaches the model it is given;
the loop asks it for each sample (GenerateSample): the loop never holds the weights (the state
layer's red line)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from services.compute.decode import generate, text_codec
from services.compute.model import Transformer

SHARDED_NOTE = "not generated: the model is sharded (FSDP2 / tensor / pipeline parallel) and samples do not gather it"


@dataclass(frozen=True)
class Sample:
    text: str  # the continuation only
    tokens: int  # new tokens
    seconds: float
    note: str = ""  # "": generated; else why not (one line)


class SampleGenerator:
    """Generates samples from the model handed over (``attach``); ``device``: the rank's."""

    def __init__(self, device: str = "cpu") -> None:
        self._device = torch.device(device)
        self._model: Any = None
        self._codecs: dict[tuple[str, int], Any] = {}

    def attach(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(
        self,
        prompts: list[str],
        max_new_tokens: int,
        *,
        temperature: float,
        seed: int,
        tokenizer: str,
        context_len: int,
    ) -> list[Sample]:
        """Each prompt's continuation. A prompt that cannot be generated gets a ``note``
        instead of text (never raises for it: a sample is a measurement)."""
        model = self._model
        why = self._not_generable(model)
        if why:
            return [Sample("", 0, 0.0, why) for _ in prompts]
        try:
            encode, decode = self._codec(tokenizer, model.spec.vocab_size)
        except (ValueError, OSError) as e:  # the tokenizer's file gone, or a vocabulary it does not fit
            return [Sample("", 0, 0.0, f"not generated: tokenizer {tokenizer}: {e}") for _ in prompts]
        out = []
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            ids = encode(prompt) or [0]
            # A seeded stream per prompt and boundary (seed + the prompt's index), on the
            # model's device: the training's own random streams are not drawn from (a resumed
            # run trains the same).
            gen = torch.Generator(device=self._device).manual_seed(seed + i)
            try:
                full = generate(
                    model,
                    torch.tensor(ids, dtype=torch.int64, device=self._device),
                    max_new_tokens,
                    temperature,
                    0,
                    generator=gen,
                    context_len=context_len,
                )
            except (RuntimeError, ValueError) as e:  # (out of memory, a shape it cannot take)
                out.append(Sample("", 0, time.perf_counter() - t0, f"not generated: {type(e).__name__}: {e}"[:300]))
                continue
            new = full[len(ids) :].tolist()
            out.append(Sample(decode(new), len(new), time.perf_counter() - t0))
        return out

    def _codec(self, tokenizer: str, vocab_size: int):
        key = (tokenizer, vocab_size)
        if key not in self._codecs:
            self._codecs[key] = text_codec(tokenizer, vocab_size)
        return self._codecs[key]

    @staticmethod
    def _not_generable(model: Any) -> str:
        if model is None:
            return "not generated: no model loaded yet"
        if not isinstance(model, Transformer):
            return SHARDED_NOTE  # (a pipeline stage holds a slice of the layers)
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return SHARDED_NOTE
        return ""
