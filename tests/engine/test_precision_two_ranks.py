"""fp16 dynamic loss scaling over two real gloo rank processes: an overflow injected on one
rank skips the step on both, the scale moves by the configured rule (hysteresis included),
and a run resumed from a checkpoint ends with the same scale, counters and weights as an
uninterrupted one. Plus the step faults of the rule (storm, minimum scale), reported to L1, in-process."""

from __future__ import annotations

import threading

import pytest
import torch
from precision_harness import guarded_rank
from rank_fakes import answer_step_faults, tiny_spec

from services.contract import engine_pb2
from services.rank.faults import Injection
from tests.precision_ranks import run_two_ranks

RULE = {"init_scale": 1024.0, "growth_interval": 2, "hysteresis": 2, "backoff_factor": 0.5, "min_scale": 1.0}


def fp16_spec(**kw):
    return tiny_spec(
        steps=8,
        parallel={"dp": 2},
        data={"micro_batch_size": 2, "seq_len": 32},
        precision={"dtype": "fp16", "loss_scale": RULE},
        checkpoint={"every_steps": 4, "at_end": False},
        **kw,
    )


def comparable(steps: list[dict]) -> list[dict]:
    """Step records with NaN written out (NaN != NaN; a skipped step's norm is NaN or inf)."""
    return [{k: repr(v) if isinstance(v, float) else v for k, v in s.items()} for s in steps]


@pytest.mark.timeout(600)
def test_an_overflow_on_one_rank_skips_the_step_on_both_backs_off_by_the_rule_and_resumes_exactly(tmp_path):
    spec = fp16_spec()
    ckpt = tmp_path / "ckpt"
    # Overflowing gradients on rank 0 only, at steps 3, 4 and 6.
    inject = "tiny:inf_grad@3:rank=0,tiny:inf_grad@4:rank=0,tiny:inf_grad@6:rank=0"
    a0, a1 = run_two_ranks(spec, tmp_path / "a", ckpt, inject)
    assert a0["failed"] == [] and a1["failed"] == []
    for r in (a0, a1):
        assert [s["step"] for s in r["steps"]] == list(range(1, 9))
        assert [s["skipped"] for s in r["steps"]] == [False, False, True, True, False, True, False, False]
        assert [s["skip_reason"] for s in r["steps"]] == ["", "", "overflow", "overflow", "", "overflow", "", ""]
        # Scale used by each step: 2 clean steps grow 1024 -> 2048; the 1st overflow spends
        # the hysteresis (2 -> 1), the 2nd backs off (1024, hysteresis 0); with none left the
        # overflow at step 6 backs off at once (512); steps 7 and 8 grow it back (1024).
        assert [s["loss_scale"] for s in r["steps"]] == [1024, 1024, 2048, 2048, 1024, 1024, 512, 512]
        assert r["metrics"] == [s["skip_reason"] for s in r["steps"]]  # the metrics logger hears it too
        assert r["verdict"] is True  # L3-5's all-rank flag: rank 0 alone reported an overflow
    assert a0["state"]["loss_scale"] == 1024.0 and a0["state"]["loss_scaler"] == [0, 2, 1]
    assert a0["state"]["skipped_steps"] == 3 and a0["state"]["consecutive_skips"] == 0
    assert [s["loss"] for s in a0["steps"]] == [s["loss"] for s in a1["steps"]]
    assert all(torch.equal(a0["weights"][k], a1["weights"][k]) for k in a0["weights"])

    # Resume from the step-4 checkpoint (scale 1024, hysteresis spent, 2 skipped steps);
    # the step-6 overflow comes again (fresh markers): the run must end where A ended.
    b0, b1 = run_two_ranks(spec, tmp_path / "b", ckpt, inject.split(",")[-1], resume="step4")
    for b, a in ((b0, a0), (b1, a1)):
        assert b["failed"] == []
        assert comparable(b["steps"]) == comparable(a["steps"][4:])
        assert b["state"] == a["state"]
        assert all(torch.equal(b["weights"][k], a["weights"][k]) for k in a["weights"])


# ------------------------------------------------------------------ in-process, one rank


def run_local(tmp_path, spec, injections):
    """One rank in-process; every step fault it reports is answered STEP_RELAUNCH (as L1-1
    decides a rollback): the loop ends there. Returns (rank, its reports)."""
    local = guarded_rank(spec, tmp_path / "ckpt", injections=injections, marker_dir=tmp_path / "markers")
    reports = answer_step_faults(local, lambda r: engine_pb2.STEP_RELAUNCH)
    local.command(engine_pb2.StartTraining(job_id="job"))
    t = threading.Thread(target=local.run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and local.error is None
    assert not local.up.of(engine_pb2.TrainingLoopFailed)  # a step fault is L1's to decide, not a failure
    return local, reports


@pytest.mark.timeout(180)
def test_k_consecutive_skipped_steps_are_an_overflow_storm_reported_to_l1_at_the_kth(tmp_path):
    spec = tiny_spec(
        steps=6,
        precision={"dtype": "fp16", "loss_scale": {**RULE, "hysteresis": 5}},
        fault_policy={"overflow_storm_steps": 3},
    )
    local, reports = run_local(tmp_path, spec, [Injection("inf_grad", s, 0) for s in (2, 4, 5, 6)])
    # The overflows follow the standing order (skip_step, the default): no round trip.
    assert [(s.skipped, s.standing_order) for s in local.steps()] == [
        (False, 0),
        (True, 1),
        (False, 0),
        (True, 1),
        (True, 1),
    ]
    (storm,) = reports
    assert (storm.kind, storm.step, storm.consecutive_skips) == (engine_pb2.STEP_FAULT_OVERFLOW_STORM, 6, 3)
    assert storm.detail.startswith("3 consecutive steps skipped (up to step 6, last: overflow, loss scale 1024)")


@pytest.mark.timeout(180)
def test_an_overflow_that_backs_the_scale_off_to_its_minimum_is_a_step_fault_of_its_own(tmp_path):
    spec = tiny_spec(
        steps=4,
        precision={"dtype": "fp16", "loss_scale": {**RULE, "init_scale": 4.0, "min_scale": 2.0, "hysteresis": 1}},
    )
    local, reports = run_local(tmp_path, spec, [Injection("inf_grad", 2, 0)])
    assert [s.skipped for s in local.steps()] == [False]
    (fault,) = reports
    assert (fault.kind, fault.step, fault.loss_scale) == (engine_pb2.STEP_FAULT_LOSS_SCALE_AT_MINIMUM, 2, 2.0)
    assert "backed off to its minimum 2 (precision.loss_scale.min_scale)" in fault.detail


@pytest.mark.timeout(180)
def test_an_overflow_mapped_away_from_skip_step_asks_l1(tmp_path):
    spec = tiny_spec(steps=3, precision={"dtype": "fp16"}, fault_policy={"actions": {"gradient_overflow": "rollback"}})
    local, reports = run_local(tmp_path, spec, [Injection("inf_grad", 2, 0)])
    assert [s.skipped for s in local.steps()] == [False]
    (fault,) = reports
    assert (fault.kind, fault.step) == (engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW, 2)
    assert fault.detail.startswith("gradients are not finite at step 2")
