"""`surgectl checkpoints --verify`: the real store process re-hashes every committed version
(its Scrub RPC) and the CLI prints one line per version, exit 1 when one is not intact. The
versions are written as ranks write them (BeginSave, the chunk writer, CommitSave)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp

from services.contract import store_pb2, store_pb2_grpc
from services.state.chunk_store import ChunkWriter
from tests.callers import any_caller_channel
from tests.cli.test_housekeeping import run_cli
from tests.conftest import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[2]
JOB = "verify-0a1b2c"


@pytest.fixture
def store(tmp_path):
    port, metrics_port = free_ports(2)
    with open(tmp_path / "store.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.store", "--host", "127.0.0.1", "--port", str(port)]
            + ["--metrics-port", str(metrics_port), "--root", str(tmp_path / "store")],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            deadline = time.monotonic() + 60
            while True:
                try:
                    grpc.channel_ready_future(ch).result(timeout=0.5)
                    break
                except grpc.FutureTimeoutError:
                    assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "store.log").read_text()
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def save(stub, step: int) -> store_pb2.SaveCompleted:
    staged = stub.BeginSave(store_pb2.SaveCheckpoint(job_id=JOB, step=step, rank=0, baseline_every=5), timeout=10)
    state = {"model": {"w": torch.full((64, 256), float(step))}, "train": {"step": step}}
    writer = ChunkWriter(staged.staging_path, staged.chunk_path, chunk_bytes=16384, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    return stub.CommitSave(store_pb2.CommitCheckpoint(job_id=JOB, step=step, world_size=1, spec_json="{}"), timeout=30)


def test_verify_names_the_version_and_chunk_a_corrupted_file_damaged_and_exits_non_zero(store, monkeypatch, capsys):
    monkeypatch.setenv("SURGE_STORE_ADDRESS", store)
    with any_caller_channel(store) as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        v1, v2 = save(stub, 1), save(stub, 2)
    code, out, err = run_cli(["checkpoints", "--verify"], monkeypatch, capsys)
    assert code == 0, (out, err)
    assert [line.split()[:2] for line in out.splitlines()[:2]] == [[v1.version, "ok"], [v2.version, "ok"]]
    # A chunk only v2 references, changed on disk in place (its size kept: bit rot).
    chunks = {c["sha"] for c in json.loads((Path(v1.path) / "manifest.json").read_bytes())["chunks"]}
    manifest = json.loads((Path(v2.path) / "manifest.json").read_bytes())
    sha = next(c["sha"] for c in manifest["chunks"] if c["sha"] not in chunks)
    chunk = Path(v2.path).parent / manifest["chunk_dir"] / sha[:2] / sha
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    code, out, err = run_cli(["checkpoints", "--verify"], monkeypatch, capsys)
    lines = out.splitlines()
    assert code == 1 and "Traceback" not in out + err, (out, err)
    assert lines[0].split()[:2] == [v1.version, "ok"]
    assert lines[1] == f"{v2.version}  CORRUPT  checkpoint {v2.version}: {manifest['chunk_dir']}/{sha}: sha256 mismatch"
    assert lines[2].startswith("2 versions verified in") and lines[2].endswith("1 not intact")
