"""L2 modules behind their commands: schedule, optimizer, mixed precision, parallel plan."""

from __future__ import annotations

import math
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from services.compute.model import build_model
from services.compute.operator_adapter import OperatorAdapter
from services.contract import Module, control_pb2, engine_pb2, route_pb2
from services.contract.bus import Bus
from services.contract.failures import ModuleFailed, RendezvousFailed, set_origin
from services.control.fault_detector import FaultDetector
from services.engine.lr_schedule import learning_rate, schedule_for
from services.engine.mixed_precision import MixedPrecision
from services.engine.optimizer import Optimizer
from services.engine.parallel_strategy import ParallelStrategy, _port_taken
from services.jobspec import ModelSpec, OptimizerSpec
from tests.module_failed import raised_in_module
from tests.ports import free_port

TINY = ModelSpec(n_layers=1, d_model=16, n_heads=2, vocab_size=32)


# ------------------------------------------------------------------ learning-rate schedule


def test_lr_warms_up_linearly_peaks_then_follows_the_cosine_to_the_floor():
    lr = lambda s: learning_rate(s, lr=1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)  # noqa: E731
    assert [lr(s) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr(60) == pytest.approx(0.55)  # halfway through the decay: (1 + 0.1) / 2
    assert lr(35) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr(110) == pytest.approx(0.1)
    assert lr(500) == pytest.approx(0.1)  # past the end: the floor
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_constant_schedule_and_no_warmup():
    # No warmup: the decay spans all 5 steps and step 5 is the floor.
    assert learning_rate(1, lr=2.0, total_steps=5) == pytest.approx(0.2 + 0.9 * (1 + math.cos(math.pi / 5)))
    assert learning_rate(5, lr=2.0, total_steps=5) == pytest.approx(0.2)
    assert learning_rate(3, lr=2.0, total_steps=5, warmup_steps=2, schedule="constant") == 2.0
    f = schedule_for(OptimizerSpec(lr=3e-3, warmup_steps=50, min_lr_ratio=0.1), 500)
    assert f(50) == pytest.approx(3e-3) and f(500) == pytest.approx(3e-4)
    with pytest.raises(ValueError, match="step must be >= 1"):
        learning_rate(0, lr=1.0, total_steps=5)


# ------------------------------------------------------------------ optimizer (L2-3)


def optimizer_on_bus():
    bus = Bus()
    opt = Optimizer(OptimizerSpec(weight_decay=0.1), bus.emitter(Module.L2_OPTIMIZER))
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, opt.apply_update)
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ExportState, opt.export_state)
    model = build_model(TINY, 0)
    opt.attach(model)
    return model, opt, bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)


def set_grads(model, value=0.5):
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_parameters_change_only_on_apply_update_and_with_its_learning_rate():
    model, opt, port = optimizer_on_bus()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    set_grads(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # grads alone: nothing
    done = port(engine_pb2.ApplyUpdate(step=1, learning_rate=0.01)).message
    assert done.step == 1 and done.learning_rate == 0.01 and done.seconds >= 0
    w0, w1 = before["tok_emb.weight"], model.state_dict()["tok_emb.weight"]
    # Adam's first step moves every weight by lr * sign(g) (|m/sqrt(v)| = 1), plus decay.
    torch.testing.assert_close(w1, w0 * (1 - 0.01 * 0.1) - 0.01, rtol=0, atol=1e-6)
    gain0, gain1 = before["norm.weight"], model.state_dict()["norm.weight"]
    torch.testing.assert_close(gain1, gain0 - 0.01, rtol=0, atol=1e-6)  # no decay on gains


def test_the_optimizer_never_touches_gradients():
    model, _, port = optimizer_on_bus()
    set_grads(model, 0.25)
    port(engine_pb2.ApplyUpdate(step=1, learning_rate=0.1))
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())


