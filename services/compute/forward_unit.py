"""L3-3 forward unit: token ids in, logits out. No loss, no gradients of its own.

Receives: ``ConfigureForward`` (the job spec's kernel choice, once; relayed to the operator
adapter as ``SelectOperators``), ``RunForward`` (payload: input ids int64 [B, T], on the
CPU) from the training loop, and ``OperatorsReady`` from the adapter. Replies
``ForwardDone`` with the logits handle as payload ([B, T, V]; float32, or bfloat16 under
the bf16 region). Under ``training=False`` the pass runs without autograd (evaluation).

The module it runs is the one the composition root attached: with data parallelism that is
the DDP wrapper, so the forward pass also prepares DDP's overlapped gradient reduction.

``seconds`` is host wall time; on CUDA it measures kernel launch, not execution.

Red lines kept (seed L3-3): no backward, no loss, no communication of its own, weights
read-only, kernels only as selected by command.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import torch
from torch import nn

from services.contract import engine_pb2
from services.contract.bus import CommandPort, Emitter, Reply
from services.contract.frozen import FrozenConfig


class Operators(Protocol):
    """What the operator adapter hands over in OperatorsReady's payload (units do not
    import each other; this is the shape of the handle)."""

    attention: str

    def region(self) -> contextlib.AbstractContextManager: ...

    def prepare(self, module: nn.Module) -> Any: ...


class ForwardUnit:
    """L3-3. ``operators`` is its port to L3_OPERATOR_ADAPTER."""

    def __init__(self, emit: Emitter, operators: CommandPort, samples: Any = None):
        """``samples``: generates the periodic samples from the attached model (a
        services.compute.samples.SampleGenerator; None: GenerateSample answers with a note)."""
        self._emit = emit
        self._samples = samples
        self._operators_port = operators
        self._module: nn.Module | None = None
        self._device: torch.device | None = None
        self._ops: Operators | None = None
        # The job spec's kernel choice, pushed once by L2-1 (red line 5: no selection of its own).
        self._choice = FrozenConfig[engine_pb2.ConfigureForward]("L3_FORWARD_UNIT", "kernel choice (ConfigureForward)")
        self._state = "idle"  # idle | running | error
        self._pipeline: Any = None

    def attach(self, module: nn.Module, *, pipeline: Any = None) -> None:
        """Composition root: the module to run (the DDP wrapper under data parallelism).

        ``pipeline`` (pp > 1; a services.compute.pipeline_stage.PipelineRunner): the
        schedule interleaves this stage's forward passes with backward passes across ranks,
        so it runs whole in the backward unit's RunBackward; RunForward then hands the
        token ids through unchanged, as its reply's payload, and this unit passes the
        adapter's selection (kernel, autocast region) on to the pipeline's forwards."""
        self._module = module
        self._device = next(module.parameters()).device
        self._pipeline = pipeline
        if self._samples is not None:  # the model itself: DDP's wrapper looked through
            inner = getattr(module, "module", None)
            self._samples.attach(inner if isinstance(inner, nn.Module) else module)

    # ------------------------------------------------------------------ commands / events

    def configure_forward(self, msg: engine_pb2.ConfigureForward, payload: Any = None) -> None:
        """Relay the job's kernel choice to the operator adapter (once).

        Raises:
            ConfigFrozen: a second ConfigureForward.
            OperatorUnavailable: the adapter refuses the kernel.
        """
        self._choice.require_unset()
        reply = self._operators_port(
            engine_pb2.SelectOperators(attention=msg.attention, adamw=msg.adamw, compile=msg.compile)
        )
        self._ops = reply.payload
        self._choice.set(msg)
        self._select_for_pipeline()

    def on_operators_ready(self, msg: engine_pb2.OperatorsReady, payload: Operators) -> None:
        self._ops = payload
        self._select_for_pipeline()

    def _select_for_pipeline(self) -> None:
        if self._pipeline is not None and self._ops is not None and self._ops.attention:
            self._pipeline.use_operators(self._ops)

    def generate_sample(self, msg: engine_pb2.GenerateSample, payload: Any = None) -> engine_pb2.SampleText:
        """A periodic sample from the model this unit runs (services/compute/samples.py); one
        that cannot be generated is answered with its note (never raises for it)."""
        if self._samples is None:
            return engine_pb2.SampleText(note="not generated: this rank has no sample generator")
        (s,) = self._samples(
            [msg.prompt],
            msg.max_new_tokens,
            temperature=msg.temperature,
            seed=msg.seed,
            tokenizer=msg.tokenizer or "bytes",
            context_len=msg.context_len,
        )
        return engine_pb2.SampleText(text=s.text, tokens=s.tokens, seconds=s.seconds, note=s.note)

    def run_forward(self, msg: engine_pb2.RunForward, payload: torch.Tensor) -> Reply:
        """执行前向计算指令. Raises RuntimeError when no module is attached or no kernel
        was selected; errors of the model itself propagate."""
        if self._pipeline is not None:
            return Reply(engine_pb2.ForwardDone(seconds=0.0), payload)
        if self._module is None or self._device is None:
            raise RuntimeError("forward unit: no model attached")
        if self._ops is None or not self._ops.attention:
            raise RuntimeError("forward unit: no attention kernel selected (ConfigureForward first)")
        t0 = time.perf_counter()
        self._state = "running"
        idx_BT = payload.to(self._device, non_blocking=True)
        self._module.train(msg.training)
        with torch.set_grad_enabled(msg.training), self._ops.region():
            logits_BTV = self._ops.prepare(self._module)(idx_BT, attention=self._ops.attention)
        self._state = "idle"
        return Reply(engine_pb2.ForwardDone(seconds=time.perf_counter() - t0), logits_BTV)
