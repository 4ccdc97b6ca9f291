"""The rank's relays of L4 and L5 (services/worker/data_client.py, store_client.py)
against in-test gRPC servers."""

from __future__ import annotations

import queue
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from rank_fakes import free_port
from services.contract import Module as M
from services.contract import data_pb2, data_pb2_grpc, engine_pb2, store_pb2, store_pb2_grpc
from services.contract.bus import Bus
from services.worker.data_client import DataClient
from services.worker.store_client import CheckpointError, CheckpointIntegrityError, StoreClient

pytestmark = pytest.mark.timeout(60)


class Data(data_pb2_grpc.DataServiceServicer):
    def Mount(self, request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"dataset {request.name}@{request.version}: sha256 mismatch")

    def Stream(self, request, context):
        ids = np.arange(2 * 3, dtype="<i4").reshape(2, 3)
        yield data_pb2.MicroBatch(input_ids=ids.tobytes(), labels=(ids + 1).tobytes(), batch_size=2, seq_len=3,
                                  tokens=6, next=data_pb2.DataPosition(document=1))
        if request.split == "bad":
            yield data_pb2.MicroBatch(input_ids=b"\0" * 5, labels=b"", batch_size=2, seq_len=3)


class Store(store_pb2_grpc.StoreServiceServicer):
    def __init__(self, root):
        self.root, self.records, self.commits = root, [], []

    def BeginSave(self, request, context):
        if request.step == 13:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "disk full\nsecond line")
        if request.step == 15:  # a place nothing can be written to
            return store_pb2.SaveStaged(job_id=request.job_id, step=15, staging_path="/proc/version/staging")
        return store_pb2.SaveStaged(job_id=request.job_id, step=request.step, staging_path=str(self.root / "staging"))

    def CommitSave(self, request, context):
        self.commits.append(request.step)
        if request.step == 14:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "checkpoint j: step 14: x.distcp: changed while committing")
        return store_pb2.SaveCompleted(job_id=request.job_id, version=f"{request.job_id}:1", step=request.step)

    def Load(self, request, context):
        if request.version == "bad:1":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "checkpoint bad:1: __0_0.distcp: sha256 mismatch")
        context.abort(grpc.StatusCode.NOT_FOUND, f"checkpoint {request.version} not found (have: none)")

    def Record(self, request_iterator, context):
        n = 0
        for rec in request_iterator:
            self.records.append(rec)
            n += 1
        return store_pb2.MetricsAck(records=n)


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


def data_relay(address: str):
    bus, got = Bus(), queue.Queue()
    client = DataClient(address, bus.emitter(M.L4_DATASET_VERSIONS), bus.emitter(M.L4_BATCH_PACKER))
    bus.subscribe(M.L4_DATASET_VERSIONS, data_pb2.MountDataset, client.mount)
    bus.subscribe(M.L4_DATASET_VERSIONS, data_pb2.OpenStream, client.open_stream)
    for kind in (data_pb2.MicroBatch, data_pb2.DataExhausted, data_pb2.DatasetUnavailable):
        bus.subscribe(M.L2_TRAINING_LOOP, kind, lambda m, p=None: got.put((m, p)))
    return client, bus.port(M.L2_TRAINING_LOOP, M.L4_DATASET_VERSIONS), got


def test_batches_are_decoded_to_int64_B_T_and_the_stream_end_is_reported(server):
    client, port, got = data_relay(server[0])
    port(data_pb2.OpenStream(split="val"))
    mb, batch = got.get(timeout=10)
    assert (mb.batch_size, mb.seq_len, mb.tokens, mb.input_ids) == (2, 3, 6, b"")  # bytes stay behind
    assert batch.split == "val" and batch.input_ids.dtype == torch.int64
    assert torch.equal(batch.input_ids, torch.arange(6).reshape(2, 3)) and torch.equal(batch.labels, batch.input_ids + 1)
    end, _ = got.get(timeout=10)
    assert isinstance(end, data_pb2.DataExhausted) and end.split == "val" and end.position.document == 1
    client.close()


def test_mount_and_stream_errors_become_dataset_unavailable_with_one_line(server):
    client, port, got = data_relay(server[0])
    reply = port(data_pb2.MountDataset(name="d", version="v2")).message
    assert isinstance(reply, data_pb2.DatasetUnavailable) and reply.reason == "dataset d@v2: sha256 mismatch"
    port(data_pb2.OpenStream(split="bad", mount=data_pb2.MountDataset(name="d", version="v2")))
    got.get(timeout=10)
    bad, _ = got.get(timeout=10)
    assert isinstance(bad, data_pb2.DatasetUnavailable) and bad.reason.startswith("malformed micro-batch: 5 bytes")
    client.close()
    client, port, got = data_relay(f"127.0.0.1:{free_port()}")  # nothing listens there
    reply = port(data_pb2.MountDataset(name="d", version="v1")).message
    assert reply.reason.startswith("data service unreachable at 127.0.0.1:")
    client.close()


