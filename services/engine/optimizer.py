"""L2-3 optimizer wrapper: AdamW weight updates, on command only.

Receives: ``ApplyUpdate`` (update now, with this learning rate), ``ExportState`` and
``RestoreState`` from the training loop. Replies: ``UpdateApplied``, ``StateExported``
(payload: a copy of the moments and step counts, an immutable
:class:`~services.state.snapshot.Slot`) and ``StateRestored`` (the slot it was handed copied
into the optimizer; nothing of it kept). No live handle on the moments leaves this module.

Red lines kept (seed L2-3): the learning rate is only ever the one ``ApplyUpdate``
carries (no schedule, no adaptation here); the update is never skipped, clipped or
conditioned on the gradients; gradient tensors are read, never written (they are cleared
by the backward unit, which produces them, at the start of each accumulation window).

AdamW: Loshchilov & Hutter 2019 (decoupled weight decay). Weight decay applies to
matrices and embeddings only (ndim >= 2), not to norm gains, as in GPT-2 / nanoGPT.

Implementation (job spec ``operators.adamw``, also checked and reported by the operator
adapter): ``fused`` (one kernel over all parameters; CUDA and, since torch 2.4, CPU),
``foreach`` (multi-tensor ops) or ``default`` (torch picks). The same algorithm either way;
an implementation this device lacks is refused, never swapped for another.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from services.contract import Module, engine_pb2
from services.contract.bus import Emitter, Reply
from services.contract.failures import FailureCause, Refusal
from services.jobspec import OptimizerSpec
from services.state.snapshot import Slot, restorable, thaw

# operators.adamw -> torch.optim.AdamW keyword arguments.
_IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True, "fused": False},
    "default": {},
}


class OptimizerUnavailable(RuntimeError, Refusal):
    """The job asked for an AdamW implementation this device lacks (a refusal)."""

    fault_class = "operator_unavailable"
    failure_cause = FailureCause.FAILURE_UNSUPPORTED


class Optimizer:
    """L2-3. Build it, ``attach`` the model (composition root), then command it."""

    def __init__(self, spec: OptimizerSpec, emit: Emitter, *, implementation: str = "fused"):
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"operators.adamw: expected one of {sorted(_IMPLEMENTATIONS)}, got {implementation!r}")
        self._spec = spec
        self._implementation = implementation
        self._emit = emit
        self._model: nn.Module | None = None
        self._optim: torch.optim.Optimizer | None = None
        self._lr: float = 0.0
        self._updates = 0

    def attach(self, model: nn.Module) -> None:
        """Composition root: the (unwrapped) model whose parameters this optimizer updates."""
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": self._spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self._model = model
        devices = {p.device.type for p in model.parameters()}
        if self._implementation == "fused" and not devices <= set(_get_fused_kernels_supported_devices()):
            raise OptimizerUnavailable(
                f"operators.adamw: fused AdamW is not available for parameters on {sorted(devices)}; "
                "choose foreach or default"
            )
        # lr=0 until the first ApplyUpdate names one.
        self._optim = torch.optim.AdamW(
            groups,
            lr=0.0,
            betas=(self._spec.beta1, self._spec.beta2),
            eps=self._spec.eps,
            **_IMPLEMENTATIONS[self._implementation],
        )

    # ------------------------------------------------------------------ commands

    def apply_update(self, msg: engine_pb2.ApplyUpdate, payload: Any = None) -> engine_pb2.UpdateApplied:
        """执行权重更新指令 + 学习率配置更新指令: one AdamW step at ``msg.learning_rate``.

        Raises RuntimeError if no model is attached.
        """
        if self._optim is None:
            raise RuntimeError("optimizer: no model attached (the composition root must attach one)")
        t0 = time.perf_counter()
        self._lr = msg.learning_rate
        for group in self._optim.param_groups:
            group["lr"] = msg.learning_rate
        self._optim.step()
        self._updates += 1
        return engine_pb2.UpdateApplied(
            step=msg.step, learning_rate=msg.learning_rate, seconds=time.perf_counter() - t0
        )

    def export_state(self, msg: engine_pb2.ExportState, payload: Any = None) -> Reply:
        """A copy of the moment buffers and step counts keyed by parameter FQN (the slot
        ``optim``: the checkpoint does not depend on parameter order), stamped with ``msg``'s
        step and version. Raises RuntimeError if no model is attached."""
        if self._optim is None or self._model is None:
            raise RuntimeError("optimizer: no model attached, nothing to export")
        state = get_optimizer_state_dict(self._model, self._optim, options=self._options())
        slot = Slot.exported("optim", Module.L2_OPTIMIZER, msg, state)
        return Reply(slot.stamped(engine_pb2.StateExported(key="optim")), slot)

    def restore_state(self, msg: engine_pb2.RestoreState, payload: Slot) -> engine_pb2.StateRestored:
        """Copy the moments and step counts of ``payload`` (this module's slot, of the step,
        version and digest ``msg`` names) into the optimizer. torch's load keeps the tensors
        it is given where their device and dtype already fit: it is given the slot's own
        (read only), and each is then copied into the moment this optimizer already holds
        of that shape (a fresh copy where it holds none), so a restore needs no second copy
        of the moments beside the slot and the live ones (on a resume the live ones are the
        template's zeros: the peak stays the template plus the state).

        Raises:
            RuntimeError: no model attached.
            InconsistentSnapshot, SlotDigestMismatch: not this module's slot, not the one named,
                or its content changed since it was taken (nothing is copied).
        """
        if self._optim is None or self._model is None:
            raise RuntimeError("optimizer: no model attached, nothing to restore into")
        t0 = time.perf_counter()
        slot = restorable(payload, "optim", Module.L2_OPTIMIZER, msg)
        live = {p: dict(state) for p, state in self._optim.state.items()}
        set_optimizer_state_dict(self._model, self._optim, thaw(slot.state, clone=False), options=self._options())
        for p, state in self._optim.state.items():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                held = live.get(p, {}).get(key)
                if held is not None and _same_layout(held, value):
                    state[key] = held.copy_(value)  # into the live buffer: the slot stays as it was
                else:
                    state[key] = value.detach().clone()
        return slot.stamped(engine_pb2.StateRestored(key="optim", seconds=time.perf_counter() - t0))

    def _options(self) -> StateDictOptions:
        # Pipeline stages hold different parameters: the nested layout's param_groups list
        # would then collide across ranks in a DCP checkpoint (one rank's copy is kept), so a
        # stage keys everything by FQN (torchtitan's flatten_optimizer_state_dict).
        return StateDictOptions(flatten_optimizer_state_dict=getattr(self._model, "num_stages", 1) > 1)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` can be copied into ``a`` element for element (type, shape, dtype,
    device, and a DTensor's mesh and placements)."""
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return not hasattr(a, "placements") or (a.device_mesh == b.device_mesh and a.placements == b.placements)
