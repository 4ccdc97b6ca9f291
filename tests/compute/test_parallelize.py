"""The one order in which parallelisms are applied to a rank's model (services/compute/parallelize.py)."""

from __future__ import annotations

import pytest

from services.compute.model import build_model
from services.compute.parallelize import checkpoint_activations, layout_steps
from services.compute.pipeline_stage import stage_of
from services.engine.parallel_strategy import plan_message
from services.engine.sharding_plan import plan
from services.jobspec import ModelSpec, ParallelSpec

MODEL = ModelSpec(d_model=64, n_heads=4, n_layers=4, vocab_size=256, tie_embeddings=False)


@pytest.mark.parametrize(
    ("world", "parallel", "steps"),
    [
        (1, ParallelSpec(), ()),
        (2, ParallelSpec(dp=2), ("ddp",)),
        (2, ParallelSpec(dp=2, activation_checkpointing=True), ("activation_checkpointing", "ddp")),
        (2, ParallelSpec(dp=2, data_parallel="fsdp2"), ("fully_shard",)),
        (2, ParallelSpec(tp=2, activation_checkpointing=True), ("tensor_parallel", "activation_checkpointing")),
        (
            4,
            ParallelSpec(dp=2, tp=2, data_parallel="fsdp2", activation_checkpointing=True),
            ("tensor_parallel", "activation_checkpointing", "fully_shard"),
        ),
        (
            4,
            ParallelSpec(dp=2, pp=2, data_parallel="fsdp2", activation_checkpointing=True),
            ("activation_checkpointing", "fully_shard"),
        ),
    ],
)
def test_every_plan_lays_the_model_out_tp_then_checkpointing_then_fsdp2_or_ddp(world, parallel, steps):
    # torchtitan's order (compile is L3-2's, at the first forward: see the module docstring).
    for rank in range(world):  # the same steps on every rank of the plan
        assert layout_steps(plan_message(plan(MODEL, world, parallel), rank, "cpu")) == steps


def test_checkpointing_reaches_every_block_of_a_model_and_of_a_pipeline_stage():
    model = build_model(MODEL, seed=1)
    assert not any(b.activation_checkpointing for b in model.blocks)
    checkpoint_activations(model)
    assert [b.activation_checkpointing for b in model.blocks] == [True] * 4

    stage = stage_of(build_model(MODEL, seed=1), plan_message(plan(MODEL, 2, ParallelSpec(pp=2)), 1, "cpu"), None)
    checkpoint_activations(stage)
    assert [b.activation_checkpointing for b in stage.blocks] == [True, True]


def test_a_resize_in_place_changes_the_dp_axis_of_a_ddp_plan_and_nothing_else():
    # Issue 16: L2-2 computes the plan again at the new dp; L3-1 and L3-5 take it only as that.
    from services.compute.parallelize import data_parallel_resize

    def at(world: int, rank: int = 1, **parallel) -> object:
        return plan_message(plan(MODEL, world, ParallelSpec(dp=world, **parallel)), rank, "cpu")

    assert data_parallel_resize(at(3), at(2)) and data_parallel_resize(at(2), at(3))
    assert data_parallel_resize(at(2, rank=0), at(1, rank=0))  # ddp -> none at dp 1
    assert not data_parallel_resize(at(2), at(3, rank=2))  # a rank keeps its id
    assert not data_parallel_resize(at(2), at(3, activation_checkpointing=True))  # the model's layout
    assert not data_parallel_resize(at(2), plan_message(plan(MODEL, 2, ParallelSpec(dp=1, tp=2)), 1, "cpu"))
    fsdp = at(2, data_parallel="fsdp2")
    assert not data_parallel_resize(fsdp, at(3, data_parallel="fsdp2"))  # its shards live on the old mesh


def test_the_shard_loader_takes_a_resized_plan_only_after_the_plan_was_withdrawn():
    from services.compute.shard_loader import ShardLoader
    from services.contract.frozen import ConfigFrozen

    def at(world: int) -> object:
        return plan_message(plan(MODEL, world, ParallelSpec(dp=world)), 1, "cpu")

    handed: list[object] = []
    loader = ShardLoader(lambda *a, **k: None, handed.append)
    mesh = object()  # (only handed on)
    loader.parallel_plan(at(3), mesh)
    with pytest.raises(ConfigFrozen):
        loader.parallel_plan(at(2), mesh)  # a second plan, unasked: the plan is fixed
    loader.parallel_plan(at(3), None)  # withdrawn (L2-2's rebuild)
    loader.parallel_plan(at(2), mesh)  # the resized group's
    loader.parallel_plan(at(2), None)
    with pytest.raises(ConfigFrozen):
        loader.parallel_plan(plan_message(plan(MODEL, 2, ParallelSpec(dp=1, tp=2)), 1, "cpu"), mesh)
