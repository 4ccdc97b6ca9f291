"""The real ``python -m services.data`` process over gRPC: Mount, List, Stream, errors, shutdown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import EXIT_PORT_IN_USE
from services.contract import data_pb2, data_pb2_grpc
from tests.callers import any_caller_channel
from tests.ports import free_port

from .helpers import as_arrays, open_stream
from .reference_sequence import reference_batches

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def start(root: Path, port: int, home: Path) -> subprocess.Popen:
    env = {**os.environ, "SURGE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("SURGE_DATA_ROOT", None)
    return subprocess.Popen(
        [sys.executable, "-m", "services.data", "--port", str(port), "--host", "127.0.0.1", "--data-root", str(root)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def service(dataset, root, tmp_path):
    port = free_port()
    proc = start(root, port, tmp_path / "home")
    ch = any_caller_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="surge.v1.DataService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        yield proc, data_pb2_grpc.DataServiceStub(ch)
    finally:
        ch.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_the_service_mounts_lists_streams_and_stops_on_sigterm(service, dataset, root):
    proc, stub = service
    listed = stub.List(data_pb2.DatasetQuery(), timeout=30).datasets
    assert [(d.name, d.version, d.manifest_sha256) for d in listed] == [("tiny", "v1", dataset.manifest_sha256)]

    ready = stub.Mount(data_pb2.MountDataset(name="tiny", version="v1", verify=True), timeout=30)
    assert (ready.train_documents, ready.train_tokens, ready.vocab_size) == (
        dataset.train_documents,
        dataset.train_tokens,
        256,
    )

    batches = list(stub.Stream(open_stream(seq_len=64, micro_batch_size=4, repeat=True, max_batches=3), timeout=30))
    assert len(batches) == 3
    ids, labels = as_arrays(batches[0])
    assert ids.shape == labels.shape == (4, 64) and batches[0].tokens == 4 * 64
    assert (ids[:, 1:] == labels[:, :-1]).all()  # pack mode: labels are the inputs shifted by one

    val = list(stub.Stream(open_stream(split="val", seq_len=64, micro_batch_size=4), timeout=30))
    assert val and val[-1].next.epoch == 1  # a non-repeating stream ends normally after its epoch

    # A rank that hangs up mid-stream leaves the service healthy.
    call = stub.Stream(open_stream(repeat=True), timeout=30)
    next(call)
    call.cancel()
    assert len(list(stub.Stream(open_stream(max_batches=2), timeout=30))) == 2

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_errors_are_grpc_statuses_with_one_line_messages(service, dataset, root):
    _, stub = service
    assert code_and_details(lambda: stub.Mount(data_pb2.MountDataset(name="tiny", version="v9"), timeout=30)) == (
        grpc.StatusCode.NOT_FOUND,
        "dataset tiny@v9 not found (have: tiny@v1)",
    )

    shutil.copytree(dataset.path, root / "tiny" / "v2")
    victim = root / "tiny" / "v2" / "train.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, details = code_and_details(
        lambda: stub.Mount(data_pb2.MountDataset(name="tiny", version="v2", verify=True), timeout=30)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith("dataset tiny@v2: train.bin: sha256 mismatch (manifest ") and "\n" not in details

    code, details = code_and_details(lambda: list(stub.Stream(open_stream(version="v2", verify=True), timeout=30)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "sha256 mismatch" in details
    code, details = code_and_details(lambda: list(stub.Stream(open_stream(seq_len=0), timeout=30)))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "packer.seq_len: must be > 0, got 0")
    code, details = code_and_details(lambda: list(stub.Stream(open_stream(min_tokens=10**6, repeat=True), timeout=30)))
    assert code == grpc.StatusCode.OUT_OF_RANGE and "no document left after filtering" in details


def test_the_next_epoch_is_built_ahead_and_a_stream_crosses_onto_it(service, dataset, root):
    """A repeating stream that opens epoch 0 has epoch 1's index built in the background (an
    epoch boundary is no build); a stream crossing into it reads the sequence of the oracle
    from the index built ahead (not rebuilt), and has epoch 2's built in turn."""
    proc, stub = service
    shape = dict(seq_len=64, micro_batch_size=2, repeat=True, seed=11)
    assert len(list(stub.Stream(open_stream(max_batches=1, **shape), timeout=30))) == 1  # in epoch 0 only
    (epoch0,) = (root / ".index" / "tiny" / "v1").glob("*/epoch-0")
    _wait_for(epoch0.parent / "epoch-1" / "meta.json")
    ahead = (epoch0.parent / "epoch-1" / "sample_idx.npy").stat().st_ino

    rows = json.loads((epoch0 / "meta.json").read_text())["rows"]
    crossing = open_stream(start=data_pb2.DataPosition(epoch=0, row=rows - 5), max_batches=6, **shape)
    got = [(b.input_ids, b.labels, b.tokens, (b.next.epoch, b.next.row)) for b in stub.Stream(crossing, timeout=30)]
    tokens = np.fromfile(dataset.path / "train.bin", dtype="<u2")
    want = reference_batches(tokens, np.load(dataset.path / "train.idx.npy"), crossing, epochs=2)
    assert got == want[:6] and {n[0] for *_, n in got} == {0, 1}
    assert (epoch0.parent / "epoch-1" / "sample_idx.npy").stat().st_ino == ahead
    _wait_for(epoch0.parent / "epoch-2" / "meta.json")


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert time.monotonic() < deadline, f"{path} not built within {timeout_s} s"
        time.sleep(0.05)


