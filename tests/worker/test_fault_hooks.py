"""The rank's fault hooks: a non-finite loss or an overflow storm ends the rank with a typed
failure; test-only injections parse strictly and fire once per job and rank."""

from __future__ import annotations

import math

import pytest
import torch

from services.contract import engine_pb2
from services.contract.bus import Reply
from services.engine.training_loop import TrainingFault
from services.worker.faults import FaultInjector, Injection, StepGuard, parse_injections

pytestmark = pytest.mark.timeout(30)


def test_injections_are_parsed_per_job_name_and_a_bad_entry_is_one_line():
    text = "a:nan_loss@7,b:hang@3:rank=1, a:hang@9:rank=2"
    assert parse_injections(text, "a") == [Injection("nan_loss", 7, 0), Injection("hang", 9, 2)]
    assert parse_injections(text, "c") == []
    with pytest.raises(ValueError, match=r"^SURGE_FAULT_INJECT: 'a:explode@1': expected <job name>:<nan_loss\|hang>@<step>"):
        parse_injections("a:explode@1", "a")


def test_a_nan_injection_poisons_the_logits_of_its_step_once_across_relaunches(tmp_path):
    logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64)
    first = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 0, marker_dir=tmp_path)
    assert torch.equal(first.before_backward(6, (logits, labels))[0], logits)
    poisoned, same = first.before_backward(7, (logits, labels))
    assert torch.isnan(poisoned).all() and same is labels
    relaunched = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 0, marker_dir=tmp_path)
    assert torch.equal(relaunched.before_backward(7, (logits, labels))[0], logits)
    other_rank = FaultInjector([Injection("nan_loss", 7, 0)], "j-1", 1, marker_dir=tmp_path)
    assert torch.equal(other_rank.before_backward(7, (logits, labels))[0], logits)


def test_a_non_finite_training_loss_ends_the_rank_as_non_finite_loss_but_evaluation_does_not():
    loss = {"value": 1.5}
    guard = StepGuard(8, lambda: 12)
    backward = guard.backward(lambda msg, payload: Reply(engine_pb2.BackwardDone(loss_sum=loss["value"], tokens=256)))
    assert backward(engine_pb2.RunBackward(backward=True), None).message.loss_sum == 1.5
    loss["value"] = math.nan
    assert math.isnan(backward(engine_pb2.RunBackward(backward=False), None).message.loss_sum)  # eval: reported only
    with pytest.raises(TrainingFault) as e:
        backward(engine_pb2.RunBackward(backward=True), None)
    assert e.value.fault_class == "non_finite_loss"
    assert str(e.value) == "training loss is nan at step 12 (256 tokens): the step is not applied"


def test_k_consecutive_overflowing_steps_are_an_overflow_storm():
    found = iter([True, True, False, True, True, True])
    guard = StepGuard(3, lambda: 1)
    check = guard.precision(lambda msg, payload: Reply(engine_pb2.OverflowChecked(found_inf=next(found), loss_scale=1.0)))
    for step in range(1, 6):  # two overflows, a good step, then two more: no storm yet
        check(engine_pb2.UnscaleAndCheck(step=step), None)
    with pytest.raises(TrainingFault) as e:
        check(engine_pb2.UnscaleAndCheck(step=6), None)
    assert e.value.fault_class == "overflow_storm" and str(e.value).startswith("3 consecutive steps overflowed (up to step 6")
