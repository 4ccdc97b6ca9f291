"""L3-2 operator adapter: which kernels the model runs with, in which compute dtype.

Receives: ``SelectOperators`` (from the forward unit, relaying the job spec's
``operators`` section: attention kernel, AdamW implementation, torch.compile on/off) and
``SetComputePrecision`` (from the mixed-precision manager). Publishes ``OperatorsReady``
(the whole selection: what was chosen, which SDPA backends are allowed, the dtype) to the
forward and backward units; the payload is an immutable :class:`Operators` handle that the
forward unit runs under.

Attention choices (the job's name -> what runs):
    math       the model's written-out attention (softmax(QK^T/sqrt(d) + mask) V)
    sdpa       F.scaled_dot_product_attention, PyTorch picks the kernel
    flash      SDPA restricted to SDPBackend.FLASH_ATTENTION (Dao et al. 2022)
    efficient  SDPA restricted to SDPBackend.EFFICIENT_ATTENTION (Rabe & Staats 2021, xFormers)
A restriction is a ``torch.nn.attention.sdpa_kernel`` context around the forward pass: if
the kernel cannot run, SDPA raises; it never falls back to another one. Whether a
restricted kernel exists here is checked once, when it is selected and again when the
dtype changes, by one causal SDPA call on a tiny [1, 1, 8, 64] input of the compute dtype
(CPU in torch 2.13: flash runs in fp32/bf16/fp16, efficient does not exist).

Choices are made only by those two commands (no auto-switching, no probing of the step's
workload). A choice this device cannot run is refused with a one-line error naming it.

Red lines kept (seed L3-2): no business computation, no gradients, no communication, never
switches on its own initiative.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from services.contract import engine_pb2
from services.contract.bus import Emitter, Reply
from services.contract.failures import FailureCause, Refusal

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Job spec attention choice -> (the model's kernel function, the SDPA backends allowed).
ATTENTION = {
    "math": ("math", ()),
    "sdpa": ("sdpa", ()),
    "flash": ("sdpa", ("FLASH_ATTENTION",)),
    "efficient": ("sdpa", ("EFFICIENT_ATTENTION",)),
}
ADAMW = ("fused", "foreach", "default")


class OperatorUnavailable(RuntimeError, Refusal):
    """A requested kernel or dtype does not exist on this device (a refusal: the same on
    every retry; the commander gets it as raised)."""

    fault_class = "operator_unavailable"
    failure_cause = FailureCause.FAILURE_UNSUPPORTED


@dataclass(frozen=True)
class Operators:
    """What the compute units run under.

    ``attention`` is the model's kernel function ("sdpa" | "math"), ``sdpa_backends`` the
    SDPBackend names SDPA is restricted to (empty: PyTorch's choice), ``dtype`` the
    autocast dtype ("float32": none), ``compile`` whether the forward runs through
    ``torch.compile``.
    """

    attention: str
    dtype: str
    device_type: str
    sdpa_backends: tuple[str, ...] = ()
    compile: bool = False
    _compiled: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Autocast for bfloat16/float16 (matmuls in the low dtype; reductions, softmax and
        parameters in float32, per torch.autocast's op lists), and the SDPA restriction."""
        with contextlib.ExitStack() as stack:
            if self.dtype != "float32":
                stack.enter_context(torch.autocast(self.device_type, dtype=_DTYPES[self.dtype]))
            if self.sdpa_backends:
                stack.enter_context(sdpa_kernel([getattr(SDPBackend, b) for b in self.sdpa_backends]))
            yield

    def prepare(self, module: torch.nn.Module) -> Any:
        """The callable to run ``module`` with: the module itself, with (``compile``) its
        regions compiled once per module (lazily, at the first call): :func:`compile_regions`."""
        if not self.compile:
            return module
        if id(module) not in self._compiled:
            self._compiled[id(module)] = compile_regions(module)
        return self._compiled[id(module)]


def compile_regions(module: torch.nn.Module) -> Any:
    """``module`` with each of its transformer blocks compiled in place (regional
    compilation, as torchtitan compiles each block): the blocks run the same code, so Dynamo
    traces and Inductor builds one block and the others reuse it. Compiling the whole model
    instead built every block's kernels: on an H200 the first step of the 1 B bench model took
    150 s against 16 s uncompiled (bench/results/gpu.json). The embedding, final norm and head
    stay eager. A module without ``blocks`` (the DDP wrapper's ``module`` is looked through) is
    compiled whole."""
    inner = module.module if isinstance(getattr(module, "module", None), torch.nn.Module) else module
    blocks = getattr(inner, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return torch.compile(module)
    for block in blocks:
        block.compile()  # in place: FSDP2's hooks on the block and the DDP wrapper stay as they are
    return module


class OperatorAdapter:
    """L3-2. ``device`` is the rank's device ("cpu", "cuda:0"), given at construction."""

    def __init__(self, emit: Emitter, device: str = "cpu"):
        self._emit = emit
        self._device = torch.device(device)
        self._attention = ""
        self._adamw = ""
        self._compile = False
        self._dtype = "float32"
        self._ops: Operators | None = None

    def select_operators(self, msg: engine_pb2.SelectOperators, payload: Any = None) -> Reply:
        """切换加速模式指令. Raises OperatorUnavailable for a kernel, AdamW implementation or
        compile request this device cannot run (the message names the job spec field)."""
        if msg.attention not in ATTENTION:
            raise OperatorUnavailable(
                f"operators.attention: {msg.attention!r} is not available; choose one of {sorted(ATTENTION)}"
            )
        self._check_attention(msg.attention, self._dtype)
        if msg.adamw:
            self._check_adamw(msg.adamw)
        if msg.compile:
            self._check_compile()
        self._attention, self._adamw, self._compile = msg.attention, msg.adamw, msg.compile
        return Reply(self._ready(), self._build())

    def set_compute_precision(self, msg: engine_pb2.SetComputePrecision, payload: Any = None) -> None:
        """张量精度转换指令. Raises OperatorUnavailable for a dtype this device lacks, or one
        the selected attention kernel cannot run in."""
        if msg.dtype not in _DTYPES:
            raise OperatorUnavailable(
                f"operator adapter: dtype {msg.dtype!r} is not supported; choose one of {sorted(_DTYPES)}"
            )
        if msg.dtype == "bfloat16" and self._device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise OperatorUnavailable(f"operator adapter: bfloat16 is not supported on {self._device}")
        if self._attention:
            self._check_attention(self._attention, msg.dtype)
        self._dtype = msg.dtype
        self._emit(self._ready(), self._build())

    # ------------------------------------------------------------------ checks

    def _check_attention(self, choice: str, dtype: str) -> None:
        backends = ATTENTION[choice][1]
        if not backends:
            return
        q = torch.zeros(1, 1, 8, 64, device=self._device, dtype=_DTYPES[dtype])
        try:
            with sdpa_kernel([getattr(SDPBackend, b) for b in backends]):
                functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise OperatorUnavailable(
                f"operators.attention: {choice} ({'+'.join(backends)}) is not available on {self._device} "
                f"in {dtype}: {reason}"
            ) from None

    def _check_adamw(self, adamw: str) -> None:
        if adamw not in ADAMW:
            raise OperatorUnavailable(f"operators.adamw: {adamw!r} is not available; choose one of {list(ADAMW)}")
        if adamw == "fused" and self._device.type not in _get_fused_kernels_supported_devices():
            raise OperatorUnavailable(f"operators.adamw: fused AdamW is not available on {self._device}")

    def _check_compile(self) -> None:
        # Inductor generates Triton on CUDA; without it torch.compile fails at the first
        # step, so refuse now. (On CPU it needs a C++ compiler, found only when it compiles.)
        if not torch._dynamo.is_dynamo_supported():
            raise OperatorUnavailable("operators.compile: torch.compile is not supported by this Python/torch")
        if self._device.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                raise OperatorUnavailable(
                    "operators.compile: torch.compile on CUDA needs triton, not installed"
                ) from None

    # ------------------------------------------------------------------ reports

    def _ready(self) -> engine_pb2.OperatorsReady:
        kernel, backends = ATTENTION.get(self._attention, ("", ()))
        return engine_pb2.OperatorsReady(
            attention=self._attention, dtype=self._dtype, adamw=self._adamw, compile=self._compile,
            kernel=kernel, sdpa_backends=list(backends), device=str(self._device),
        )  # fmt: skip

    def _build(self) -> Operators:
        kernel, backends = ATTENTION.get(self._attention, ("", ()))
        # One handle per selection, so a compiled wrapper survives a dtype change only if
        # nothing else changed (a new dtype retraces anyway).
        if self._ops is None or (self._ops.attention, self._ops.sdpa_backends, self._ops.compile, self._ops.dtype) != (
            kernel,
            backends,
            self._compile,
            self._dtype,
        ):
            self._ops = Operators(kernel, self._dtype, self._device.type, backends, self._compile)
        return self._ops
