"""Long-lived streams hold no thread of the store (issue 27, item 3): with more metric and
watch streams open than the old server had threads (32), a save's control calls answer at
once. The real `python -m services.store` process over gRPC on loopback."""

from __future__ import annotations

import os
import queue
import threading
import time

import grpc
import pytest

from services.common.grpc_server import channel
from services.contract import Module, engine_pb2, store_pb2, store_pb2_grpc
from tests.store.test_store_service import store  # noqa: F401 - the real service, as a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A node agent's metric stream each, held open (SURGE_BENCH_RECORD_STREAMS: more, as a bench).
RECORD_STREAMS = int(os.environ.get("SURGE_BENCH_RECORD_STREAMS") or 40)
WATCH_STREAMS = 8  # control's corruption watch (one per control, more here)
BEGIN_SAVE_BOUND_S = 5.0  # generous: answered in milliseconds; the old server never answered


def test_begin_save_answers_promptly_with_40_record_and_8_watch_streams_open(store):  # noqa: F811 - the fixture
    address = f"127.0.0.1:{store.port}"
    channels = [channel(address, module=Module.L2_TRAINING_LOOP) for _ in range(RECORD_STREAMS)]
    watchers = [channel(address, module=Module.L1_ORCHESTRATOR) for _ in range(WATCH_STREAMS)]
    user = channel(address, module=Module.EXT_USER)
    feeds: list[queue.Queue] = []
    calls = []
    try:
        # Every Record stream writes one record and gets its ack, then stays open, idle.
        acked = threading.Semaphore(0)
        for i, ch in enumerate(channels):
            feed: queue.Queue = queue.Queue()
            record = store_pb2.MetricRecord(
                step=engine_pb2.StepCompleted(job_id="cap", rank=i, step=1, loss=1.0), seq=1
            )
            feed.put(store_pb2.MetricBatch(records=[record]))
            feeds.append(feed)
            call = store_pb2_grpc.StoreServiceStub(ch).Record(iter(feed.get, None), timeout=60)
            calls.append(call)
            threading.Thread(target=_drain, args=(call, acked), daemon=True).start()
        for ch in watchers:
            watch = store_pb2_grpc.StoreServiceStub(ch).WatchCheckpoints(
                store_pb2.WatchCheckpointsRequest(job_id="cap"), timeout=60
            )
            calls.append(watch)
        deadline = time.monotonic() + 30
        for _ in range(RECORD_STREAMS):  # all 40 served at once: each answered its record
            assert acked.acquire(timeout=max(0.0, deadline - time.monotonic())), "a Record stream was not served"
        time.sleep(0.5)  # the watch streams settle into their wait
        ended = [(c.code(), c.details()) for c in calls if not c.running()]
        assert not ended, ended

        loop = store_pb2_grpc.StoreServiceStub(channels[0])
        t0 = time.monotonic()
        staged = loop.BeginSave(store_pb2.SaveCheckpoint(job_id="cap", step=4, rank=0), timeout=BEGIN_SAVE_BOUND_S)
        begin_s = time.monotonic() - t0
        t0 = time.monotonic()
        listed = store_pb2_grpc.StoreServiceStub(user).List(store_pb2.CheckpointQuery(job_id="cap"), timeout=5)
        list_s = time.monotonic() - t0
    finally:
        for feed in feeds:
            feed.put(None)
        for call in calls:
            call.cancel()
        for ch in [*channels, *watchers, user]:
            ch.close()
    assert staged.staging_path  # a directory to write into: the save goes on
    assert list(listed.checkpoints) == []
    assert begin_s < BEGIN_SAVE_BOUND_S
    print(
        f"\nbench: BeginSave with {RECORD_STREAMS} Record + {WATCH_STREAMS} WatchCheckpoints streams open: "
        f"{begin_s * 1000:.1f} ms (List {list_s * 1000:.1f} ms)"
    )


def _drain(call: grpc.Call, acked: threading.Semaphore) -> None:
    try:
        for _ in call:
            acked.release()
    except grpc.RpcError:
        pass  # cancelled at the end of the test