def store_relay(address: str):
    bus, up = Bus(), []
    client = StoreClient(address, bus.emitter(M.L5_CHECKPOINT_MANAGER))
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.SaveCheckpoint, client.save_checkpoint)
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.CommitCheckpoint, client.commit_checkpoint)
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.FlushCheckpoint, client.flush_checkpoint)
    bus.subscribe(M.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, client.load_checkpoint)
    bus.subscribe(M.L1_ORCHESTRATOR, store_pb2.SaveCompleted, lambda m, p=None: up.append(m))
    return client, bus.port(M.L2_TRAINING_LOOP, M.L5_CHECKPOINT_MANAGER), up


def test_step_metrics_stream_to_the_store_and_are_flushed_on_close(server):
    address, store = server
    client, _, _ = store_relay(address)
    for step in range(1, 21):
        client.on_step_completed(engine_pb2.StepCompleted(job_id="j", step=step, loss=1.0))
    client.on_eval_completed(engine_pb2.EvalCompleted(job_id="j", step=20, loss=2.0))
    client.close(timeout=10)
    assert [r.step.step for r in store.records[:20]] == list(range(1, 21))
    assert store.records[20].eval.loss == 2.0


def test_metrics_never_block_the_step_when_the_store_is_down():
    client, _, _ = store_relay(f"127.0.0.1:{free_port()}")
    t0 = time.perf_counter()
    for step in range(10_000):
        client.on_step_completed(engine_pb2.StepCompleted(step=step))
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    client.close(timeout=2)
    assert time.perf_counter() - t0 < 4.0


def test_a_checkpoint_is_written_to_the_staging_path_and_rank_0_commit_goes_up(server, tmp_path):
    address, _ = server
    client, port, up = store_relay(address)
    weights = {"w": torch.arange(4.0)}
    staged = port(store_pb2.SaveCheckpoint(job_id="j", step=5, rank=0), {"model": weights}).message
    assert staged.staging_path == str(tmp_path / "staging") and (tmp_path / "staging" / ".metadata").exists()
    done = port(store_pb2.CommitCheckpoint(job_id="j", step=5, world_size=1)).message
    assert done.version == "j:1" and up == [done]
    with pytest.raises(CheckpointError, match=r"^store at 127.0.0.1:\d+: BeginSave: RESOURCE_EXHAUSTED: disk full second line$"):
        port(store_pb2.SaveCheckpoint(job_id="j", step=13, rank=0), {"model": weights})
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_returns_after_the_staging_copy_and_commits_once_the_write_is_done(server, tmp_path):
    import torch.distributed.checkpoint as dcp

    address, _ = server
    client, port, up = store_relay(address)
    weights = {"w": torch.arange(1000.0)}
    staged = port(store_pb2.SaveCheckpoint(job_id="j", step=6, rank=0, write_async=True), {"model": weights}).message
    assert staged.seconds > 0
    weights["w"] += 1.0  # training goes on: the save holds its own copy
    assert port(store_pb2.CommitCheckpoint(job_id="j", step=6, world_size=1)).message is None  # in the background
    assert port(store_pb2.FlushCheckpoint(job_id="j")).message is None
    assert [u.version for u in up] == ["j:1"]  # committed after the write, then reported up
    back = {"model": {"w": torch.zeros(1000)}}
    dcp.load(back, checkpoint_id=staged.staging_path)
    assert torch.equal(back["model"]["w"], torch.arange(1000.0))
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_background_commit_that_fails_is_raised_at_the_next_flush(server):
    client, port, up = store_relay(server[0])
    port(store_pb2.SaveCheckpoint(job_id="j", step=14, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    port(store_pb2.CommitCheckpoint(job_id="j", step=14, world_size=1))
    with pytest.raises(CheckpointError, match="CommitSave: FAILED_PRECONDITION: checkpoint j: step 14: x.distcp: changed"):
        port(store_pb2.FlushCheckpoint(job_id="j"))
    assert up == []
    port(store_pb2.FlushCheckpoint(job_id="j"))  # reported once; nothing is pending any more
    client.close()


def test_a_version_that_fails_verification_is_a_checkpoint_integrity_fault(server):
    client, port, _ = store_relay(server[0])
    with pytest.raises(CheckpointIntegrityError, match="Load: FAILED_PRECONDITION: checkpoint bad:1: __0_0.distcp: sha256") as e:
        port(store_pb2.LoadCheckpoint(version="bad:1"), {"model": {"w": torch.ones(3)}})
    assert e.value.fault_class == "checkpoint_integrity"
    with pytest.raises(CheckpointError, match="NOT_FOUND") as e:
        port(store_pb2.LoadCheckpoint(version="other:1"), {"model": {"w": torch.ones(3)}})
    assert e.value.fault_class == "checkpoint_error"
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_background_write_that_fails_is_never_committed_and_is_raised_at_the_flush(server):
    address, store = server
    client, port, up = store_relay(address)
    port(store_pb2.SaveCheckpoint(job_id="j", step=15, rank=0, write_async=True), {"model": {"w": torch.ones(3)}})
    port(store_pb2.CommitCheckpoint(job_id="j", step=15, world_size=1))
    with pytest.raises(CheckpointError, match="^checkpoint write failed: "):
        port(store_pb2.FlushCheckpoint(job_id="j"))
    assert store.commits == [] and up == []
    client.close()
