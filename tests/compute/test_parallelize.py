"""The one order in which parallelisms are applied to a rank's model (services/compute/parallelize.py)."""

from __future__ import annotations

import json

import pytest
import torch

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


# ---------------------------------------------------------------- meta-device layout and init

LAYOUTS = {  # (world, rank to check, parallel section): ranks whose shards are uneven or 2-D
    "fsdp2_dp2": (2, 1, {"dp": 2, "data_parallel": "fsdp2"}),
    "tp2": (2, 1, {"tp": 2}),
    "fsdp2_dp2_x_tp2": (4, 2, {"dp": 2, "tp": 2, "data_parallel": "fsdp2"}),
}
SHARDED = ModelSpec(d_model=64, n_heads=4, n_layers=2, vocab_size=97, tie_embeddings=False)  # 97: uneven rows


def _check_rank(world: int, rank: int, parallel: dict, hf_dir: str) -> None:
    """In a process of its own: rank ``rank`` of ``world`` joins torch's fake process group
    (every collective a no-op: any communication would leave wrong values), has L3-5 lay
    out the meta model for ``parallel``, materialises it, and checks every local shard
    against the one-process model's tensor cut as torch cuts it (``distribute_tensor``
    with ``src_data_rank=None``); then reads the same shards from the Hugging Face
    directory ``hf_dir`` (that model, exported) and checks them too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from services.compute.gradient_reduction import GradientReduction
    from services.compute.hf_format import read_hf_tensors
    from services.compute.model import materialise, meta_model

    whole = build_model(SHARDED, 5).state_dict()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    msg = plan_message(plan(SHARDED, world, ParallelSpec(**parallel)), rank, "cpu")
    reduction = GradientReduction(lambda *a, **k: None)
    reduction.parallel_plan(msg, init_device_mesh("cpu", (msg.pp, msg.dp, msg.tp), mesh_dim_names=("pp", "dp", "tp")))
    model = meta_model(SHARDED)
    reduction.lay_out(model)
    materialise(model, SHARDED, 5, "cpu")
    params = dict(model.named_parameters())
    assert params.keys() == whole.keys() and all(isinstance(p, DTensor) for p in params.values())
    for name, p in params.items():
        want = distribute_tensor(whole[name], p.device_mesh, p.placements, src_data_rank=None).to_local()
        assert torch.equal(p.to_local(), want), (name, p.placements)
    for name, t in read_hf_tensors(hf_dir, params).items():
        assert torch.equal(t.to_local(), params[name].to_local()), (name, t.placements)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_each_rank_materialises_its_shards_of_the_one_process_weights_without_communication(tmp_path):
    from pathlib import Path

    from services.compute import hf_format
    from services.jobspec import JobSpec

    spec = JobSpec.model_validate(
        {"name": "hf", "steps": 1, "model": SHARDED.model_dump(), "data": {"dataset": "corpus@v1", "seq_len": 16}}
    )
    hf_format.save_hf(tmp_path, build_model(SHARDED, 5).state_dict(), spec)
    # One process per layout: a fake process group and its device meshes are per process
    # (forked with torch imported: tests/rank_forks.py).
    from tests.rank_forks import run_ranks_to_end

    run_ranks_to_end(
        [
            [__file__, str(world), str(rank), json.dumps(parallel), str(tmp_path)]
            for world, rank, parallel in LAYOUTS.values()
        ],
        timeout=100,
        tail=2000,
        cwd=Path(__file__).resolve().parents[2],
    )


if __name__ == "__main__":
    import sys

    _check_rank(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
