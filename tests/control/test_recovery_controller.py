"""The recovery controller executes StartRecovery: it verifies the named snapshot through
the checkpoint manager's route, has the allocator rebuild the group (kill and relaunch the
ranks on a fresh port), and reports; it never chooses a version.

The test stands in for the remote checkpoint manager (L5-1) and the allocator (L1-2)."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, store_pb2
from services.contract.bus import Bus
from services.control.recovery_controller import RecoveryController

M = Module
pytestmark = pytest.mark.timeout(30)


def wired(load, rebuild=None) -> tuple[Bus, list[control_pb2.RebuildCommunicator]]:
    bus = Bus()
    rc = RecoveryController(
        checkpoints=bus.port(M.L1_RECOVERY_CONTROLLER, M.L5_CHECKPOINT_MANAGER),
        resources=bus.port(M.L1_RECOVERY_CONTROLLER, M.L1_RESOURCE_ALLOCATOR),
    )
    rebuilt: list[control_pb2.RebuildCommunicator] = []

    def rebuild_ok(msg, payload):
        rebuilt.append(msg)
        return control_pb2.ResourcesReady(
            job_id=msg.job_id, world_size=2, master_addr="h", master_port=4242, worker_ids=["wa", "wb"]
        )

    bus.subscribe(M.L1_RECOVERY_CONTROLLER, control_pb2.StartRecovery, rc.start_recovery)
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, load)
    bus.subscribe(M.L1_RESOURCE_ALLOCATOR, control_pb2.RebuildCommunicator, rebuild or rebuild_ok)
    return bus, rebuilt


def recover(bus: Bus, version: str, exclude=()):
    msg = control_pb2.StartRecovery(job_id="j", checkpoint_version=version, reason="test", exclude_worker_ids=exclude)
    return bus.command(M.L1_ORCHESTRATOR, M.L1_RECOVERY_CONTROLLER, msg).message


def test_a_named_version_is_verified_then_the_ranks_are_relaunched_to_load_it():
    asked = []

    def load(msg, payload):
        asked.append(msg.version)
        return store_pb2.CheckpointLoaded(info=store_pb2.CheckpointInfo(version=msg.version, step=40))

    bus, rebuilt = wired(load)
    reply = recover(bus, "j:2", exclude=["wc"])
    assert isinstance(reply, control_pb2.RecoveryCompleted)
    assert (reply.job_id, reply.checkpoint_version, asked) == ("j", "j:2", ["j:2"])
    assert (reply.master_port, list(reply.worker_ids)) == (4242, ["wa", "wb"])
    assert [(r.job_id, r.resume_version, list(r.exclude_worker_ids)) for r in rebuilt] == [("j", "j:2", ["wc"])]


def test_a_fresh_start_needs_no_snapshot():
    def load(msg, payload):
        raise AssertionError("no snapshot should be loaded")

    bus, rebuilt = wired(load)
    assert isinstance(recover(bus, ""), control_pb2.RecoveryCompleted)
    assert [r.resume_version for r in rebuilt] == [""]


def test_a_version_that_cannot_be_loaded_is_reported_unusable_and_no_rank_is_touched():
    def load(msg, payload):
        raise RuntimeError("store 127.0.0.1:1: NOT_FOUND: no version j:9")

    bus, rebuilt = wired(load)
    reply = recover(bus, "j:9")
    assert isinstance(reply, control_pb2.RecoveryFailed)
    assert reply.reason == "checkpoint j:9: store 127.0.0.1:1: NOT_FOUND: no version j:9"
    assert (reply.snapshot_unusable, reply.checkpoint_version, rebuilt) == (True, "j:9", [])


def test_ranks_that_no_longer_fit_are_a_failed_recovery_but_not_an_unusable_snapshot():
    def full(msg, payload):
        return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason="1 are free on 1 registered workers")

    bus, _ = wired(lambda m, p: None, rebuild=full)
    reply = recover(bus, "")
    assert isinstance(reply, control_pb2.RecoveryFailed) and not reply.snapshot_unusable
    assert reply.reason == "relaunching the ranks (fresh start): 1 are free on 1 registered workers"
