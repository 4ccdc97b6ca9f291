"""The job spec: one YAML file, validated once by pydantic, pushed down frozen.

Unknown keys are rejected with their path; every user mistake becomes one line that names
the file and the field (``demo.yaml: data.seq_len: Input should be greater than 0, got -4``).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
from collections.abc import Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.contract.failures import Refusal
from services.jobspec_errors import spec_error_text


class JobSpecError(ValueError, Refusal):
    """A job spec that cannot be used; the message is one line naming file and field."""


# Ranges (checked at submit, so that no value fails later, half-way through a job's start).
# Every spec integer travels in a proto field or an int64 tensor (LoopState) somewhere:
# none may exceed int64; fields carried as uint32 / int32 say so with their own bound.
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
# Floats: finite (no .inf / .nan: ConfigDict allow_inf_nan) and at most this in magnitude.
FLOAT_MAX = 1e15
# Durations (``*_seconds``): a deadline longer than this is a mistake (30 days), and
# longer than ``threading.TIMEOUT_MAX`` cannot even be armed.
SECONDS_MAX = 30 * 24 * 3600.0
# Tokens per micro-batch (seq_len x micro_batch_size): the data service packs them as two
# int32 arrays (inputs, labels) into one MicroBatch message, which gRPC caps at 64 MiB.
MICRO_BATCH_TOKENS_MAX = 2**22
# The shortest heartbeat period a rank may ask for (seconds): each beat is a message through
# its node agent to control, from every rank.
MIN_BEAT_SECONDS = 0.01


class _Strict(BaseModel):
    # strict: "120" is not an integer; a spec says what it means or is refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_in_range(cls, value: object, info) -> object:
        """The floor under every numeric field of every section, new ones included: an
        integer (alone, in a list or a mapping) fits int64; a float is at most FLOAT_MAX
        in magnitude, a ``*_seconds`` one at most SECONDS_MAX. Tighter bounds are on the
        fields themselves."""
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for v in items:
            if isinstance(v, bool):
                continue
            if isinstance(v, int) and not -I64_MAX - 1 <= v <= I64_MAX:
                raise ValueError(f"{v} does not fit a 64-bit integer (at most {I64_MAX})")
            if isinstance(v, float):
                top = SECONDS_MAX if (info.field_name or "").endswith("_seconds") else FLOAT_MAX
                if abs(v) > top:
                    what = f"{top:.0f} s (30 days)" if top == SECONDS_MAX else f"{top:g}"
                    raise ValueError(f"{v!r} is out of range (at most {what})")  # (repr: never rounded)
        return value


class RopeScaling(_Strict):
    """Llama 3.1 / 3.2's rewrite of the RoPE frequencies for long contexts (Meta's
    ``apply_scaling``, transformers' ``_compute_llama3_parameters``, HF config
    ``rope_scaling: {rope_type: llama3, ...}``): wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, longer than
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, and those
    between interpolated smoothly. Defaults: Llama 3.1's (Llama 3.2's factor is 32)."""

    type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0, le=1e6)
    low_freq_factor: float = Field(1.0, gt=0, le=1e6)
    high_freq_factor: float = Field(4.0, gt=0, le=1e6)
    original_max_position_embeddings: int = Field(8192, gt=0, le=I32_MAX)  # tokens

    @model_validator(mode="after")
    def _high_above_low(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:  # (the smoothing divides by their difference)
            raise ValueError(
                f"high_freq_factor: {self.high_freq_factor:g} must be greater than low_freq_factor "
                f"({self.low_freq_factor:g})"
            )
        return self


class ModelSpec(_Strict):
    """Decoder-only transformer (pre-norm, RoPE). Sizes in tokens / channels."""

    n_layers: int = Field(4, gt=0, le=I32_MAX)
    d_model: int = Field(128, gt=0, le=I32_MAX)
    n_heads: int = Field(4, gt=0, le=I32_MAX)
    # Grouped-query attention (Ainslie et al. 2023), HF ``num_key_value_heads``: the k and v
    # projections have n_kv_heads heads, each shared by n_heads / n_kv_heads query heads
    # (None: n_heads, multi-head attention; 1: multi-query attention).
    n_kv_heads: int | None = Field(None, gt=0, le=I32_MAX)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    # Hidden width of the MLP as a multiple of d_model. SwiGLU uses 2/3 of it per branch
    # (LLaMA, Touvron et al. 2023) so both choices cost the same FLOPs.
    mlp_ratio: float = Field(4.0, gt=0, le=1024)
    # The MLP hidden width itself (HF ``intermediate_size``); when set, mlp_ratio is not read.
    ffn_hidden: int | None = Field(None, gt=0, le=I32_MAX)
    # Biases on the q, k and v projections (Qwen2, HF ``attention_bias``); initialised to 0.
    qkv_bias: bool = False
    tie_embeddings: bool = True
    vocab_size: int = Field(256, gt=0, le=I32_MAX)  # token ids travel as int32
    # RoFormer (Su et al. 2021) default. Above 1: at theta <= 1 every pair of channels turns
    # by a radian or more per position, and positions alias.
    rope_theta: float = Field(10000.0, gt=1)
    rope_scaling: RopeScaling | None = None  # None: RoPE's frequencies as they are
    norm_eps: float = Field(1e-5, gt=0, le=1)
    init_std: float = Field(0.02, gt=0, le=1)  # GPT-2 initialisation (above 1 the logits blow up at step 0)
    # Kept for older specs; ``operators.attention`` is the place for the kernel choice
    # (both set and different is refused).
    attention: Literal["sdpa", "math"] = "sdpa"
    # Fine-tuning: parameters to keep frozen, as fnmatch patterns over their names
    # (``tok_emb.weight``, ``blocks.*.attn.*``; a tied weight matches by either name). A
    # frozen parameter gets no gradient and the optimizer keeps no state for it, so an
    # incremental checkpoint never writes it again. Checked against the model's parameter
    # names (:func:`model_parameters`) wherever a spec is validated, so at submit: a pattern
    # that matches nothing, or patterns that leave nothing to train, are refused.
    freeze: list[Annotated[str, Field(min_length=1, max_length=1024)]] = []

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even for RoPE")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} must divide n_heads ({self.n_heads})")
        return self

    @property
    def head_dim(self) -> int:
        """K: the width of one attention head (d_model / n_heads)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The k/v heads: ``n_kv_heads``, else ``n_heads``."""
        return self.n_kv_heads or self.n_heads

    @model_validator(mode="after")
    def _freeze_leaves_something_to_train(self, info: ValidationInfo) -> ModelSpec:
        # Not on a spec read back (STORED: a journal or checkpoint of a job submitted before
        # this rule; the shard loader applies it to the built model's names).
        if self.freeze and not (info.context or {}).get("stored"):
            frozen_parameters(self.freeze, ((name, owner) for name, owner, _ in model_parameters(self)))
        return self


def model_parameters(spec: ModelSpec) -> Iterator[tuple[str, str, int]]:
    """``(name, owner, numel)`` of every parameter of the model services/compute/model.py
    builds for ``spec``, in its ``named_parameters(remove_duplicate=False)`` order (a tied
    weight under both names; ``owner``: the name of the tensor it is, its first name).

    Here, without torch, so that a spec's ``freeze`` is checked wherever the spec is
    validated (control has no tensor library); tests/compute/test_freeze.py keeps it equal
    to the built model's names and sizes.
    """
    for name, owner, shape in model_parameter_shapes(spec):
        yield name, owner, math.prod(shape)


def model_parameter_shapes(spec: ModelSpec) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """``(name, owner, shape)`` of every parameter, as :func:`model_parameters` lists them:
    ``nn.Linear`` weights ``(out_features, in_features)``, the embedding ``(vocab_size,
    d_model)``, norm gains and biases 1-D (what a Hugging Face directory's tensors are
    checked against at submit, services/hf_config.py)."""
    V, D, F = spec.vocab_size, spec.d_model, mlp_hidden_width(spec)
    KV = spec.kv_heads * spec.head_dim  # the k and v projections' width
    yield "tok_emb.weight", "tok_emb.weight", (V, D)
    mlp = (("gate", (F, D)),) if spec.mlp == "swiglu" else ()
    for i in range(spec.n_layers):
        b = f"blocks.{i}."
        yield b + "attn_norm.weight", b + "attn_norm.weight", (D,)
        for proj, width in (("q", D), ("k", KV), ("v", KV)):  # (nn.Linear: weight, then bias)
            yield b + f"attn.{proj}.weight", b + f"attn.{proj}.weight", (width, D)
            if spec.qkv_bias:
                yield b + f"attn.{proj}.bias", b + f"attn.{proj}.bias", (width,)
        yield b + "attn.proj.weight", b + "attn.proj.weight", (D, D)
        yield b + "mlp_norm.weight", b + "mlp_norm.weight", (D,)
        for lin, shape in (*mlp, ("up", (F, D)), ("down", (D, F))):
            yield b + f"mlp.{lin}.weight", b + f"mlp.{lin}.weight", shape
    yield "norm.weight", "norm.weight", (D,)
    yield "lm_head.weight", "tok_emb.weight" if spec.tie_embeddings else "lm_head.weight", (V, D)


def frozen_parameters(patterns: Sequence[str], named: Iterable[tuple[str, Hashable]]) -> set[Hashable]:
    """The parameters ``patterns`` (``model.freeze``: fnmatch, case-sensitive) freeze, out of
    ``named``: ``(name, owner)`` pairs, a tied parameter under each of its names with one
    owner (the spec's :func:`model_parameters`, or a built model's names and tensors).

    Raises:
        ValueError, one line naming the field: ``freeze[i]: '<pattern>' matches no
            parameter (names look like: ...)``, with the names nearest to it; or
            ``freeze: [...] freezes all N parameters; nothing would train``.
    """
    named = list(named)
    frozen: set[Hashable] = set()
    for i, pattern in enumerate(patterns):
        hit = re.compile(fnmatch.translate(pattern)).match
        owners = {owner for name, owner in named if hit(name)}
        if not owners:
            names = list(dict.fromkeys(name for name, _ in named))[:2000]  # (a hint: bounded work)
            near = difflib.get_close_matches(pattern, names, n=4, cutoff=0.5) or names[:4]
            raise ValueError(f"freeze[{i}]: {pattern!r} matches no parameter (names look like: {', '.join(near)}, ...)")
        frozen |= owners
    every = {owner for _, owner in named}
    if every and frozen >= every:
        raise ValueError(
            f"freeze: {list(patterns)!r} freezes all {len(every)} parameters; nothing would train "
            "(leave at least one unfrozen)"
        )
    return frozen


class PrefetchSpec(_Strict):
    watermark: int = Field(256, gt=0, le=U32_MAX)  # documents read ahead
    threads: int = Field(2, gt=0, le=256)  # reader threads the data service starts


class FilterSpec(_Strict):
    min_tokens: int = Field(1, ge=0, le=U32_MAX)
    max_tokens: int = Field(0, ge=0, le=U32_MAX)  # 0: no upper bound
    banned_bytes: str = ""  # documents containing any of these characters are dropped
    banned_tokens: list[Annotated[int, Field(ge=0, le=U32_MAX)]] = []  # token ids (< model.vocab_size)


DATASET_PATTERN = r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+$"  # name@version


class MixtureItem(_Strict):
    """One dataset of ``data.mixture`` and its weight (the weights are normalised)."""

    dataset: str = Field(..., pattern=DATASET_PATTERN)
    weight: float = Field(..., gt=0, allow_inf_nan=False)


class DataSpec(_Strict):
    """The training data: one ``dataset`` (name@version), or a weighted ``mixture`` of
    several, blended row by row (services/data/blend.py), each with its own position."""

    dataset: str | None = Field(None, pattern=DATASET_PATTERN)
    mixture: list[MixtureItem] | None = None
    seq_len: int = Field(256, gt=0, le=U32_MAX)
    micro_batch_size: int = Field(8, gt=0, le=U32_MAX)  # rows per rank per micro-step
    grad_accum: int = Field(1, gt=0, le=U32_MAX)  # micro-steps per optimizer step
    shuffle: bool = True
    shuffle_seed: int = Field(1234, ge=0)
    pack: Literal["pack", "pad"] = "pack"
    pad_id: int = Field(0, ge=0, le=U32_MAX)  # a token id (< model.vocab_size)
    prefetch: PrefetchSpec = PrefetchSpec()
    filter: FilterSpec = FilterSpec()

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.dataset is not None and self.mixture is not None:
            raise ValueError("dataset and mixture both given: one or the other")
        if self.dataset is None and self.mixture is None:
            raise ValueError("dataset (name@version) or mixture (a list of {dataset, weight}) is required")
        if self.mixture is not None and not self.mixture:
            raise ValueError("mixture: empty; list at least one {dataset: NAME@VERSION, weight: W}")
        return self

    @model_validator(mode="after")
    def _micro_batch_fits_a_message(self) -> DataSpec:
        tokens = self.seq_len * self.micro_batch_size
        if tokens > MICRO_BATCH_TOKENS_MAX:
            raise ValueError(
                f"seq_len x micro_batch_size: {self.seq_len} x {self.micro_batch_size} = {tokens} tokens per "
                f"micro-batch; the data service sends at most {MICRO_BATCH_TOKENS_MAX} in one message"
            )
        return self

    @property
    def datasets(self) -> list[tuple[str, str, float]]:
        """(name, version, weight) of each dataset read: the mixture's, or the one at weight 1."""
        items = self.mixture if self.mixture is not None else [MixtureItem(dataset=self.dataset, weight=1.0)]
        return [(*i.dataset.split("@", 1), i.weight) for i in items]

    @property
    def name(self) -> str:
        """The dataset's name (a mixture's first component's: its tokenizer and vocabulary
        stand for the mixture's, whose components are checked against the model alike)."""
        return self.datasets[0][0]

    @property
    def version(self) -> str:
        return self.datasets[0][1]

    @property
    def label(self) -> str:
        """``name@version``, or the mixture's ``name@version*weight`` joined by ``+``."""
        if self.mixture is None:
            return self.dataset
        return "+".join(f"{i.dataset}*{i.weight:g}" for i in self.mixture)


