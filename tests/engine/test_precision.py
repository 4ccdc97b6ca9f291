"""L2-4 dynamic loss scaling: the rule (growth, backoff, hysteresis, minimum), its agreement
with torch.amp.GradScaler's kernel, and the precision manager behind its commands."""

from __future__ import annotations

import random

import pytest
import torch

from services.compute.operator_adapter import OperatorAdapter
from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.engine.mixed_precision import DynamicLossScaler, MixedPrecision, ScalerPolicy
from services.jobspec import JobSpecError, parse_job_spec

pytestmark = pytest.mark.timeout(60)


def test_the_scale_grows_by_the_factor_after_growth_interval_clean_steps():
    s = DynamicLossScaler(ScalerPolicy(init_scale=1024.0, growth_interval=3, hysteresis=2))
    for _ in range(2):
        assert s.update(False) == (False, False)
    assert (s.scale, s.growth_tracker) == (1024.0, 2)
    s.update(False)
    assert (s.scale, s.growth_tracker, s.hysteresis_left) == (2048.0, 0, 2)


def test_hysteresis_tolerates_overflows_before_backing_off_and_only_a_growth_refills_it():
    s = DynamicLossScaler(ScalerPolicy(init_scale=1024.0, growth_interval=2, hysteresis=2, backoff_factor=0.5))
    assert s.update(True) == (False, False)  # first overflow: tolerated
    assert (s.scale, s.hysteresis_left, s.growth_tracker) == (1024.0, 1, 0)
    s.update(False)  # a clean step does not refill (Megatron)
    assert s.update(True) == (True, False)  # second overflow: back off
    assert (s.scale, s.hysteresis_left) == (512.0, 0)
    assert s.update(True) == (True, False)  # hysteresis spent: every overflow backs off
    assert s.scale == 256.0
    s.update(False), s.update(False)  # growth_interval clean steps: grow, refill
    assert (s.scale, s.hysteresis_left, s.growth_tracker) == (512.0, 2, 0)
    assert s.update(True) == (False, False)


def test_an_overflow_whose_backoff_reaches_the_minimum_scale_is_flagged_and_the_scale_stays_there():
    s = DynamicLossScaler(ScalerPolicy(init_scale=8.0, min_scale=2.0, hysteresis=1, backoff_factor=0.5))
    assert s.update(True) == (True, False) and s.scale == 4.0
    assert s.update(True) == (True, True) and s.scale == 2.0  # reached the minimum
    assert s.update(True) == (False, True) and s.scale == 2.0  # cannot go lower


def test_with_hysteresis_one_the_rule_is_torch_amp_gradscalers_kernel():
    rng = random.Random(0)
    verdicts = [rng.random() < 0.3 for _ in range(200)]
    ours = DynamicLossScaler(
        ScalerPolicy(
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=4,
            hysteresis=1,
            min_scale=2.0**-24,
        )
    )
    scale, tracker = torch.tensor(2.0**16), torch.tensor(0, dtype=torch.int32)
    for found_inf in verdicts:
        ours.update(found_inf)
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found_inf)), 2.0, 0.5, 4)
        assert (ours.scale, ours.growth_tracker) == (float(scale), int(tracker))


def test_a_bad_scaling_rule_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^precision.loss_scale.backoff_factor: invalid value 1.5$"):
        ScalerPolicy(backoff_factor=1.5)
    with pytest.raises(JobSpecError, match="precision.loss_scale.hysteresis: Input should be greater than 0"):
        parse_job_spec(
            "name: a\nsteps: 1\ndata: {dataset: d@v}\nprecision: {dtype: fp16, loss_scale: {hysteresis: 0}}\n"
        )


def test_the_spec_defaults_are_gradscaler_and_megatron_and_old_string_specs_still_parse():
    spec = parse_job_spec("name: a\nsteps: 1\ndata: {dataset: d@v}\nprecision: fp16\n")
    rule = spec.precision.scaling
    assert (rule.init_scale, rule.growth_factor, rule.backoff_factor, rule.growth_interval) == (65536.0, 2.0, 0.5, 2000)
    assert (rule.hysteresis, rule.min_scale) == (2, 1.0)
    assert parse_job_spec("name: a\nsteps: 1\ndata: {dataset: d@v}\nprecision: bf16\n").precision.dtype == "bf16"
    assert parse_job_spec("name: a\nsteps: 1\ndata: {dataset: d@v}\n").precision.dtype == "fp32"


