"""The order in which a rank's model is laid out for parallelism, written in one place.

torchtitan's ``parallelize_llama`` (torchtitan/models/llama3/infra/parallelize.py) applies
tensor parallelism, then activation checkpointing, then torch.compile, then FSDP (or DDP).
Surge follows it. :func:`layout_steps` is the one place that order is written: L3-5's
``GradientReduction.attach`` (called by the composition root with the loaded model)
applies the steps it returns, one after the other, and nothing else lays the model out.

1. ``tensor_parallel`` (tp > 1): the projections become DTensor shards over the tp axis.
   First, because every later step must see the final parameters.
2. ``activation_checkpointing``: each block keeps only its input and recomputes its inside
   in backward (``Block``, non-reentrant ``torch.utils.checkpoint``). After TP, so the
   recomputed region is what TP made of the block; hooks on the block itself (FSDP2's,
   next) stay outside that region.
3. ``fully_shard`` (FSDP2: every block, then the root) or ``ddp`` (one wrapper around the
   model): last, so they shard or hook the final parameters (with TP, FSDP2's shards are
   two-dimensional: dp over tp).

torch.compile is the step not applied here: L3-2 (the operator adapter) compiles the module
this layout produces, lazily at its first forward, because the job's kernel choice
(``operators.compile``) reaches L3 in ConfigureForward, after the model was loaded. It
compiles each block in place, as torchtitan does (operator_adapter.compile_regions); the
compile being lazy, that it is asked for after FSDP2/DDP rather than before changes nothing:
the blocks' FSDP2 hooks are in place either way when Dynamo first traces.

A pipeline stage (pp > 1) is cut from the model before any of this (L3-1 keeps its stage
only), and a stage iterates its blocks like the model, so every step applies to it as is.

Models larger than one rank: L3-1 builds the model on the meta device (no storage), has the
steps of :data:`ON_META` (TP, activation checkpointing, FSDP2) applied to it there, then
materialises it (``to_empty`` + the seeded initialisation of services/compute/model.py,
each rank filling only its shards), and only then hands it over for DDP, whose wrap checks
and broadcasts the weights themselves. So the order stays the one above, with the weights
coming into existence between FSDP2's place and DDP's (the two never apply together), and
no rank ever holds more of the model than its plan gives it (torchtitan's meta-device
initialisation).
"""

from __future__ import annotations

from torch import nn

from services.contract import engine_pb2

TENSOR_PARALLEL = "tensor_parallel"
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
FULLY_SHARD = "fully_shard"
DDP = "ddp"


# The steps that only re-lay the parameters out (DTensor placements, module hooks, the
# blocks' recompute flag): they apply to a model on the meta device, before its weights exist.
ON_META = frozenset({TENSOR_PARALLEL, ACTIVATION_CHECKPOINTING, FULLY_SHARD})


def layout_steps(plan: engine_pb2.ParallelPlan) -> tuple[str, ...]:
    """The layout steps ``plan`` asks for, in the order they are applied (module docstring).

    A pure function of the plan: the same plan gives the same steps on every rank.
    """
    wanted = (
        (TENSOR_PARALLEL, plan.tp > 1),
        (ACTIVATION_CHECKPOINTING, plan.activation_checkpointing),
        (FULLY_SHARD, plan.data_parallel == "fsdp2"),
        (DDP, plan.data_parallel == "ddp"),
    )
    return tuple(step for step, applies in wanted if applies)


def rebuildable(plan: engine_pb2.ParallelPlan) -> bool:
    """Whether a group of ``plan`` can be rebuilt in place (issue 16): one stage, no tensor
    parallelism, gradients synced by DDP or not at all. (FSDP2 and TP lay the parameters
    out as DTensors over the old mesh; re-laying them out is not built.)"""
    return plan.tp <= 1 and plan.pp <= 1 and plan.data_parallel in ("ddp", "none")


# What a plan says about the data-parallel axis alone (issue 16's resize in place changes
# these and nothing else).
_DP_FIELDS = ("world_size", "dp", "dp_rank", "mesh", "data_parallel")


def data_parallel_resize(old: engine_pb2.ParallelPlan, new: engine_pb2.ParallelPlan) -> bool:
    """Whether ``new`` is ``old`` at another data-parallel size (a resize in place, issue 16):
    both with one stage, no tensor parallelism and gradients synced by DDP or not at all
    (data_parallel ``none`` at dp 1), the same rank, and equal in every field but the dp
    axis's (world size, dp, dp coordinate, mesh, ddp/none). Such a plan changes nothing a
    layout step did to the model's parameters: only the DDP wrapper is made anew."""

    def local(plan: engine_pb2.ParallelPlan) -> engine_pb2.ParallelPlan:
        copy = engine_pb2.ParallelPlan()
        copy.CopyFrom(plan)
        for field in _DP_FIELDS:
            copy.ClearField(field)
        return copy

    return rebuildable(old) and rebuildable(new) and local(old) == local(new)


def checkpoint_activations(model: nn.Module) -> None:
    """Make every block of ``model`` (a Transformer or a pipeline stage) recompute its
    activations in backward instead of keeping them (Chen et al. 2016). No communication;
    parameter names do not change, so checkpoints do not depend on it."""
    for block in model.blocks:
        block.activation_checkpointing = True