class ParallelSpec(_Strict):
    """How the ranks split the work; world size = dp * tp * pp (validated against the
    model by :func:`services.engine.sharding_plan.plan`, which names the field at fault).

    ``data_parallel``: how the dp axis syncs gradients: ``ddp`` (DistributedDataParallel)
    or ``fsdp2`` (``fully_shard`` per block, then the root). ``microbatches`` is the number
    of pipeline micro-batches per micro-step (only read when pp > 1; 0: pp of them).
    """

    dp: int = Field(1, gt=0, le=U32_MAX)
    tp: int = Field(1, gt=0, le=U32_MAX)
    pp: int = Field(1, gt=0, le=U32_MAX)
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    activation_checkpointing: bool = False
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    microbatches: int = Field(0, ge=0, le=U32_MAX)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, else gloo
    threads_per_rank: int = Field(1, gt=0, le=1024)
    # Peak dense throughput of one device, only for the MFU estimate. 0: a known GPU's data
    # sheet bf16 figure, else measured at the rank's start (services/common/device_peaks.py).
    peak_tflops_per_device: float = Field(0.0, ge=0, le=1e6)


def mlp_hidden_width(spec: ModelSpec) -> int:
    """F for ``spec``: ``ffn_hidden`` when set, else mlp_ratio * D (GELU) or 2/3 of it
    rounded to a multiple of 8 (SwiGLU)."""
    if spec.ffn_hidden is not None:
        return spec.ffn_hidden
    if spec.mlp == "swiglu":
        return max(8, 8 * round(2 / 3 * spec.mlp_ratio * spec.d_model / 8))
    return max(1, round(spec.mlp_ratio * spec.d_model))


