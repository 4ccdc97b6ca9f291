"""Configuration is pushed once at initialisation and frozen (Issue 3, part 4).

A module that receives a configuration change outside init refuses it with ConfigFrozen,
unless the seed lists a command for that change: the shuffler's per-round plan (本轮混洗启动
指令 + 本轮随机种子), the operator adapter's 切换加速模式指令, the dataset manager's mount /
switch commands, the optimizer's learning rate on every ApplyUpdate (学习率配置更新指令).

The data service builds a fresh set of L4 modules for every stream (``build_stream``), so
for the prefetcher, filter and packer "once" means once per stream.
"""

from __future__ import annotations

import pytest

from services.compute.operator_adapter import OperatorAdapter
from services.contract import Module, data_pb2, engine_pb2
from services.contract.bus import Bus
from services.contract.frozen import ConfigFrozen, FrozenConfig
from services.data.errors import InvalidConfig

from .wiring import build_data, build_rank, optimizer_with_model, shuffler_on_bus


def test_frozen_config_takes_one_push_and_refuses_the_next():
    slot = FrozenConfig[int]("L4_FILTER", "filter rules")
    assert not slot.is_set
    with pytest.raises(RuntimeError, match="L4_FILTER: filter rules has not been pushed yet"):
        slot.get()
    assert slot.set(3) == 3 and slot.is_set and slot.get() == 3
    with pytest.raises(ConfigFrozen, match="^L4_FILTER: filter rules already set at init; the seed lists no command"):
        slot.set(4)
    assert slot.get() == 3
    with pytest.raises(TypeError):
        FrozenConfig[int]("x", "y", error=ValueError)  # type: ignore[arg-type]


def _stream_pushes():
    """(module, first push, second push) of one stream's L4 config commands."""
    return [
        (
            Module.L4_PREFETCHER,
            data_pb2.SetPrefetch(watermark=8, threads=2),
            data_pb2.SetPrefetch(watermark=64, threads=8),
        ),
        (Module.L4_FILTER, data_pb2.FilterRules(min_tokens=1), data_pb2.FilterRules(min_tokens=50)),
        (
            Module.L4_BATCH_PACKER,
            data_pb2.PackerConfig(seq_len=16, micro_batch_size=4, mode=data_pb2.PACK),
            data_pb2.PackerConfig(seq_len=16, micro_batch_size=64, mode=data_pb2.PACK),
        ),
    ]


@pytest.mark.parametrize("module", [Module.L4_PREFETCHER, Module.L4_FILTER, Module.L4_BATCH_PACKER], ids=Module.Name)
def test_a_data_module_refuses_a_second_config_push_on_its_stream(tmp_path, module):
    built = build_data(tmp_path)
    stream_bus = built.buses[-1]  # build_stream's bus: the one with the whole pipeline
    ((_, first, second),) = [(m, a, b) for m, a, b in _stream_pushes() if m == module]
    port = stream_bus.port(Module.L2_TRAINING_LOOP, module)
    port(first)
    with pytest.raises(ConfigFrozen, match=f"^{Module.Name(module)}: .* already set at init") as err:
        port(second)
    assert isinstance(err.value, InvalidConfig)  # still INVALID_ARGUMENT on the wire


def test_each_stream_gets_its_own_data_modules_so_once_means_once_per_stream(tmp_path):
    a, b = build_data(tmp_path), build_data(tmp_path)
    for module in (Module.L4_PREFETCHER, Module.L4_SHUFFLER, Module.L4_FILTER, Module.L4_BATCH_PACKER):
        assert a.modules[module] is not b.modules[module]


