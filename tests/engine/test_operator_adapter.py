"""L3-2 operator adapter: selection by command only, reported in OperatorsReady, refusal of
what this device lacks (no silent fallback), and torch.compile running on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from services.compute.forward_unit import ForwardUnit
from services.compute.model import build_model
from services.compute.operator_adapter import OperatorAdapter, OperatorUnavailable, compile_regions
from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.engine.optimizer import Optimizer, OptimizerUnavailable
from services.jobspec import JobSpecError, ModelSpec, OptimizerSpec, parse_job_spec

pytestmark = pytest.mark.timeout(120)
SPEC = ModelSpec(n_layers=1, d_model=32, n_heads=2, vocab_size=64)


def wired(device: str = "cpu"):
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER), device)
    forward = ForwardUnit(
        bus.emitter(Module.L3_FORWARD_UNIT), bus.port(Module.L3_FORWARD_UNIT, Module.L3_OPERATOR_ADAPTER)
    )
    reports: list[engine_pb2.OperatorsReady] = []
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SelectOperators, adapter.select_operators)
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SetComputePrecision, adapter.set_compute_precision)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.ConfigureForward, forward.configure_forward)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.RunForward, forward.run_forward)
    bus.subscribe(
        Module.L3_FORWARD_UNIT,
        engine_pb2.OperatorsReady,
        lambda m, p: (reports.append(m), forward.on_operators_ready(m, p)),
    )
    model = build_model(SPEC, 0)
    if device == "cpu":
        forward.attach(model)
    forward_port = bus.port(Module.L2_TRAINING_LOOP, Module.L3_FORWARD_UNIT)
    return model, forward_port, bus.port(Module.L2_MIXED_PRECISION, Module.L3_OPERATOR_ADAPTER), reports


def test_the_selection_is_reported_whole_and_flash_runs_restricted_to_its_kernel():
    model, forward, precision, reports = wired()
    forward(engine_pb2.ConfigureForward(attention="flash", adamw="foreach", compile=False))
    precision(engine_pb2.SetComputePrecision(dtype="float16"))
    ready = reports[-1]
    assert (ready.attention, ready.kernel, list(ready.sdpa_backends)) == ("flash", "sdpa", ["FLASH_ATTENTION"])
    assert (ready.dtype, ready.adamw, ready.compile, ready.device) == ("float16", "foreach", False, "cpu")
    x = torch.randint(0, 64, (2, 16))
    logits = forward(engine_pb2.RunForward(training=False), x).payload
    assert logits.dtype == torch.float16  # fp16 autocast region
    with torch.no_grad():
        reference = model(x, attention="math")
    assert torch.allclose(logits.float(), reference, atol=2e-2)


def test_math_and_sdpa_give_the_same_logits():
    model, forward, _, _ = wired()
    forward(engine_pb2.ConfigureForward(attention="math"))
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(
            forward(engine_pb2.RunForward(training=False), x).payload, model(x, attention="sdpa"), atol=1e-5
        )


def test_an_unavailable_kernel_is_refused_with_the_field_named_and_nothing_selected():
    _, forward, _, reports = wired()
    # No memory-efficient SDPA kernel on CPU in torch 2.13: refused, not swapped for another.
    refused = r"^operators.attention: efficient \(EFFICIENT_ATTENTION\) is not available on cpu in float32"
    with pytest.raises(OperatorUnavailable, match=refused):
        forward(engine_pb2.ConfigureForward(attention="efficient"))
    with pytest.raises(OperatorUnavailable, match=r"^operators.adamw: 'sgd' is not available"):
        wired()[1](engine_pb2.ConfigureForward(attention="sdpa", adamw="sgd"))
    assert reports == []


def test_fused_adamw_is_refused_on_a_device_without_the_kernel():
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER), "meta")
    with pytest.raises(OperatorUnavailable, match=r"^operators.adamw: fused AdamW is not available on meta"):
        adapter.select_operators(engine_pb2.SelectOperators(attention="math", adamw="fused"))
    optimizer = Optimizer(OptimizerSpec(), bus.emitter(Module.L2_OPTIMIZER), implementation="fused")
    with pytest.raises(OptimizerUnavailable, match=r"fused AdamW is not available for parameters on \['meta'\]"):
        optimizer.attach(build_model(SPEC, 0).to("meta"))


@pytest.mark.parametrize("implementation", ["fused", "foreach", "default"])
def test_every_adamw_implementation_takes_the_same_step_on_cpu(implementation):
    bus = Bus()
    model = build_model(SPEC, 0)
    optimizer = Optimizer(OptimizerSpec(), bus.emitter(Module.L2_OPTIMIZER), implementation=implementation)
    optimizer.attach(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    optimizer.apply_update(engine_pb2.ApplyUpdate(step=1, learning_rate=1e-2))
    reference = build_model(SPEC, 0)
    torch.manual_seed(0)
    ref_opt = torch.optim.AdamW(
        [{"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    for p in reference.parameters():
        p.grad = torch.full_like(p, 0.01)
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-7), name


def test_the_job_spec_keeps_model_attention_and_refuses_two_different_choices():
    base = "name: a\nsteps: 1\ndata: {dataset: d@v}\n"
    assert parse_job_spec(base + "model: {attention: math}\n").attention == "math"
    assert parse_job_spec(base + "operators: {attention: flash}\n").attention == "flash"
    with pytest.raises(JobSpecError, match="operators.attention \\(flash\\) and model.attention \\(math\\) disagree"):
        parse_job_spec(base + "model: {attention: math}\noperators: {attention: flash}\n")
    with pytest.raises(JobSpecError, match="operators.adamw: Input should be 'fused', 'foreach' or 'default'"):
        parse_job_spec(base + "operators: {adamw: apex}\n")


@pytest.mark.timeout(600)
def test_torch_compile_runs_the_forward_and_backward_on_cpu_with_eager_numbers():
    # Inductor generates and builds C++ here: tens of seconds on a loaded 2-core machine.
    model, forward, _, _ = wired()
    forward(engine_pb2.ConfigureForward(attention="sdpa", compile=True))
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    logits = forward(engine_pb2.RunForward(training=True), x).payload
    functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1)).backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = model(x, attention="sdpa")
    functional.cross_entropy(eager.reshape(-1, 64), y.reshape(-1)).backward()
    assert torch.allclose(logits, eager, atol=1e-5)
    assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(compiled_grads, model.parameters()))
    # Regional compilation: each block compiled in place, the model itself not wrapped
    # (a whole-model compile builds every block's kernels: 150 s of a 1 B model's first step).
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None


def test_regional_compilation_looks_through_the_ddp_wrapper_and_compiles_whole_what_has_no_blocks():
    model = build_model(SPEC, 0)
    wrapper = torch.nn.Module()
    wrapper.module = model  # DDP's shape: the model under .module
    assert compile_regions(wrapper) is wrapper
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    plain = torch.nn.Linear(2, 2)
    assert compile_regions(plain) is not plain  # no blocks: torch.compile's wrapper of the whole
