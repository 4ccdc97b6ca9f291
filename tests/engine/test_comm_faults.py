"""Communication faults at L2-2 (issue 26): the collective timeout comes from the job's
liveness settings, an NCCL rank keeps its process when its communicator fails, a survivor
aborts its group the moment L1-2 says a peer was lost; and a rank refuses a device it
cannot see. Real gloo groups in this process; NCCL cannot run here, so its abort is the one
stand-in (the boundary of :func:`abort_communicators`)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_fakes import LocalRank, free_port, tiny_spec

from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.contract.failures import (
    C,
    cause_of,
    communication_failed,
    communicator_broken,
    communicator_reset,
)
from services.engine.parallel_strategy import (
    DeviceNotVisible,
    ParallelStrategy,
    abort_communicators,
    device_not_visible,
)
from services.jobspec import LivenessSpec, spec_from_json
from services.rank.comm_settings import (
    COLLECTIVE_TIMEOUT_FLOOR_S,
    apply_nccl_environment,
    collective_timeout_s,
    nccl_environment,
    side_timeout_s,
)


@pytest.fixture(autouse=True)
def _no_group_left():
    communicator_reset()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    communicator_reset()


# (liveness settings, compiles) -> collective timeout (s)
TIMEOUTS = [
    ({}, False, 60.0),  # the defaults: 2 x max(15 s running-silent, 30 s stall) = 60 s, where 300 s was
    ({"stall_min_seconds": 45}, False, 90.0),
    ({"heartbeat_timeout_running_seconds": 50}, False, 100.0),
    ({"stall_min_seconds": 5, "heartbeat_timeout_running_seconds": 5}, False, COLLECTIVE_TIMEOUT_FLOOR_S),  # floor
    ({}, True, 900.0),  # a compiling job waits out phase_seconds.compile
    ({"phase_seconds": {"compile": 120}}, True, 120.0),
    ({"collective_timeout_seconds": 20}, True, 20.0),  # the spec's own, as written
]


@pytest.mark.parametrize("settings, compiles, expected", TIMEOUTS)
def test_the_collective_timeout_is_derived_from_the_jobs_liveness_settings(settings, compiles, expected):
    assert collective_timeout_s(LivenessSpec.model_validate(settings), compiles) == expected


def test_a_peer_waits_in_a_collective_as_long_as_the_job_waits_for_its_data_service():
    # A rank whose read-ahead ran out waits for the data service (fault_policy.data_outage_seconds)
    # while its peers wait for it in the step's collective: their timeout covers it and L1's deadline.
    assert collective_timeout_s(LivenessSpec(), data_outage_s=300.0) == 330.0  # 300 + max(15, 30)
    assert collective_timeout_s(LivenessSpec(), data_outage_s=10.0) == 60.0  # the floor
    assert collective_timeout_s(LivenessSpec.model_validate({"collective_timeout_seconds": 20}), False, 300.0) == 20.0


def test_the_side_groups_wait_out_a_checkpoint_staging():
    assert side_timeout_s(LivenessSpec()) == 600.0  # phase_seconds.checkpoint_staging
    assert side_timeout_s(LivenessSpec.model_validate({"collective_timeout_seconds": 700})) == 700.0


def test_an_nccl_rank_is_set_to_abort_its_communicator_and_live():
    env = nccl_environment(90.0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly (3, torch's default, tears the process down)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "90"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    process = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # an operator's own choice is kept
    assert apply_nccl_environment(90.0, process)["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert process["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_the_timeout_reaches_the_process_group_from_the_jobs_spec(tmp_path):
    # The rank's real composition root, on the spec InitJob carries: stall_min_seconds 40 and a
    # data outage waited for 60 s -> every collective of the group may wait 100 s.
    spec = tiny_spec(steps=1, liveness={"stall_min_seconds": 40}, fault_policy={"data_outage_seconds": 60})
    rank = LocalRank(spec, tmp_path)
    carried = spec_from_json(rank.init.spec_json)  # what InitJob carries to the rank
    assert collective_timeout_s(carried.liveness, carried.operators.compile) == 80.0
    outage = carried.fault_policy.data_outage_seconds
    assert collective_timeout_s(carried.liveness, carried.operators.compile, outage) == 100.0
    rank.bring_up()
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=100)
    finally:
        rank.modules.parallel.shutdown()


def strategy(abort=None, **kwargs) -> tuple[ParallelStrategy, list]:
    """L2-2 on a bus of its own; ``abort`` None: a stand-in at the NCCL boundary that
    records (backend, thread, communicator recorded broken by then)."""
    bus, calls = Bus(), []

    def stand_in(backend: str) -> bool:  # the NCCL boundary: what was aborted, from which thread
        calls.append((backend, threading.current_thread().name, communicator_broken()))
        return True

    s = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        abort=abort or stand_in,
        **kwargs,
    )
    for target in (Module.L3_SHARD_LOADER, Module.L3_GRADIENT_REDUCTION):
        bus.subscribe(target, engine_pb2.ParallelPlan, lambda m, p=None: None)
    return s, calls


def one_rank() -> engine_pb2.RankAssignment:
    return engine_pb2.RankAssignment(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), backend="gloo", device="cpu"
    )


def rendezvous(generation: int, lost: list[int], port: int = 1) -> engine_pb2.RebuildParallelGroup:
    return engine_pb2.RebuildParallelGroup(
        job_id="j", master_addr="127.0.0.1", master_port=port, world_size=1, generation=generation, lost_ranks=lost
    )


def test_a_survivor_aborts_its_group_from_the_session_thread_when_l1_2_names_lost_ranks():
    s, calls = strategy()
    s.rebuild_parallel_group(rendezvous(1, [1]))  # before any group: nothing to abort
    assert calls == [] and not communicator_broken()
    s, calls = strategy()
    s.rank_assignment(one_rank())
    # A resize of a whole group (no lost ranks): left by the loop at a boundary, not aborted.
    s.rebuild_parallel_group(rendezvous(1, []))
    assert calls == [] and not communicator_broken()
    # L1-2's rendezvous naming a lost rank, heard on the session's thread.
    heard = threading.Thread(target=s.rebuild_parallel_group, args=(rendezvous(2, [3]),), name="session")
    heard.start()
    heard.join(5)
    # Recorded broken before the abort (what the blocked collective then raises is typed),
    # aborted on the session's thread, once per rendezvous.
    assert calls == [("gloo", "session", True)]
    s.rebuild_parallel_group(rendezvous(2, [3]))
    assert len(calls) == 1
    error = communication_failed("all_reduce", RuntimeError("Connection closed by peer"))
    assert cause_of(error) == C.FAILURE_COMMUNICATION  # by type, not by the text


def test_gloo_cannot_be_aborted_in_torch_2_13_so_the_world_is_left_to_the_rebuild():
    s, _ = strategy(abort=abort_communicators)
    s.rank_assignment(one_rank())
    assert abort_communicators("gloo") is False
    s.rebuild_parallel_group(rendezvous(1, [2]))
    assert communicator_broken() and dist.is_initialized()  # recorded, and the group still the main thread's


# (device, devices the process sees, CUDA_VISIBLE_DEVICES) -> why it cannot be used (None: it can)
DEVICES = [
    ("cuda:0", 1, "5", None),
    ("cuda", 8, None, None),
    ("cuda:7", 8, None, None),
    ("cuda:1", 1, "5", "rank assignment: device 'cuda:1' but this process sees 1 CUDA device (cuda:0..cuda:0; "
     "CUDA_VISIBLE_DEVICES '5')"),
    ("cuda:3", 0, None, "rank assignment: device 'cuda:3' but this process sees no CUDA device "
     "(CUDA_VISIBLE_DEVICES unset)"),
    ("cuda:0", 0, "", "rank assignment: device 'cuda:0' but this process sees no CUDA device "
     "(CUDA_VISIBLE_DEVICES '')"),
]  # fmt: skip


@pytest.mark.parametrize("device, count, visible, expected", DEVICES)
def test_a_device_the_process_cannot_see_is_named_in_one_line(device, count, visible, expected):
    assert device_not_visible(device, count, visible) == expected


def test_a_cuda_assignment_in_a_process_without_cuda_is_a_typed_config_error():
    s, _ = strategy(visible_devices="3")
    with pytest.raises(DeviceNotVisible) as refused:
        s.rank_assignment(
            engine_pb2.RankAssignment(
                rank=0, world_size=1, master_addr="127.0.0.1", master_port=1, backend="gloo", device="cuda:0"
            )
        )
    assert refused.value.fault_class == "config_error" and cause_of(refused.value) == C.FAILURE_INVALID_INPUT
    assert str(refused.value) == (
        "rank assignment: device 'cuda:0' but this process sees no CUDA device (CUDA_VISIBLE_DEVICES '3')"
    )


def test_a_step_whose_group_was_aborted_under_it_fails_typed_instead_of_using_its_numbers():
    # NCCL: a collective cut short by the abort returns what its buffers held. L3-5's step
    # reduction (the world's one small all-reduce) checks the record L2-2 made before it
    # aborted, and the step fails as a communication failure (then the loop rebuilds).
    from services.compute.gradient_reduction import GradientReduction
    from services.contract.failures import CommunicationFailed, communicator_failed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    reduction = GradientReduction(Bus().emitter(Module.L3_GRADIENT_REDUCTION))
    reduction._plan = engine_pb2.ParallelPlan(world_size=2, dp=2, tp=1, pp=1)  # (as after ParallelPlan: a dp 2 world)
    step = engine_pb2.ReduceGradients(local_loss_sum=3.0, local_tokens=4)
    assert reduction.reduce_gradients(step).global_loss_sum == 3.0  # a whole group: its numbers
    communicator_failed()  # L2-2's record, made before it aborts
    with pytest.raises(CommunicationFailed):
        reduction.reduce_gradients(step)
