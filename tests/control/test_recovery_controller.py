"""The recovery controller executes StartRecovery: it has the allocator rebuild the group
(kill and relaunch the ranks on a fresh port, to load the named version), and reports with
a typed cause; it never chooses a version and never touches the store (the relaunched ranks
check every shard's digest as they load it; the orchestrator asked the store's verdicts).

The test stands in for the allocator (L1-2)."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2
from services.contract.bus import Bus
from services.control.recovery_controller import RecoveryController

RecoveryFailureCause = control_pb2.RecoveryFailureCause
pytestmark = pytest.mark.timeout(30)


def wired(rebuild=None) -> tuple[Bus, list[control_pb2.RebuildCommunicator]]:
    bus = Bus()
    rc = RecoveryController(resources=bus.port(Module.L1_RECOVERY_CONTROLLER, Module.L1_RESOURCE_ALLOCATOR))
    rebuilt: list[control_pb2.RebuildCommunicator] = []

    def rebuild_ok(msg, payload):
        rebuilt.append(msg)
        return control_pb2.ResourcesReady(
            job_id=msg.job_id, world_size=2, master_addr="h", master_port=4242, worker_ids=["wa", "wb"]
        )

    bus.subscribe(Module.L1_RECOVERY_CONTROLLER, control_pb2.StartRecovery, rc.start_recovery)
    bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, control_pb2.RebuildCommunicator, rebuild or rebuild_ok)
    return bus, rebuilt


def recover(bus: Bus, version: str, exclude=()):
    msg = control_pb2.StartRecovery(job_id="j", checkpoint_version=version, reason="test", exclude_worker_ids=exclude)
    return bus.command(Module.L1_ORCHESTRATOR, Module.L1_RECOVERY_CONTROLLER, msg).message


def test_the_ranks_are_relaunched_to_load_the_named_version_without_asking_the_store():
    bus, rebuilt = wired()
    reply = recover(bus, "j:2", exclude=["wc"])
    assert isinstance(reply, control_pb2.RecoveryCompleted)
    assert (reply.job_id, reply.checkpoint_version) == ("j", "j:2")
    assert (reply.master_port, list(reply.worker_ids)) == (4242, ["wa", "wb"])
    assert [(r.job_id, r.resume_version, list(r.exclude_worker_ids)) for r in rebuilt] == [("j", "j:2", ["wc"])]


def test_a_fresh_start_relaunches_with_no_version():
    bus, rebuilt = wired()
    reply = recover(bus, "")
    assert isinstance(reply, control_pb2.RecoveryCompleted) and reply.checkpoint_version == ""
    assert [r.resume_version for r in rebuilt] == [""]


def test_ranks_that_no_longer_fit_are_a_typed_no_placement_failure_with_the_numbers():
    def full(msg, payload):
        return control_pb2.ResourcesInsufficient(
            job_id=msg.job_id, requested_ranks=2, available_ranks=1, reason="1 is free on 1 registered worker"
        )

    bus, _ = wired(full)
    reply = recover(bus, "j:2")
    assert isinstance(reply, control_pb2.RecoveryFailed)
    assert (reply.cause, reply.step, reply.requested_ranks, reply.available_ranks) == (
        RecoveryFailureCause.RECOVERY_NO_PLACEMENT,
        "placement",
        2,
        1,
    )
    assert reply.reason == "placing the ranks (checkpoint j:2): 1 is free on 1 registered worker"
    # The same command, once capacity is back, places the ranks (the controller holds no grudge).
    bus2, rebuilt = wired()
    assert isinstance(recover(bus2, "j:2"), control_pb2.RecoveryCompleted) and len(rebuilt) == 1
