"""A data module's failure event crosses to the rank by its name (services/contract/relay.py):
the stream's end brings it back in the trailing metadata, the rank's data relay puts it on the
rank's bus as that module, and the rank's session link sends it up to L1-3. Real gRPC on
127.0.0.1, the real stream pipeline, a fault injected in the shuffler's handler."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import structlog

from services.common.grpc_server import AioServiceServer
from services.contract import Module, data_pb2, data_pb2_grpc, injection, route_pb2
from services.contract.bus import Bus, Traffic
from services.contract.relay import L1, L4, RANK, Link, unpack
from services.data.__main__ import build_stream
from services.data.server import DataServicer
from services.rank.data_client import DataClient

from .helpers import open_stream


@contextmanager
def rank_reading(root, injected: str = "", on_up=None):
    """A real data service on 127.0.0.1 (fault ``injected`` into its handlers) and a rank's side
    of it: a bus whose session link records what would go up to control (``up``), and a
    ``read(bus)`` that opens the rank's stream with the rank's data relay. Everything is
    stopped, and the injection cleared, on the way out."""
    injection.configure(injected)
    server = AioServiceServer("data", "127.0.0.1", 0)
    work = ThreadPoolExecutor(4)
    data_pb2_grpc.add_DataServiceServicer_to_server(
        DataServicer(
            mount=None,
            list_datasets=None,
            new_stream=lambda: build_stream(root),
            log=structlog.get_logger("data"),
            executor=work,
        ),
        server.server,
    )
    server.start(["surge.v1.DataService"])
    bus, up, clients = Bus(traffic=Traffic()), [], []

    def send(routed, msg, payload):
        up.append(routed)
        if on_up is not None:
            on_up()

    def read() -> None:
        client = DataClient(
            f"127.0.0.1:{server.port}",
            bus.emitter(Module.L4_DATASET_VERSIONS),
            bus.emitter(Module.L4_BATCH_PACKER),
            back=Link(bus, name="data service", near=RANK, beyond=L4).deliver,
        )
        clients.append(client)
        client.open_stream(open_stream())

    Link(bus, name="rank session", near=RANK | L4, beyond=L1, send=send).stand_in()
    try:
        yield bus, up, read
    finally:
        injection.configure("")
        for client in clients:
            client.close()
        server.stop(grace=0)
        work.shutdown(wait=True)


def test_a_stream_modules_failure_event_reaches_the_rank_bus_and_its_session_as_that_module(dataset, root):
    with rank_reading(root, "handler:L4_SHUFFLER:ShufflePlan:cause=FAILURE_DATA_CORRUPT") as (bus, up, read):
        heard, unavailable = threading.Event(), []
        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.ShuffleFailed, lambda msg, p: heard.set())
        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DatasetUnavailable, lambda msg, p: unavailable.append(msg))
        read()
        assert heard.wait(30), "the loop never heard the shuffler failed"
    shuffle = [r for r in up if r.type == "surge.v1.ShuffleFailed"]
    assert [(r.sender, r.receiver) for r in shuffle] == [(Module.L4_SHUFFLER, 0)]
    failed = unpack(shuffle[0])
    assert (failed.failure.cause, failed.failure.module) == (route_pb2.FAILURE_DATA_CORRUPT, Module.L4_SHUFFLER)
    # It was delivered on the rank's bus as L4-3, to the stand-in for L1-3 and to the loop,
    # and no DatasetUnavailable was made up in L4-1's name next to it.
    assert bus.snapshot().sent[(Module.L4_SHUFFLER, "surge.v1.ShuffleFailed", Module.L1_FAULT_DETECTOR)] == 1
    assert unavailable == [] and [r.type for r in up] == ["surge.v1.ShuffleFailed"]


# (module, the DATA message its handler fails on, that module's failure event, after N calls).
# Each comes once per epoch (references: the catalog, the epoch's order, its keep mask).
DATA_PATH_FAILURES = [
    ("L4_SHUFFLER", "SamplesRead", "ShuffleFailed", 0),
    ("L4_FILTER", "SamplesShuffled", "SampleStreamInterrupted", 0),
    ("L4_BATCH_PACKER", "SamplesFiltered", "PackingFailed", 0),
]


@pytest.mark.parametrize(
    ("module", "message", "event", "after"), DATA_PATH_FAILURES, ids=[m for _, m, _, _ in DATA_PATH_FAILURES]
)
def test_a_handler_failing_on_the_data_path_ends_the_stream_with_its_failure_event(
    dataset, root, module, message, event, after
):
    with rank_reading(root, f"handler:{module}:{message}:after={after}:cause=FAILURE_DATA_CORRUPT") as (bus, up, read):
        ended, heard, exhausted = threading.Event(), [], []
        cls = getattr(data_pb2, event)
        bus.subscribe(Module.L2_TRAINING_LOOP, cls, lambda msg, p: (heard.append(msg), ended.set()))
        bus.subscribe(
            Module.L2_TRAINING_LOOP, data_pb2.DataExhausted, lambda msg, p: (exhausted.append(msg), ended.set())
        )
        read()
        assert ended.wait(30), "the stream neither failed nor ended"
    # The stream ended with the failure (not as a stream whose data ran out), and the module's
    # one failure event reached the loop and, by its name, the session: its first failure,
    # not the failures that followed from it further down the stream.
    assert exhausted == [] and len(heard) == 1
    failure = heard[0].failure
    assert (failure.cause, failure.module, failure.operation) == (
        route_pb2.FAILURE_DATA_CORRUPT,
        route_pb2.Module.Value(module),
        f"surge.v1.{message}",
    )
    assert [(r.type, r.sender) for r in up] == [(f"surge.v1.{event}", route_pb2.Module.Value(module))]


def test_a_loop_failing_on_a_batch_stops_the_rank_reading_and_blames_no_data_module(dataset, root):
    # MicroBatch is data too: the loop's failure on it is the loop's (TrainingLoopFailed, up to
    # L1), the relay stops reading the stream, and no DatasetUnavailable names L4-1.
    sent = threading.Event()
    with rank_reading(root, on_up=sent.set) as (bus, up, read):
        batches: list = []

        def on_micro_batch(msg, payload):
            batches.append(msg)
            raise RuntimeError("the loop cannot take this batch")

        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.MicroBatch, on_micro_batch)
        read()
        assert sent.wait(30), "nothing went up"
        time.sleep(0.5)  # (what else the relay would send, had it gone on)
    assert len(batches) == 1
    assert [(r.type, r.sender) for r in up] == [("surge.v1.TrainingLoopFailed", Module.L2_TRAINING_LOOP)]
