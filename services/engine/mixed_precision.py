"""L2-4 mixed-precision manager: compute dtype, dynamic loss scale, overflow check.

Receives (from the training loop): ``InitPrecision`` -> replies ``PrecisionReady`` after
commanding the operator adapter (``SetComputePrecision``); ``UnscaleAndCheck`` -> replies
``OverflowChecked`` (this rank's found_inf, loss scale, and its pieces of the squared
gradient norm); ``ScaleLoss`` (the step's reduced verdict, squares and gradient scale) ->
unscales the gradients and replies ``LossScaleAdjusted`` (the step's gradient norm, the
scale for the next step and the scaler's whole state).

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
reduction unit (L3-5) all-reduce the flag and the norm's pieces (services/engine/grad_norm.py)
with the loss statistics, in the step's one small all-reduce, and hands the reduced values
to ``ScaleLoss``, so every rank's scaler makes the same move and reports the same norm.
The unscale waits for that second command too: the loop back-propagates with a normaliser
known before the step (services/engine/training_loop/__init__.py, "Loss normalisation") and corrects
it by the global token count only after the reduction; unscale and correction are one
multiply (``grad_scale / loss_scale``), one pass over the gradients.

Gradient clipping by global norm (``optimizer.max_grad_norm``, pushed once with
``InitPrecision``) is this manager's, as a scaling: every gradient of every rank is multiplied
by the same ``clip_coef = min(1, max_grad_norm / (norm + 1e-6))`` (torch.nn.utils.
clip_grad_norm_'s coefficient), folded into the unscale's one multiply, after unscaling as
``torch.amp`` orders it (``unscale_`` then ``clip_grad_norm_``). The norm is the reduced,
whole-model one, so the coefficient is the same on every rank under DDP, FSDP2, TP and PP.
Why here (a law question, recorded in services/contract/exceptions.yaml,
``seed-gradient-clipping-owner``): the optimizer's own red line forbids it to clip (L2-3,
seed line 681), the backward unit's allows gradient changes only as 「缩放除外，由精度模块统一
管控」 (scaling, under the precision module, line 1123), and this module's red line allows
「仅做缩放转换」 (scaling, line 759); clipping by the global norm is a scaling of the whole
gradient by one number, direction unchanged. A step whose verdict is found_inf is not
clipped (coefficient 1): its update is not applied. The reported ``grad_norm`` is the norm
before clipping (as clip_grad_norm_ returns it, and as Megatron-LM logs it).

Red lines kept (seed L2-4): gradient values are changed only by scaling (the unscale and the
clip coefficient, one multiply), never clipped element-wise or zeroed; the manager never
skips an update itself: it reports ``found_inf`` and the loop decides. It reads gradients
through the parameter handles the composition root gives it.
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
from services.engine.grad_norm import local_squares

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ScalerPolicy:
    """Dynamic loss-scaling rule (all from the job spec; see ``LossScaleSpec``)."""

    init_scale: float = 2.0**16  # torch.amp.GradScaler
    growth_factor: float = 2.0  # torch.amp.GradScaler
    backoff_factor: float = 0.5  # torch.amp.GradScaler
    growth_interval: int = 2000  # torch.amp.GradScaler
    hysteresis: int = 2  # Megatron-LM DynamicGradScaler
    min_scale: float = 1.0  # Megatron-LM DynamicGradScaler

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
            self.scale, self.growth_tracker, self.hysteresis_left = (
                state.scale,
                state.growth_tracker,
                state.hysteresis_left,
            )
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
        # Seed L2-4 s2: 精度策略副本, carried by 混合精度初始化指令 once; frozen after it.
        self._policy = FrozenConfig[str]("L2_MIXED_PRECISION", "precision policy (InitPrecision)")
        self._scaler: DynamicLossScaler | None = None  # fp16 only
        self._max_grad_norm = 0.0  # from InitPrecision (set with the policy); 0: no clipping
        self._state = "idle"  # idle | checking | overflow | no_overflow

    def attach(self, parameters: Iterable[torch.Tensor]) -> None:
        """Composition root: the parameters whose gradients this manager checks (this
        rank's: a pipeline stage's own, DTensor shards under FSDP2 / TP)."""
        self._params = list({id(p): p for p in parameters}.values())

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
        if not (math.isfinite(msg.max_grad_norm) and msg.max_grad_norm >= 0):
            raise ValueError(f"optimizer.max_grad_norm: must be finite and >= 0, got {msg.max_grad_norm}")
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
        self._max_grad_norm = msg.max_grad_norm
        return engine_pb2.PrecisionReady(
            precision=msg.precision, loss_scale=self._loss_scale, state=self._scaler_state()
        )

    def unscale_and_check(self, msg: engine_pb2.UnscaleAndCheck, payload: Any = None) -> engine_pb2.OverflowChecked:
        """执行梯度反缩放与溢出检测指令, the check half: this rank's gradients' sums of squares
        as back-propagated (services/engine/grad_norm.py); found_inf when one is not finite.
        One host sync, no communication, no gradient changed. Unscaling by 1/scale (scale
        >= min_scale > 0) cannot create an inf, so the verdict is the unscaled gradients'
        as well. The unscale itself comes with ScaleLoss, once the reduced values are in."""
        self._state = "checking"
        grads = [p.grad for p in self._params if p.grad is not None]
        replicated, sharded = local_squares(grads)
        found_inf = not (math.isfinite(replicated) and math.isfinite(sharded))
        self._state = "overflow" if found_inf else "no_overflow"
        return engine_pb2.OverflowChecked(
            found_inf=found_inf, loss_scale=self._loss_scale, replicated_squares=replicated, sharded_squares=sharded,
        )  # fmt: skip

    def scale_loss(self, msg: engine_pb2.ScaleLoss, payload: Any = None) -> engine_pb2.LossScaleAdjusted:
        """执行 loss 缩放指令: unscale this step's gradients (times ``grad_scale`` / loss
        scale) and clip them to ``max_grad_norm`` (times ``clip_coef``), in one pass, skipped
        when the product is 1; report the norm of the unscaled gradients from the reduced
        squares (the whole model's, the same on every rank), then move the scale per the
        rule with the step's all-rank verdict; fp32/bf16 keep 1. Reply: the norm, the clip
        coefficient and the scale the next step's backward uses."""
        factor = (msg.grad_scale or 1.0) / self._loss_scale
        grad_norm = math.sqrt(msg.grad_squares) * factor if msg.grad_squares >= 0 else float("nan")
        clip_coef = 1.0
        if self._max_grad_norm > 0 and not msg.found_inf and math.isfinite(grad_norm):
            clip_coef = min(1.0, self._max_grad_norm / (grad_norm + 1e-6))  # clip_grad_norm_'s
        grads = [p.grad for p in self._params if p.grad is not None]
        if factor * clip_coef != 1.0 and grads:
            torch._foreach_mul_(grads, factor * clip_coef)
        backed_off = at_minimum = False
        if self._scaler is not None:
            backed_off, at_minimum = self._scaler.update(msg.found_inf)
        # (The step number is not echoed: this module keeps no step count, seed L2-4 red line 2.)
        return engine_pb2.LossScaleAdjusted(
            loss_scale=self._loss_scale, state=self._scaler_state(),
            backed_off=backed_off, at_minimum=at_minimum, grad_norm=grad_norm, clip_coef=clip_coef,
        )  # fmt: skip

    def _scaler_state(self) -> engine_pb2.LossScalerState:
        if self._scaler is None:
            return engine_pb2.LossScalerState(scale=1.0)
        return self._scaler.state()
