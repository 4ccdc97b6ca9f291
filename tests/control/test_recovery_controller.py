"""The recovery controller executes StartRecovery: it verifies the named snapshot through
the checkpoint manager's route and reports; it never chooses a version.

The test stands in for the remote checkpoint manager (L5-1) on the bus."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, store_pb2
from services.contract.bus import Bus
from services.control.recovery_controller import RecoveryController

M = Module
pytestmark = pytest.mark.timeout(30)


def wired(load) -> Bus:
    bus = Bus()
    rc = RecoveryController(checkpoints=bus.port(M.L1_RECOVERY_CONTROLLER, M.L5_CHECKPOINT_MANAGER))
    bus.subscribe(M.L1_RECOVERY_CONTROLLER, control_pb2.StartRecovery, rc.start_recovery)
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, load)
    return bus


def recover(bus: Bus, version: str):
    msg = control_pb2.StartRecovery(job_id="j", checkpoint_version=version, reason="test")
    return bus.command(M.L1_ORCHESTRATOR, M.L1_RECOVERY_CONTROLLER, msg).message


def test_a_named_version_is_verified_by_the_checkpoint_manager():
    asked = []

    def load(msg, payload):
        asked.append(msg.version)
        return store_pb2.CheckpointLoaded(info=store_pb2.CheckpointInfo(version=msg.version, step=40))

    reply = recover(wired(load), "j:2")
    assert isinstance(reply, control_pb2.RecoveryCompleted)
    assert (reply.job_id, reply.checkpoint_version, asked) == ("j", "j:2", ["j:2"])


def test_a_fresh_start_needs_no_snapshot():
    def load(msg, payload):
        raise AssertionError("no snapshot should be loaded")

    assert isinstance(recover(wired(load), ""), control_pb2.RecoveryCompleted)


def test_a_version_that_cannot_be_loaded_is_reported_failed():
    def load(msg, payload):
        raise RuntimeError("store 127.0.0.1:1: NOT_FOUND: no version j:9")

    reply = recover(wired(load), "j:9")
    assert isinstance(reply, control_pb2.RecoveryFailed)
    assert reply.reason == "checkpoint j:9: store 127.0.0.1:1: NOT_FOUND: no version j:9"
