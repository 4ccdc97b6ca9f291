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
