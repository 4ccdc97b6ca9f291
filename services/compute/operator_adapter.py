"""L3-2 operator adapter: which attention kernel and which compute dtype the model runs in.

Receives: ``SelectOperators`` (from the forward unit, relaying the job spec's choice) and
``SetComputePrecision`` (from the mixed-precision manager). Publishes ``OperatorsReady``
to the forward and backward units; the payload is an immutable :class:`Operators`
handle (kernel name + autocast region) that they run under.

Choices are made only by those two commands (no auto-switching, no probing of the step's
workload). A choice this device cannot run is refused with a one-line error naming it.

Red lines kept (seed L3-2): no business computation, no gradients, no communication, never
switches on its own initiative.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from services.compute.model import ATTENTION_BACKENDS
from services.contract import engine_pb2
from services.contract.bus import Emitter, Reply

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class OperatorUnavailable(RuntimeError):
    """A requested kernel or dtype does not exist on this device."""

    fault_class = "operator_unavailable"


@dataclass(frozen=True)
class Operators:
    """What the compute units run under: the attention kernel name and the dtype region."""

    attention: str
    dtype: str
    device_type: str

    def region(self) -> contextlib.AbstractContextManager:
        """Autocast for bfloat16 (matmuls in bf16, reductions and params in fp32); nothing
        for float32."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.dtype])


class OperatorAdapter:
    """L3-2. ``device`` is the rank's device ("cpu", "cuda:0"), given at construction."""

    def __init__(self, emit: Emitter, device: str = "cpu"):
        self._emit = emit
        self._device = torch.device(device)
        self._attention = ""
        self._dtype = "float32"

    def select_operators(self, msg: engine_pb2.SelectOperators, payload: Any = None) -> Reply:
        """切换加速模式指令. Raises OperatorUnavailable for an unknown kernel."""
        if msg.attention not in ATTENTION_BACKENDS:
            raise OperatorUnavailable(
                f"operator adapter: attention {msg.attention!r} is not available; choose one of {ATTENTION_BACKENDS}"
            )
        self._attention = msg.attention
        return Reply(self._ready(), self._operators())

    def set_compute_precision(self, msg: engine_pb2.SetComputePrecision, payload: Any = None) -> None:
        """张量精度转换指令. Raises OperatorUnavailable for a dtype this device lacks."""
        if msg.dtype not in _DTYPES:
            raise OperatorUnavailable(f"operator adapter: dtype {msg.dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
        if msg.dtype == "bfloat16" and self._device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise OperatorUnavailable(f"operator adapter: bfloat16 is not supported on {self._device}")
        self._dtype = msg.dtype
        self._emit(self._ready(), self._operators())

    def _ready(self) -> engine_pb2.OperatorsReady:
        return engine_pb2.OperatorsReady(attention=self._attention, dtype=self._dtype)

    def _operators(self) -> Operators:
        return Operators(attention=self._attention, dtype=self._dtype, device_type=self._device.type)
