"""The sections of how a job trains and reports: optimizer, precision, operators, checkpoint,
simulation, integrity, evaluation, metrics and notifications."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from services.jobspec.base import U32_MAX, _Strict
from services.jobspec.evaluation import EVAL_HOOKS_MAX, EvalHook


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


# Sample generation's bounds: rank 0 generates while the other ranks wait in the next step's
# collective, so its time is every rank's; these keep it a fraction of a step at the demo model.
SAMPLE_PROMPTS_MAX = 8
SAMPLE_PROMPT_CHARS_MAX = 1000
SAMPLE_TOKENS_MAX = 512


class EvalSpec(_Strict):
    """The held-out loss (``every_steps``, ``batches``, ``at_end``) and periodic samples:
    every ``sample_every_steps`` steps (0: none) rank 0 continues each of ``sample_prompts``
    by ``sample_tokens`` tokens with the model's KV-cache decoding (services/compute/decode.py),
    greedy at ``sample_temperature`` 0, else drawn with ``sample_seed``; each sample goes to its
    log and to the store as a record of its own (``type: sample``)."""

    every_steps: int = Field(100, ge=0)  # 0: only at the end
    batches: int = Field(8, gt=0, le=U32_MAX)  # micro-batches per rank per evaluation
    at_end: bool = True
    sample_every_steps: int = Field(0, ge=0, le=U32_MAX)
    sample_prompts: list[Annotated[str, StringConstraints(min_length=1, max_length=SAMPLE_PROMPT_CHARS_MAX)]] = Field(
        default_factory=lambda: ["\n"], min_length=1, max_length=SAMPLE_PROMPTS_MAX
    )
    sample_tokens: int = Field(64, gt=0, le=SAMPLE_TOKENS_MAX)
    sample_temperature: float = Field(0.0, ge=0, le=10)  # 0: greedy
    sample_seed: int = Field(0, ge=0, le=U32_MAX)
    # Evaluation jobs control submits by itself (evaluation.py EvalHook; `surgectl evaluate`'s job).
    hooks: list[EvalHook] = Field(default_factory=list, max_length=EVAL_HOOKS_MAX)


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
