"""A data module's failure event crosses to the rank by its name (services/contract/relay.py):
the stream's end brings it back in the trailing metadata, the rank's data relay puts it on the
rank's bus as that module, and the rank's session link sends it up to L1-3. Real gRPC on
127.0.0.1, the real stream pipeline, a fault injected in the shuffler's handler."""

from __future__ import annotations

import threading

import structlog

from services.common.grpc_server import ServiceServer
from services.contract import Module, data_pb2, data_pb2_grpc, injection, route_pb2
from services.contract.bus import Bus, Traffic
from services.contract.relay import L1, L4, RANK, Link, unpack
from services.data.__main__ import build_stream
from services.data.server import DataServicer
from services.worker.data_client import DataClient

from .helpers import open_stream


def test_a_stream_modules_failure_event_reaches_the_rank_bus_and_its_session_as_that_module(dataset, root):
    injection.configure("handler:L4_SHUFFLER:ShufflePlan:cause=FAILURE_DATA_CORRUPT")
    server = ServiceServer("data", "127.0.0.1", 0)
    data_pb2_grpc.add_DataServiceServicer_to_server(
        DataServicer(mount=None, list_datasets=None, new_stream=lambda: build_stream(root),
                     log=structlog.get_logger("data")), server.server)
    server.start(["surge.v1.DataService"])
    client = None
    try:
        bus = Bus(traffic=Traffic())
        up: list = []  # what the rank's session would send to control
        Link(bus, name="rank session", near=RANK | L4, beyond=L1, send=lambda routed, msg, p: up.append(routed)).stand_in()
        heard, unavailable = threading.Event(), []
        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.ShuffleFailed, lambda msg, p: heard.set())
        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DatasetUnavailable, lambda msg, p: unavailable.append(msg))
        client = DataClient(f"127.0.0.1:{server.port}", bus.emitter(Module.L4_DATASET_VERSIONS),
                            bus.emitter(Module.L4_BATCH_PACKER),
                            back=Link(bus, name="data service", near=RANK, beyond=L4).deliver)
        client.open_stream(open_stream())
        assert heard.wait(30), "the loop never heard the shuffler failed"
    finally:
        injection.configure("")
        if client is not None:
            client.close()
        server.stop(grace=0)
    shuffle = [r for r in up if r.type == "surge.v1.ShuffleFailed"]
    assert [(r.sender, r.receiver) for r in shuffle] == [(Module.L4_SHUFFLER, 0)]
    failed = unpack(shuffle[0])
    assert (failed.failure.cause, failed.failure.module) == (route_pb2.FAILURE_DATA_CORRUPT, Module.L4_SHUFFLER)
    # It was delivered on the rank's bus as L4-3, to the stand-in for L1-3 and to the loop,
    # and no DatasetUnavailable was made up in L4-1's name next to it.
    assert bus.snapshot().sent[(Module.L4_SHUFFLER, "surge.v1.ShuffleFailed", Module.L1_FAULT_DETECTOR)] == 1
    assert unavailable == [] and [r.type for r in up] == ["surge.v1.ShuffleFailed"]
