"""The real `python -m services.store` process, over gRPC and HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.grpc_server import EXIT_PORT_IN_USE
from services.contract import Module, engine_pb2, store_pb2, store_pb2_grpc
from tests.callers import any_caller_channel, metadata
from tests.conftest import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[2]


def spawn(root: Path, port: int, metrics_port: int, log=subprocess.PIPE, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "SURGE_HOME": str(root / "home"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--root",
            str(root / "store"),
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )


def answers_or_exits(proc: subprocess.Popen, port: int, polls: int | None = None) -> bool:
    """Wait until the store at ``port`` answers or its process ``proc`` exits, for at most
    ``polls`` half-seconds (None: no bound). True if the process still runs."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        ready = grpc.channel_ready_future(ch)
        n = 0
        while polls is None or n < polls:
            try:
                ready.result(timeout=0.5)
                break
            except grpc.FutureTimeoutError:
                if proc.poll() is not None:
                    break
            n += 1
    return proc.poll() is None


@dataclass
class Store:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    root: Path


@pytest.fixture
def store(tmp_path, request):
    extra = getattr(request, "param", ())  # extra command-line flags (indirect parametrization)
    for _ in range(3):  # a port taken between picking and binding: pick again
        port, metrics_port = free_ports(2)
        log = tmp_path / "store.log"
        with open(log, "wb") as out:  # a file, not a pipe: a long log never blocks the service
            proc = spawn(tmp_path, port, metrics_port, out, *extra)
        try:
            if answers_or_exits(proc, port):
                break
            err = log.read_text()
            assert "in use" in err, err
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    else:
        pytest.fail("store did not start on free ports in 3 tries")
    try:
        yield Store(proc, port, metrics_port, tmp_path / "store")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_save_commit_list_load_and_metrics_through_the_real_service(store):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        staged = [stub.BeginSave(store_pb2.SaveCheckpoint(job_id="it", step=8, rank=r), timeout=10) for r in (0, 1)]
        assert staged[0].staging_path == staged[1].staging_path
        state = {"w": torch.linspace(0, 1, 10)}
        with pytest.warns(UserWarning):
            dcp.save(state, checkpoint_id=staged[0].staging_path)
        done = stub.CommitSave(
            store_pb2.CommitCheckpoint(job_id="it", step=8, world_size=2, spec_json='{"a": 1}'), timeout=10
        )
        assert (done.version, done.parent, done.step) == ("it:1", "", 8)
        assert Path(done.path) == store.root / "checkpoints" / "it" / "1"

        listed = stub.List(store_pb2.CheckpointQuery(job_id="it"), timeout=10).checkpoints
        assert [(c.version, c.manifest_sha256) for c in listed] == [("it:1", done.manifest_sha256)]
        info = stub.Load(store_pb2.LoadCheckpoint(version="latest"), timeout=10).info
        assert (info.version, info.path, info.spec_json) == ("it:1", done.path, '{"a": 1}')
        back = {"w": torch.zeros(10)}
        with pytest.warns(UserWarning):
            dcp.load(back, checkpoint_id=info.path)
        assert torch.equal(back["w"], state["w"])

        with pytest.raises(grpc.RpcError) as e:
            stub.Load(store_pb2.LoadCheckpoint(version="it:9"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details() == "checkpoint it:9 not found (have: it:1)"
        with pytest.raises(grpc.RpcError) as e:
            stub.CommitSave(store_pb2.CommitCheckpoint(job_id="it", step=99), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:  # the route lets only the training loop commit
            stub.CommitSave(
                store_pb2.CommitCheckpoint(job_id="it", step=8), timeout=10, metadata=metadata(Module.EXT_USER)
            )
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

        records = [  # the loop's sink choice first (metrics: {tensorboard: true}), then its steps
            store_pb2.MetricRecord(config=store_pb2.LogCollectionConfig(job_id="it", tensorboard=True), seq=1),
            store_pb2.MetricRecord(
                step=engine_pb2.StepCompleted(job_id="it", rank=0, step=1, loss=4.5, tokens=64), seq=2
            ),
            store_pb2.MetricRecord(
                step=engine_pb2.StepCompleted(job_id="it", rank=0, step=2, loss=4.25, tokens=64), seq=3
            ),
        ]
        # Two batches (a node agent sends what it holds unsent in one): an ack per record, in order.
        batches = [store_pb2.MetricBatch(records=records[:1]), store_pb2.MetricBatch(records=records[1:])]
        acks = [[(a.records, a.seq) for a in b.acks] for b in stub.Record(iter(batches), timeout=10)]
        assert acks == [[(0, 1)], [(1, 2), (1, 3)]]
        # A node agent that reconnects resends what it holds: acknowledged again, written once.
        again = list(stub.Record(iter([store_pb2.MetricBatch(records=records)]), timeout=10))
        assert [[(a.records, a.seq) for a in b.acks] for b in again] == [[(0, 1), (0, 2), (0, 3)]]

    body = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=10).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    labels = (("job", "it"), ("rank", "0"))
    assert samples[("surge_train_loss", labels)] == 4.25
    assert samples[("surge_train_steps_total", labels)] == 2
    assert samples[("surge_train_tokens_total", (("job", "it"),))] == 128  # (the job's, once: rank 0's)
    assert samples[("surge_checkpoint_commits_total", (("job", "it"),))] == 1
    jsonl = (store.root / "metrics" / "it.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in jsonl] == [4.5, 4.25]
    from tests.sink_readers import tensorboard_points

    assert tensorboard_points(store.root / "metrics" / "it" / "tensorboard", "train/loss", 2) == [(1, 4.5), (2, 4.25)]


def test_sigterm_stops_the_service_cleanly(store):
    store.proc.send_signal(signal.SIGTERM)
    assert store.proc.wait(timeout=15) == 0


def test_sigusr2_writes_every_threads_stack_to_the_log_and_the_service_goes_on(store, tmp_path):
    """A hang's diagnosis without py-spy (services/common/stack_dump.py; every service and
    rank installs it): the stacks of all its threads, the main one among them, and it still
    answers after."""
    log = tmp_path / "store.log"
    store.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 20
    main = f"services{os.sep}store{os.sep}__main__.py"  # the main thread's bottom frame (written last or first)
    while (text := log.read_text()).count("(most recent call first)") < 2 or main not in text:
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.1)
    assert store.proc.poll() is None and answers_or_exits(store.proc, store.port)


def test_a_port_in_use_is_a_one_line_error_and_a_nonzero_exit(store, tmp_path):
    (other,) = free_ports(1)
    for port, metrics_port, says in (
        (store.port, other, f"cannot listen on 127.0.0.1:{store.port}"),
        (other, store.metrics_port, f"cannot serve /metrics on 127.0.0.1:{store.metrics_port}"),
    ):
        second = spawn(tmp_path / "second", port, metrics_port)
        out, err = second.communicate(timeout=60)
        assert second.returncode == EXIT_PORT_IN_USE  # typed: another socket holds it (gRPC or /metrics)
        lines = err.decode().strip().splitlines()
        assert len(lines) == 1 and says in lines[0], err.decode()


def test_scrub_watch_verify_and_load_of_a_corrupt_version_through_the_real_service(store):
    import threading

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        for step in (5, 10):
            staged = stub.BeginSave(store_pb2.SaveCheckpoint(job_id="sc", step=step, rank=0), timeout=10)
            with pytest.warns(UserWarning):
                dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=staged.staging_path)
            stub.CommitSave(store_pb2.CommitCheckpoint(job_id="sc", step=step, world_size=1), timeout=10)
        watched: list[store_pb2.CheckpointCorrupt] = []
        watch = stub.WatchCheckpoints(store_pb2.WatchCheckpointsRequest(job_id="sc"), timeout=60)

        def follow():
            try:
                for event in watch:
                    watched.append(event)
            except grpc.RpcError:
                pass

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        shard = next(p for p in (store.root / "checkpoints" / "sc" / "2").iterdir() if p.suffix == ".distcp")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x40
        shard.write_bytes(bytes(data))
        cheap = stub.Verify(store_pb2.VerifyCheckpoints(job_id="sc"), timeout=10)
        assert [v.cause for v in cheap.versions] == [store_pb2.VERDICT_OK] * 2  # recorded, not re-hashed
        done = stub.Scrub(store_pb2.ScrubCheckpoints(job_id="sc"), timeout=30)
        assert [(v.info.version, v.ok, v.cause) for v in done.versions] == [
            ("sc:1", True, store_pb2.VERDICT_OK),
            ("sc:2", False, store_pb2.VERDICT_CORRUPT),
        ]
        assert [(c.version, c.step, c.cause) for c in done.newly_corrupt] == [("sc:2", 10, store_pb2.CORRUPT)]
        for _ in range(100):
            if watched:
                break
            threading.Event().wait(0.05)
        assert [(c.version, c.cause) for c in watched] == [("sc:2", store_pb2.CORRUPT)]
        watch.cancel()
        # A new watcher hears of it first thing; the cheap verify and latest know it.
        late = stub.WatchCheckpoints(store_pb2.WatchCheckpointsRequest(), timeout=10)
        assert next(late).version == "sc:2"
        late.cancel()
        assert [v.ok for v in stub.Verify(store_pb2.VerifyCheckpoints(job_id="sc"), timeout=10).versions] == [
            True,
            False,
        ]
        assert stub.Load(store_pb2.LoadCheckpoint(version="sc:latest"), timeout=10).info.version == "sc:1"
        with pytest.raises(grpc.RpcError) as e:
            stub.Load(store_pb2.LoadCheckpoint(version="sc:2"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("surge-store-cause", "CORRUPT") in tuple(e.value.trailing_metadata())
        with pytest.raises(grpc.RpcError) as e:  # only the orchestrator (or the operator) may ask for a scrub
            stub.Scrub(store_pb2.ScrubCheckpoints(), timeout=10, metadata=metadata(Module.L2_TRAINING_LOOP))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("store", [("--scrub-interval-seconds", "0.3")], indirect=True)
def test_the_scrub_schedule_finds_a_flipped_byte_on_its_own(store):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        staged = stub.BeginSave(store_pb2.SaveCheckpoint(job_id="sched", step=1, rank=0), timeout=10)
        with pytest.warns(UserWarning):
            dcp.save({"w": torch.ones(64)}, checkpoint_id=staged.staging_path)
        done = stub.CommitSave(store_pb2.CommitCheckpoint(job_id="sched", step=1, world_size=1), timeout=10)
        watch = stub.WatchCheckpoints(store_pb2.WatchCheckpointsRequest(job_id="sched"), timeout=30)
        shard = next(p for p in Path(done.path).iterdir() if p.suffix == ".distcp")
        # Flipped in place: write_bytes truncates first, and a scrub (every 0.3 s) that read
        # the file between the truncation and the write found it 0 bytes long.
        with shard.open("r+b") as f:
            first = f.read(1)[0]
            f.seek(0)
            f.write(bytes([first ^ 0x01]))
        found = next(watch)  # nobody asked: the schedule's scrub found it
        watch.cancel()
    assert (found.version, found.cause) == ("sched:1", store_pb2.CORRUPT)
    assert found.reason == f"checkpoint sched:1: {shard.name}: sha256 mismatch"
