"""The model's section: its shape (``ModelSpec``), the parameters it has, which are frozen,
and where its first weights come from (``init_from``)."""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Annotated, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.jobspec.base import I32_MAX, MAX_LAYERS, _Strict


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

    n_layers: int = Field(4, gt=0, le=MAX_LAYERS)
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
    V, D = spec.vocab_size, spec.d_model
    yield "tok_emb.weight", "tok_emb.weight", (V, D)
    block = tuple(block_parameter_shapes(spec))
    for i in range(spec.n_layers):
        for name, shape in block:
            yield f"blocks.{i}.{name}", f"blocks.{i}.{name}", shape
    yield "norm.weight", "norm.weight", (D,)
    yield "lm_head.weight", "tok_emb.weight" if spec.tie_embeddings else "lm_head.weight", (V, D)


def block_parameter_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name within the block, shape)`` of one block's parameters, in the order
    :func:`model_parameter_shapes` lists them (every block is alike: what lets a spec's
    arithmetic, the memory estimate's, take O(1) in ``n_layers``)."""
    D, F = spec.d_model, mlp_hidden_width(spec)
    KV = spec.kv_heads * spec.head_dim  # the k and v projections' width
    mlp = (("gate", (F, D)),) if spec.mlp == "swiglu" else ()
    yield "attn_norm.weight", (D,)
    for proj, width in (("q", D), ("k", KV), ("v", KV)):  # (nn.Linear: weight, then bias)
        yield f"attn.{proj}.weight", (width, D)
        if spec.qkv_bias:
            yield f"attn.{proj}.bias", (width,)
    yield "attn.proj.weight", (D, D)
    yield "mlp_norm.weight", (D,)
    for lin, shape in (*mlp, ("up", (F, D)), ("down", (D, F))):
        yield f"mlp.{lin}.weight", shape


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


def mlp_hidden_width(spec: ModelSpec) -> int:
    """F for ``spec``: ``ffn_hidden`` when set, else mlp_ratio * D (GELU) or 2/3 of it
    rounded to a multiple of 8 (SwiGLU)."""
    if spec.ffn_hidden is not None:
        return spec.ffn_hidden
    if spec.mlp == "swiglu":
        return max(8, 8 * round(2 / 3 * spec.mlp_ratio * spec.d_model / 8))
    return max(1, round(spec.mlp_ratio * spec.d_model))
