"""Checkpoints under sharded parallel configs, and a dp=2 checkpoint resumed at dp=1.

Every run drives Surge's real rank wiring in gloo processes (tests/parallel/harness.py);
checkpoints are torch.distributed.checkpoint directories written and read through the
rank's checkpoint relay, with the model and optimizer as sharded DTensor state under
FSDP2 / TP (get_state_dict / set_state_dict).
"""

from __future__ import annotations

import pytest
import torch
from harness import parity_spec, run_config

from services.compute.inference import load_model_for_inference

SHARDED = {
    "fsdp2_dp2": {"dp": 2, "data_parallel": "fsdp2"},
    "tp2": {"tp": 2},
    "fsdp2_dp2_x_tp2": {"dp": 2, "tp": 2, "data_parallel": "fsdp2"},
}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """config name -> (results of a 6-step run saving at steps 3 and 6, its checkpoint root)."""
    cache: dict[str, tuple[list[dict], object]] = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"full_{name}")
            cache[name] = (run_config({**SHARDED[name], "steps": 6, "ckpt_every": 3}, out), out / "ckpt")
        return cache[name]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SHARDED))
def test_resume_under_a_sharded_config_replays_the_uninterrupted_run_bit_for_bit(full_runs, tmp_path, name):
    full, ckpt = full_runs(name)
    assert full[0]["committed"] == [3, 6]
    resumed = run_config({**SHARDED[name], "steps": 6, "ckpt_root": str(ckpt), "resume": "step3"}, tmp_path)
    assert resumed[0]["steps"] == [4, 5, 6]
    assert resumed[0]["losses"] == full[0]["losses"][3:]
    assert all(torch.equal(resumed[0]["state"][k], v) for k, v in full[0]["state"].items())


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_loads_for_single_process_inference(full_runs):
    full, ckpt = full_runs("fsdp2_dp2_x_tp2")
    model = load_model_for_inference(str(ckpt / "step6"), parity_spec())
    assert all(torch.equal(v, full[0]["state"][k]) for k, v in model.state_dict().items())


@pytest.mark.timeout(600)
def test_a_dp2_checkpoint_resumes_at_dp1_on_the_same_global_batches(full_runs, tmp_path):
    """The data position is global (one cursor): the FSDP2 dp=2 checkpoint of step 3 resumes
    in one process (the same 8-row global batch in one micro-batch) and steps 4..6 take the
    same rows: the same token counts, the same losses to 1e-5."""
    full, ckpt = full_runs("fsdp2_dp2")
    (single,) = run_config({"steps": 6, "ckpt_root": str(ckpt), "resume": "step3"}, tmp_path)
    assert single["steps"] == [4, 5, 6] and single["tokens"] == full[0]["tokens"][3:]
    assert max(abs(a - b) / b for a, b in zip(single["losses"], full[0]["losses"][3:], strict=True)) <= 1e-5


@pytest.mark.timeout(600)
def test_a_dp2_fsdp2_checkpoint_loads_into_dp1_and_continues_like_dp2(full_runs, tmp_path):
    """Model and optimizer of an FSDP2 dp=2 checkpoint, loaded through the checkpoint relay
    into one process (and, for comparison, into DDP dp=2), then 3 more steps on the same
    global batches: the same losses (1e-5) as the dp=2 continuation."""
    _, ckpt = full_runs("fsdp2_dp2")
    weights = str(ckpt / "step3")
    single = run_config({"steps": 3, "load_weights_from": weights}, tmp_path / "dp1")[0]
    pair = run_config({"dp": 2, "steps": 3, "load_weights_from": weights}, tmp_path / "dp2")[0]
    on_disk = load_model_for_inference(weights, parity_spec()).state_dict()
    assert all(torch.equal(single["loaded"]["state"][k], v) for k, v in on_disk.items())
    assert single["loaded"]["optim"]["blocks.0.attn.q.weight.step"].item() == 3  # AdamW's step count came too
    torch.testing.assert_close(single["loaded"]["optim"], pair["loaded"]["optim"], rtol=0, atol=0)
    assert len(single["losses"]) == 3
    assert max(abs(a - b) / b for a, b in zip(single["losses"], pair["losses"], strict=True)) <= 1e-5
