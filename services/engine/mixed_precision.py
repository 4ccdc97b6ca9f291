"""L2-4 mixed-precision manager: compute dtype, dynamic loss scale, overflow check.

Receives (from the training loop): ``InitPrecision`` -> replies ``PrecisionReady`` after
commanding the operator adapter (``SetComputePrecision``); ``UnscaleAndCheck`` -> replies
``OverflowChecked`` (this rank's found_inf, loss scale, L2 norm of the unscaled
gradients); ``ScaleLoss`` (the step's overflow verdict over all ranks) -> replies
``LossScaleAdjusted`` (the scale for the next step and the scaler's whole state).

Policies:
    fp32: float32 compute, loss scale 1.
    bf16: bfloat16 autocast for matmuls (parameters, gradients and optimizer state stay
          float32), loss scale 1: bf16 has float32's exponent range, so gradients do not
          underflow and no dynamic scaling is needed (Kalamkar et al. 2019, "A Study of
          BFLOAT16 for Deep Learning Training"; dynamic scaling is an fp16 remedy,
          Micikevicius et al. 2018).
    fp16: float16 autocast, parameters and optimizer state float32, and dynamic loss
          scaling (:class:`DynamicLossScaler`; defaults in ``services.jobspec.LossScaleSpec``).

Why the verdict comes back in a second command: this manager checks only the gradients on
its own rank, and with sharded gradients (FSDP2, tensor or pipeline parallel) ranks can
disagree. It may not communicate (seed L2-4 red line 4); the loop has the gradient
reduction unit all-reduce the flag and hands the all-rank verdict to ``ScaleLoss``, so
every rank's scaler makes the same move.

Red lines kept (seed L2-4): gradient values are changed only by (un)scaling, never clipped
or zeroed; the manager never skips an update itself: it reports ``found_inf`` and the loop
decides. It reads gradients through the parameter handles the composition root gives it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from services.contract import engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.contract.frozen import FrozenConfig
from services.engine.grad_norm import total_norm

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ScalerPolicy:
    """Dynamic loss-scaling rule (all from the job spec; see ``LossScaleSpec``)."""

    init_scale: float = 2.0**16      # torch.amp.GradScaler
    growth_factor: float = 2.0       # torch.amp.GradScaler
    backoff_factor: float = 0.5      # torch.amp.GradScaler
    growth_interval: int = 2000      # torch.amp.GradScaler
    hysteresis: int = 2              # Megatron-LM DynamicGradScaler
    min_scale: float = 1.0           # Megatron-LM DynamicGradScaler

    def __post_init__(self) -> None:
        bad = [
            ("init_scale", self.init_scale > 0), ("growth_factor", self.growth_factor > 1),
            ("backoff_factor", 0 < self.backoff_factor < 1), ("growth_interval", self.growth_interval > 0),
            ("hysteresis", self.hysteresis > 0), ("min_scale", 0 < self.min_scale <= self.init_scale),
        ]  # fmt: skip
        for name, ok in bad:
            if not ok:
                raise ValueError(f"precision.loss_scale.{name}: invalid value {getattr(self, name)!r}")


class DynamicLossScaler:
    """Megatron-LM's ``DynamicGradScaler.update`` rule, on plain Python numbers.

    Per step, with the all-rank overflow verdict ``found_inf``:
        overflow: growth_tracker = 0; hysteresis_left -= 1; if hysteresis_left <= 0:
                  scale = max(scale * backoff_factor, min_scale)
        clean:    growth_tracker += 1; when it reaches growth_interval: growth_tracker = 0,
                  hysteresis_left = hysteresis, scale *= growth_factor
    (With hysteresis 1 this is exactly ``torch.amp.GradScaler``'s rule.) The hysteresis is
    refilled only by a growth, as in Megatron: once spent, every overflow backs off until
    the scale grows again.
    """

    def __init__(self, policy: ScalerPolicy, state: engine_pb2.LossScalerState | None = None):
        self.policy = policy
        if state is None:
            self.scale, self.growth_tracker, self.hysteresis_left = policy.init_scale, 0, policy.hysteresis
        else:
            self.scale, self.growth_tracker, self.hysteresis_left = state.scale, state.growth_tracker, state.hysteresis_left
            if not (math.isfinite(self.scale) and self.scale > 0):
                raise ValueError(f"loss scaler: restored scale must be finite and > 0, got {self.scale}")

    def update(self, found_inf: bool) -> tuple[bool, bool]:
        """Apply one step's verdict. Returns (backed_off, at_minimum): at_minimum is an
        overflow whose backoff reached ``min_scale`` (or found it there): fp16 cannot hold
        these gradients at any allowed scale (DeepSpeed stops the run at this point too).
        """
        p = self.policy
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                old = self.scale
                self.scale = max(self.scale * p.backoff_factor, p.min_scale)
                return self.scale < old, self.scale <= p.min_scale
            return False, False
        self.growth_tracker += 1
        if self.growth_tracker == p.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_left = p.hysteresis
            self.scale *= p.growth_factor
        return False, False

    def state(self) -> engine_pb2.LossScalerState:
        return engine_pb2.LossScalerState(
            scale=self.scale, growth_tracker=self.growth_tracker, hysteresis_left=self.hysteresis_left
        )


class MixedPrecision:
    """L2-4. ``operators`` is its port to L3_OPERATOR_ADAPTER."""

    def __init__(self, emit: Emitter, operators: CommandPort):
        self._emit = emit
        self._operators = operators
        self._params: list[torch.Tensor] = []
        self._stages: Any = None  # the pp group under pipeline parallelism
        # Seed L2-4 s2: 精度策略副本, carried by 混合精度初始化指令 once; frozen after it.
        self._policy = FrozenConfig[str]("L2_MIXED_PRECISION", "precision policy (InitPrecision)")
        self._scaler: DynamicLossScaler | None = None  # fp16 only
        self._state = "idle"  # idle | checking | overflow | no_overflow

    def attach(self, parameters: Iterable[torch.Tensor], *, stages: Any = None) -> None:
        """Composition root: the parameters whose gradients this manager checks.
        ``stages`` (pp > 1): the pp process group; each stage holds only its own
        parameters, so the norm's squares are summed over it (the whole model's norm)."""
        self._params = list({id(p): p for p in parameters}.values())
        self._stages = stages

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    # ------------------------------------------------------------------ commands

    def init_precision(self, msg: engine_pb2.InitPrecision, payload: Any = None) -> engine_pb2.PrecisionReady:
        """混合精度初始化指令. Raises ValueError for an unknown policy or a bad scaling
        rule, ConfigFrozen for a second InitPrecision; the adapter's refusal (dtype
        unavailable on this device) propagates."""
        self._policy.require_unset()
        if msg.precision not in _DTYPES:
            raise ValueError(f"precision: expected one of {sorted(_DTYPES)}, got {msg.precision!r}")
        scaler = None
        if msg.precision == "fp16":
            policy = ScalerPolicy(
                init_scale=msg.init_scale, growth_factor=msg.growth_factor, backoff_factor=msg.backoff_factor,
                growth_interval=msg.growth_interval, hysteresis=msg.hysteresis, min_scale=msg.min_scale,
            )  # fmt: skip
            scaler = DynamicLossScaler(policy, msg.resume if msg.HasField("resume") else None)
        self._operators(engine_pb2.SetComputePrecision(dtype=_DTYPES[msg.precision]))
        self._policy.set(msg.precision)
        self._scaler = scaler
        return engine_pb2.PrecisionReady(precision=msg.precision, loss_scale=self._loss_scale, state=self._scaler_state())

    def unscale_and_check(self, msg: engine_pb2.UnscaleAndCheck, payload: Any = None) -> engine_pb2.OverflowChecked:
        """执行梯度反缩放与溢出检测指令: unscale (when the scale is not 1), then the L2 norm
        of this rank's gradients; found_inf when it is not finite. One host sync.
        Unscaling by 1/scale (scale >= min_scale > 0) cannot create an inf, so the verdict
        is the scaled gradients' as well."""
        self._state = "checking"
        grads = [p.grad for p in self._params if p.grad is not None]
        scale = self._loss_scale
        if scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = total_norm(grads, over=self._stages)  # DTensor-aware (FSDP2/TP shards): services/engine/grad_norm.py
        found_inf = not math.isfinite(norm)
        self._state = "overflow" if found_inf else "no_overflow"
        return engine_pb2.OverflowChecked(found_inf=found_inf, loss_scale=scale, grad_norm=norm)

    def scale_loss(self, msg: engine_pb2.ScaleLoss, payload: Any = None) -> engine_pb2.LossScaleAdjusted:
        """执行 loss 缩放指令: move the scale per the rule with the step's all-rank
        verdict; fp32/bf16 keep 1. Reply: the scale the next step's backward uses."""
        backed_off = at_minimum = False
        if self._scaler is not None:
            backed_off, at_minimum = self._scaler.update(msg.found_inf)
        # (The step number is not echoed: this module keeps no step count, seed L2-4 red line 2.)
        return engine_pb2.LossScaleAdjusted(
            loss_scale=self._loss_scale, state=self._scaler_state(),
            backed_off=backed_off, at_minimum=at_minimum,
        )  # fmt: skip

    def _scaler_state(self) -> engine_pb2.LossScalerState:
        if self._scaler is None:
            return engine_pb2.LossScalerState(scale=1.0)
        return self._scaler.state()