@pytest.mark.parametrize(
    "sender, receiver, first, second",
    [
        (
            Module.L2_PARALLEL_STRATEGY,
            Module.L3_SHARD_LOADER,
            engine_pb2.ParallelPlan(rank=0, world_size=1, dp=1, data_parallel="none", device="cpu"),
            engine_pb2.ParallelPlan(rank=0, world_size=2, dp=2, data_parallel="ddp", device="cpu"),
        ),
        (
            Module.L2_PARALLEL_STRATEGY,
            Module.L3_GRADIENT_REDUCTION,
            engine_pb2.ParallelPlan(rank=0, world_size=1, dp=1, data_parallel="none", device="cpu"),
            engine_pb2.ParallelPlan(rank=0, world_size=2, dp=2, data_parallel="ddp", device="cpu"),
        ),
        (
            Module.L2_TRAINING_LOOP,
            Module.L2_MIXED_PRECISION,
            engine_pb2.InitPrecision(precision="fp32"),
            engine_pb2.InitPrecision(precision="bf16"),
        ),
        (
            Module.L2_TRAINING_LOOP,
            Module.L3_FORWARD_UNIT,
            engine_pb2.ConfigureForward(attention="sdpa"),
            engine_pb2.ConfigureForward(attention="math"),
        ),
        (
            Module.L1_ORCHESTRATOR,
            Module.L2_TRAINING_LOOP,
            engine_pb2.InitJob(job_id="a", spec_json="{}"),
            engine_pb2.InitJob(job_id="b", spec_json="{}"),
        ),
    ],
    ids=["shard_loader", "gradient_reduction", "mixed_precision", "forward_unit", "training_loop"],
)
def test_a_rank_module_refuses_a_second_init_push(tmp_path, sender, receiver, first, second):
    built = build_rank(tmp_path, load_model=False)
    port = built.buses[0].port(sender, receiver)
    port(first)
    with pytest.raises(ConfigFrozen, match=f"^{Module.Name(receiver)}: .* already set at init"):
        port(second)


def test_the_parallel_strategy_refuses_a_second_rank_assignment(tmp_path):
    built = build_rank(tmp_path, load_model=False)
    strategy = built.modules[Module.L2_PARALLEL_STRATEGY]
    # Mark the first assignment as taken without a rendezvous (which needs a process group).
    strategy._assignment.set(engine_pb2.RankAssignment(rank=0, world_size=1))
    port = built.buses[0].port(Module.L1_RESOURCE_ALLOCATOR, Module.L2_PARALLEL_STRATEGY)
    with pytest.raises(ConfigFrozen, match="^L2_PARALLEL_STRATEGY: rank assignment already set at init"):
        port(
            engine_pb2.RankAssignment(
                rank=0, world_size=1, backend="gloo", master_addr="127.0.0.1", master_port=1, device="cpu"
            )
        )


def test_the_fault_detectors_grading_table_cannot_change_after_init():
    from services.control.fault_detector import FaultDetector

    detector = FaultDetector(emit=lambda *a: None, rules={"comm_error": 2})
    with pytest.raises(TypeError):
        detector._rules["comm_error"] = 4  # read-only even from inside
    # No input carries rules: its commands and events are the monitoring start and faults,
    # every module's failure event among them (``on_failure``, issue 13), and ``close``, the
    # composition root's at process end.
    public = {n for n in dir(detector) if not n.startswith("_")}
    assert public == {
        "start_fault_monitoring",
        "reset_fault_ledger",
        "on_rank_heartbeat",
        "on_agent_heartbeat",
        "on_worker_registration",  # a registration or withdrawal ends the agent deadline: no rules
        "on_rank_exited",
        "on_rank_process_state",
        "on_hardware_error",
        "on_rank_log_flood",  # footprint warnings (issue 29 item 8): facts, no rules
        "on_memory_copy_skipped",
        "on_training_loop_failed",
        "on_failure",
        "on_data_service_unreachable",
        "on_link_state_changed",  # a node agent's view of a data-plane link (issue 29 item 5): a fact
        "on_boundary_violation_reported",
        "close",
    }


# ---------------------------------------------------------------------- changes the seed lists


def test_the_shuffler_takes_a_new_plan_for_every_epoch(tmp_path):
    bus, out = shuffler_on_bus()
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER)
    for epoch, seed in ((0, 7), (1, 7), (2, 8)):  # 本轮混洗启动指令 + 本轮随机种子: per round
        port(data_pb2.ShufflePlan(seed=seed, epoch=epoch, enabled=True))
    assert {d.epoch for d in out} == {0, 1, 2}


def test_the_operator_adapter_switches_kernels_only_when_commanded():
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER))
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SelectOperators, adapter.select_operators)
    port = bus.port(Module.L3_FORWARD_UNIT, Module.L3_OPERATOR_ADAPTER)
    assert port(engine_pb2.SelectOperators(attention="sdpa")).payload.attention == "sdpa"
    # 切换加速模式指令 is a seed command: a change by command is allowed, never on its own.
    assert port(engine_pb2.SelectOperators(attention="math")).payload.attention == "math"


def test_the_optimizer_takes_its_learning_rate_from_every_update_command():
    model, optimizer, port = optimizer_with_model()
    for step, lr in ((1, 0.01), (2, 0.002)):  # 学习率配置更新指令 rides on ApplyUpdate
        assert port(engine_pb2.ApplyUpdate(step=step, learning_rate=lr)).message.learning_rate == lr
        assert {g["lr"] for g in optimizer._optim.param_groups} == {lr}