# ------------------------------------------------------------------ the manager on a bus


def manager():
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER), "cpu")
    precision = MixedPrecision(
        bus.emitter(Module.L2_MIXED_PRECISION), bus.port(Module.L2_MIXED_PRECISION, Module.L3_OPERATOR_ADAPTER)
    )
    ready: list[engine_pb2.OperatorsReady] = []
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SetComputePrecision, adapter.set_compute_precision)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.OperatorsReady, lambda m, p=None: ready.append(m))
    for msg, handler in (
        (engine_pb2.InitPrecision, precision.init_precision),
        (engine_pb2.UnscaleAndCheck, precision.unscale_and_check),
        (engine_pb2.ScaleLoss, precision.scale_loss),
    ):
        bus.subscribe(Module.L2_MIXED_PRECISION, msg, handler)
    return precision, bus.port(Module.L2_TRAINING_LOOP, Module.L2_MIXED_PRECISION), ready


def fp16(**kw) -> engine_pb2.InitPrecision:
    rule = dict(
        init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2, min_scale=1.0
    )
    rule.update(kw)
    return engine_pb2.InitPrecision(precision="fp16", **rule)


def test_fp16_sets_float16_compute_unscales_the_gradients_and_moves_the_scale_by_the_all_rank_verdict():
    precision, loop, ready = manager()
    p = torch.nn.Parameter(torch.zeros(4))
    precision.attach([p])
    got = loop(fp16()).message
    assert (got.precision, got.loss_scale, got.state.hysteresis_left) == ("fp16", 1024.0, 2)
    assert ready[-1].dtype == "float16"
    p.grad = torch.full((4,), 2048.0)  # scaled by 1024
    checked = loop(engine_pb2.UnscaleAndCheck(step=1)).message
    assert not checked.found_inf and checked.loss_scale == 1024.0
    assert checked.replicated_squares == pytest.approx(4 * 2048.0**2)  # as back-propagated
    assert torch.equal(p.grad, torch.full((4,), 2048.0))
    # The verdict that moves the scale is the all-rank one the loop hands over, not this
    # rank's; the unscale comes with it, and the norm is the unscaled gradients'.
    adjusted = loop(engine_pb2.ScaleLoss(step=1, found_inf=True, grad_squares=checked.replicated_squares)).message
    assert torch.equal(p.grad, torch.full((4,), 2.0)) and adjusted.grad_norm == pytest.approx(4.0)
    assert (adjusted.loss_scale, adjusted.state.hysteresis_left, adjusted.backed_off) == (1024.0, 1, False)
    adjusted = loop(engine_pb2.ScaleLoss(step=2, found_inf=True)).message
    assert (adjusted.loss_scale, adjusted.backed_off, adjusted.at_minimum) == (512.0, True, False)


def test_a_resumed_scaler_starts_exactly_from_the_checkpointed_state():
    precision, loop, _ = manager()
    msg = fp16()
    msg.resume.CopyFrom(engine_pb2.LossScalerState(scale=96.0, growth_tracker=2, hysteresis_left=1))
    got = loop(msg).message
    assert (got.loss_scale, got.state.growth_tracker, got.state.hysteresis_left) == (96.0, 2, 1)
    assert loop(engine_pb2.ScaleLoss(step=9, found_inf=False)).message.loss_scale == 192.0  # 3rd clean step


def test_fp32_and_bf16_keep_a_scale_of_one_whatever_the_verdict():
    for policy in ("fp32", "bf16"):
        _, loop, ready = manager()
        assert loop(engine_pb2.InitPrecision(precision=policy)).message.loss_scale == 1.0
        adjusted = loop(engine_pb2.ScaleLoss(step=1, found_inf=True)).message
        assert (adjusted.loss_scale, adjusted.backed_off, adjusted.at_minimum) == (1.0, False, False)
