"""The rank's relays of L4 and L5 (services/rank/data_client.py, store_client.py) and the
node agent's metric stream (services/worker/metric_stream.py) against in-test gRPC servers."""

from __future__ import annotations

import gc
import queue
import shutil
import sys
import threading
import time
import weakref
from concurrent import futures

import grpc
import numpy as np
import pytest
import structlog
import torch
import torch.distributed as dist
from rank_fakes import free_port

from services.contract import Module, data_pb2, data_pb2_grpc, engine_pb2, route_pb2, store_pb2, store_pb2_grpc
from services.contract.bus import Bus
from services.rank.data_client import DataClient
from services.rank.metrics_client import MetricsClient
from services.rank.store_client import CheckpointError, CheckpointIntegrityError, StoreClient
from services.worker.metric_stream import MetricStream, MetricStreams
from tests.module_failed import raised_in_module

pytestmark = pytest.mark.timeout(60)


class Data(data_pb2_grpc.DataServiceServicer):
    def Mount(self, request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"dataset {request.name}@{request.version}: sha256 mismatch")

    def Stream(self, request, context):
        ids = np.arange(2 * 3, dtype="<i4").reshape(2, 3)
        if request.split == "train":  # a long stream, one batch per row from the start position
            for row in range(request.start.row + 1, request.start.row + 500):
                time.sleep(0.01)
                yield data_pb2.MicroBatch(
                    input_ids=ids.tobytes(), labels=ids.tobytes(), batch_size=2, seq_len=3, tokens=6,
                    next=data_pb2.DataPosition(row=row),
                )  # fmt: skip
            return
        yield data_pb2.MicroBatch(
            input_ids=ids.tobytes(),
            labels=(ids + 1).tobytes(),
            batch_size=2,
            seq_len=3,
            tokens=6,
            next=data_pb2.DataPosition(row=1),
        )
        if request.split == "bad":
            yield data_pb2.MicroBatch(input_ids=b"\0" * 5, labels=b"", batch_size=2, seq_len=3)


class Store(store_pb2_grpc.StoreServiceServicer):
    def __init__(self, root):
        self.root, self.records, self.commits = root, [], []
        self.attempts: list[tuple[str, int, str]] = []  # (BeginSave | CommitSave, step, attempt)
        self.loads: dict[str, store_pb2.CheckpointInfo] = {}  # version -> what Load answers
        self.streams = 0
        self.received: list[tuple[int, int]] = []  # (stream number, record seq) of every record read
        self.break_first_stream_after = 0  # > 0: the first Record stream acks 2 records, reads this many, fails
        self.batches: list[tuple[float, int]] = []  # (time.monotonic(), records) of every MetricBatch read

    def BeginSave(self, request, context):
        self.attempts.append(("BeginSave", request.step, request.attempt))
        if request.step == 13:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "disk full\nsecond line")
        if request.step == 15:  # a place nothing can be written to
            return store_pb2.SaveStaged(job_id=request.job_id, step=15, staging_path="/proc/version/staging")
        return store_pb2.SaveStaged(job_id=request.job_id, step=request.step, staging_path=str(self.root / "staging"))

    def CommitSave(self, request, context):
        self.commits.append(request.step)
        self.attempts.append(("CommitSave", request.step, request.attempt))
        if request.step == 14:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "checkpoint j: step 14: x.distcp: changed while committing"
            )
        if request.step == 16:  # the store went away under the commit
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if request.step == 17:  # a store that does not answer (stopped)
            time.sleep(3.0)
        return store_pb2.SaveCompleted(job_id=request.job_id, version=f"{request.job_id}:1", step=request.step)

    def Load(self, request, context):
        if request.version in self.loads:
            return store_pb2.CheckpointLoaded(info=self.loads[request.version])
        if request.version == "bad:1":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "checkpoint bad:1: __0_0.distcp: sha256 mismatch")
        context.abort(grpc.StatusCode.NOT_FOUND, f"checkpoint {request.version} not found (have: none)")

    def Record(self, request_iterator, context):
        self.streams += 1
        first = self.streams == 1
        i = 0  # records of this stream so far
        for batch in request_iterator:
            self.batches.append((time.monotonic(), len(batch.records)))
            acks = []
            for rec in batch.records:
                self.received.append((self.streams, rec.seq))
                i += 1
                if first and self.break_first_stream_after:
                    if i > self.break_first_stream_after:
                        if acks:
                            yield store_pb2.MetricAcks(acks=acks)
                        context.abort(grpc.StatusCode.UNAVAILABLE, "store restarting")
                    self.records.append(rec)
                    if i <= 2:  # written, but only the first two acknowledged before the break
                        acks.append(store_pb2.MetricsAck(records=1, seq=rec.seq))
                    continue
                if any(r.seq == rec.seq for r in self.records):
                    acks.append(store_pb2.MetricsAck(records=0, seq=rec.seq))  # the real store writes a resend once
                    continue
                self.records.append(rec)
                acks.append(store_pb2.MetricsAck(records=1, seq=rec.seq))
            yield store_pb2.MetricAcks(acks=acks)


