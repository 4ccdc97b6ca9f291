"""Control's watch of the store's scrub (services/control/store_relay.py ``StoreRelay.watch``)
against an in-test store: the store's CheckpointCorrupt events are relayed, the watch opens
again after the store went away (on its one channel: gRPC reconnects it; nothing is left of
the try before), and ``close`` ends it."""

from __future__ import annotations

import queue
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from services.contract import store_pb2, store_pb2_grpc
from services.control.store_relay import StoreRelay
from tests.ports import free_port

pytestmark = pytest.mark.timeout(60)


class _Scrubs(store_pb2_grpc.StoreServiceServicer):
    """WatchCheckpoints: one stream per watcher; what the test puts on ``found`` goes down
    the open stream (None ends it)."""

    def __init__(self) -> None:
        self.found: queue.Queue = queue.Queue()
        self.watches = 0

    def WatchCheckpoints(self, request, context):  # noqa: N802 (gRPC method name)
        self.watches += 1
        while context.is_active():
            try:
                corrupt = self.found.get(timeout=0.1)
            except queue.Empty:
                continue
            if corrupt is None:
                return
            yield corrupt


def _serve(port: int, scrubs: _Scrubs) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    store_pb2_grpc.add_StoreServiceServicer_to_server(scrubs, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def _until(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _spinning() -> list[str]:
    """Threads waiting in grpcio's channel spin loop now."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        frame = frames.get(t.ident)
        while frame is not None:
            if frame.f_code.co_name == "channel_spin":
                out.append(t.name)
                break
            frame = frame.f_back
    return out


def test_the_watch_relays_the_scrubs_finds_reopens_on_its_one_channel_after_the_store_and_ends_at_close():
    port, scrubs = free_port(), _Scrubs()
    server = _serve(port, scrubs)
    relayed: list[store_pb2.CheckpointCorrupt] = []
    relay = StoreRelay(f"127.0.0.1:{port}", events=lambda msg, payload=None: relayed.append(msg))
    relay.watch()
    try:
        _until(lambda: scrubs.watches == 1)
        scrubs.found.put(store_pb2.CheckpointCorrupt(job_id="j", version="v3", step=30))
        _until(lambda: len(relayed) == 1)
        assert (relayed[0].job_id, relayed[0].version) == ("j", "v3")
        time.sleep(0.3)  # (the watch waits for the next one now)
        assert len(_spinning()) == 1  # one channel's spin thread: the watch's

        server.stop(0).wait()  # the store goes away and comes back on its port
        server = _serve(port, scrubs)
        _until(lambda: scrubs.watches == 2)
        scrubs.found.put(store_pb2.CheckpointCorrupt(job_id="j", version="v4", step=40))
        _until(lambda: len(relayed) == 2)
        assert relayed[1].version == "v4"
        time.sleep(0.3)
        assert len(_spinning()) == 1  # the open watch's only: nothing is left of the first try
    finally:
        relay.close()
        watcher = next((t for t in threading.enumerate() if t.name == "store-watch"), None)
        if watcher is not None:
            watcher.join(5)
            assert not watcher.is_alive()  # close cancelled the watch: its thread ended
        server.stop(0)


def test_a_close_that_races_the_watch_opening_its_stream_still_ends_it():
    # close() while the watch thread is between its closed-check and the stream's opening: the
    # thread sees the close after it assigns the call and cancels it itself (was: the new
    # stream was never cancelled, and the thread waited on it for as long as the store lived).
    port, scrubs = free_port(), _Scrubs()
    server = _serve(port, scrubs)
    try:
        for _ in range(20):
            relay = StoreRelay(f"127.0.0.1:{port}", events=lambda msg, payload=None: None)
            relay.watch()
            watcher = next(t for t in threading.enumerate() if t.name == "store-watch")
            relay.close()
            watcher.join(5)
            assert not watcher.is_alive()
    finally:
        server.stop(0)