def check_parallel(model: ModelSpec, world_size: int, parallel: ParallelSpec) -> None:
    """The configurations L2-2's planner (services/engine/sharding_plan.py) refuses; here,
    at the bottom of the import graph, so the job spec refuses them when it is parsed.

    Raises:
        ValueError, one line naming the field: dp * tp * pp differs from ``world_size``;
            model.n_heads, model.n_kv_heads, model.d_model or the MLP hidden width not divisible by tp; ddp
            with tp > 1 (DDP does not shard DTensor parameters: use fsdp2); fewer layers
            than stages; tied embeddings with pp > 1 (the
            two ends of the tie would live on different stages); fewer micro-batches than
            stages under 1f1b.
    """
    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    if dp * tp * pp > U32_MAX:
        raise ValueError(f"parallel: dp ({dp}) * tp ({tp}) * pp ({pp}) = {dp * tp * pp} ranks, more than {U32_MAX}")
    if dp * tp * pp != world_size:
        raise ValueError(
            f"parallel: dp ({dp}) * tp ({tp}) * pp ({pp}) = {dp * tp * pp}, but the world has {world_size} ranks"
        )
    if tp > 1:
        if model.n_heads % tp:
            raise ValueError(f"parallel.tp: model.n_heads ({model.n_heads}) must be divisible by tp ({tp})")
        if model.kv_heads % tp:  # each tp rank holds whole k/v heads: those its query heads read
            raise ValueError(f"parallel.tp: model.n_kv_heads ({model.kv_heads}) must be divisible by tp ({tp})")
        if model.d_model % tp:
            raise ValueError(f"parallel.tp: model.d_model ({model.d_model}) must be divisible by tp ({tp})")
        hidden = mlp_hidden_width(model)
        if hidden % tp:
            field = "model.ffn_hidden" if model.ffn_hidden is not None else "from model.mlp_ratio"
            raise ValueError(f"parallel.tp: the MLP hidden width ({hidden}, {field}) must be divisible by tp ({tp})")
        if dp > 1 and parallel.data_parallel == "ddp":
            raise ValueError(
                "parallel.data_parallel: ddp cannot be combined with tp > 1 (DDP does not shard DTensor "
                "parameters, so their checkpoint would be wrong); use fsdp2"
            )
    if pp > 1:
        if model.n_layers < pp:
            raise ValueError(
                f"parallel.pp: model.n_layers ({model.n_layers}) must be >= pp ({pp}): every stage needs a block"
            )
        if model.tie_embeddings:
            raise ValueError(
                f"model.tie_embeddings: must be false when parallel.pp ({pp}) > 1 (embedding and LM head live on different stages)"
            )
        n_micro = parallel.microbatches or pp
        if parallel.pipeline_schedule == "1f1b" and n_micro < pp:
            raise ValueError(f"parallel.microbatches: 1f1b needs at least pp ({pp}) micro-batches, got {n_micro}")


class OptimizerSpec(_Strict):
    """AdamW; linear warmup then ``schedule`` (services/engine/lr_schedule.py): constant,
    linear or cosine decay to ``min_lr_ratio * lr``, or ``wsd`` (warmup-stable-decay: the
    last ``decay_ratio`` share of the steps decays, ``decay_shape`` linear or 1-sqrt).
    ``max_grad_norm``: clip the gradients to this global L2 norm (0: no clipping; the
    precision manager scales them, services/engine/mixed_precision.py)."""

    name: Literal["adamw"] = "adamw"
    # AdamW moves every weight by about lr a step: at 1 it overwrites weights of scale
    # init_std at once (schedules go up to it; 3e-3 .. 6e-4 is the usual range).
    lr: float = Field(3e-3, gt=0, le=1)
    weight_decay: float = Field(0.1, ge=0)  # decoupled: lr x weight_decay < 1 (checked below)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)  # GPT-3 / LLaMA setting
    eps: float = Field(1e-8, gt=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    schedule: Literal["constant", "linear", "cosine", "wsd"] = "cosine"
    decay_ratio: float = Field(0.2, gt=0, le=1)  # wsd only: the share of all steps that decays
    decay_shape: Literal["linear", "1-sqrt"] = "linear"  # wsd only
    max_grad_norm: float = Field(0.0, ge=0, le=1e9)  # 0: off (1.0 is GPT-3's / Llama's)

    @model_validator(mode="after")
    def _decay_keeps_the_sign(self) -> OptimizerSpec:
        # AdamW multiplies each weight by 1 - lr x weight_decay a step: at 1 or more the
        # "decay" zeroes or flips every weight at the peak learning rate.
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"weight_decay: lr x weight_decay = {self.lr:g} x {self.weight_decay:g} must be < 1 "
                "(AdamW multiplies every weight by 1 - lr x weight_decay each step)"
            )
        return self


class LossScaleSpec(_Strict):
    """Dynamic loss scaling for fp16 (the precision manager, L2-4, owns it).

    Defaults: ``init_scale`` 2**16, ``growth_factor`` 2, ``backoff_factor`` 0.5 and
    ``growth_interval`` 2000 are ``torch.amp.GradScaler``'s; ``hysteresis`` 2 and
    ``min_scale`` 1 are Megatron-LM's ``DynamicGradScaler`` (``--hysteresis``,
    ``--min-loss-scale``). Rule (Megatron's): an overflowing step spends one unit of
    hysteresis and backs the scale off (``* backoff_factor``, never below ``min_scale``)
    once none is left; ``growth_interval`` consecutive clean steps grow it
    (``* growth_factor``) and refill the hysteresis.
    """

    init_scale: float = Field(2.0**16, gt=0, le=2.0**32)  # (Megatron-LM starts at 2**32)
    growth_factor: float = Field(2.0, gt=1, le=2.0**16)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: int = Field(2000, gt=0)  # clean steps
    hysteresis: int = Field(2, gt=0, le=U32_MAX)  # overflows tolerated before a backoff (1: back off at once)
    min_scale: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _min_below_init(self) -> LossScaleSpec:
        if self.min_scale > self.init_scale:
            raise ValueError(f"min_scale ({self.min_scale:g}) must be <= init_scale ({self.init_scale:g})")
        return self


