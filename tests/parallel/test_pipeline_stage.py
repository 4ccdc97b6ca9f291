"""Pipeline stage modules on the same model code, in one process (no group needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.compute.model import build_model
from services.compute.pipeline_stage import PipelineRunner, StageModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_common import SEED, SPEC, global_batch, layer_ranges  # noqa: E402


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stages_chained_in_one_process_equal_the_unsplit_model_exactly(pp):
    model = build_model(SPEC, seed=SEED)
    stages = [StageModule(model, r, stage_index=s, num_stages=pp) for s, r in enumerate(layer_ranges(pp))]
    ids_BT, _ = global_batch(1)
    with torch.no_grad():
        x = ids_BT
        for stage in stages:
            x = stage(x)
        assert torch.equal(x, model(ids_BT))


def test_stage_state_dicts_partition_the_full_models_keys_under_the_same_names():
    model = build_model(SPEC, seed=SEED)
    full = model.state_dict()
    keys = [set(StageModule(model, r, stage_index=s, num_stages=2).state_dict()) for s, r in enumerate(layer_ranges(2))]
    assert keys[0].isdisjoint(keys[1]) and keys[0] | keys[1] == set(full)
    assert "tok_emb.weight" in keys[0] and "blocks.1.mlp.down.weight" in keys[0]
    assert "lm_head.weight" in keys[1] and "blocks.2.mlp.down.weight" in keys[1] and "norm.weight" in keys[1]


def _runner(**kw):
    stage = StageModule(build_model(SPEC, seed=SEED), range(0, 2), stage_index=0, num_stages=2)
    args = dict(schedule="1f1b", microbatches=2, microbatch_shape=(2, 32))
    return PipelineRunner(stage, **{**args, **kw})


def test_tied_embeddings_with_more_than_one_stage_are_refused_naming_the_field():
    model = build_model(SPEC.model_copy(update={"tie_embeddings": True}), seed=SEED)
    with pytest.raises(ValueError, match=r"^model.tie_embeddings: must be false with parallel.pp > 1"):
        StageModule(model, range(0, 2), stage_index=0, num_stages=2)
    StageModule(model, range(0, 4), stage_index=0, num_stages=1)  # one stage holds both ends: fine


def test_unknown_schedule_and_bad_microbatches_are_refused_before_any_communication():
    with pytest.raises(
        ValueError, match=r"parallel.pipeline_schedule: expected one of \('gpipe', '1f1b'\), got 'dualpipe'"
    ):
        _runner(schedule="dualpipe")
    with pytest.raises(ValueError, match=r"parallel.microbatches: must be >= 1, got 0"):
        _runner(microbatches=0)
    with pytest.raises(ValueError, match=r"stage_index 2 is not in 0..1"):
        StageModule(build_model(SPEC, seed=SEED), range(0, 2), stage_index=2, num_stages=2)


def test_a_layer_range_outside_the_model_is_refused():
    model = build_model(SPEC, seed=SEED)
    with pytest.raises(ValueError, match="is not a contiguous range"):
        StageModule(model, range(3, 6), stage_index=1, num_stages=2)
