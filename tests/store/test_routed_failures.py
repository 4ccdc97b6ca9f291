"""A store module's failure event crosses to its caller by name (services/contract/relay.py): the
failed call brings it back in its trailing metadata and the caller's relay puts it on its bus
as that module. Real gRPC on 127.0.0.1, the store's real composition root, a fault injected
in a handler."""

from __future__ import annotations

import threading

import structlog
from prometheus_client import CollectorRegistry

from services.common.grpc_server import AioServiceServer
from services.contract import Module, injection, route_pb2, store_pb2, store_pb2_grpc
from services.contract.bus import Bus, Traffic
from services.contract.relay import L1, L5, RANK, Link
from services.control.store_relay import StoreRelay
from services.rank.store_client import StoreClient
from services.store.__main__ import wire


def test_a_checkpoint_managers_failure_reaches_control_as_l5_1s_own_event_not_a_rebuilt_one(tmp_path):
    relay, metrics, _ = wire(tmp_path, structlog.get_logger("store"), registry=CollectorRegistry())
    server = AioServiceServer("store", "127.0.0.1", 0)
    store_pb2_grpc.add_StoreServiceServicer_to_server(relay, server.server)
    server.start(["surge.v1.StoreService"])
    injection.configure("handler:L5_CHECKPOINT_MANAGER:VerifyCheckpoints:cause=FAILURE_IO")
    try:
        bus = Bus(traffic=Traffic())
        got: list[store_pb2.SnapshotFailed] = []
        answered = threading.Event()
        bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SnapshotFailed, lambda m, p: (got.append(m), answered.set()))
        control = StoreRelay(
            f"127.0.0.1:{server.port}",
            bus.emitter(Module.L5_CHECKPOINT_MANAGER),
            back=Link(bus, name="store service", near=L1, beyond=L5),
        )
        control.verify_checkpoints(store_pb2.VerifyCheckpoints(job_id="j"))
        assert answered.wait(20)
    finally:
        injection.configure("")
        server.stop(grace=0)
        metrics.close()
    (failed,) = got  # L5-1's event, and no SnapshotFailed rebuilt from the status
    assert (failed.failure.module, failed.failure.cause) == (Module.L5_CHECKPOINT_MANAGER, route_pb2.FAILURE_IO)
    assert failed.failure.operation == "surge.v1.VerifyCheckpoints"
    # ... and as the answer to that call: the orchestrator's verification step reads these.
    assert (failed.operation, failed.job_id, failed.cause) == ("verify", "j", store_pb2.REJECTED)
    assert bus.snapshot().sent[(Module.L5_CHECKPOINT_MANAGER, "surge.v1.SnapshotFailed", Module.L1_ORCHESTRATOR)] == 1


def test_a_begin_save_the_store_failed_reaches_the_rank_as_one_typed_snapshot_failed(tmp_path):
    relay, metrics, _ = wire(tmp_path, structlog.get_logger("store"), registry=CollectorRegistry())
    server = AioServiceServer("store", "127.0.0.1", 0)
    store_pb2_grpc.add_StoreServiceServicer_to_server(relay, server.server)
    server.start(["surge.v1.StoreService"])
    # after=1: the first SaveCheckpoint L5-1 handles in this process is the rank relay's own
    # (it is L5-1 on the rank's bus), the second the store's.
    injection.configure("handler:L5_CHECKPOINT_MANAGER:SaveCheckpoint:after=1:cause=FAILURE_IO")
    client = None
    try:
        bus = Bus(traffic=Traffic())
        got: list[store_pb2.SnapshotFailed] = []
        bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SnapshotFailed, lambda m, p: got.append(m))
        back = Link(bus, name="store service", near=RANK, beyond=L5)
        client = StoreClient(
            f"127.0.0.1:{server.port}",
            bus.emitter(Module.L5_CHECKPOINT_MANAGER),
            on_error=lambda e: back.deliver_returned(e, skip=(store_pb2.SnapshotFailed,)),
        )  # as rank.py
        bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.SaveCheckpoint, client.save_checkpoint)  # as rank.py
        port = bus.port(Module.L2_TRAINING_LOOP, Module.L5_CHECKPOINT_MANAGER, commands=(store_pb2.SaveCheckpoint,))
        staged = port(store_pb2.SaveCheckpoint(job_id="j", step=8, rank=0), {"model": {}}).message
    finally:
        injection.configure("")
        if client is not None:
            client.close(timeout=1)
        server.stop(grace=0)
        metrics.close()
    assert staged.staging_path == ""  # skipped: training goes on
    # One report (the store's own SnapshotFailed came back too; the relay's, with the step,
    # stands for it), its failure typed by the store's cause, not 0.
    (failed,) = got
    assert (failed.operation, failed.cause, failed.step, failed.job_id) == ("save", store_pb2.REJECTED, 8, "j")
    f = failed.failure
    assert (f.module, f.operation, f.cause, f.job_id) == (
        Module.L5_CHECKPOINT_MANAGER,
        "surge.v1.SaveCheckpoint",
        route_pb2.FAILURE_IO,
        "j",
    )