class PrecisionSpec(_Strict):
    """``fp32``; ``bf16`` autocast (loss scale 1); ``fp16`` autocast with dynamic loss
    scaling (``loss_scale``). A bare string (``precision: bf16``) means ``{dtype: bf16}``."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: LossScaleSpec | None = None  # fp16 only; None: the defaults

    @model_validator(mode="after")
    def _scaling_is_fp16_only(self) -> PrecisionSpec:
        if self.loss_scale is not None and self.dtype != "fp16":
            raise ValueError(f"loss_scale is only used with dtype fp16, got dtype {self.dtype}")
        return self

    @property
    def scaling(self) -> LossScaleSpec:
        return self.loss_scale or LossScaleSpec()


class OperatorsSpec(_Strict):
    """Kernels the operator adapter (L3-2) selects; it refuses one this device lacks.

    ``attention``: ``sdpa`` (PyTorch picks the SDPA kernel), ``flash`` / ``efficient``
    (SDPA restricted to that kernel with ``torch.nn.attention.sdpa_kernel``), ``math``
    (attention written out in the model); unset: ``model.attention``. ``adamw``: ``fused``
    (one kernel for all parameters), ``foreach`` (multi-tensor) or ``default`` (torch's
    choice). ``compile``: ``torch.compile`` the model's forward.
    """

    attention: Literal["sdpa", "flash", "efficient", "math"] | None = None
    adamw: Literal["fused", "foreach", "default"] = "fused"
    compile: bool = False


class CheckpointSpec(_Strict):
    # `async` is a Python keyword: the field is `async_`, spelled `async` in a job file.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    every_steps: int = Field(100, ge=0)  # 0: only at the end
    keep_last: int = Field(3, ge=0, le=U32_MAX)  # 0: keep all
    keep_every: int = Field(0, ge=0, le=U32_MAX)  # also keep versions whose step is a multiple of it (0: none)
    # Incremental saves: every Nth version is a full baseline, the versions between write only
    # the chunks that changed (services/state/chunk_store.py). 0 or 1: every version is full.
    baseline_every: int = Field(10, ge=0, le=U32_MAX)
    at_end: bool = True
    # Asynchronous save: the loop blocks only for the snapshot's copy; the write (dcp.save
    # from the store relay's thread) and the commit run in the background (the end of a run waits).
    async_: bool = Field(True, alias="async")


class SimulateSpec(_Strict):
    """Simulated ranks for the scale test bed (issue 27 item 7; ``bench/scale.py``): the node
    agent starts ``python -m services.rank.simulated`` instead of ``services.rank``, a
    torch-free rank that speaks the same RankSession, data and store protocols (it opens its
    real data stream and takes ``data.grad_accum`` micro-batches per step, and saves a real
    shard of ``shard_bytes`` per rank through the store at every checkpoint), with the
    model's compute replaced by a sleep of ``step_time_s`` seconds per step. Control sees an
    ordinary job. Simulated ranks never resume from a checkpoint (a relaunch that names
    one fails with config_error) and take data parallelism only (tp = pp = 1).
    """

    step_time_s: float = Field(0.1, ge=0, le=3600)
    shard_bytes: int = Field(4096, gt=0, le=64 << 20)  # one chunk (the store's streamed-chunk bound)


class IntegritySpec(_Strict):
    """Checks that the training state is right, not only intact (issue 29 item 3).

    ``replica_check_every_steps``: every N steps and at the last (after the update, before
    that step's evaluation and save) the data-parallel replicas' parameters are digested and compared
    (services/compute/replica_digest.py); a mismatch is the fault ``replica_divergence``,
    naming the tensor and the odd replica; the store's ``latest`` names only versions a check
    that agreed covers (services/store/checkpoint_manager/layout.py). 0: off. Default 100, the default
    ``checkpoint.every_steps``: every default save is covered by a check at its own step,
    and the check costs one read of the parameters and one all-gather of one float64 per
    tensor per 100 steps (measured 0.7 % of step time at N = 10 on the test model: README.md,
    "Silently wrong ranks").
    """

    replica_check_every_steps: int = Field(100, ge=0, le=U32_MAX)


class EvalSpec(_Strict):
    every_steps: int = Field(100, ge=0)  # 0: only at the end
    batches: int = Field(8, gt=0, le=U32_MAX)  # micro-batches per rank per evaluation
    at_end: bool = True


class WandbSpec(_Strict):
    # A W&B run per job, written by the store's metrics logger (L5-2) under the job's metrics
    # directory; offline only: `wandb sync <dir>` uploads it from a machine that may.
    project: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    mode: Literal["offline"] = "offline"


class MetricsSpec(_Strict):
    """Where a job's metrics go besides the store's JSONL file and Prometheus (same raw values)."""

    tensorboard: bool = False  # TensorBoard event files under the job's metrics directory
    wandb: WandbSpec | None = None
    # A `step N loss ... lr ... grad_norm ... tok/s ...` line in the rank logs every N steps
    # and at the last step (0: none).
    log_every: int = Field(10, ge=0, le=U32_MAX)


WEBHOOK_URL_MAX = 2048  # characters
WEBHOOK_PATTERN = r"^https?://[^\s/?#]+[^\s]*$"


class NotifySpec(_Strict):
    """Who hears of the job's end: control POSTs a small JSON (job id, name, outcome, step,
    message) to ``webhook`` when the job ends with an outcome in ``outcomes``, from its one sender
    thread, with a timeout; a failed POST is logged and counted
    (``surge_webhook_failures_total``), never retried and never changes the job. None: the
    stack's webhook (control's ``--webhook`` / SURGE_CONTROL_WEBHOOK), if any."""

    webhook: str | None = Field(None, pattern=WEBHOOK_PATTERN, max_length=WEBHOOK_URL_MAX)
    outcomes: list[Literal["FINISHED", "FAILED", "STOPPED"]] = Field(["FINISHED", "FAILED"], min_length=1, max_length=3)


# skip_step: the training loop skips the step's update on every rank and goes on (only for
# the step faults of STEP_FAULT_CLASSES).
# skip_save: a save a destination refused (SAVE_FAULT_CLASSES) is given up; the ranks train on
# and the next checkpoint interval saves again (services/control/fault_decision.py).
# pause: the job is PAUSED, its ranks gone and every checkpoint kept, for `surgectl resume` (only
# for PAUSE_CLASSES: a data service down past data_outage_seconds, a dataset shard changed).
FaultAction = Literal[
    "ignore", "skip_step", "skip_save", "restart_ranks", "rollback", "exclude_node", "rebuild", "shrink", "replace",
    "pause", "stop",
]  # fmt: skip
# pause: the ranks end and the job is PAUSED (not FAILED), every checkpoint kept, its message
# the fault's one line and what to do; an operator's resume relaunches it from its newest
# checkpoint (services/control/fault_decision.py).
# rebuild (issue 16): the lost rank is replaced and the survivors keep their processes: they
# rebuild the process group in place and the replacement takes its state from a live peer's
# memory (services/control/fault_decision.py). It applies to the loss of a rank (these
# classes); a job whose state is not whole on a data-parallel peer cannot take it
# (rebuild_refusal). shrink: a rebuild that, when no slot is free for a replacement (a node
# lost, no spare), goes on at the largest data-parallel size the remaining ranks allow, on the
# same global batches, and grows back when slots return.
IN_PLACE_ACTIONS = ("rebuild", "shrink")
REBUILD_CLASSES = (
    "rank_exit", "rank_silent", "rank_stalled", "worker_lost", "worker_departed", "comm_error", "slow_rank",
)  # fmt: skip
# A slow rank (issue 29 item 2: computing >= 1.5x the job's median per step, sustained; the
# fault detector's slow_ranks.py) trains on at its pace unless the policy says otherwise:
# ignore (report it: event, status, metric), replace (a rebuild in place that ends it and
# starts its replacement on another node, its own left out of the job: the survivors keep
# training and it heals from a live peer, one step replayed at most), or shrink (the same, and
# without a free slot elsewhere the job goes on at a smaller data-parallel size).
SLOW_RANK_ACTIONS = ("ignore", "replace", "shrink")
# Step faults: found by the training loop in a step's all-rank values (every rank finds the same
# one at the same step). The loop blocks at that step and L1-1 decides by the class's action
# (services/control/fault_decision.py), every action valid: ignore applies the step as it is,
# skip_step skips its update (for overflow_storm: both go on with the step skipped and the count
# restarted), rollback / restart_ranks / exclude_node relaunch the ranks from the newest
# checkpoint (one before the step: it was not applied), stop fails the job.
STEP_FAULT_CLASSES = ("non_finite_loss", "gradient_overflow", "overflow_storm", "loss_scale_at_minimum")
# Save faults: a checkpoint save whose bytes a destination refused (a full disk, a quota, a
# permission, a read-only filesystem, an I/O error; typed from the errno where the write
# failed). The ranks have trained on; skip_save records it and they go on (the next interval
# saves again, the versions before are intact), stop ends the job FAILED with them kept, a
# relaunch resumes from the newest one.
SAVE_FAULT_CLASSES = ("checkpoint_write_failed",)
# A data service down (its address unreachable, the ranks' relays reconnecting) is no training
# fault: the job waits for it up to fault_policy.data_outage_seconds, then the class's action
# decides (pause by default: resumable once the service is up; stop: FAILED).
DATA_OUTAGE = "data_outage"
# ... and a dataset version whose bytes changed under the job (issue 29 item 7): a relaunch
# would meet the same shard again, so the job waits for an operator.
PAUSE_CLASSES = (DATA_OUTAGE, "data_corrupt")
FAULT_GRADES = ("MINOR", "MEDIUM", "SEVERE", "FATAL")
# The orchestrator's defaults, by fault class first, then by grade (a class not listed).
# restart_ranks resumes from the newest checkpoint (from scratch if none); rollback from the
# newest one not after the faulting step that verifies (older ones if it does not).
DEFAULT_CLASS_ACTIONS: dict[str, str] = {
    "rank_exit": "restart_ranks",
    "rank_silent": "restart_ranks",
    "rank_stalled": "restart_ranks",
    "comm_error": "restart_ranks",
    "port_in_use": "restart_ranks",
    # A lost node agent has withdrawn its slots: a relaunch cannot land there while it is
    # gone, and when it comes back (restarted in place, the stack brought up again) it is
    # a worker like any other. exclude_node stays available to leave a flaky node out.
    "worker_lost": "restart_ranks",
    # The node agent was asked to leave (SIGTERM, `surgectl restart worker-N`): its ranks
    # are relaunched elsewhere, or on it once it is back (never while it is leaving).
    "worker_departed": "restart_ranks",
    # A recovery step that waited past the policy's deadline (store_wait_seconds,
    # capacity_wait_seconds): the job ends FAILED with every checkpoint kept, to be resumed.
    "store_unreachable": "stop",
    "no_capacity": "stop",
    # The relaunched ranks did not all report ready within restore_seconds.
    "recovery_timeout": "restart_ranks",
    "non_finite_loss": "rollback",
    # An fp16 overflow is what dynamic loss scaling expects: skip, back off, go on.
    "gradient_overflow": "skip_step",
    "loss_scale_at_minimum": "rollback",
    "overflow_storm": "rollback",
    "checkpoint_error": "rollback",
    "checkpoint_write_failed": "skip_save",
    # A shard of the job's dataset version no longer holds the bytes its manifest pinned (a
    # file rewritten on disk under the running job, found at its next read or at resume: issue
    # 29 item 7). A relaunch would read the same wrong bytes: the job pauses naming the version
    # and the shard, for an operator to put the files back (or prepare a new version) and resume.
    "data_corrupt": "pause",
    # A device of the node failed (an uncorrectable ECC error, a fatal Xid: the node agent's
    # NVML sampler): its ranks are relaunched without that node, which would fail them again.
    "device_error": "exclude_node",
    # A rank's exit by its cause (the node agent's evidence: services/worker/exit_cause.py):
    # killed by the OOM killer (its cgroup's oom_kill count rose), or MemoryError (the rank's
    # exit code 75). Relaunched once with the same configuration (DEFAULT_CLASS_RESTARTS); a
    # second one pauses the job with a hint (fault_decision.py MEMORY_CLASSES), never FAILED:
    # the same model on the same devices runs out again until its configuration changes.
    # Any other exit (an error code, a signal that was no OOM kill) is rank_exit.
    "rank_oom": "restart_ranks",
    "rank_memory_error": "restart_ranks",
    # Data-parallel replicas found different (integrity.replica_check_every_steps): back to
    # the newest version at or before the last check that agreed (services/control/fault_decision.py).
    "replica_divergence": "rollback",
    # A replaced incarnation of a rank (stopped past its timeout, replaced, continued) was
    # refused by a fenced service (issue 29 item 4): its replacement runs and its node agent
    # ends it; nothing to decide.
    "rank_fenced": "ignore",
    "slow_rank": "ignore",  # reported (event, status, metric), the job trains on
    # A collective stalled (or failed) while its ranks still beat and a data-plane link between
    # their nodes was down (both node agents hear nothing of each other, while both reach
    # control): recovered like a lost node, without one of the link's two nodes (the one with
    # more links down; a tie leaves out the one not hosting rank 0: fault_decision.link_endpoint).
    "link_down": "exclude_node",
    # The data service stayed unreachable for fault_policy.data_outage_seconds (the job waited,
    # its ranks alive): PAUSED with every checkpoint kept, `surgectl resume` once it is up.
    DATA_OUTAGE: "pause",
}
# Restart budgets by class where the default (``max_restarts``) does not fit; a job's
# ``restarts`` entry wins. One relaunch with the same configuration for running out of memory.
DEFAULT_CLASS_RESTARTS: dict[str, int] = {"rank_oom": 1, "rank_memory_error": 1}
# Every fault class control can report (and a policy can name): the fault detector's rules
# (services/control/fault_detector/rules.py DEFAULT_RULES, FAILURE_CLASSES, ALIASES), the classes a
# failure exception carries (``fault_class``), and the orchestrator's recovery-wait classes.
# jobspec is below control (import-linter), so the list lives here;
# tests/test_fault_classes_known.py fails when control can report a class it lacks.
KNOWN_FAULT_CLASSES: frozenset[str] = frozenset(
    {
        *DEFAULT_CLASS_ACTIONS,
        *STEP_FAULT_CLASSES,
        "rank_exit_clean",
        "rank_released",
        "agent_silent",  # a node's report (no job): L1-1 holds the worker out of placement
        "slow_rank_cleared",
        "rank_stalled_in_collective",
        "loop_failure",
        "internal_error",
        "boundary_violation",
        "checkpoint_integrity",
        "data_unavailable",
        "data_exhausted",
        "operator_unavailable",
        "model_error",
        "config_error",
        "config_frozen",
        "session_lost",
        "out_of_memory",
        "io_error",
        "timeout",
        "unavailable",
        "data_corrupt",
        "data_io_error",
        "snapshot_failed",
        "log_write_failed",
        "recovery_failed",
        "device_degraded",
        "rank_log_flood",  # a warning: the rank's log is rotated at its bound (issue 29 item 8)
        "memory_copy_skipped",  # a warning: the next save tries its memory copy again
        "link_degraded",  # a warning: a data-plane link loses probes (one way or both)
    }
)
DEFAULT_GRADE_ACTIONS: dict[str, str] = {
    "MINOR": "ignore",
    "MEDIUM": "ignore",
    "SEVERE": "restart_ranks",
    "FATAL": "stop",
}


class FaultPolicySpec(_Strict):
    """What the orchestrator does about a graded fault (one decision per incident).

    ``actions`` maps a fault class (``rank_exit``, ``non_finite_loss``, ...) or a grade
    (``MINOR`` .. ``FATAL``) to an action; a class entry wins over a grade entry, and both
    over the defaults above. Every relaunch (restart_ranks, rollback, exclude_node) spends one
    restart of the fault class's budget (``restarts[class]``, else DEFAULT_CLASS_RESTARTS,
    else ``max_restarts``); an exhausted budget stops the job FAILED, except running out of
    memory (``rank_oom``, ``rank_memory_error``: 1 by default), which pauses it with a hint.
    """

    actions: dict[str, FaultAction] = {}
    max_restarts: int = Field(3, ge=0, le=U32_MAX)
    restarts: dict[str, Annotated[int, Field(le=U32_MAX)]] = {}  # (>= 0: checked below, naming the class)
    # K consecutive skipped (overflowing) steps; counted in a uint32 (StepFaultReported.consecutive_skips)
    overflow_storm_steps: int = Field(8, gt=0, le=U32_MAX)
    # How long a recovery waits (seconds) before the policy decides: for the store to answer
    # its verification (``store_unreachable``), for enough free slots to relaunch the ranks
    # (``no_capacity``), and for the relaunched ranks to restore and report ready
    # (``recovery_timeout``). Waiting loses nothing: the job stays FAULT_FROZEN, its status
    # says what it waits for, and no checkpoint is struck.
    store_wait_seconds: float = Field(600.0, gt=0, le=7 * 86400)
    capacity_wait_seconds: float = Field(600.0, ge=0, le=7 * 86400)
    restore_seconds: float = Field(600.0, gt=0, le=7 * 86400)
    # The same bound for a rebuild in place (``rebuild``, ``shrink``): every rank of the new
    # group (survivors and replacements) ready within it, else ``recovery_timeout``. Shorter:
    # a survivor reaches the new rendezvous in seconds unless it is blocked in a wait its
    # lost peer's death does not end, and the fallback (restart_ranks) loses little.
    rebuild_seconds: float = Field(120.0, gt=0, le=7 * 86400)
    # How long a training loop blocked on a step fault waits for L1-1's verdict before it says
    # so (seconds): it reports the fault again and keeps waiting (it never decides itself);
    # the report reaches a restarted control, which decides then.
    verdict_seconds: float = Field(30.0, gt=0, le=7 * 86400)
    # What a relaunch does when no committed checkpoint of the job verifies (none saved yet,
    # or every one struck): start the ranks from step 0 (the default: the job's earlier
    # behaviour), or stop the job FAILED, keeping whatever the store holds for an operator
    # (services/control/fault_decision.py: ``no_checkpoint``).
    no_checkpoint: Literal["restart_from_scratch", "stop"] = "restart_from_scratch"
    # How long the job waits for a data service that cannot be reached (seconds): its ranks stay
    # alive, their streams reconnecting with backoff, and continue at the batch where they
    # stopped when it is back (`surgectl up` starts it, or `surgectl restart data`); past it the
    # policy decides ``data_outage`` (default: pause). 5 minutes covers a restart by hand or by a
    # container's restart policy; a data service gone for longer wants an operator.
    data_outage_seconds: float = Field(300.0, gt=0, le=7 * 86400)
    # Inspect before acting (issue 29 item 9): a fault whose decision relaunches the ranks holds
    # them alive and idle (FreezeTraining) this long before the decided action runs, so an
    # operator can look at them (py-spy, logs); `surgectl thaw JOB` runs it at once, `surgectl
    # stop JOB` ends the job. 0 (the default): the decision runs at once. ``freeze_classes``:
    # the fault classes it applies to (empty: every class).
    freeze_seconds: float = Field(0.0, ge=0, le=7 * 86400)
    freeze_classes: list[str] = []

    @model_validator(mode="after")
    def _known_keys(self) -> FaultPolicySpec:
        for key in self.freeze_classes:
            if key not in KNOWN_FAULT_CLASSES:
                raise ValueError(
                    f"freeze_classes: {key}: unknown fault class (known: {', '.join(sorted(KNOWN_FAULT_CLASSES))})"
                )
        for table, name in ((self.actions, "actions"), (self.restarts, "restarts")):
            for key in table:
                if key not in FAULT_GRADES and key not in KNOWN_FAULT_CLASSES:
                    raise ValueError(
                        f"{name}.{key}: unknown fault class (known: {', '.join(FAULT_GRADES)}, "
                        f"{', '.join(sorted(KNOWN_FAULT_CLASSES))})"
                    )
        for key, action in self.actions.items():
            if key == "slow_rank" and action not in SLOW_RANK_ACTIONS:
                raise ValueError(f"actions.slow_rank: must be one of {', '.join(SLOW_RANK_ACTIONS)}, got {action}")
            if action == "replace" and key != "slow_rank":
                raise ValueError(f"actions.{key}: replace applies only to slow_rank (a lost rank: rebuild)")
            if action in IN_PLACE_ACTIONS and key not in REBUILD_CLASSES:  # (a grade holds other faults too)
                raise ValueError(f"actions.{key}: {action} applies only to a lost rank ({', '.join(REBUILD_CLASSES)})")
            if action == "skip_step" and key not in STEP_FAULT_CLASSES:
                raise ValueError(f"actions.{key}: skip_step applies only to {', '.join(STEP_FAULT_CLASSES)}")
            if action == "skip_save" and key not in SAVE_FAULT_CLASSES:
                raise ValueError(f"actions.{key}: skip_save applies only to {', '.join(SAVE_FAULT_CLASSES)}")
            if action == "pause" and key not in PAUSE_CLASSES:
                raise ValueError(f"actions.{key}: pause applies only to {', '.join(PAUSE_CLASSES)}")
        for key, n in self.restarts.items():
            if n < 0:
                raise ValueError(f"restarts.{key} must be >= 0, got {n}")
        return self

    def action_for(self, fault_class: str, grade: str) -> str:
        """The action for a fault of ``fault_class`` graded ``grade`` (a FaultGrade name)."""
        for table, key in ((self.actions, fault_class), (self.actions, grade), (DEFAULT_CLASS_ACTIONS, fault_class)):
            if key in table:
                return table[key]
        return DEFAULT_GRADE_ACTIONS.get(grade, "stop")

    def step_action(self, fault_class: str) -> str:
        """The action for a step fault of ``fault_class`` (one of STEP_FAULT_CLASSES), or a
        ``slow_rank``: the class's entry in ``actions``, else the default table. Grades do not
        apply: a step fault is not graded (the loop reports it to L1-1 directly), a slow rank
        fails nothing."""
        return self.actions.get(fault_class, DEFAULT_CLASS_ACTIONS[fault_class])

    @property
    def rebuilds(self) -> bool:
        """Whether some fault is rebuilt in place: the ranks then keep their processes when
        their group breaks, waiting for L1's decision (InitJob.rebuild_in_place)."""
        return any(a in IN_PLACE_ACTIONS or a == "replace" for a in self.actions.values())

    def freezes(self, fault_class: str) -> float:
        """How long a fault of ``fault_class`` holds the ranks before its decided relaunch
        runs (seconds; 0: not held)."""
        if not self.freeze_classes or fault_class in self.freeze_classes:
            return self.freeze_seconds
        return 0.0

    def budget_for(self, fault_class: str) -> int:
        """Relaunches allowed for ``fault_class`` in one job: ``restarts[class]``, else the
        class's default (DEFAULT_CLASS_RESTARTS), else ``max_restarts``."""
        return self.restarts.get(fault_class, DEFAULT_CLASS_RESTARTS.get(fault_class, self.max_restarts))


