"""The planner (L2-2's pure function): no process, no process group."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from services.engine.sharding_plan import AXES, ShardingPlan, Topology, TopologyWarning, plan
from services.jobspec import ModelSpec, ParallelSpec, parse_job_spec

MODEL = ModelSpec(n_layers=4, d_model=64, n_heads=4, tie_embeddings=False)


def test_dp_tp_pp_mesh_puts_tp_innermost_and_every_rank_at_one_coordinate():
    p = plan(MODEL, 8, ParallelSpec(dp=2, tp=2, pp=2, data_parallel="fsdp2"))
    assert p.axis_names == AXES == ("pp", "dp", "tp") and p.mesh_shape == (2, 2, 2)
    assert p.mesh == (((0, 1), (2, 3)), ((4, 5), (6, 7)))
    assert p.coord(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert sorted(p.coords) == sorted({p.coords[r] for r in range(8)})  # a bijection
    assert p.group_of(5, "tp") == (4, 5)
    assert p.group_of(5, "dp") == (5, 7)
    assert p.group_of(5, "pp") == (1, 5)
    for axis, groups in p.groups:  # each axis's groups partition the world
        assert sorted(r for g in groups for r in g) == list(range(8)), axis


def test_layers_split_evenly_over_stages_with_the_remainder_first():
    p = plan(ModelSpec(n_layers=5, d_model=64, n_heads=4, tie_embeddings=False), 2, ParallelSpec(pp=2))
    assert p.stage_layers == ((0, 1, 2), (3, 4))
    assert plan(MODEL, 1, ParallelSpec()).stage_layers == ((0, 1, 2, 3),)


def test_tp_styles_are_megatrons_column_then_row_split():
    styles = dict(plan(MODEL, 2, ParallelSpec(tp=2)).tp_styles)
    assert styles["blocks.0.attn.q"] == styles["blocks.0.attn.k"] == styles["blocks.0.attn.v"] == "colwise"
    assert styles["blocks.3.mlp.gate"] == styles["blocks.3.mlp.up"] == "colwise"
    assert styles["blocks.0.attn.proj"] == styles["blocks.3.mlp.down"] == "rowwise"
    assert len(styles) == 4 * 7
    gelu = dict(plan(MODEL.model_copy(update={"mlp": "gelu"}), 2, ParallelSpec(tp=2)).tp_styles)
    assert "blocks.0.mlp.gate" not in gelu and gelu["blocks.0.mlp.up"] == "colwise"
    assert plan(MODEL, 2, ParallelSpec(dp=2)).tp_styles == ()


def test_data_parallel_kind_schedule_and_checkpointing_come_from_the_config():
    p = plan(
        MODEL,
        4,
        ParallelSpec(
            dp=2, pp=2, data_parallel="fsdp2", activation_checkpointing=True, pipeline_schedule="gpipe", microbatches=4
        ),
    )
    assert (p.data_parallel, p.activation_checkpointing, p.pipeline_schedule, p.microbatches) == (
        "fsdp2",
        True,
        "gpipe",
        4,
    )
    assert plan(MODEL, 2, ParallelSpec(tp=2, data_parallel="fsdp2")).data_parallel == "none"  # dp == 1
    assert plan(MODEL, 2, ParallelSpec(pp=2)).microbatches == 2  # 0 means pp


def test_plan_is_immutable_and_a_pure_function_of_its_inputs():
    a = plan(MODEL, 4, ParallelSpec(dp=2, tp=2, data_parallel="fsdp2"))
    assert a == plan(MODEL, 4, ParallelSpec(dp=2, tp=2, data_parallel="fsdp2"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dp = 4  # type: ignore[misc]
    assert isinstance(a, ShardingPlan) and hash(a) == hash(
        plan(MODEL, 4, ParallelSpec(dp=2, tp=2, data_parallel="fsdp2"))
    )


@pytest.mark.parametrize(
    ("model", "world", "parallel", "message"),
    [
        (MODEL, 4, ParallelSpec(dp=2), r"^parallel: dp \(2\) \* tp \(1\) \* pp \(1\) = 2, but the world has 4 ranks$"),
        (
            ModelSpec(d_model=96, n_heads=6),
            4,
            ParallelSpec(tp=4),
            r"^parallel.tp: model.n_heads \(6\) must be divisible by tp \(4\)$",
        ),
        (
            ModelSpec(d_model=96, n_heads=3),
            3,
            ParallelSpec(tp=3),
            r"^parallel.tp: the MLP hidden width \(256, from model.mlp_ratio\) must be divisible by tp \(3\)$",
        ),
        (
            ModelSpec(d_model=64, n_heads=4, n_kv_heads=2),
            4,
            ParallelSpec(tp=4, data_parallel="fsdp2"),
            r"^parallel.tp: model.n_kv_heads \(2\) must be divisible by tp \(4\)$",
        ),
        (MODEL, 8, ParallelSpec(pp=8), r"^parallel.pp: model.n_layers \(4\) must be >= pp \(8\)"),
        (
            ModelSpec(n_layers=4),
            2,
            ParallelSpec(pp=2),
            r"^model.tie_embeddings: must be false when parallel.pp \(2\) > 1",
        ),
        (
            MODEL,
            4,
            ParallelSpec(pp=4, microbatches=2),
            r"^parallel.microbatches: 1f1b needs at least pp \(4\) micro-batches, got 2$",
        ),
        (MODEL, 4, ParallelSpec(dp=2, tp=2), r"^parallel.data_parallel: ddp cannot be combined with tp > 1"),
    ],
)
def test_impossible_configs_are_refused_with_one_line_naming_the_field(model, world, parallel, message):
    with pytest.raises(ValueError, match=message) as info:
        plan(model, world, parallel)
    assert "\n" not in str(info.value)


def test_gpipe_accepts_fewer_microbatches_than_stages():
    assert plan(MODEL, 4, ParallelSpec(pp=4, microbatches=1, pipeline_schedule="gpipe")).microbatches == 1


def test_tp_groups_stay_inside_a_node_when_nodes_hold_a_multiple_of_tp():
    # Ranks interleaved over two nodes (as an allocator filling round-robin would).
    topo = Topology(("a", "b", "a", "b", "a", "b", "a", "b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = plan(MODEL, 8, ParallelSpec(dp=2, tp=4, data_parallel="fsdp2"), topo)
    for group in dict(p.groups)["tp"]:
        assert len({topo.rank_nodes[r] for r in group}) == 1, group
    assert p.group_of(0, "tp") == (0, 2, 4, 6) and p.group_of(1, "tp") == (1, 3, 5, 7)
    assert p.warnings == ()


def test_tp_group_spanning_nodes_is_planned_with_a_warning():
    topo = Topology.uniform(4, ranks_per_node=2)
    with pytest.warns(TopologyWarning, match=r"parallel.tp: 1 tp group\(s\) span nodes"):
        p = plan(MODEL, 4, ParallelSpec(tp=4), topo)
    assert p.group_of(0, "tp") == (0, 1, 2, 3) and len(p.warnings) == 1


def test_topology_must_list_every_rank():
    with pytest.raises(ValueError, match=r"^topology: lists 2 ranks, the world has 4$"):
        plan(MODEL, 4, ParallelSpec(dp=4), Topology.single_node(2))


def test_job_spec_parallel_section_sets_world_size_and_old_specs_stay_valid():
    base = "name: j\nsteps: 3\ndata: {dataset: d@v1}\n"
    assert parse_job_spec(base).world_size == 1
    assert parse_job_spec(base + "parallel: {dp: 2}\n").world_size == 2
    spec = parse_job_spec(
        base + "model: {tie_embeddings: false}\nparallel: {dp: 2, pp: 2, data_parallel: fsdp2,"
        " activation_checkpointing: true, pipeline_schedule: gpipe, microbatches: 4}\n"
    )
    assert spec.world_size == 4 and spec.tokens_per_step == 2 * 8 * 1 * 256
    assert parse_job_spec(base + "parallel: {dp: 2, tp: 2, data_parallel: fsdp2}\n").world_size == 4
    with pytest.raises(ValueError, match=r"^job.yaml: parallel.data_parallel: "):
        parse_job_spec(base + "parallel: {data_parallel: zero3}\n")


def test_job_spec_refuses_at_parse_time_what_the_planner_refuses():
    base = "name: j\nsteps: 3\ndata: {dataset: d@v1}\n"
    with pytest.raises(ValueError, match=r"parallel.tp: model.n_heads \(4\) must be divisible by tp \(3\)$"):
        parse_job_spec(base + "parallel: {tp: 3}\n")
    with pytest.raises(ValueError, match=r"model.tie_embeddings: must be false when parallel.pp \(2\) > 1"):
        parse_job_spec(base + "parallel: {pp: 2}\n")
    with pytest.raises(ValueError, match=r"parallel.tp: tp \(2\) > 1 together with pp \(2\) > 1 is not supported yet$"):
        parse_job_spec(base + "model: {tie_embeddings: false}\nparallel: {tp: 2, pp: 2}\n")
