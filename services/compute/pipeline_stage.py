"""Pipeline-parallel execution of the decoder: one stage per rank, torch.distributed.pipelining.

The model code is ``services/compute/model.py``'s, unchanged: a stage is a view of a built
:class:`Transformer` that keeps the embedding (stage 0), a contiguous range of blocks (from
the parallel plan), and the final norm + LM head (last stage). The kept submodules keep
their names (``tok_emb``, ``blocks.<i>``, ``norm``, ``lm_head``), so a stage's state dict is
the full model's restricted to that stage: a checkpoint written under PP is keyed exactly
like one written without it, and loads into any other layout (DCP resolves keys).

Schedules: torch's ``ScheduleGPipe`` (Huang et al. 2019, fill-drain) and ``Schedule1F1B``
(Narayanan et al. 2021, PipeDream-Flush), one stage per rank. This unit executes a schedule;
it does not judge one: L2-2 checks it first (``ParallelStrategy.rank_assignment`` runs
``services.engine.schedule_check.check_pipeline`` on the same action lists, every send has
its receive and blocking execution completes) before any process group exists, so no rank
can wait on a bad schedule. L3 may not import L2, hence the check lives there.

In a rank (``services/rank/__main__.py``): the shard loader cuts this rank's stage
(:func:`stage_of`), L3-5 wraps it for the dp axis (DDP or FSDP2), the composition root
builds the runner (:func:`runner_for`) and hands it to the backward unit, whose RunBackward
runs the schedule for each micro-step (forward and backward interleave across ranks, so
they cannot be two commands); the forward unit hands the token ids through.

Loss: the last stage computes, per micro-batch m,

    loss_m = sum_t CE(logits_t, label_t) * loss_scale / normalizer      (label -100 excluded)

and torch's schedule backpropagates each ``loss_m`` (``scale_grads=False``: no division by
the number of micro-batches). With ``normalizer`` = the global count of non-padding tokens
of the step, the accumulated gradient equals the unsplit model's gradient of the mean token
loss over the whole batch, padding included (under DDP, which averages over the dp ranks,
pass global tokens / dp). Cross entropy in float32 whatever the compute dtype.

Tied embeddings: the embedding lives on stage 0 and the LM head on the last stage, so a tied
weight would need its gradient all-reduced between the two (Megatron's embedding group).
Surge refuses ``model.tie_embeddings`` with pp > 1 instead (one clear error) rather than
untie silently and train a different model than the job asked for.

Shape legend: B rows, T positions, D width, V vocabulary (see model.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from services.compute.model import Transformer, math_attention, rotary_for, sdpa_attention
from services.contract import engine_pb2

IGNORE_INDEX = -100
_KERNELS = {"sdpa": sdpa_attention, "math": math_attention}
# torch.distributed.pipelining's classes, imported when a stage is built: the package pulls
# in torch._dynamo (0.3-1 s per process on 2 cores), which every rank would pay at
# start-up, pipeline or not.
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


class LayerSlice(nn.Module):
    """Some of the model's blocks, registered under their own indices (FQNs
    ``blocks.<i>.…`` equal the full model's) and iterable in order like the model's
    ``nn.ModuleList``, so code written for ``model.blocks`` (activation checkpointing,
    ``fully_shard`` per block) applies to a stage unchanged."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i in sorted(blocks):
            self.add_module(str(i), blocks[i])

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class StageModule(nn.Module):
    """Stage ``stage_index`` of ``model``: shares (does not copy) the kept submodules.

    forward: stage 0 takes token ids int64 [B, T]; later stages take activations float
    [B, T, D]. The last stage returns logits [B, T, V], the others activations [B, T, D].

    Raises ValueError: tied embeddings split across stages (see the module docstring), a
    layer range outside the model, an unknown attention backend.
    """

    def __init__(
        self, model: Transformer, layers: range, *, stage_index: int, num_stages: int, attention: str | None = None
    ):
        super().__init__()
        spec = model.spec
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"pipeline stage: stage_index {stage_index} is not in 0..{num_stages - 1}")
        first, last = stage_index == 0, stage_index == num_stages - 1
        if spec.tie_embeddings and not (first and last):
            raise ValueError(
                "model.tie_embeddings: must be false with parallel.pp > 1 "
                "(the embedding and the LM head live on different pipeline stages)"
            )
        name = attention or spec.attention
        if name not in _KERNELS:
            raise ValueError(f"attention: expected one of {tuple(_KERNELS)}, got {name!r}")
        if not (0 <= layers.start <= layers.stop <= spec.n_layers) or layers.step != 1:
            raise ValueError(f"pipeline stage: layers {layers} is not a contiguous range of 0..{spec.n_layers - 1}")
        self.spec = spec
        self.stage_index, self.num_stages = stage_index, num_stages
        self.first, self.last = first, last
        # The pp process group joining this stage to its neighbours (set by the shard
        # loader from the plan's mesh; None: the default group).
        self.group: dist.ProcessGroup | None = None
        self.tok_emb = model.tok_emb if first else None
        self.blocks = LayerSlice({i: model.blocks[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._kernel = _KERNELS[name]
        self._rotary = rotary_for(spec)

    def use_attention(self, name: str) -> None:
        """The job's attention kernel ("sdpa" | "math"). Raises ValueError otherwise."""
        if name not in _KERNELS:
            raise ValueError(f"attention: expected one of {tuple(_KERNELS)}, got {name!r}")
        self._kernel = _KERNELS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_BTD = self.tok_emb(x) if self.tok_emb is not None else x
        rope = self._rotary.tables(x_BTD.shape[1], x_BTD.device, torch.float32)
        for block in self.blocks:
            x_BTD = block(x_BTD, rope, self._kernel)
        return self.lm_head(self.norm(x_BTD)) if self.last else x_BTD


def _static_meta(stage: StageModule, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Example tensors (on the meta device) of one micro-batch's stage input and output."""
    rows, seq = shape
    spec, meta = stage.spec, torch.device("meta")
    # requires_grad: torch builds the receive buffers from these, and a buffer that does not
    # require grad would silently cut the backward pass at the stage boundary.
    act_BTD = torch.empty(rows, seq, spec.d_model, dtype=torch.float32, device=meta, requires_grad=True)
    inp = torch.empty(rows, seq, dtype=torch.int64, device=meta) if stage.first else act_BTD
    out = torch.empty(rows, seq, spec.vocab_size, dtype=torch.float32, device=meta) if stage.last else act_BTD
    return {
        "input_args": (inp,),
        "output_args": (out,),
        # Gradients travel back along the activations; token ids and the loss have none.
        "input_grads": (None if stage.first else act_BTD,),
        "output_grads": (None if stage.last else act_BTD,),
    }


class PipelineRunner:
    """Runs one rank's stage of the pipeline: ``forward_backward`` (every micro-batch of a
    step, interleaved per the schedule) and ``forward_only`` (evaluation).

    Args:
        module: this rank's :class:`StageModule` (its parameters get the gradients; its
            stage index, stage count and pp group place it in the pipeline).
        schedule: "gpipe" | "1f1b"; microbatches: pipeline micro-batches per step.
        run_module: what the schedule calls: ``module`` itself, or ``module`` wrapped for
            data parallelism (DDP over the dp group; or ``module`` after ``fully_shard``).
        region: a context manager factory entered around every schedule call (autocast).
        microbatch_shape: (rows, seq_len) of one pipeline micro-batch. The stage is built
            in torch's static mode from it: no first-step shape inference, whose extra
            backward pass breaks DDP's bucket rebuild (torch 2.13: "rebuilt parameter
            indices size is not same as original model parameters size"); every batch
            must then have rows * microbatches rows of seq_len positions.

    Raises ValueError: an unknown schedule, microbatches < 1.
    """

    def __init__(
        self,
        module: StageModule,
        *,
        schedule: str,
        microbatches: int,
        device: torch.device | str = "cpu",
        run_module: nn.Module | None = None,
        region: Callable[[], contextlib.AbstractContextManager] | None = None,
        microbatch_shape: tuple[int, int],
    ):
        if schedule not in _SCHEDULES:
            raise ValueError(f"parallel.pipeline_schedule: expected one of {tuple(_SCHEDULES)}, got {schedule!r}")
        if microbatches < 1:
            raise ValueError(f"parallel.microbatches: must be >= 1, got {microbatches}")
        self.module = module
        self._run_module = run_module if run_module is not None else module
        self._microbatches = microbatches
        self._batch_shape = (microbatch_shape[0] * microbatches, microbatch_shape[1])
        self._region = region or contextlib.nullcontext
        from torch.distributed import pipelining

        self.stage = pipelining.PipelineStage(
            self._run_module,
            module.stage_index,
            module.num_stages,
            torch.device(device),
            group=module.group,
            **_static_meta(module, microbatch_shape),
        )
        schedule_class = getattr(pipelining, _SCHEDULES[schedule])
        self._schedule = schedule_class(self.stage, microbatches, loss_fn=self._loss, scale_grads=False)
        self._ce_sums: dict[int, torch.Tensor] = {}
        self._scale = 1.0  # loss_scale / normalizer of the running step

    @property
    def is_first(self) -> bool:
        return self.module.first

    @property
    def is_last(self) -> bool:
        return self.module.last

    def use_operators(self, ops) -> None:
        """The operator adapter's selection, relayed by the forward unit (an
        ``operator_adapter.Operators``): its attention kernel for the stage's blocks, its
        region (autocast, SDPA restriction) around every schedule call. Activations between
        stages stay float32 under autocast (the residual stream adds in float32)."""
        self.module.use_attention(ops.attention)
        self._region = ops.region

    def _loss(self, logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        ce_sum = functional.cross_entropy(
            logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(),
            labels_BT.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        loss = ce_sum * self._scale
        # Keyed by the loss tensor: torch also calls loss_fn during its first-step metadata
        # inference, and only the micro-batch losses the schedule returns count.
        self._ce_sums[id(loss)] = ce_sum.detach()
        return loss

    def _inputs(self, input_ids_BT: torch.Tensor | None, labels_BT: torch.Tensor | None):
        args = ()
        if self.is_first:
            if input_ids_BT is None:
                raise ValueError("pipeline stage 0: input_ids are required")
            args = (input_ids_BT.to(self.stage.device),)
        target = None
        if self.is_last:
            if labels_BT is None:
                raise ValueError("pipeline last stage: labels are required")
            target = labels_BT.to(self.stage.device)
        for name, t in (("input_ids", input_ids_BT), ("labels", labels_BT)):
            if t is not None and tuple(t.shape) != self._batch_shape:
                raise ValueError(
                    f"pipeline: {name} has shape {tuple(t.shape)}, expected {self._batch_shape} "
                    f"({self._microbatches} micro-batches of the configured shape)"
                )
        return args, target

    def forward_backward(
        self,
        input_ids_BT: torch.Tensor | None,
        labels_BT: torch.Tensor | None,
        *,
        normalizer: float,
        loss_scale: float = 1.0,
        zero_grad: bool = True,
    ) -> float | None:
        """Forward and backward of the step's batch, split into the pipeline micro-batches
        along B. Stage 0 needs ``input_ids_BT`` (int64 [B, T]); the last stage needs
        ``labels_BT`` (int64 [B, T], -100 = padding); other stages may pass None.

        Gradients of this stage's parameters start from zero (``zero_grad``) or add to the
        ones already there (later micro-steps of a gradient-accumulation window). Returns the summed token cross entropy of the batch (nats,
        unscaled) on the last stage, None elsewhere.

        Raises ValueError for a non-positive normalizer or loss scale or a missing input.
        """
        if normalizer <= 0 or loss_scale <= 0:
            raise ValueError(f"pipeline: normalizer and loss_scale must be > 0, got {normalizer}, {loss_scale}")
        args, target = self._inputs(input_ids_BT, labels_BT)
        if zero_grad:
            for p in self.module.parameters():
                p.grad = None
        self._ce_sums.clear()
        self._scale = loss_scale / normalizer
        self._run_module.train(True)
        losses: list[torch.Tensor] = []
        with self._region():
            self._schedule.step(*args, target=target, losses=losses)
        return self._take_loss(losses)

    @torch.no_grad()
    def forward_only(self, input_ids_BT: torch.Tensor | None, labels_BT: torch.Tensor | None) -> float | None:
        """Forward only over the pipeline; the summed token cross entropy on the last stage
        (nats), None elsewhere. Batch shape as for ``forward_backward``."""
        args, target = self._inputs(input_ids_BT, labels_BT)
        self._ce_sums.clear()
        self._scale = 1.0
        self._run_module.train(False)
        losses: list[torch.Tensor] = []
        try:
            with self._region():
                self._schedule.eval(*args, target=target, losses=losses)
        finally:
            self._run_module.train(True)
        return self._take_loss(losses)

    def _take_loss(self, losses: list[torch.Tensor]) -> float | None:
        """Sum of the CE sums of exactly the micro-batch losses the schedule reported."""
        try:
            if not self.is_last:
                return None
            if len(losses) != self._microbatches:
                raise RuntimeError(f"pipeline: expected {self._microbatches} micro-batch losses, got {len(losses)}")
            return float(torch.stack([self._ce_sums[id(loss)] for loss in losses]).double().sum())
        finally:
            self._ce_sums.clear()


# ------------------------------------------------------------------ wiring into a rank


def check_pipeline_job(spec) -> None:  # services.jobspec.JobSpec (not imported: L3 stays below it)
    """Refuse, before a rank builds anything, what the pipeline path does not combine with
    yet (one line naming the field). Nothing to check when ``parallel.pp`` is 1.

    Raises ValueError: tp > 1 (a stage has no TP input/output conversion), torch.compile
    (stages run eagerly), or ``data.micro_batch_size`` not divisible by the pipeline
    micro-batches.
    """
    par = spec.parallel
    if par.pp == 1:
        return
    if par.tp > 1:
        raise ValueError(f"parallel.tp: tp ({par.tp}) > 1 inside pipeline stages is not supported yet (pp = {par.pp})")
    if spec.operators.compile:
        raise ValueError("operators.compile: torch.compile of pipeline stages is not supported yet (pp > 1)")
    n = par.microbatches or par.pp
    if spec.data.micro_batch_size % n:
        raise ValueError(
            f"data.micro_batch_size: {spec.data.micro_batch_size} rows must split into "
            f"parallel.microbatches ({n}) pipeline micro-batches"
        )


def stage_of(model: Transformer, plan: engine_pb2.ParallelPlan, mesh, attention: str | None = None) -> StageModule:
    """The shard loader's cut: this rank's stage of ``model`` per the plan (its pp
    coordinate, the plan's layer list for it), joined to its neighbours by the mesh's pp
    group (``mesh`` None: the default group)."""
    layers = list(plan.stages[plan.pp_rank].layers)
    if layers != list(range(layers[0], layers[-1] + 1)):
        raise ValueError(f"parallel plan: stage {plan.pp_rank} holds layers {layers}, not a contiguous range")
    stage = StageModule(
        model, range(layers[0], layers[-1] + 1), stage_index=plan.pp_rank, num_stages=plan.pp, attention=attention
    )
    stage.group = mesh["pp"].get_group() if mesh is not None else None
    return stage


def runner_for(stage: StageModule, run_module: nn.Module, spec, device: str = "cpu") -> PipelineRunner:
    """The composition root's pipeline runner for ``stage`` under the job's schedule; one
    pipeline micro-batch is micro_batch_size / microbatches rows of seq_len tokens."""
    n = spec.parallel.microbatches or spec.parallel.pp
    return PipelineRunner(
        stage,
        schedule=spec.parallel.pipeline_schedule,
        microbatches=n,
        device=device,
        run_module=run_module,
        microbatch_shape=(spec.data.micro_batch_size // n, spec.data.seq_len),
    )