PHASE_SECONDS_MAX = 7 * 24 * 3600.0  # a week: longer is a typo, not a budget


class PhaseSecondsSpec(_Strict):
    """Progress budgets of the phases that are slow by nature (seconds; ``liveness.phase_seconds``).

    ``evaluation``: the floor of an evaluation's budget (0: ``stall_min_seconds``), to which
    ``stall_step_factor`` x the median evaluation-batch time x ``eval.batches`` is added.
    ``checkpoint_staging``: copying a checkpoint's state out and committing it.
    ``compile``: the first step of a ``operators.compile`` job (forward and backward compile).
    Each budget restarts whenever the phase's progress advances (an evaluation batch done).
    """

    evaluation: float = Field(0.0, ge=0, le=PHASE_SECONDS_MAX)
    checkpoint_staging: float = Field(600.0, gt=0, le=PHASE_SECONDS_MAX)
    compile: float = Field(900.0, gt=0, le=PHASE_SECONDS_MAX)


class LivenessSpec(_Strict):
    """Deadlines the fault detector keeps on every rank, reset by its heartbeats (seconds).

    A rank beats every ``heartbeat_interval_seconds`` from a side thread; silent for
    ``heartbeat_timeout_seconds``: declared silent, unless its node agent states that its
    process runs (not stopped by a signal): then its beats are late, not gone (a loaded host,
    a slow relay), and it is declared silent after ``heartbeat_timeout_running_seconds``. A
    process its agent states stopped (SIGSTOP, ^Z, a debugger's stop) has
    ``heartbeat_timeout_seconds`` counted from the stop: a stop explains a silence, it never
    shortens it (a shorter stop is no fault); stopped for good, it is declared within the
    timeout plus one beat period after its last beat. (A cgroup freeze is no stop ``waitid``
    reports: the process stays stated running.) Each beat says the rank's phase (data
    wait, forward, backward, collective, optimizer, evaluation, checkpoint staging,
    compile). Beating but no progress (no new step, phase or unit of the phase) for the
    phase's budget: stalled. The budget of a training step's phases is
    max(``stall_min_seconds``, ``stall_step_factor`` x median step time); evaluation,
    checkpoint staging and compile have theirs (``phase_seconds``). A rank stalled while it
    waits in a collective is ``rank_stalled_in_collective``: a consequence of the peer that
    stopped outside one. A communication error waits ``attribution_seconds`` for the fault
    that caused it (a peer's death), so the survivor is not blamed. A collective waits for a
    peer at most ``collective_timeout_seconds`` (the process group's timeout; 0: derived from
    these deadlines, at least 60 s: services/engine/parallel_strategy.collective_timeout_s).
    """

    heartbeat_interval_seconds: float = Field(1.0, gt=0)
    heartbeat_timeout_seconds: float = Field(3.0, gt=0)
    heartbeat_timeout_running_seconds: float = Field(15.0, gt=0)
    stall_min_seconds: float = Field(30.0, gt=0)
    stall_step_factor: float = Field(5.0, gt=0, le=10_000)  # (a step 10^4 x the median is stalled)
    attribution_seconds: float = Field(1.0, ge=0)
    collective_timeout_seconds: float = Field(0.0, ge=0, le=PHASE_SECONDS_MAX)
    phase_seconds: PhaseSecondsSpec = PhaseSecondsSpec()

    @model_validator(mode="after")
    def _timeout_covers_beats(self) -> LivenessSpec:
        if self.heartbeat_timeout_seconds < 2 * self.heartbeat_interval_seconds:
            raise ValueError(
                f"heartbeat_timeout_seconds ({self.heartbeat_timeout_seconds}) must be at least twice "
                f"heartbeat_interval_seconds ({self.heartbeat_interval_seconds})"
            )
        if self.heartbeat_timeout_running_seconds < self.heartbeat_timeout_seconds:
            raise ValueError(
                f"heartbeat_timeout_running_seconds ({self.heartbeat_timeout_running_seconds}) must be at least "
                f"heartbeat_timeout_seconds ({self.heartbeat_timeout_seconds})"
            )
        return self