def test_optimizer_state_exports_keyed_by_parameter_name():
    model, _, port = optimizer_on_bus()
    set_grads(model)
    port(engine_pb2.ApplyUpdate(step=1, learning_rate=0.1))
    reply = port(engine_pb2.ExportState())
    assert reply.message.key == "optim"
    state = reply.payload.state_dict()
    assert "tok_emb.weight" in state["state"] and "exp_avg" in state["state"]["tok_emb.weight"]


# ------------------------------------------------------------------ mixed precision (L2-4)


def precision_on_bus():
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER), "cpu")
    mp = MixedPrecision(
        bus.emitter(Module.L2_MIXED_PRECISION), bus.port(Module.L2_MIXED_PRECISION, Module.L3_OPERATOR_ADAPTER)
    )
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SetComputePrecision, adapter.set_compute_precision)
    bus.subscribe(Module.L2_MIXED_PRECISION, engine_pb2.InitPrecision, mp.init_precision)
    bus.subscribe(Module.L2_MIXED_PRECISION, engine_pb2.UnscaleAndCheck, mp.unscale_and_check)
    bus.subscribe(Module.L2_MIXED_PRECISION, engine_pb2.ScaleLoss, mp.scale_loss)
    model = build_model(TINY, 0)
    mp.attach(model.parameters())
    return model, bus.port(Module.L2_TRAINING_LOOP, Module.L2_MIXED_PRECISION)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_precision_init_reports_ready_with_loss_scale_one(policy):
    _, port = precision_on_bus()
    ready = port(engine_pb2.InitPrecision(precision=policy)).message
    assert ready.precision == policy and ready.loss_scale == 1.0


def test_overflow_check_reports_the_norm_pieces_and_leaves_gradients_alone_until_scale_loss():
    model, port = precision_on_bus()
    port(engine_pb2.InitPrecision(precision="fp32"))
    set_grads(model, 0.5)
    check = port(engine_pb2.UnscaleAndCheck(step=1)).message
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert not check.found_inf and check.replicated_squares == pytest.approx(0.25 * n, rel=1e-6)
    assert check.sharded_squares == 0.0
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    # ScaleLoss applies the loop's correction (here x2) and reports the norm of the result.
    adjusted = port(engine_pb2.ScaleLoss(step=1, grad_scale=2.0, grad_squares=check.replicated_squares)).message
    assert adjusted.grad_norm == pytest.approx(math.sqrt(n), rel=1e-6)
    assert all(torch.equal(p.grad, torch.full_like(p, 1.0)) for p in model.parameters())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_inf_or_nan_gradient_is_reported_as_found_inf_and_not_repaired(bad):
    model, port = precision_on_bus()
    port(engine_pb2.InitPrecision(precision="bf16"))
    set_grads(model, 0.5)
    model.norm.weight.grad[3] = bad
    snapshot = [p.grad.clone() for p in model.parameters()]
    check = port(engine_pb2.UnscaleAndCheck(step=7)).message
    assert check.found_inf
    for g, p in zip(snapshot, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


def test_an_unknown_precision_policy_is_refused():
    _, port = precision_on_bus()
    # A configuration the module cannot use is its failure (PrecisionFailed, INVALID_INPUT).
    with raised_in_module(
        ValueError, "precision: expected one of", event="PrecisionFailed", cause=route_pb2.FAILURE_INVALID_INPUT
    ):
        port(engine_pb2.InitPrecision(precision="fp8"))


# ------------------------------------------------------------------ parallel strategy (L2-2)


def test_a_rank_assignment_that_cannot_work_is_refused_naming_the_field():
    bus = Bus()
    strategy = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
    )
    base = dict(rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, backend="gloo", device="cpu")
    for bad, words in (
        ({"rank": 2}, "rank 2 is not in world_size 1"),
        ({"backend": "mpi"}, "backend must be 'gloo' or 'nccl'"),
        ({"backend": "nccl"}, "backend nccl needs a CUDA device"),
    ):
        with pytest.raises(ValueError, match=words):
            strategy.rank_assignment(engine_pb2.RankAssignment(**{**base, **bad}))


