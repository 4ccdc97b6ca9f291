"""NaN loss injected on one rank (SURGE_FAULT_INJECT) under two real gloo rank processes:
with ``fault_policy.actions.non_finite_loss: skip_step`` the step is skipped on both ranks
and training goes on; without it both ranks report the same typed failure. The NaN is
reported as it was (step event and metric), never smoothed away."""

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
    r0, r1 = run_two_ranks(spec(actions={"non_finite_loss": "skip_step"}), tmp_path, tmp_path / "ckpt",
                           "nan:nan_loss@3:rank=1")
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


@pytest.mark.timeout(300)
def test_without_skip_step_a_nan_loss_on_one_rank_is_the_same_typed_failure_on_both(tmp_path):
    r0, r1 = run_two_ranks(spec(), tmp_path, tmp_path / "ckpt", "nan:nan_loss@3:rank=1")
    for r in (r0, r1):
        assert [s["step"] for s in r["steps"]] == [1, 2]
        ((fault_class, detail),) = r["failed"]
        assert fault_class == "non_finite_loss"
        assert detail.startswith("training loss is nan at step 3 (128 tokens): the step is not applied")


# ------------------------------------------------------------------ through the whole stack

STACK_INJECT = "tskip:inf_grad@3,tskip:nan_loss@5:rank=1"
STACK_JOB = """\
name: tskip
steps: 8
seed: 0
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 64, micro_batch_size: 4}
parallel: {dp: 2}
optimizer: {lr: 3.0e-3, warmup_steps: 2}
precision: {dtype: fp16, loss_scale: {init_scale: 1024.0, hysteresis: 1}}
checkpoint: {every_steps: 0, at_end: false}
eval: {every_steps: 0, at_end: false}
fault_policy: {actions: {non_finite_loss: skip_step}}
"""


@pytest.fixture
def skip_stack(tmp_path):
    from tests.faults.test_recovery import running_stack

    with running_stack(tmp_path / "home", ("json",), ("tskip",), env={"SURGE_FAULT_INJECT": STACK_INJECT}) as s:
        yield s


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_through_the_stack_an_overflow_and_a_nan_are_skip_events_and_metrics_and_the_job_finishes(skip_stack):
    from tests.faults.test_recovery import finished, metric, of_type

    before = {r: metric(skip_stack.metrics(), "surge_skipped_steps_total", reason=r) for r in ("overflow", "non_finite_loss")}
    job = skip_stack.submit(STACK_JOB)
    events = skip_stack.events(job)
    finished(events)
    skips = of_type(events, "skip")
    assert [m.split(" (")[0] for m in skips] == ["step 3 skipped", "step 5 skipped"]
    assert "(overflow)" in skips[0] and "(non_finite_loss)" in skips[1] and skips[1].endswith("loss nan")
    after = {r: metric(skip_stack.metrics(), "surge_skipped_steps_total", reason=r) for r in before}
    assert after == {"overflow": before["overflow"] + 1, "non_finite_loss": before["non_finite_loss"] + 1}
    records = {(r["rank"], r["step"]): r for r in skip_stack.step_records(job)}
    for rank in (0, 1):
        assert [records[rank, s]["skipped"] for s in range(1, 9)] == [s in (3, 5) for s in range(1, 9)]
        assert records[rank, 4]["loss_scale"] == 512.0  # hysteresis 1: the overflow at step 3 halved 1024
    assert not of_type(events, "fault")
