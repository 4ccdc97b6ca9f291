"""NaN loss injected on one rank (SURGE_FAULT_INJECT) under two real gloo rank processes:
with ``fault_policy.actions.non_finite_loss: skip_step`` (a standing order L1-1 issues with
the job) the step is skipped on both ranks, their weights stay equal and finite, and
training goes on. The NaN is reported as it was (step event and metric), never smoothed
away. Every other action, on the real stack: tests/faults/test_step_faults.py."""

from __future__ import annotations

import math

import pytest
import torch

from services.jobspec import JobSpec
from tests.precision_ranks import run_two_ranks


def spec(**fault_policy) -> JobSpec:
    return JobSpec.model_validate({
        "name": "nan", "steps": 6, "seed": 0,
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4},
        "data": {"dataset": "corpus@v1", "seq_len": 32, "micro_batch_size": 2},
        "parallel": {"dp": 2}, "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 0, "at_end": False}, "eval": {"every_steps": 0, "at_end": False},
        "fault_policy": fault_policy,
    })  # fmt: skip


@pytest.mark.timeout(300)
def test_a_nan_loss_on_one_rank_is_skipped_on_both_under_skip_step_and_training_goes_on(tmp_path):
    r0, r1 = run_two_ranks(
        spec(actions={"non_finite_loss": "skip_step"}), tmp_path, tmp_path / "ckpt", "nan:nan_loss@3:rank=1"
    )
    for r in (r0, r1):
        assert r["failed"] == []
        assert [s["step"] for s in r["steps"]] == [1, 2, 3, 4, 5, 6]
        assert [s["skipped"] for s in r["steps"]] == [False, False, True, False, False, False]
        assert [s["skip_reason"] for s in r["steps"]] == ["", "", "non_finite_loss", "", "", ""]
        assert math.isnan(r["steps"][2]["loss"])  # reported as it was
        assert all(math.isfinite(s["loss"]) for i, s in enumerate(r["steps"]) if i != 2)
        assert r["metrics"][2] == "non_finite_loss"  # the metrics logger hears the skip too
        assert r["state"]["skipped_steps"] == 1
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    assert all(torch.isfinite(v).all() for v in r0["weights"].values())  # the NaN step never reached the weights