def test_a_taken_rendezvous_port_is_l2_2_s_typed_port_in_use_graded_medium_by_l1_3():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    bus, reports = Bus(), []
    strategy = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
    )
    bus.subscribe(Module.L2_PARALLEL_STRATEGY, engine_pb2.RankAssignment, strategy.rank_assignment)
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR))
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.ParallelTopologyError, detector.on_failure)
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, lambda m, p=None: reports.append(m))
    bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j"))
    set_origin("j", 0)  # (a rank's root names its job on its failures)
    try:
        with pytest.raises(ModuleFailed) as failed:
            bus.command(
                Module.L1_RESOURCE_ALLOCATOR,
                Module.L2_PARALLEL_STRATEGY,
                engine_pb2.RankAssignment(
                    rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, backend="gloo", device="cpu"
                ),
            )
    finally:
        holder.close()
        set_origin()
    error = failed.value.error
    assert isinstance(error, RendezvousFailed) and error.port_in_use  # the OS said so: a bind probe's errno
    event = failed.value.event
    assert (event.DESCRIPTOR.name, event.fault_class, event.failure.cause) == (
        "ParallelTopologyError",
        "port_in_use",
        route_pb2.FAILURE_RENDEZVOUS,
    )
    assert [(r.event, r.fault_class, r.grade) for r in reports] == [
        ("ParallelTopologyError", "port_in_use", control_pb2.MEDIUM)
    ]
    assert not _port_taken(port)  # released: the probe does not claim a free port


def test_a_rank_waiting_at_a_rendezvous_for_a_peer_that_never_comes_is_released_by_a_newer_one():
    # A rebuild's replacement died before it joined: the survivors wait at that rendezvous's
    # store; L1-2's next rendezvous (a newer generation) releases them at once, instead of the
    # group timeout. (A real TCPStore; the peer simply never arrives.)
    from services.engine import parallel_strategy as ps

    bus = Bus()
    strategy = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        rendezvous_timeout_s=120,
    )
    port = free_port()
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            strategy._arrive("127.0.0.1", port, 0, 2)  # rank 0 of 2: hosts the store, waits for rank 1
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    waiter = threading.Thread(target=join, daemon=True)
    t0 = time.monotonic()
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not outcome  # still waiting for rank 1
    newer = engine_pb2.RebuildParallelGroup(
        job_id="j", master_addr="127.0.0.1", master_port=port + 1, world_size=2, generation=1
    )
    strategy.rebuild_parallel_group(newer)  # from L1-2 (the session's thread): posted, and supersedes
    waiter.join(10)
    assert outcome and isinstance(outcome[0], ps._Superseded), outcome
    assert time.monotonic() - t0 < 10  # not the 120 s rendezvous timeout


def test_a_replacement_that_hears_of_its_own_group_before_it_joins_still_joins_it():
    # L1-2 sends every live rank the new generation's rendezvous; a replacement still starting
    # may hear it before its RankAssignment (the same rendezvous) is joined. That is no newer
    # group: the replacement joins, at that generation (a fresh-user trial saw it superseded).
    bus, ready = Bus(), []
    strategy = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        rendezvous_timeout_s=30,
    )
    bus.subscribe(Module.L2_TRAINING_LOOP, engine_pb2.ParallelReady, lambda m, p=None: ready.append(m))
    for target in (Module.L3_SHARD_LOADER, Module.L3_GRADIENT_REDUCTION):
        bus.subscribe(target, engine_pb2.ParallelPlan, lambda m, p=None: None)
    port = free_port()
    strategy.rebuild_parallel_group(
        engine_pb2.RebuildParallelGroup(
            job_id="j", master_addr="127.0.0.1", master_port=port, world_size=1, generation=3
        )
    )
    try:
        strategy.rank_assignment(
            engine_pb2.RankAssignment(
                rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, backend="gloo", device="cpu"
            )
        )
        assert [m.world_size for m in ready] == [1] and dist.is_initialized()
        assert strategy._generation == 3  # a later rendezvous must be newer than this one
    finally:
        strategy.shutdown()