@pytest.fixture
def server(tmp_path):
    store = Store(tmp_path)
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    data_pb2_grpc.add_DataServiceServicer_to_server(Data(), s)
    store_pb2_grpc.add_StoreServiceServicer_to_server(store, s)
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    yield f"127.0.0.1:{port}", store
    s.stop(0)


def data_relay(address: str, **job):
    bus, got = Bus(), queue.Queue()
    client = DataClient(address, bus.emitter(Module.L4_DATASET_VERSIONS), bus.emitter(Module.L4_BATCH_PACKER), **job)
    bus.subscribe(Module.L1_FAULT_DETECTOR, data_pb2.DataServiceUnreachable, lambda m, p=None: got.put((m, p)))
    bus.subscribe(Module.L4_DATASET_VERSIONS, data_pb2.MountDataset, client.mount)
    bus.subscribe(Module.L4_DATASET_VERSIONS, data_pb2.OpenStream, client.open_stream)
    for kind in (data_pb2.MicroBatch, data_pb2.DataExhausted, data_pb2.DatasetUnavailable):
        bus.subscribe(Module.L2_TRAINING_LOOP, kind, lambda m, p=None: got.put((m, p)))
    return client, bus.port(Module.L2_TRAINING_LOOP, Module.L4_DATASET_VERSIONS), got


def test_batches_are_decoded_to_int64_B_T_and_the_stream_end_is_reported(server):
    client, port, got = data_relay(server[0])
    port(data_pb2.OpenStream(split="val"))
    mb, batch = got.get(timeout=10)
    assert (mb.batch_size, mb.seq_len, mb.tokens, mb.input_ids) == (2, 3, 6, b"")  # bytes stay behind
    assert batch.split == "val" and batch.input_ids.dtype == torch.int64
    assert torch.equal(batch.input_ids, torch.arange(6).reshape(2, 3)) and torch.equal(
        batch.labels, batch.input_ids + 1
    )
    end, _ = got.get(timeout=10)
    assert isinstance(end, data_pb2.DataExhausted) and end.split == "val" and end.position.row == 1
    client.close()


def test_a_reopened_stream_replaces_the_old_one_and_its_batches_carry_the_new_token(server):
    # The loop reopens its train stream at the healed position after a group rebuilt in place
    # (issue 16): the old stream stops, and a batch of it still on its way is told apart by
    # its token (OpenStream's reply payload), which the loop drops.
    client, port, got = data_relay(server[0])
    first = port(data_pb2.OpenStream(split="train")).payload
    mb, batch = got.get(timeout=10)
    assert batch.stream is first and mb.next.row == 1
    second = port(data_pb2.OpenStream(split="train", start=data_pb2.DataPosition(row=100))).payload
    assert second is not first
    late = []
    while (item := got.get(timeout=10))[1].stream is not second:
        late.append(item)
    assert item[0].next.row == 101  # the new stream, from its start
    assert all(b.stream is first for _, b in late)
    time.sleep(0.3)  # the old stream was cancelled: nothing more of it comes
    rest = []
    while not got.empty():
        rest.append(got.get())
    assert rest and all(b.stream is second for _, b in rest)
    assert [m.next.row for m, _ in rest] == list(range(102, 102 + len(rest)))
    client.close()


def test_mount_and_stream_errors_become_dataset_unavailable_with_one_line(server):
    client, port, got = data_relay(server[0])
    reply = port(data_pb2.MountDataset(name="d", version="v2")).message
    assert isinstance(reply, data_pb2.DatasetUnavailable) and reply.reason == "dataset d@v2: sha256 mismatch"
    # Typed by the service's status (FAILED_PRECONDITION: a refused input), not by its words.
    assert (reply.failure.module, reply.failure.cause) == (Module.L4_DATASET_VERSIONS, route_pb2.FAILURE_INVALID_INPUT)
    port(data_pb2.OpenStream(split="bad", mount=data_pb2.MountDataset(name="d", version="v2")))
    got.get(timeout=10)
    bad, _ = got.get(timeout=10)
    assert isinstance(bad, data_pb2.DatasetUnavailable) and bad.reason.startswith("malformed micro-batch: 5 bytes")
    client.close()
    client, port, got = data_relay(f"127.0.0.1:{free_port()}")  # nothing listens there
    reply = port(data_pb2.MountDataset(name="d", version="v1")).message
    assert reply.reason.startswith("data service unreachable at 127.0.0.1:")
    assert reply.failure.cause == route_pb2.FAILURE_UNAVAILABLE
    client.close()


class Restarting(Data):
    """A data service whose train streams break (UNAVAILABLE, as when it restarts) after
    ``breaks_after`` batches (after the first break: ``then_after``), ``breaks`` times;
    every stream's start is kept."""

    def __init__(self, breaks_after: int, breaks: int, then_after: int | None = None):
        self.breaks_after, self.breaks, self.starts = breaks_after, breaks, []
        self.then_after = breaks_after if then_after is None else then_after

    def Stream(self, request, context):
        self.starts.append(request.start.row)
        for i, mb in enumerate(super().Stream(request, context)):
            if i == self.breaks_after and self.breaks > 0:
                self.breaks, self.breaks_after = self.breaks - 1, self.then_after
                context.abort(grpc.StatusCode.UNAVAILABLE, "data service restarting")
            yield mb


