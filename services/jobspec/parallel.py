"""The parallel section: the dp x tp x pp layout and the checks that the model can take it."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from services.jobspec.base import MAX_WORLD_SIZE, U32_MAX, _Strict
from services.jobspec.model import ModelSpec, mlp_hidden_width


class ParallelSpec(_Strict):
    """How the ranks split the work; world size = dp * tp * pp (validated against the
    model by :func:`services.engine.sharding_plan.plan`, which names the field at fault).

    ``data_parallel``: how the dp axis syncs gradients: ``ddp`` (DistributedDataParallel)
    or ``fsdp2`` (``fully_shard`` per block, then the root). ``microbatches`` is the number
    of pipeline micro-batches per micro-step (only read when pp > 1; 0: pp of them).

    ``device``: the kind of slot every rank runs on (issue 30: quotas per device kind):
    ``gpu`` (a CUDA device each), ``cpu`` (a worker's CPU slots) or ``any`` (the allocator's
    choice, CUDA slots first, as before the field existed). ``backend: nccl`` implies ``gpu``;
    ``nccl`` with ``cpu`` is refused. :attr:`device_kind` is the kind the scheduler counts.
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
    device: Literal["any", "gpu", "cpu"] = "any"
    # Peak dense throughput of one device, only for the MFU estimate. 0: a known GPU's data
    # sheet bf16 figure, else measured at the rank's start (services/common/device_peaks.py).
    peak_tflops_per_device: float = Field(0.0, ge=0, le=1e6)

    @model_validator(mode="after")
    def _device_agrees_with_backend(self) -> ParallelSpec:
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("device: cpu contradicts parallel.backend nccl (NCCL needs a GPU per rank)")
        return self

    @property
    def device_kind(self) -> str:
        """The kind of slot the ranks need: ``gpu``, ``cpu`` or ``any`` (``nccl`` implies gpu)."""
        return "gpu" if self.backend == "nccl" else self.device


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
    if dp * tp * pp > MAX_WORLD_SIZE:
        raise ValueError(
            f"parallel: dp ({dp}) * tp ({tp}) * pp ({pp}) = {dp * tp * pp} ranks, more than {MAX_WORLD_SIZE:,} "
            "(the largest world size Surge takes)"
        )
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
