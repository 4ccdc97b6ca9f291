"""Streams of byte-identical requests (the tp/pp peers of one dp replica) share one pipeline
(services/data/stream_share.py). Real gRPC on 127.0.0.1, the real stream pipelines; each
pipeline's build waits on a gate the test opens once every stream it means to share one is
attached (otherwise the first stream could run past the window before its peers arrive)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import structlog

from services.common import grpc_server
from services.common.grpc_server import AioServiceServer
from services.contract import Module, data_pb2, data_pb2_grpc
from services.data.__main__ import build_stream
from services.data.server import DataServicer
from services.data.stream_share import PipelineRegistry

from .helpers import open_stream

READ_AHEAD = 2  # a window of 4 batches: it moves on within a few batches


def wait_until(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def data_service(root, **share):
    """A real data service (``share``: DataServicer's keep_head, join_grace_s); yields
    (servicer, stub, gate, relays): builds wait on ``gate``, ``relays`` are the StreamRelays
    it built."""
    server = AioServiceServer("data", "127.0.0.1", 0)
    work = ThreadPoolExecutor(4)
    gate, relays = threading.Event(), []

    def new_stream():
        assert gate.wait(10), "the test never opened the gate"
        relays.append(build_stream(root))
        return relays[-1]

    servicer = DataServicer(
        mount=None,
        list_datasets=None,
        new_stream=new_stream,
        log=structlog.get_logger("data"),
        executor=work,
        read_ahead=READ_AHEAD,
        **share,
    )
    data_pb2_grpc.add_DataServiceServicer_to_server(servicer, server.server)
    server.start(["surge.v1.DataService"])
    channel = grpc_server.channel(f"127.0.0.1:{server.port}", module=Module.L2_TRAINING_LOOP)
    try:
        yield servicer, data_pb2_grpc.DataServiceStub(channel), gate, relays
    finally:
        channel.close()
        server.stop(grace=0)
        work.shutdown(wait=True)


def reference(root, req: data_pb2.OpenStream) -> list[bytes]:
    """The sequence a stream of ``req`` yields alone (in process, its own pipeline)."""
    return [b.SerializeToString() for b in build_stream(root).batches(req)]


def read_all(stub, req, out: list, n: int | None = None) -> None:
    for i, batch in enumerate(stub.Stream(req)):
        if n is not None and i == n:
            break
        out.append(batch.SerializeToString())


def test_identical_requests_share_one_pipeline_and_a_different_one_gets_its_own(dataset, root):
    same = open_stream(rank=0, world_size=2, repeat=True, max_batches=40)
    other = open_stream(rank=1, world_size=2, repeat=True, max_batches=40)
    with data_service(root) as (servicer, stub, gate, relays):
        got = [[] for _ in range(4)]
        readers = [
            threading.Thread(target=read_all, args=(stub, req, out))
            for req, out in zip((same, same, same, other), got, strict=True)
        ]
        for t in readers:
            t.start()
        wait_until(lambda: servicer.streams_open == 4, "four streams attached")
        gate.set()
        for t in readers:
            t.join(30)
        assert servicer.pipelines_built == 2 and len(relays) == 2
        wait_until(lambda: all(r._closed for r in relays), "both pipelines closed")
    expected = reference(root, same)
    assert len(expected) == 40 and got[0] == got[1] == got[2] == expected
    assert got[3] == reference(root, other) != expected


def test_a_stream_that_comes_after_the_window_moved_gets_its_own_pipeline_from_the_start(dataset, root):
    req = open_stream(repeat=True, max_batches=30)
    expected = reference(root, req)
    with data_service(root, keep_head=0, join_grace_s=0) as (servicer, stub, gate, relays):
        gate.set()
        first = stub.Stream(req)
        early = [next(first).SerializeToString() for _ in range(12)]  # 3 windows on
        late: list[bytes] = []
        read_all(stub, req, late)
        assert servicer.pipelines_built == 2
        rest = [b.SerializeToString() for b in first]
    assert early + rest == expected and late == expected


def test_a_peer_that_opens_a_little_later_joins_while_the_head_is_kept_and_not_once_it_is_passed(dataset, root):
    """On the registry itself (gRPC's buffers would move the first stream's cursor on their
    own): the first consumer reads 10 batches, a peer attaches and gets the whole sequence;
    once the first passed the head kept (16), the next one opens a pipeline of its own."""
    req = open_stream(repeat=True, max_batches=60)
    expected = reference(root, req)
    work = ThreadPoolExecutor(2)

    async def run() -> tuple[list, list, list, int, int]:
        registry = PipelineRegistry(
            new_stream=lambda: build_stream(root),
            executor=work,
            read_ahead=READ_AHEAD,
            log=structlog.get_logger("data"),
            keep_head=16,
            join_grace_s=30,
        )
        first = registry.attach(req).consume()
        a = [(await anext(first)).SerializeToString() for _ in range(10)]
        peer = registry.attach(req).consume()
        b = [(await anext(peer)).SerializeToString() for _ in range(10)]  # it catches up (held)
        joined = registry.pipelines_built
        for _ in range(30):  # in lockstep (the slower holds the faster), both past the head
            a.append((await anext(first)).SerializeToString())
            b.append((await anext(peer)).SerializeToString())
        late = [x.SerializeToString() async for x in registry.attach(req).consume()]

        async def rest(consumer, out: list) -> None:
            out += [x.SerializeToString() async for x in consumer]

        await asyncio.gather(rest(first, a), rest(peer, b))  # (together: the slower holds the faster)
        return a, b, late, joined, registry.pipelines_built

    try:
        a, b, late, joined, built = asyncio.run(run())
    finally:
        work.shutdown(wait=True)
    assert (joined, built) == (1, 2)
    assert a == b == late == expected


def test_a_stream_that_hangs_up_mid_way_does_not_disturb_its_peers(dataset, root):
    req = open_stream(repeat=True, max_batches=40)
    with data_service(root) as (servicer, stub, gate, relays):
        quitter = stub.Stream(req)
        got = [[], []]
        peers = [threading.Thread(target=read_all, args=(stub, req, out)) for out in got]
        for t in peers:
            t.start()
        wait_until(lambda: servicer.streams_open == 3, "three streams attached")
        gate.set()
        head = [next(quitter).SerializeToString() for _ in range(3)]
        quitter.cancel()  # the rank hangs up: its peers' pipeline waits for it no more
        for t in peers:
            t.join(30)
        assert servicer.pipelines_built == 1
        wait_until(lambda: servicer.streams_open == 0 and relays[0]._closed, "the pipeline closed")
    expected = reference(root, req)
    assert head == expected[:3] and got[0] == got[1] == expected


def test_a_stream_that_asks_for_several_batches_per_message_gets_the_same_sequence_in_fewer_messages(dataset, root):
    # issue 28 item 3: the rank's relay asks for up to 4 micro-batches per stream message; the
    # service sends what its pipeline holds (never more than asked, never waiting to fill one),
    # the later ones in the first's `more`, and the sequence is the one a stream of one batch
    # per message gets, in order; a peer asking for one per message shares the pipeline's batches.
    req = open_stream(rank=0, world_size=1, repeat=True, max_batches=30)
    windowed = data_pb2.OpenStream()
    windowed.CopyFrom(req)
    windowed.batches_per_message = 4
    with data_service(root) as (servicer, stub, gate, relays):
        gate.set()
        messages = list(stub.Stream(windowed))
        alone = []
        read_all(stub, req, alone)
    flat = []
    for m in messages:
        assert all(not b.more for b in m.more)  # never nested
        rest = list(m.more)
        m.ClearField("more")
        flat += [m.SerializeToString(), *(b.SerializeToString() for b in rest)]
    expected = reference(root, req)
    assert len(expected) == 30 and flat == expected and alone == expected
    assert max(1 + len(m.more) for m in messages) <= 4
    assert len(messages) < 30  # (READ_AHEAD 2: the pipeline holds 2 or more when asked)