def serve_data(servicer) -> tuple[grpc.Server, str]:
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    data_pb2_grpc.add_DataServiceServicer_to_server(servicer, s)
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    return s, f"127.0.0.1:{port}"


def test_a_stream_broken_by_a_restart_resumes_at_the_last_batch_handed_on_none_repeated_or_skipped():
    data = Restarting(breaks_after=5, breaks=2)
    server, address = serve_data(data)
    client, port, got = data_relay(address)
    try:
        token = port(data_pb2.OpenStream(split="train")).payload
        batches = [got.get(timeout=20) for _ in range(15)]
    finally:
        client.close()
        server.stop(0)
    # Rows 1..15 in order across two breaks: each reopened stream started at the last handed
    # batch's `next`, and every batch is of the one stream the loop opened (same token).
    assert [m.next.row for m, _ in batches] == list(range(1, 16))
    assert all(isinstance(m, data_pb2.MicroBatch) and b.stream is token for m, b in batches)
    assert data.starts == [0, 5, 10]


def test_a_data_service_that_stays_away_is_reported_unavailable_once_the_backoff_budget_is_spent(monkeypatch):
    from services.rank import data_client

    monkeypatch.setattr(data_client, "RECONNECT_S", 1.0)
    data = Restarting(breaks_after=2, breaks=1_000, then_after=0)  # two batches, then never one again
    server, address = serve_data(data)
    client, port, got = data_relay(address)
    try:
        port(data_pb2.OpenStream(split="train", mount=data_pb2.MountDataset(name="d", version="v1")))
        t0 = time.monotonic()
        while not isinstance((item := got.get(timeout=20))[0], data_pb2.DatasetUnavailable):
            pass
        waited = time.monotonic() - t0
    finally:
        client.close()
        server.stop(0)
    gone = item[0]
    assert (gone.name, gone.failure.cause) == ("d", route_pb2.FAILURE_UNAVAILABLE)  # typed by the status code
    assert gone.reason.startswith("data service unreachable at 127.0.0.1:")
    assert len(data.starts) >= 3 and 1.0 <= waited < 10.0  # tried again, jittered, within its budget
    assert set(data.starts[1:]) == {2}  # every retry at the same position: nothing was handed on since


def test_a_jobs_relay_tells_l1_it_waits_for_the_data_service_and_when_it_is_back_where_it_continues():
    data = Restarting(breaks_after=3, breaks=1)
    server, address = serve_data(data)
    client, port, got = data_relay(address, job_id="j", rank=1, outage_s=60.0)
    try:
        port(data_pb2.OpenStream(split="train"))
        items = [got.get(timeout=20)[0] for _ in range(8)]
    finally:
        client.close()
        server.stop(0)
    told = [m for m in items if isinstance(m, data_pb2.DataServiceUnreachable)]
    rows = [m.next.row for m in items if isinstance(m, data_pb2.MicroBatch)]
    assert rows == [1, 2, 3, 4, 5, 6]  # nothing repeated or skipped across the break
    waiting, back = told
    assert (waiting.job_id, waiting.rank, waiting.split, waiting.back, waiting.address) == (
        "j",
        1,
        "train",
        False,
        address,
    )
    assert waiting.reason.startswith("data service unreachable at 127.0.0.1:") and waiting.at.row == 3
    assert (back.back, back.at.row) == (True, 3) and back.waited_seconds > 0
    assert items.index(back) == 4  # told before the first batch of the reopened stream is handed on


def test_a_jobs_mount_waits_for_an_unreachable_data_service_then_reports_it_typed_unavailable(monkeypatch):
    from services.rank import data_client

    monkeypatch.setattr(data_client, "RECONNECT_S", 0.5)  # the relay's margin over the job's wait
    client, port, got = data_relay(f"127.0.0.1:{free_port()}", job_id="j", rank=0, outage_s=0.5)
    t0 = time.monotonic()
    reply = port(data_pb2.MountDataset(name="d", version="v1")).message
    waited = time.monotonic() - t0
    client.close()
    assert 1.0 <= waited < 10.0  # tried again for the job's wait and the margin, not at once
    assert reply.failure.cause == route_pb2.FAILURE_UNAVAILABLE
    (told, _) = got.get(timeout=1)
    assert (told.split, told.back, told.job_id) == ("", False, "j")  # (a mount: no split)


IO = route_pb2.FAILURE_IO


def store_relay(address: str):
    bus, up = Bus(), []
    client = StoreClient(address, bus.emitter(Module.L5_CHECKPOINT_MANAGER))
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.SaveCheckpoint, client.save_checkpoint)
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.CommitCheckpoint, client.commit_checkpoint)
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.FlushCheckpoint, client.flush_checkpoint)
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, client.load_checkpoint)
    bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SaveCompleted, lambda m, p=None: up.append(m))
    bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SnapshotFailed, lambda m, p=None: up.append(m))
    return client, bus.port(Module.L2_TRAINING_LOOP, Module.L5_CHECKPOINT_MANAGER), up