def test_a_port_in_use_is_a_one_line_error(root, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = start(root, port, tmp_path / "home")
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == EXIT_PORT_IN_USE  # typed: another socket holds it
    assert err.strip() == f"error: data: cannot listen on 127.0.0.1:{port} (port already in use?)"


def test_a_ranks_stream_opened_past_epoch_0_that_crossed_an_epoch_continues_after_a_service_restart(
    dataset, root, tmp_path
):
    """The rank's relay (services/rank/data_client.py) reopens a stream broken by a data-service
    restart where its handed batches end; a stream opened at epoch 1 (a resume) that crossed
    into epoch 2 reopens with epoch 2's shuffle, and the batches go on as one unbroken stream
    (they were refused as "start.epoch 2 differs from shuffle.epoch 1", failing the job)."""
    import queue

    from services.contract import Module
    from services.contract.bus import Bus
    from services.rank.data_client import DataClient

    port = free_port()
    shape = dict(seq_len=64, micro_batch_size=2, repeat=True, seed=11)
    proc = start(root, port, tmp_path / "home")
    client = None
    try:
        _wait_serving(port)
        ch = any_caller_channel(f"127.0.0.1:{port}")
        stub = data_pb2_grpc.DataServiceStub(ch)
        assert (
            len(
                list(stub.Stream(open_stream(start=data_pb2.DataPosition(epoch=1), max_batches=1, **shape), timeout=60))
            )
            == 1
        )
        ch.close()
        (epoch1,) = (root / ".index" / "tiny" / "v1").glob("*/epoch-1")
        rows = json.loads((epoch1 / "meta.json").read_text())["rows"]
        req = open_stream(start=data_pb2.DataPosition(epoch=1, row=rows - 5), **shape)  # as the loop opens it
        assert req.shuffle.epoch == 1

        bus, got, failed = Bus(), queue.Queue(maxsize=1), queue.Queue()  # a full inbox stops the relay reading
        client = DataClient(
            f"127.0.0.1:{port}", bus.emitter(Module.L4_DATASET_VERSIONS), bus.emitter(Module.L4_BATCH_PACKER)
        )
        bus.subscribe(Module.L4_DATASET_VERSIONS, data_pb2.OpenStream, client.open_stream)
        bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.MicroBatch, lambda m, p=None: got.put((m, p), timeout=60))
        for kind in (data_pb2.DataExhausted, data_pb2.DatasetUnavailable):
            bus.subscribe(Module.L2_TRAINING_LOOP, kind, lambda m, p=None: failed.put(m))
        bus.port(Module.L2_TRAINING_LOOP, Module.L4_DATASET_VERSIONS)(req)

        def take() -> tuple:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                assert failed.empty(), failed.queue[0]
                try:
                    return got.get(timeout=0.5)
                except queue.Empty:
                    pass
            raise AssertionError("no batch within 90 s")

        taken = [take()]
        while taken[-1][0].next.epoch < 2:  # across the epoch's end
            taken.append(take())
        proc.kill()  # the data service restarts while the rank reads epoch 2
        proc.wait(timeout=30)
        proc.stdout.close(), proc.stderr.close()
        proc = start(root, port, tmp_path / "home")
        while len(taken) < 12:
            taken.append(take())
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close(), proc.stderr.close()
    tokens = np.fromfile(dataset.path / "train.bin", dtype="<u2")
    want = reference_batches(tokens, np.load(dataset.path / "train.idx.npy"), req, epochs=3)
    as_bytes = lambda t: t.numpy().astype("<i4").tobytes()  # noqa: E731 - the wire's form of the decoded tensor
    assert [(as_bytes(p.input_ids), as_bytes(p.labels), m.tokens, (m.next.epoch, m.next.row)) for m, p in taken] == (
        want[:12]
    )
    assert {m.next.epoch for m, _ in taken} == {1, 2}


def _wait_serving(port: int, timeout_s: float = 60.0) -> None:
    ch = any_caller_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)
    finally:
        ch.close()
