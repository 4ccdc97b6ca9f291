"""Gradient clipping by global norm (``optimizer.max_grad_norm``), owned by the precision
manager (L2-4) as a scaling folded into its unscale (services/engine/mixed_precision.py).

1. The manager alone: its gradients equal ``torch.nn.utils.clip_grad_norm_``'s after the
   unscale; below the threshold, at 0 and on a found_inf step nothing is clipped.
2. One rank (the real rank wiring, in this process) trains like a plain PyTorch loop that
   calls ``clip_grad_norm_`` before ``AdamW.step``.
3. Two data-parallel ranks (processes over gloo) train like one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from harness import GLOBAL_ROWS, GlobalRowsData, Rank, parity_spec, run_config

from services.compute.model import build_model
from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.engine.lr_schedule import schedule_for
from services.engine.mixed_precision import MixedPrecision
from tests.conftest import free_ports

MAX_NORM = 0.3  # well below this model's first gradient norms (about 1-3): every step clips
STEPS = 4


# ------------------------------------------------------------------ the manager alone


def manager(max_grad_norm: float, precision: str = "fp32"):
    bus = Bus()
    mp = MixedPrecision(bus.emitter(Module.L2_MIXED_PRECISION), lambda msg: None)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((4, 5), (7,), (3, 3))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    mp.attach(params)
    mp.init_precision(engine_pb2.InitPrecision(precision=precision, max_grad_norm=max_grad_norm))
    return mp, params


def step(mp, params, grad_scale: float, found_inf: bool = False):
    checked = mp.unscale_and_check(engine_pb2.UnscaleAndCheck(step=1))
    squares = checked.replicated_squares + checked.sharded_squares
    return mp.scale_loss(engine_pb2.ScaleLoss(step=1, found_inf=found_inf, grad_squares=squares, grad_scale=grad_scale))


def test_the_manager_clips_exactly_as_clip_grad_norm_after_the_unscale():
    mp, params = manager(max_grad_norm=1.5)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone() * 0.25  # the unscale (grad_scale 0.25, loss scale 1)
    expected_norm = torch.nn.utils.clip_grad_norm_(ref, 1.5)
    out = step(mp, params, grad_scale=0.25)
    assert out.grad_norm == pytest.approx(float(expected_norm), rel=1e-6)  # the norm before clipping
    assert out.grad_norm > 1.5 and out.clip_coef == pytest.approx(1.5 / (out.grad_norm + 1e-6))
    for r, p in zip(ref, params):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    assert clipped == pytest.approx(1.5, rel=1e-5)


@pytest.mark.parametrize(("max_norm", "found_inf"), [(0.0, False), (1e6, False), (1.5, True)])
def test_no_clipping_when_off_below_the_threshold_or_on_a_step_that_is_not_applied(max_norm, found_inf):
    mp, params = manager(max_grad_norm=max_norm)
    before = [p.grad.clone() for p in params]
    out = step(mp, params, grad_scale=1.0, found_inf=found_inf)
    assert out.clip_coef == 1.0
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_a_bad_max_grad_norm_is_refused_naming_the_field():
    bus = Bus()
    mp = MixedPrecision(bus.emitter(Module.L2_MIXED_PRECISION), lambda msg: None)
    with pytest.raises(ValueError, match="optimizer.max_grad_norm"):
        mp.init_precision(engine_pb2.InitPrecision(precision="fp32", max_grad_norm=-1.0))


# ------------------------------------------------------------------ training with clipping


def clipped_spec():
    return parity_spec(steps=STEPS, optimizer={"max_grad_norm": MAX_NORM})


def plain_pytorch_reference(spec) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The same job as a plain loop: mean loss over the global batch's tokens, backward,
    clip_grad_norm_, AdamW (Surge's groups and settings) at the schedule's rate."""
    torch.manual_seed(0)
    model = build_model(spec.model, spec.seed)
    o = spec.optimizer
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0, betas=(o.beta1, o.beta2), eps=o.eps, fused=True,
    )  # fmt: skip
    lr_at = schedule_for(o, spec.steps)
    data = GlobalRowsData(lambda *a: None, lambda *a: None, batches=0)
    losses, norms = [], []
    for s in range(spec.steps):
        rows = [data.row(s * GLOBAL_ROWS + b) for b in range(GLOBAL_ROWS)]
        x = torch.from_numpy(np.stack([r[0] for r in rows]))
        y = torch.from_numpy(np.stack([r[1] for r in rows]))
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)))
        for g in opt.param_groups:
            g["lr"] = lr_at(s + 1)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in sorted(model.state_dict().items())}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The real rank wiring, one rank, in this process."""
    spec = clipped_spec()
    (port,) = free_ports(1)
    r = Rank(spec, tmp_path_factory.mktemp("ckpt"), rank=0, world_size=1, port=port)
    try:
        r.run()
        steps = r.up.of(engine_pb2.StepCompleted)
        state = r.full_state()
    finally:
        r.modules.parallel.shutdown()
    return {"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps], "state": state}


@pytest.mark.timeout(120)
def test_one_rank_updates_like_clip_grad_norm_before_adamw(one_rank):
    spec = clipped_spec()
    losses, norms, state = plain_pytorch_reference(spec)
    assert min(norms) > MAX_NORM  # every step was clipped
    assert one_rank["losses"] == pytest.approx(losses, rel=1e-5)
    assert one_rank["grad_norms"] == pytest.approx(norms, rel=1e-5)  # the norm before clipping
    for k, v in state.items():
        torch.testing.assert_close(one_rank["state"][k], v, rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.timeout(240)
def test_two_data_parallel_ranks_clip_like_one(one_rank, tmp_path):
    runs = run_config({"dp": 2, "steps": STEPS, "optimizer": {"max_grad_norm": MAX_NORM}}, tmp_path)
    for r in runs:  # the same global norm, hence the same coefficient, on both ranks
        assert r["grad_norms"] == runs[0]["grad_norms"] and r["losses"] == runs[0]["losses"]
    assert runs[0]["losses"] == pytest.approx(one_rank["losses"], rel=1e-5)
    assert runs[0]["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-5)
    for k, v in one_rank["state"].items():
        torch.testing.assert_close(runs[0]["state"][k], v, rtol=0, atol=2e-4, msg=lambda m, k=k: f"{k}: {m}")