def metric_stream(address: str, **kw) -> tuple[MetricStream, list]:
    acks: list[store_pb2.MetricsAck] = []
    return MetricStream(address, structlog.get_logger(), **kw), acks


def test_step_metrics_stream_to_the_store_and_are_flushed_on_close(server):
    address, store = server
    stream, acks = metric_stream(address)
    for step in range(1, 21):  # two ranks' records on the node's one stream, each numbered by its rank
        stream.submit(
            store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id="j", step=step), seq=step), acks.append
        )
    stream.submit(
        store_pb2.MetricRecord(eval=engine_pb2.EvalCompleted(job_id="j", step=20, loss=2.0), seq=7), acks.append
    )
    stream.close(timeout=10)
    assert [r.step.step for r in store.records[:20]] == list(range(1, 21))
    assert store.records[20].eval.loss == 2.0
    assert [r.seq for r in store.records] == list(range(1, 22))  # the stream's own order
    assert [a.seq for a in acks] == [*range(1, 21), 7]  # each ack back with its rank's seq


def test_a_ranks_metrics_client_waits_at_its_end_for_the_ack_of_every_record_it_handed_on():
    sent: list[store_pb2.MetricRecord] = []
    routed: list = []
    client = MetricsClient(sent.append, on_routed=routed.extend)
    client.on_step_completed(engine_pb2.StepCompleted(job_id="j", step=1))
    client.log_collection_config(store_pb2.LogCollectionConfig(job_id="j"))
    assert [r.seq for r in sent] == [1, 2] and client.held_records == 2
    acker = threading.Timer(0.3, lambda: [client.acked(store_pb2.MetricsAck(seq=r.seq, records=1)) for r in sent[:]])
    acker.start()
    t0 = time.monotonic()
    client.stop_log_collection(store_pb2.StopLogCollection(job_id="j"))  # its own ack (seq 3) comes too
    assert 0.25 < time.monotonic() - t0 < 4.0 and client.held_records == 0
    assert [r.WhichOneof("record") for r in sent] == ["step", "config", "stop"]
    client.acked(store_pb2.MetricsAck(seq=3, routed=[route_pb2.Routed(type="surge.v1.LogWriteFailed")]))
    assert [r.type for r in routed] == ["surge.v1.LogWriteFailed"]  # a sink's failure, for the rank's bus


def _step(step: int, seq: int) -> store_pb2.MetricRecord:
    return store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id="j", step=step), seq=seq)


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_nodes_records_go_per_interval_and_each_rank_gets_one_ack_per_batch(server):
    """Per interval, not per step: records submitted over less than the linger go in one
    MetricBatch once the oldest has waited it, and each rank (key) gets one ack for them."""
    address, store = server
    stream = MetricStream(address, structlog.get_logger(), linger_s=0.6)
    by_rank: dict[str, list[store_pb2.MetricsAck]] = {"a": [], "b": [], "none": []}
    t0 = time.monotonic()
    for step in (1, 2, 3):  # two ranks finishing steps 0.05 s apart, and a record without a key
        stream.submit(_step(step, step), by_rank["a"].append, key="a")
        stream.submit(_step(step, step), by_rank["b"].append, key="b")
        time.sleep(0.05)
    stream.submit(_step(9, 7), by_rank["none"].append)
    stream.submit(_step(10, 8), by_rank["none"].append)
    _wait_for(lambda: stream.held_records == 0)
    assert [n for _, n in store.batches] == [8]  # one batch, not one per record
    assert store.batches[0][0] - t0 >= 0.55  # it waited for the linger of its oldest record
    assert [(a.seq, a.records) for a in by_rank["a"]] == [(3, 3)]  # the rank's last seq, the records summed
    assert [(a.seq, a.records) for a in by_rank["b"]] == [(3, 3)]
    assert [(a.seq, a.records) for a in by_rank["none"]] == [(7, 1), (8, 1)]  # no key: an ack per record
    stream.close(timeout=2)


def _thread_in(function: str, timeout: float = 10.0) -> int:
    """The native id of the thread whose stack is in ``function`` now (waits for one)."""
    deadline = time.monotonic() + timeout
    while True:
        frames = sys._current_frames()
        for t in threading.enumerate():
            frame = frames.get(t.ident)
            while frame is not None:
                if frame.f_code.co_name == function:
                    return t.native_id
                frame = frame.f_back
        assert time.monotonic() < deadline, f"no thread in {function}"
        time.sleep(0.02)