# A checkpoint version of another job: "<job_id>:<n>" or "<job_id>:latest" (the store's forms).
_VERSION = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}:(?:[0-9]{1,19}|latest)$"


class InitFromSpec(_Strict):
    """Start from existing weights instead of ``seed``'s initialisation (fine-tuning, a fork):
    exactly one of

    * ``checkpoint``: a committed Surge version (``<job_id>:<n>`` or ``<job_id>:latest``) whose
      model has this spec's architecture; ``load``: ``weights`` (the model only: a fresh
      optimizer) or ``weights+optimizer`` (its AdamW moments too);
    * ``hf``: the absolute path of a Hugging Face Llama or Qwen2 directory (config.json and
      ``*.safetensors``), read by every rank on its own node (a shared or copied path, like
      ``SURGE_HOME``); the fields of ``model:`` the spec leaves out that describe the
      architecture are taken from its config (no ``model:`` section: all of them), those it
      writes must agree with it (:func:`parse_job_spec`).

    The job starts at step 0 with a fresh data position and LR schedule either way; a job
    that resumes from a checkpoint of its own (a pause, a recovery) loads that instead.
    Mapping and checks: services/compute/hf_format.py; the load: the training loop's start.
    """

    checkpoint: Annotated[str, Field(max_length=160)] | None = None
    load: Literal["weights", "weights+optimizer"] = "weights"
    hf: Annotated[str, Field(min_length=1, max_length=4096)] | None = None

    @field_validator("checkpoint")
    @classmethod
    def _a_version(cls, value: str | None) -> str | None:
        if value is not None and not re.match(_VERSION, value):
            raise ValueError(f'expected a checkpoint version "<job_id>:<n>" or "<job_id>:latest", got {value!r}')
        return value

    @model_validator(mode="after")
    def _one_source(self) -> InitFromSpec:
        if (self.checkpoint is None) == (self.hf is None):
            raise ValueError("set exactly one of checkpoint (a version <job_id>:<n>) or hf (a directory)")
        if self.hf is not None:
            if not self.hf.startswith("/"):
                raise ValueError(f"hf: {self.hf!r} must be an absolute path (the ranks read it on their node)")
            if self.load != "weights":
                raise ValueError(
                    f"load: {self.load} needs a Surge checkpoint (a Hugging Face directory holds weights only)"
                )
        return self