def test_a_rendezvous_naming_a_new_layout_brings_the_plan_computed_again_at_its_dp():
    # A resize in place (issue 16): the plan at the new size comes only with L1-2's rendezvous
    # naming the layout; without one the size must be the group's; a rank at or above the new
    # size, or a layout that makes FSDP2 of a plan that had no dp axis, is a bug (L1 checks).
    from services.engine.sharding_plan import plan
    from services.jobspec import ParallelSpec

    def strategy(parallel: ParallelSpec) -> ParallelStrategy:
        bus = Bus()
        s = ParallelStrategy(
            bus.emitter(Module.L2_PARALLEL_STRATEGY),
            bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
            bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
            model=TINY,
            parallel=parallel,
        )
        s._plan, s._world_size = plan(TINY, parallel.dp, parallel), parallel.dp  # (as a formed group)
        return s

    def rendezvous(world_size: int, dp: int = 0) -> engine_pb2.RebuildParallelGroup:
        layout = engine_pb2.DataParallelLayout(dp=dp, micro_batch_size=2, grad_accum=3) if dp else None
        return engine_pb2.RebuildParallelGroup(master_port=1, world_size=world_size, generation=1, layout=layout)

    three = strategy(ParallelSpec(dp=3))
    assert three._plan_for(rendezvous(3), rank=2) is three._plan  # the same size: the same plan
    smaller = three._plan_for(rendezvous(2, dp=2), rank=1)
    assert (smaller.world_size, smaller.dp, smaller.coords[1], smaller.data_parallel) == (2, 2, (0, 1, 0), "ddp")
    assert three._plan_for(rendezvous(1, dp=1), rank=0).data_parallel == "none"
    with pytest.raises(RuntimeError, match="names no layout"):
        three._plan_for(rendezvous(2), rank=0)
    with pytest.raises(RuntimeError, match="rank 2 cannot join"):
        three._plan_for(rendezvous(2, dp=2), rank=2)
    with pytest.raises(RuntimeError, match="rank 0 cannot join"):
        three._plan_for(rendezvous(3, dp=2), rank=0)  # world size must be the layout's dp
    with pytest.raises(RuntimeError, match="data_parallel=fsdp2"):
        strategy(ParallelSpec(dp=1, data_parallel="fsdp2"))._plan_for(rendezvous(2, dp=2), rank=0)


def test_a_rendezvous_names_its_ranks_nodes_as_runs_and_the_rank_expands_them():
    # L1-2 sends the world's node list as runs (RebuildParallelGroup.node_runs: the same command
    # goes to every node agent of the job, issue 28); the rank plans on them as on the list.
    from services.common.rank_nodes import node_runs
    from services.engine.sharding_plan import Topology, plan
    from services.jobspec import ParallelSpec

    bus = Bus()
    s = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        model=TINY,
        parallel=ParallelSpec(dp=3),
    )
    s._plan, s._world_size = plan(TINY, 3, ParallelSpec(dp=3)), 3  # (as a formed group)
    layout = engine_pb2.DataParallelLayout(dp=2, micro_batch_size=2, grad_accum=3)

    def rendezvous(nodes: list[str]) -> engine_pb2.RebuildParallelGroup:
        return engine_pb2.RebuildParallelGroup(
            master_port=1, world_size=2, generation=1, layout=layout, node_runs=node_runs(nodes)
        )

    got = s._plan_for(rendezvous(["a", "b"]), rank=1)
    assert got == plan(TINY, 2, ParallelSpec(dp=2), Topology(("a", "b")))
    with pytest.raises(ValueError, match="topology: lists 3 ranks"):  # (read: a list of another size is refused)
        s._plan_for(rendezvous(["a", "a", "b"]), rank=1)