def _wakeups(native_id: int) -> int:
    """A thread's voluntary context switches: each time it blocked and was woken again."""
    with open(f"/proc/self/task/{native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_records_behind_a_lingering_one_do_not_wake_the_streams_sender(server):
    """A record submitted while the stream's sender waits out an older record's linger changes
    nothing of that wait, so it does not wake the sender (a rank's beat brings a beat's worth
    of records at once); what a rank waits on still wakes it and goes at once with the rest."""
    address, store = server
    stream = MetricStream(address, structlog.get_logger(), linger_s=60)
    acks: list[store_pb2.MetricsAck] = []
    stream.submit(_step(1, 1), acks.append, key="r")  # the sender now waits for its linger
    sender = _thread_in("_batches")
    time.sleep(0.3)
    before = _wakeups(sender)
    for step in range(2, 42):
        stream.submit(_step(step, step), acks.append, key="r")
        time.sleep(0.01)  # (time for a woken sender to wait again: each record would be a wake-up)
    woken = _wakeups(sender) - before
    assert store.batches == [] and woken <= 3, woken  # 40 records: the old code woke it ~40 times
    stream.submit(store_pb2.MetricRecord(stop=store_pb2.StopLogCollection(job_id="j"), seq=42), acks.append, key="r")
    _wait_for(lambda: acks, timeout=5)
    assert [n for _, n in store.batches] == [42] and [(a.seq, a.records) for a in acks] == [(42, 42)]
    stream.close(timeout=2)


def test_a_ranks_acks_of_one_batch_merge_its_routed_failure_events_in_order():
    stream = MetricStream(f"127.0.0.1:{free_port()}", structlog.get_logger(), linger_s=60)
    got: list[store_pb2.MetricsAck] = []
    for seq in (1, 2, 3):
        stream.submit(_step(seq, 10 + seq), got.append, key="r")
    failed = [route_pb2.Routed(type=f"surge.v1.LogWriteFailed{i}") for i in range(2)]
    stream._acked(  # the store's acks of the three records (stream seqs 1-3)
        [
            store_pb2.MetricsAck(seq=1, records=1, routed=[failed[0]]),
            store_pb2.MetricsAck(seq=2, records=0),
            store_pb2.MetricsAck(seq=3, records=1, routed=[failed[1]]),
        ]
    )
    assert len(got) == 1 and (got[0].seq, got[0].records) == (13, 2)
    assert [r.type for r in got[0].routed] == ["surge.v1.LogWriteFailed0", "surge.v1.LogWriteFailed1"]
    assert stream.held_records == 0
    stream.close(timeout=0.5)


def test_what_a_rank_waits_on_does_not_linger(server):
    """A StopLogCollection (the rank's loop waits for its ack at its end) goes at once with
    everything before it, and so does what is held at close."""
    address, store = server
    stream = MetricStream(address, structlog.get_logger(), linger_s=60)
    acks: list[store_pb2.MetricsAck] = []
    stream.submit(_step(1, 1), acks.append, key="r")
    time.sleep(0.3)
    assert store.batches == []  # lingering
    t0 = time.monotonic()
    stream.submit(store_pb2.MetricRecord(stop=store_pb2.StopLogCollection(job_id="j"), seq=2), acks.append, key="r")
    _wait_for(lambda: acks, timeout=5)
    assert time.monotonic() - t0 < 3.0 and [(a.seq, a.records) for a in acks] == [(2, 2)]
    stream.submit(_step(2, 3), acks.append, key="r")
    t0 = time.monotonic()
    stream.close(timeout=5)
    assert time.monotonic() - t0 < 3.0 and acks[-1].seq == 3 and [n for _, n in store.batches] == [2, 1]


def test_metrics_never_block_the_step_when_the_store_is_down():
    stream, acks = metric_stream(f"127.0.0.1:{free_port()}")
    t0 = time.perf_counter()
    for step in range(10_000):
        stream.submit(store_pb2.MetricRecord(step=engine_pb2.StepCompleted(step=step)), acks.append)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    stream.close(timeout=2)
    assert time.perf_counter() - t0 < 4.0
    assert acks == []


def test_a_checkpoint_is_written_to_the_staging_path_and_rank_0_commit_goes_up(server, tmp_path):
    address, _ = server
    client, port, up = store_relay(address)
    weights = {"w": torch.arange(4.0)}
    staged = port(store_pb2.SaveCheckpoint(job_id="j", step=5, rank=0), {"model": weights}).message
    assert staged.staging_path == str(tmp_path / "staging") and (tmp_path / "staging" / ".metadata").exists()
    done = port(store_pb2.CommitCheckpoint(job_id="j", step=5, world_size=1)).message
    assert done.version == "j:1" and up == [done]
    # A refused BeginSave writes nothing and is no fault: skipped, reported (typed), no commit.
    skipped = port(store_pb2.SaveCheckpoint(job_id="j", step=13, rank=0), {"model": weights}).message
    assert skipped.staging_path == ""
    assert port(store_pb2.CommitCheckpoint(job_id="j", step=13, world_size=1)).message is None
    failed = up[-1]
    assert (failed.operation, failed.cause, failed.step, failed.job_id) == ("save", store_pb2.REJECTED, 13, "j")
    assert failed.reason.endswith("BeginSave: RESOURCE_EXHAUSTED: disk full second line")
    # Its failure part is typed by the store's answer (its status: no surge-failure-cause here).
    f = failed.failure
    assert (f.module, f.operation, f.cause, f.job_id) == (
        Module.L5_CHECKPOINT_MANAGER,
        "surge.v1.SaveCheckpoint",
        route_pb2.FAILURE_EXHAUSTED,
        "j",
    )
    assert server[1].commits == [5]
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_returns_before_the_write_and_commits_once_the_write_is_done(server, tmp_path):
    import torch.distributed.checkpoint as dcp

    address, _ = server
    client, port, up = store_relay(address)
    # The payload is a snapshot: a private copy (services/state/state_manager.py), written as
    # it is from the relay's thread, with no copy of its own.
    weights = {"w": torch.arange(1000.0)}
    staged = port(store_pb2.SaveCheckpoint(job_id="j", step=6, rank=0, write_async=True), {"model": weights}).message
    assert staged.seconds > 0
    assert port(store_pb2.CommitCheckpoint(job_id="j", step=6, world_size=1)).message is None  # in the background
    assert port(store_pb2.FlushCheckpoint(job_id="j")).message is None
    assert [u.version for u in up] == ["j:1"]  # committed after the write, then reported up
    back = {"model": {"w": torch.zeros(1000)}}
    dcp.load(back, checkpoint_id=staged.staging_path)
    assert torch.equal(back["model"]["w"], torch.arange(1000.0))
    client.close()


def test_a_refused_commit_is_reported_once_as_the_save_it_seals(server):
    client, port, up = store_relay(server[0])
    port(store_pb2.SaveCheckpoint(job_id="j", step=14, rank=0), {"model": {"w": torch.ones(3)}})
    with raised_in_module(CheckpointError, "CommitSave: FAILED_PRECONDITION"):
        port(store_pb2.CommitCheckpoint(job_id="j", step=14, world_size=1))
    assert [(u.operation, u.cause, u.step, u.job_id) for u in up] == [("save", store_pb2.REJECTED, 14, "j")]
    f = up[0].failure
    assert (f.module, f.operation, f.cause, f.job_id) == (
        Module.L5_CHECKPOINT_MANAGER,
        "surge.v1.CommitCheckpoint",
        route_pb2.FAILURE_INVALID_INPUT,
        "j",
    )
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_background_commit_that_fails_is_raised_at_the_next_flush(server):
    client, port, up = store_relay(server[0])
    port(store_pb2.SaveCheckpoint(job_id="j", step=14, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    port(store_pb2.CommitCheckpoint(job_id="j", step=14, world_size=1))
    with raised_in_module(CheckpointError, "CommitSave: FAILED_PRECONDITION: checkpoint j: step 14: x.distcp: changed"):
        port(store_pb2.FlushCheckpoint(job_id="j"))
    # Nothing committed; the relay reported its failure once, as the save of step 14 the store
    # refused (its status: a refusal), raised at the flush; the bus built no second one.
    assert [(u.DESCRIPTOR.name, u.job_id, u.operation, u.cause, u.step) for u in up] == [
        ("SnapshotFailed", "j", "save", store_pb2.REJECTED, 14)
    ]
    assert (up[0].failure.operation, up[0].failure.cause) == (
        "surge.v1.FlushCheckpoint",
        route_pb2.FAILURE_INVALID_INPUT,
    )
    port(store_pb2.FlushCheckpoint(job_id="j"))  # reported once; nothing is pending any more
    client.close()


def test_every_save_and_commit_of_one_launch_names_its_attempt_and_a_relaunch_another(server, tmp_path):
    address, store = server
    for _launch in range(2):  # a relaunched rank is a new process: a new relay
        client, port, _ = store_relay(address)
        for step in (4, 8):
            shutil.rmtree(tmp_path / "staging", ignore_errors=True)
            port(store_pb2.SaveCheckpoint(job_id="j", step=step, rank=0), {"model": {"w": torch.ones(3)}})
            port(store_pb2.CommitCheckpoint(job_id="j", step=step, world_size=1))
        client.close()
    assert [(op, step) for op, step, _ in store.attempts] == [
        ("BeginSave", 4),
        ("CommitSave", 4),
        ("BeginSave", 8),
        ("CommitSave", 8),
    ] * 2
    first, second = {a for _, _, a in store.attempts[:4]}, {a for _, _, a in store.attempts[4:]}
    assert len(first) == len(second) == 1 and first != second and "" not in first | second


def test_after_the_group_is_rebuilt_in_place_a_save_makes_its_groups_and_its_attempt_anew(server, tmp_path):
    # Issue 16: the survivors' relay outlives the default group. It must neither keep the old
    # world alive (a referenced group keeps its sockets open: a peer blocked in it stays
    # blocked) nor save on its destroyed groups; the new group's ranks draw a new attempt
    # together (a replacement rank starts with none).
    address, store = server
    client, port, _ = store_relay(address)
    try:
        for step in (4, 8):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            shutil.rmtree(tmp_path / "staging", ignore_errors=True)
            port(
                store_pb2.SaveCheckpoint(job_id="j", step=step, rank=0, write_async=True),
                {"model": {"w": torch.ones(3)}},
            )
            port(store_pb2.FlushCheckpoint(job_id="j"))
            world = weakref.ref(dist.group.WORLD)
            dist.destroy_process_group()
            gc.collect()
            assert world() is None, "the store relay still holds the destroyed world"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        client.close()
    begun = [attempt for op, _, attempt in store.attempts if op == "BeginSave"]
    assert len(begun) == 2 and len(set(begun)) == 2 and "" not in begun


def test_a_version_that_fails_verification_is_a_checkpoint_integrity_fault(server):
    client, port, _ = store_relay(server[0])
    with raised_in_module(
        CheckpointIntegrityError, "Load: FAILED_PRECONDITION: checkpoint bad:1: __0_0.distcp: sha256"
    ) as e:
        port(store_pb2.LoadCheckpoint(version="bad:1"), {"model": {"w": torch.ones(3)}})
    assert e.value.fault_class == "checkpoint_integrity"
    with raised_in_module(CheckpointError, "NOT_FOUND") as e:
        port(store_pb2.LoadCheckpoint(version="other:1"), {"model": {"w": torch.ones(3)}})
    assert e.value.fault_class == "checkpoint_error"
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_background_write_that_fails_is_never_committed_and_is_raised_at_the_flush(server):
    address, store = server
    client, port, up = store_relay(address)
    port(store_pb2.SaveCheckpoint(job_id="j", step=15, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    port(store_pb2.CommitCheckpoint(job_id="j", step=15, world_size=1))
    with raised_in_module(CheckpointError, "^checkpoint write failed: "):
        port(store_pb2.FlushCheckpoint(job_id="j"))
    assert store.commits == []
    # This rank's own write failed (no store cause), typed by what it raised; the save's step.
    assert [(u.DESCRIPTOR.name, u.operation, u.cause, u.step, u.failure.cause) for u in up] == [
        ("SnapshotFailed", "save", store_pb2.STORE_FAILURE_UNSPECIFIED, 15, IO)
    ]
    client.close()


def test_a_save_the_store_cannot_be_asked_for_is_skipped_and_reported_and_training_goes_on():
    client, port, up = store_relay(f"127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.perf_counter()
    staged = port(store_pb2.SaveCheckpoint(job_id="j", step=20, rank=0), {"model": {"w": torch.ones(3)}}).message
    assert staged.staging_path == "" and time.perf_counter() - t0 < 5
    assert port(store_pb2.CommitCheckpoint(job_id="j", step=20, world_size=1)).message is None
    (failed,) = up
    assert (failed.operation, failed.cause, failed.step, failed.rank) == ("save", store_pb2.UNREACHABLE, 20, 0)
    assert (failed.failure.cause, failed.failure.operation) == (
        route_pb2.FAILURE_UNAVAILABLE,
        "surge.v1.SaveCheckpoint",
    )
    port(store_pb2.FlushCheckpoint(job_id="j"))  # nothing pending, nothing raised
    client.close(timeout=1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_background_commit_that_cannot_reach_the_store_is_reported_retried_at_the_flush_and_not_raised(
    server, monkeypatch
):
    from services.rank import store_client

    monkeypatch.setattr(store_client, "FLUSH_RETRY_S", 1.5)
    address, store = server
    client, port, up = store_relay(address)
    port(store_pb2.SaveCheckpoint(job_id="j", step=16, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    assert port(store_pb2.CommitCheckpoint(job_id="j", step=16, world_size=1)).message is None
    port(store_pb2.FlushCheckpoint(job_id="j"))  # retried for 1.5 s, then given up: not a fault
    assert store.commits[0] == 16 and len(store.commits) >= 2  # the first try, then the flush's retries
    assert [(u.operation, u.cause, u.step) for u in up] == [("save", store_pb2.UNREACHABLE, 16)]  # reported once
    assert (up[0].failure.cause, up[0].failure.operation) == (
        route_pb2.FAILURE_UNAVAILABLE,
        "surge.v1.CommitCheckpoint",
    )
    client.close()


def test_metric_records_not_acknowledged_are_resent_after_the_stream_breaks(server):
    address, store = server
    store.break_first_stream_after = 5
    stream, acks = metric_stream(address)
    for step in range(1, 11):
        stream.submit(store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id="j", step=step)), acks.append)
    stream.close(timeout=15)
    # The first stream wrote 1..5 but acknowledged only 1 and 2: 3..10 came on the next one,
    # and the store wrote each record once.
    assert [seq for n, seq in store.received if n == 1][:5] == [1, 2, 3, 4, 5]
    assert [seq for n, seq in store.received if n == 2] == list(range(3, 11))
    assert [r.step.step for r in store.records] == list(range(1, 11))
    assert store.streams == 2 and stream.held_records == 0


def test_the_metric_buffer_is_bounded_and_counts_what_it_drops():
    stream, acks = metric_stream(f"127.0.0.1:{free_port()}", buffer=100)
    for step in range(1, 251):
        stream.submit(store_pb2.MetricRecord(step=engine_pb2.StepCompleted(job_id="j", step=step)), acks.append)
    assert stream.held_records == 100 and stream.dropped == 150
    assert [held.record.step.step for held in stream._held][:1] == [151]  # the oldest went first
    stream.close(timeout=0.5)


def _committed_version(tmp_path, job: str = "v"):
    """A real committed version (DCP shards + manifest) made by the checkpoint manager."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from services.store.checkpoint_manager import CheckpointManager

    manager = CheckpointManager(tmp_path / "store")
    staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=3, rank=0)).staging_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(64.0)}}, checkpoint_id=staged)
    done = manager.commit_checkpoint(store_pb2.CommitCheckpoint(job_id=job, step=3, world_size=1))
    return manager.load_checkpoint(store_pb2.LoadCheckpoint(version=done.version)).info


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_load_checks_each_file_as_it_reads_it_and_names_the_one_that_differs(server, tmp_path):
    from pathlib import Path

    address, store = server
    info = _committed_version(tmp_path)
    store.loads[info.version] = info
    client, port, up = store_relay(address)
    into = {"model": {"w": torch.zeros(64)}}
    assert port(store_pb2.LoadCheckpoint(version=info.version), into).message.info.version == "v:1"
    assert torch.equal(into["model"]["w"], torch.arange(64.0))
    shard = next(p for p in Path(info.path).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with raised_in_module(CheckpointIntegrityError, f"^checkpoint v:1: {shard.name}: sha256 mismatch$") as e:
        port(store_pb2.LoadCheckpoint(version=info.version), {"model": {"w": torch.zeros(64)}})
    assert (e.value.fault_class, e.value.cause, e.value.file) == ("checkpoint_integrity", store_pb2.CORRUPT, shard.name)
    shard.unlink()
    with raised_in_module(CheckpointIntegrityError, f"^checkpoint v:1: {shard.name}: missing$") as e:
        port(store_pb2.LoadCheckpoint(version=info.version), {"model": {"w": torch.zeros(64)}})
    assert e.value.cause == store_pb2.MISSING_FILE
    assert [(u.operation, u.cause, u.version) for u in up] == [
        ("load", store_pb2.CORRUPT, "v:1"),
        ("load", store_pb2.MISSING_FILE, "v:1"),
    ]
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_flush_waits_for_a_silent_store_no_longer_than_its_bound_and_reports_it(server, monkeypatch):
    from services.rank import store_client

    monkeypatch.setattr(store_client, "FLUSH_RETRY_S", 1.0)
    client, port, up = store_relay(server[0])
    port(store_pb2.SaveCheckpoint(job_id="j", step=17, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    port(store_pb2.CommitCheckpoint(job_id="j", step=17, world_size=1))
    t0 = time.perf_counter()
    port(store_pb2.FlushCheckpoint(job_id="j"))  # not raised: the run ends without that version
    assert time.perf_counter() - t0 < 2.5
    assert [(u.operation, u.cause, u.step) for u in up] == [("save", store_pb2.TIMEOUT, 17)]
    assert (up[0].failure.cause, up[0].failure.operation) == (route_pb2.FAILURE_TIMEOUT, "surge.v1.FlushCheckpoint")
    assert "that save is not committed" in up[0].reason
    client.close(timeout=1)


def test_a_flush_sends_what_is_held_without_lingering(server):
    """A rank that reported its loop's end (the node agent's ``flush``) waits for its
    records' acks to exit: they do not wait out the linger."""
    address, store = server
    streams = MetricStreams(structlog.get_logger(), linger_s=60)
    acks: list[store_pb2.MetricsAck] = []
    streams.flush(address)  # no stream yet: nothing to do
    streams.submit(address, _step(1, 1), acks.append, key="r")
    streams.submit(address, _step(2, 2), acks.append, key="r")
    time.sleep(0.3)
    t0 = time.monotonic()
    streams.flush(address)
    _wait_for(lambda: acks and acks[-1].seq == 2, timeout=5)
    assert time.monotonic() - t0 < 3.0 and [n for _, n in store.batches] == [2]
    streams.close(timeout=2)


class Windowed(Restarting):
    """``Restarting`` that puts up to ``batches_per_message`` batches in one stream message
    (the later ones in the first's ``more``), as the data service does; each request kept."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def Stream(self, request, context):
        self.requests.append(request)
        piece = []
        for mb in super().Stream(request, context):
            piece.append(mb)
            if len(piece) == max(1, request.batches_per_message):
                head, *rest = piece
                head.more.extend(rest)
                yield head
                piece = []


def test_several_batches_per_message_reach_the_loop_one_by_one_in_order_and_a_resume_mid_window_loses_and_repeats_none():
    # issue 28 item 3: the relay asks for several micro-batches per message; the loop gets each
    # alone (no `more`), decoded, in order. The service breaks after 6 batches (inside its second
    # message of 4): the 4 of the first message were handed on, the 2 of the broken one never
    # arrived, so the stream is reopened at the 4th batch's `next` and rows 5.. come once each.
    data = Windowed(breaks_after=6, breaks=1)
    server, address = serve_data(data)
    client, port, got = data_relay(address)
    try:
        token = port(data_pb2.OpenStream(split="train")).payload
        batches = [got.get(timeout=20) for _ in range(14)]
    finally:
        client.close()
        server.stop(0)
    assert [r.batches_per_message for r in data.requests] == [4, 4]  # the relay's ask, kept on resume
    assert data.starts == [0, 4]  # the last batch handed on: the first message's 4th
    assert [m.next.row for m, _ in batches] == list(range(1, 15))
    assert all(not m.more and b.stream is token for m, b in batches)
    assert all(torch.equal(b.input_ids, torch.arange(6).reshape(2, 3)) for _, b in batches)
