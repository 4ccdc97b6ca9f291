"""The job spec: one YAML file, validated once by pydantic, pushed down frozen.

Unknown keys are rejected with their path; every user mistake becomes one line that names
the file and the field (``demo.yaml: data.seq_len: Input should be greater than 0, got -4``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class JobSpecError(ValueError):
    """A job spec that cannot be used; the message is one line naming file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """Decoder-only transformer (pre-norm, RoPE). Sizes in tokens / channels."""

    n_layers: int = Field(4, gt=0)
    d_model: int = Field(128, gt=0)
    n_heads: int = Field(4, gt=0)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    # Hidden width of the MLP as a multiple of d_model. SwiGLU uses 2/3 of it per branch
    # (LLaMA, Touvron et al. 2023) so both choices cost the same FLOPs.
    mlp_ratio: float = Field(4.0, gt=0)
    tie_embeddings: bool = True
    vocab_size: int = Field(256, gt=0)
    rope_theta: float = Field(10000.0, gt=0)  # RoFormer (Su et al. 2021) default
    norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)       # GPT-2 initialisation
    attention: Literal["sdpa", "math"] = "sdpa"

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSpec:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even for RoPE")
        return self


class PrefetchSpec(_Strict):
    watermark: int = Field(256, gt=0)   # documents read ahead
    threads: int = Field(2, gt=0)


class FilterSpec(_Strict):
    min_tokens: int = Field(1, ge=0)
    max_tokens: int = Field(0, ge=0)   # 0: no upper bound
    banned_bytes: str = ""             # documents containing any of these characters are dropped
    banned_tokens: list[int] = []


class DataSpec(_Strict):
    dataset: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+$")  # name@version
    seq_len: int = Field(256, gt=0)
    micro_batch_size: int = Field(8, gt=0)   # rows per rank per micro-step
    grad_accum: int = Field(1, gt=0)         # micro-steps per optimizer step
    shuffle: bool = True
    shuffle_seed: int = Field(1234, ge=0)
    pack: Literal["pack", "pad"] = "pack"
    pad_id: int = Field(0, ge=0)
    prefetch: PrefetchSpec = PrefetchSpec()
    filter: FilterSpec = FilterSpec()

    @property
    def name(self) -> str:
        return self.dataset.split("@", 1)[0]

    @property
    def version(self) -> str:
        return self.dataset.split("@", 1)[1]


class ParallelSpec(_Strict):
    dp: int = Field(1, gt=0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"   # auto: nccl on CUDA, else gloo
    threads_per_rank: int = Field(1, gt=0)


class OptimizerSpec(_Strict):
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)   # GPT-3 / LLaMA setting
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    schedule: Literal["cosine", "constant"] = "cosine"


class CheckpointSpec(_Strict):
    every_steps: int = Field(100, ge=0)   # 0: only at the end
    keep_last: int = Field(3, ge=0)       # 0: keep all
    at_end: bool = True


class EvalSpec(_Strict):
    every_steps: int = Field(100, ge=0)   # 0: only at the end
    batches: int = Field(8, gt=0)         # micro-batches per rank per evaluation
    at_end: bool = True


class JobSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")
    steps: int = Field(..., gt=0)
    seed: int = Field(0, ge=0)
    model: ModelSpec = ModelSpec()
    data: DataSpec
    parallel: ParallelSpec = ParallelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: Literal["fp32", "bf16"] = "fp32"
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = EvalSpec()

    @property
    def world_size(self) -> int:
        return self.parallel.dp

    @property
    def tokens_per_step(self) -> int:
        d = self.data
        return self.parallel.dp * d.micro_batch_size * d.grad_accum * d.seq_len


def parse_job_spec(text: str, source: str = "job.yaml") -> JobSpec:
    """YAML text -> JobSpec.

    Raises:
        JobSpecError: malformed YAML, unknown key, wrong type or value; one line naming
            ``source`` and the field's dotted path.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobSpecError(f"{source}:{where}: malformed YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise JobSpecError(f"{source}: expected a mapping of job fields, got {type(raw).__name__}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] in ("extra_forbidden", "missing") else f", got {err.get('input')!r}"
        raise JobSpecError(f"{source}: {path}: {msg}{got}") from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file. Raises JobSpecError (also for a missing file)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobSpecError(f"{p}: cannot read job spec: {e.strerror}") from None
    return parse_job_spec(text, str(p))


def spec_to_json(spec: JobSpec) -> str:
    return spec.model_dump_json()


def spec_from_json(text: str) -> JobSpec:
    return JobSpec.model_validate_json(text)
