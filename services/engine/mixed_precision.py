"""L2-4 mixed-precision manager: compute dtype, loss scale, overflow check.

Receives (from the training loop): ``InitPrecision`` -> replies ``PrecisionReady`` after
commanding the operator adapter (``SetComputePrecision``); ``UnscaleAndCheck`` -> replies
``OverflowChecked`` (found_inf, loss scale, global L2 norm of the unscaled gradients).

Policies:
    fp32: float32 compute, loss scale 1.
    bf16: bfloat16 autocast for matmuls (parameters, gradients and optimizer state stay
          float32), loss scale 1: bf16 has float32's exponent range, so gradients do not
          underflow and no dynamic scaling is needed (Kalamkar et al. 2019, "A Study of
          BFLOAT16 for Deep Learning Training"; dynamic scaling is an fp16 remedy,
          Micikevicius et al. 2018).

Red lines kept (seed L2-4): gradient values are changed only by (un)scaling, never clipped
or zeroed; the manager never skips an update itself: it reports ``found_inf`` and the loop
decides. It reads gradients through the parameter handles the composition root gives it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from services.contract import engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.contract.frozen import FrozenConfig

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class MixedPrecision:
    """L2-4. ``operators`` is its port to L3_OPERATOR_ADAPTER."""

    def __init__(self, emit: Emitter, operators: CommandPort):
        self._emit = emit
        self._operators = operators
        self._params: list[torch.Tensor] = []
        # Seed L2-4 s2: 精度策略副本, carried by 混合精度初始化指令 once; frozen after it.
        self._policy = FrozenConfig[str]("L2_MIXED_PRECISION", "precision policy (InitPrecision)")
        self._loss_scale = 1.0
        self._state = "idle"  # idle | checking | overflow | no_overflow

    def attach(self, parameters: Iterable[torch.Tensor]) -> None:
        """Composition root: the parameters whose gradients this manager checks."""
        self._params = list({id(p): p for p in parameters}.values())

    # ------------------------------------------------------------------ commands

    def init_precision(self, msg: engine_pb2.InitPrecision, payload: Any = None) -> engine_pb2.PrecisionReady:
        """混合精度初始化指令. Raises ValueError for an unknown policy, ConfigFrozen for a
        second InitPrecision; the adapter's refusal (dtype unavailable on this device)
        propagates."""
        self._policy.require_unset()
        if msg.precision not in _DTYPES:
            raise ValueError(f"precision: expected one of {sorted(_DTYPES)}, got {msg.precision!r}")
        self._operators(engine_pb2.SetComputePrecision(dtype=_DTYPES[msg.precision]))
        self._policy.set(msg.precision)
        self._loss_scale = 1.0
        return engine_pb2.PrecisionReady(precision=msg.precision, loss_scale=self._loss_scale)

    def unscale_and_check(self, msg: engine_pb2.UnscaleAndCheck, payload: Any = None) -> engine_pb2.OverflowChecked:
        """执行梯度反缩放与溢出检测指令: unscale (when the scale is not 1), then the global
        L2 norm of all gradients; found_inf when it is not finite. One host sync."""
        self._state = "checking"
        grads = [p.grad for p in self._params if p.grad is not None]
        if self._loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / self._loss_scale)
        norm = float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0
        found_inf = not math.isfinite(norm)
        self._state = "overflow" if found_inf else "no_overflow"
        return engine_pb2.OverflowChecked(found_inf=found_inf, loss_scale=self._loss_scale, grad_norm=norm)