def rebuild_refusal(spec: JobSpec, *, structural: bool = False) -> str:
    """Why ``spec``'s ranks cannot rebuild their group in place ("" when they can): the
    replacement of a lost rank takes its whole state from a live peer, so every rank must
    hold a whole replica (data parallelism alone: DDP, no FSDP2, TP or PP shards) and there
    must be a peer (dp >= 2). ``structural``: the plan alone (checked at submit; the dp
    size may change by an operator's resume, so dp >= 2 is the decision's to check)."""
    p = spec.parallel
    if p.tp > 1 or p.pp > 1:
        return f"needs tp = pp = 1 (a lost rank's tp/pp shard is on no live peer; this job has tp {p.tp}, pp {p.pp})"
    if p.dp > 1 and p.data_parallel != "ddp":
        return f"needs data_parallel ddp (with {p.data_parallel} a lost rank's shard is on no live peer)"
    if p.dp < 2 and not structural:
        return "needs dp >= 2 (a lost rank heals from a live peer)"
    return ""


class LinksSpec(_Strict):
    """The data-plane links between the job's nodes (issue 29 item 5, "cut links").

    Each node agent probes its peers among the job's nodes (its ring neighbours and rank 0's
    node) every ``probe_seconds`` with a UDP echo (services/worker/link_probe.py). A link both
    ends hear nothing on for ``down_probes`` probes is down: ``link_down`` once it stayed down
    for the job's ``liveness.heartbeat_timeout_seconds`` while both node agents and every rank
    beat, or earlier when a collective of ranks that still beat stalls (or fails) across it.
    One that loses ``degraded_loss`` of
    its probes or more, either way, is degraded (``link_degraded``, a warning). A cut is seen
    ``down_probes`` x ``probe_seconds`` after it, plus one period at most.
    """

    probe_seconds: float = Field(1.0, ge=0.05, le=60.0)  # (0.05 s: 20 packets a second per peer at most)
    down_probes: int = Field(3, ge=2, le=100)
    degraded_loss: float = Field(0.2, gt=0, lt=1)


class JobSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    steps: int = Field(..., gt=0)
    seed: int = Field(0, ge=0)
    model: ModelSpec = ModelSpec()
    data: DataSpec
    parallel: ParallelSpec = ParallelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: PrecisionSpec = PrecisionSpec()
    operators: OperatorsSpec = OperatorsSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = EvalSpec()
    integrity: IntegritySpec = IntegritySpec()
    fault_policy: FaultPolicySpec = FaultPolicySpec()
    liveness: LivenessSpec = LivenessSpec()
    links: LinksSpec = LinksSpec()
    init_from: InitFromSpec | None = None
    metrics: MetricsSpec = MetricsSpec()
    notify: NotifySpec = NotifySpec()
    simulate: SimulateSpec | None = None  # the scale test bed's simulated ranks (SimulateSpec)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_string(cls, value: object) -> object:
        # `precision: bf16` (the older form) is `precision: {dtype: bf16}`.
        return {"dtype": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_attention_choice(self) -> JobSpec:
        chosen = self.operators.attention
        # model.attention at its default says nothing (and a spec's JSON form carries it).
        if chosen is not None and self.model.attention != "sdpa" and chosen != self.model.attention:
            raise ValueError(
                f"operators.attention ({chosen}) and model.attention ({self.model.attention}) disagree; "
                "set operators.attention only"
            )
        return self

    @model_validator(mode="after")
    def _deadlines_can_be_met(self) -> JobSpec:
        # (Next to LivenessSpec's own rule that the silence deadline covers two beats.)
        live = self.liveness
        if live.heartbeat_interval_seconds < MIN_BEAT_SECONDS:
            raise ValueError(
                f"liveness.heartbeat_interval_seconds: {live.heartbeat_interval_seconds:g} s is shorter than a rank's "
                f"beat thread can keep and control can take from every rank (at least {MIN_BEAT_SECONDS:g} s)"
            )
        if live.stall_min_seconds < 2 * live.heartbeat_interval_seconds:
            raise ValueError(
                f"liveness.stall_min_seconds: {live.stall_min_seconds:g} s cannot be met: step progress is heard in "
                f"heartbeats, every {live.heartbeat_interval_seconds:g} s; it must be at least two of them "
                f"({2 * live.heartbeat_interval_seconds:g} s)"
            )
        return self

    @model_validator(mode="after")
    def _token_ids_in_vocabulary(self) -> JobSpec:
        vocab, d = self.model.vocab_size, self.data
        if d.pad_id >= vocab:
            raise ValueError(f"data.pad_id: {d.pad_id} is not a token id of model.vocab_size {vocab} (0..{vocab - 1})")
        outside = [t for t in d.filter.banned_tokens if t >= vocab]
        if outside:
            raise ValueError(
                f"data.filter.banned_tokens: {outside[0]} is not a token id of model.vocab_size {vocab} (0..{vocab - 1})"
            )
        return self

    @model_validator(mode="after")
    def _parallel_fits_model(self) -> JobSpec:
        # The planner's refusals, at submit time rather than when the ranks start.
        check_parallel(self.model, self.world_size, self.parallel)
        p = self.parallel
        if p.tp > 1 and p.pp > 1:  # plannable, but the pipeline stages do not take TP shards yet
            raise ValueError(f"parallel.tp: tp ({p.tp}) > 1 together with pp ({p.pp}) > 1 is not supported yet")
        if p.pp > 1 and self.operators.compile:
            raise ValueError("operators.compile: torch.compile of pipeline stages is not supported yet (pp > 1)")
        n_micro = p.microbatches or p.pp
        if p.pp > 1 and self.data.micro_batch_size % n_micro:
            raise ValueError(
                f"data.micro_batch_size: {self.data.micro_batch_size} rows must split into "
                f"parallel.microbatches ({n_micro}) pipeline micro-batches"
            )
        return self

    @model_validator(mode="after")
    def _simulated_ranks_are_data_parallel(self) -> JobSpec:
        p = self.parallel
        if self.simulate is not None and (p.tp > 1 or p.pp > 1):
            raise ValueError(
                f"simulate: simulated ranks take data parallelism only (tp {p.tp}, pp {p.pp}; need 1 and 1)"
            )
        return self

    @model_validator(mode="after")
    def _rebuild_fits_plan(self) -> JobSpec:
        asked = sorted((k, a) for k, a in self.fault_policy.actions.items() if a in (*IN_PLACE_ACTIONS, "replace"))
        why = rebuild_refusal(self, structural=True) if asked else ""
        if why:
            raise ValueError(f"fault_policy.actions.{asked[0][0]}: {asked[0][1]} {why}; use restart_ranks")
        return self

    @property
    def attention(self) -> str:
        """The attention kernel the job asks for: ``operators.attention``, else ``model.attention``."""
        return self.operators.attention or self.model.attention

    @property
    def world_size(self) -> int:
        """Ranks the job needs: dp * tp * pp."""
        p = self.parallel
        return p.dp * p.tp * p.pp

    @property
    def tokens_per_step(self) -> int:
        d = self.data
        return self.parallel.dp * d.micro_batch_size * d.grad_accum * d.seq_len


def parse_job_spec(text: str, source: str = "job.yaml") -> JobSpec:
    """YAML text -> JobSpec. With ``init_from.hf``, the fields of ``model:`` the text leaves
    out that describe the architecture come from that directory's config.json when it can
    be read here (services/hf_config.py ``model_from_hf``: a submit checks the directory
    in any case), and those it writes must agree with it.

    Raises:
        JobSpecError: malformed YAML, unknown key, wrong type or value; ``init_from.hf``'s
            config differing from a written model field or of an architecture Surge lacks;
            one line naming ``source`` and the field's dotted path.
    """
    raw = read_spec_mapping(text, source)
    init = raw.get("init_from")
    if isinstance(init, dict) and isinstance(init.get("hf"), str) and init["hf"].startswith("/"):
        # The model's shape from the directory's config.json, for the fields the spec leaves
        # out (a spec with no model section: all of them). Here, where every reader of a job
        # file passes (surgectl, control's SubmitJob), so both see the same model; a spec read
        # back (spec_from_json) holds the whole model and reads no directory. (Imported here:
        # services/hf_config.py builds on this module.)
        from services.hf_config import model_from_hf

        written = raw.get("model")
        model = model_from_hf(init["hf"], written, source)
        raw = raw if model is None else {**raw, "model": model}
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        if isinstance(init, dict) and isinstance(init.get("hf"), str) and init["hf"].startswith("/"):
            from services.hf_config import unread_directory

            # A directory that gave the model none of its shape is the problem to name, not
            # a default it left in place (``model.vocab_size: 256``, which the user never wrote).
            problem = unread_directory(init["hf"], written)
            if problem:
                raise JobSpecError(f"{source}: {problem}") from None
        raise JobSpecError(spec_error_text(e, source, JobSpec)) from None


def read_spec_mapping(text: str, source: str = "job.yaml") -> dict:
    """YAML text -> the raw mapping of job fields, not validated (``surgectl submit --set``
    edits it before :func:`parse_job_spec` validates it).

    Raises:
        JobSpecError: malformed YAML (a key twice included) or not a mapping; one line.
    """
    raw = yaml_value(text, source)
    if not isinstance(raw, dict):
        raise JobSpecError(f"{source}: expected a mapping of job fields, got {type(raw).__name__}")
    return raw


def yaml_value(text: str, source: str) -> object:
    """A YAML document read as a job file is read (``1e-3`` is a float, a key twice is an
    error). Raises JobSpecError: malformed YAML, one line naming ``source``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobSpecError(f"{source}:{where}: malformed YAML: {problem}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (YAML's last-one-wins
    would silently drop what the author wrote first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats that YAML 1.1 (PyYAML) reads as strings, which the strict spec then
# refuses as "not a number": an exponent with no dot (``1e-3``, ``3E+4``: everyone writes an
# LR so) or with no sign (``5.0e5``, ``.5e6``: how rope_theta is written). YAML 1.2's core
# schema float, less what YAML 1.1 already reads (``1.0e+5``, ``.inf``).
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file. Raises JobSpecError (also for a missing file)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobSpecError(f"{p}: cannot read job spec: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise JobSpecError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_job_spec(text, str(p))


def spec_to_json(spec: JobSpec) -> str:
    return spec.model_dump_json()


# Validation context of a spec read back (journal, checkpoint, InitJob): the freeze rule that
# needs the model's names is left to the shard loader, so a job journaled before it reloads.
STORED: dict[str, bool] = {"stored": True}


def spec_from_json(text: str) -> JobSpec:
    return JobSpec.model_validate_json(text, context=STORED)


def at_data_parallel_size(
    spec: JobSpec, dp: int, *, micro_batch_size: int = 0, grad_accum: int = 0, largest: int = 0, source: str
) -> JobSpec:
    """``spec`` at ``dp`` data-parallel ranks with the job's global batch (micro_batch_size x
    grad_accum x dp rows) kept: the data position is a cursor into one sequence of global
    batches, and the step count, schedule and losses are per global batch. Unnamed
    (0): ``micro_batch_size`` is the largest not above ``largest`` (default: the job's) that
    divides the rows per rank (no rank holds more activations than the job ran with),
    ``grad_accum`` what is left.

    Raises:
        JobSpecError: ``dp`` does not divide the global batch, or the given sizes do not
            multiply to it (one line naming ``source`` and the fields).
    """
    d = spec.data
    rows = d.micro_batch_size * d.grad_accum * spec.parallel.dp
    per_rank, left = divmod(rows, dp) if dp > 0 else (0, 1)
    if left:
        raise JobSpecError(
            f"{source}: the global batch of {rows} rows (data.micro_batch_size x data.grad_accum x parallel.dp = "
            f"{d.micro_batch_size} x {d.grad_accum} x {spec.parallel.dp}) does not split over {dp} ranks"
        )
    mbs, accum = micro_batch_size, grad_accum
    if not mbs and accum:
        mbs = per_rank // accum if per_rank % accum == 0 else 0
    if not mbs:
        mbs = max(b for b in range(1, min(largest or d.micro_batch_size, per_rank) + 1) if per_rank % b == 0)
    accum = accum or per_rank // mbs
    if mbs * accum != per_rank:
        raise JobSpecError(
            f"{source}: data.micro_batch_size x data.grad_accum must be {per_rank} rows per rank at dp {dp} "
            f"(the global batch of {rows} rows kept), not {mbs} x {accum}"
        )
    return with_layout(spec, dp=dp, micro_batch_size=mbs, grad_accum=accum, source=source)


def with_layout(spec: JobSpec, *, dp: int, micro_batch_size: int, grad_accum: int, source: str) -> JobSpec:
    """``spec`` at another data-parallel layout (``parallel.dp``, ``data.micro_batch_size``,
    ``data.grad_accum``), validated like a submitted spec. ``eval.batches`` (micro-batches per
    rank) follows, so that an evaluation reads the same held-out rows at every layout (the
    rows, batches x dp x micro_batch_size, rounded up where the new layout does not split
    them); everything else is unchanged.

    Raises:
        JobSpecError: the layout breaks a rule of the spec (one line naming ``source`` and
            the field, e.g. a pipeline's micro-batch split).
    """
    raw = json.loads(spec_to_json(spec))
    raw["parallel"]["dp"] = dp
    raw["data"]["micro_batch_size"], raw["data"]["grad_accum"] = micro_batch_size, grad_accum
    eval_rows = spec.eval.batches * spec.parallel.dp * spec.data.micro_batch_size
    raw["eval"]["batches"] = max(1, -(-eval_rows // max(dp * micro_batch_size, 1)))
    try:
        return JobSpec.model_validate_json(json.dumps(raw))
    except ValidationError as e:
        raise JobSpecError(spec_error_text(e, source, JobSpec)) from None
