"""Checkpoints without a shared filesystem (issue 17, part 2): real processes throughout.

A real `store` service on 127.0.0.1 whose root the ranks never see, and two real rank
processes (gloo, CPU) saving and loading through the rank's own checkpoint relay
(``remote_rank_main.py``: StoreClient, DCP from the relay's thread, rank 0's commit). An
audit hook in every rank refuses and counts any file operation under the store's root, so
"the rank never opens the store's paths" is checked, not assumed. Two deployments:

* ``--transfer stream``: chunks and index files stream to the store over gRPC, and back;
* ``--backend s3``: chunks in an S3-compatible object store (moto's server, started here on
  127.0.0.1), written and read by the ranks through s3fs; the index streams to the store.

For each: a save from 2 ranks is committed and verifies (re-hashed), loads back bit-exact
on 2 ranks; a rank killed in the middle of its stream leaves no committed version and the
previous one loads; the next save works. Then the boundary: a chunk whose bytes are not its
name, a stream cut inside a file, names outside the staging directory, an oversized chunk
and another attempt's upload are refused with a typed failure and leave nothing behind; a
chunk damaged in the object store is refused by the reader and found by a scrub.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
import torch

from services.common.grpc_server import channel
from services.contract import Module, store_pb2, store_pb2_grpc
from services.contract.failures import CAUSE_METADATA, FailureCause
from services.rank.store_client import CheckpointIntegrityError, StoreClient
from tests.conftest import free_ports
from tests.rank_forks import RankProcess

from .harness import REPO, Processes, child_env, store_stub, verify, versions_of, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
MIB = 4  # per rank: 4 MiB of its own + 1 MiB shared: 6 chunks a rank
S3_ENV = {"AWS_ACCESS_KEY_ID": "surge-test", "AWS_SECRET_ACCESS_KEY": "surge-test", "AWS_DEFAULT_REGION": "us-east-1"}


def start_store(procs: Processes, root: Path, *extra: str, name: str = "store") -> str:
    port, metrics = free_ports(2)
    argv = [sys.executable, "-m", "services.store", "--host", "127.0.0.1", "--port", str(port)]
    proc = procs.start(name, [*argv, "--metrics-port", str(metrics), "--root", str(root), *extra])
    address = f"127.0.0.1:{port}"
    wait_ready(address, proc, "store")
    return address


def ranks(address: str, job: str, actions: str, forbidden: Path, die: str = "", world: int = 2):
    """One launch of ``world`` rank processes running ``actions`` (remote_rank_main.py, forked
    with torch imported: tests/rank_forks.py); with ``die`` ("STEP:N"), the last rank kills
    itself at the N-th chunk of its save of STEP. -> [(exit code, stdout lines, stderr tail)]."""
    (port,) = free_ports(1)
    logs = Path(tempfile.mkdtemp(prefix="remote-ranks-"))
    procs = []
    for r in range(world):
        argv = [address, job, "-", str(MIB), str(r), str(world), str(port), actions, str(forbidden)]
        if die and r == world - 1:
            argv.append(die)
        out, err = logs / f"rank{r}.out", logs / f"rank{r}.err"
        procs.append(RankProcess(HERE / "remote_rank_main.py", argv, out, REPO, child_env(), err_path=err))
    result = []
    for p in procs:
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.log.close()
        p.err.close()
        stdout, stderr = Path(p.log.name).read_text(), Path(p.err.name).read_text(errors="replace")
        result.append((p.returncode, stdout.splitlines(), stderr[-3000:]))
    shutil.rmtree(logs, ignore_errors=True)
    return result


def said(result, prefix: str) -> list[str]:
    return [line for line in result[1] if line.startswith(prefix)]


def save_load_kill(address: str, root: Path, transfer: str) -> None:
    """The whole path for one deployment, in two launches of 2 ranks (see the module docstring)."""
    # Launch 1: save step 1 (committed), load it back, then save step 2 with rank 1 killed
    # after handing 3 chunks of its part to the transfer (its stream cut mid-save).
    first = ranks(address, "job", "save:1,load:1,save:2", root, die="2:3")
    assert first[1][0] == -9, first[1]
    for rc, lines, err in first:
        assert f"staged transfer={transfer}" in lines, (lines, err)
        assert said((rc, lines), "loaded") == ["loaded ok job:1"], (lines, err)
        assert "forbidden 0" in lines or rc == -9, lines  # never a file operation under the store's root
        assert not said((rc, lines), "touched"), lines
    assert said(first[0], "committed") == ["committed job:1"], first[0]  # step 2's save: never committed
    assert said(first[0], "save failed"), first[0]
    assert [(v.info.version, v.ok) for v in verify(address, "job", rehash=True)] == [("job:1", True)]
    # Launch 2: the version before the killed save loads, and the next save goes through.
    second = ranks(address, "job", "load:1,save:3,load:3", root)
    for rc, lines, err in second:
        assert rc == 0, err
        assert said((rc, lines), "loaded") == ["loaded ok job:1", "loaded ok job:2"], (lines, err)
        assert "forbidden 0" in lines, lines
    assert said(second[0], "committed") == ["committed job:2"], second[0]
    assert [(v.info.step, v.ok) for v in verify(address, "job", rehash=True)] == [(1, True), (3, True)]


@pytest.fixture
def procs(tmp_path):
    p = Processes(tmp_path / "logs")
    yield p
    p.close()


def test_two_ranks_save_and_load_through_the_store_without_its_filesystem(procs, tmp_path):
    root = tmp_path / "store-root-the-ranks-never-see"
    address = start_store(procs, root, "--transfer", "stream")
    save_load_kill(address, root, "TRANSFER_STREAM")
    assert not list((root / "checkpoints" / "job" / ".staging").iterdir())  # the killed save's staging is gone
    # The killed save's chunks (epoch 2: what rank 0 and rank 1 streamed before the kill) were
    # garbage-collected by the next commit; the two versions' epochs remain.
    assert versions_of(address, "job")[-1].chunk_path.endswith("/chunks/3")
    assert sorted(p.name for p in (root / "checkpoints" / "job" / "chunks").iterdir()) == ["1", "3"]


def test_a_delta_streams_only_the_chunks_its_epoch_lacks(procs, tmp_path):
    root = tmp_path / "store"
    address = start_store(procs, root, "--transfer", "stream")
    frozen = torch.randn(2 * 262144, generator=torch.Generator().manual_seed(7))  # 2 MiB, the same every save
    client = StoreClient(address, lambda msg, payload=None: None)
    try:
        done = []
        for step in (1, 2):
            state = {
                "model": {"frozen": frozen, "w": torch.full((262144,), float(step))},
                "train": {"step": torch.tensor(step)},
            }
            ask = store_pb2.SaveCheckpoint(job_id="d", step=step, rank=0, baseline_every=10)
            client.save_checkpoint(ask, state)
            done.append(client.commit_checkpoint(store_pb2.CommitCheckpoint(job_id="d", step=step, world_size=1)))
        back = {
            "model": {"frozen": torch.zeros_like(frozen), "w": torch.zeros(262144)},
            "train": {"step": torch.tensor(0)},
        }
        info = client.load_checkpoint(store_pb2.LoadCheckpoint(version="d:2"), back).info
    finally:
        client.close(timeout=1)
    assert done[0].baseline and not done[1].baseline
    assert done[0].written_bytes >= 3 << 20 and done[1].written_bytes < (1 << 20) + 4096  # frozen: not sent again
    assert info.transfer == store_pb2.TRANSFER_STREAM
    assert torch.equal(back["model"]["frozen"], frozen) and torch.equal(back["model"]["w"], torch.full((262144,), 2.0))


# ---------------------------------------------------------------------- the boundary


def _upload(stub, header: store_pb2.CheckpointUploadHeader, *files: store_pb2.CheckpointFileData):
    parts = [store_pb2.CheckpointUpload(header=header), *(store_pb2.CheckpointUpload(file=f) for f in files)]
    return stub.PutCheckpointFiles(iter(parts), timeout=30)


def _refused(call) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    cause = dict(e.value.trailing_metadata() or ()).get(CAUSE_METADATA, "")
    return e.value.code(), cause, e.value.details()


def test_a_digest_mismatch_a_cut_stream_a_name_outside_staging_and_an_oversized_chunk_are_refused(procs, tmp_path):
    root = tmp_path / "store"
    address = start_store(procs, root, "--transfer", "stream")
    ch, stub = store_stub(address)
    with ch:
        staged = stub.BeginSave(store_pb2.SaveCheckpoint(job_id="j", step=5, rank=0, attempt="a1"), timeout=10)
    assert staged.transfer == store_pb2.TRANSFER_STREAM
    staging, chunks = Path(staged.staging_path), Path(staged.chunk_path)
    header = store_pb2.CheckpointUploadHeader(job_id="j", step=5, attempt="a1", rank=0, epoch=staged.epoch)
    good, bad = os.urandom(3000), os.urandom(3000)
    sha = hashlib.sha256(good).hexdigest()
    chunk = store_pb2.CHECKPOINT_FILE_CHUNK
    index = store_pb2.CHECKPOINT_FILE_INDEX
    data = store_pb2_grpc.StoreServiceStub(channel(address, module=Module.L5_CHECKPOINT_MANAGER))

    # A chunk whose bytes do not hash to its name: refused on arrival, typed, not kept.
    code, cause, details = _refused(
        lambda: _upload(data, header, store_pb2.CheckpointFileData(name=sha, kind=chunk, size=3000, data=bad))
    )
    assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILURE_DATA_CORRUPT"), details
    assert "sha256 mismatch on arrival" in details
    # An index file cut short (the stream ends inside it), and one longer than declared.
    meta = os.urandom(5000)
    decl = hashlib.sha256(meta).hexdigest()
    for sent in (meta[:2500], meta + b"x"):
        part = store_pb2.CheckpointFileData(name=".metadata", kind=index, size=5000, sha256=decl, data=sent)
        code, cause, details = _refused(lambda part=part: _upload(data, header, part))
        assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILURE_DATA_CORRUPT"), details
    # Names outside the staging directory, or the manifest the store writes.
    for name in ("../escape", "/tmp/abs", "a/../../b", "x/./y", "manifest.json", "a\\b", "a//b", ""):
        part = store_pb2.CheckpointFileData(name=name, kind=index, size=4, sha256=hashlib.sha256(b"evil").hexdigest())
        part.data = b"evil"
        code, cause, details = _refused(lambda part=part: _upload(data, header, part))
        assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILURE_INVALID_INPUT"), (name, details)
    # A chunk name that is not a digest, and a size over the bound.
    for name, size in (("../" + sha[3:], 10), (sha, (64 << 20) + 1)):
        part = store_pb2.CheckpointFileData(name=name, kind=chunk, size=size, data=b"")
        code, cause, _ = _refused(lambda part=part: _upload(data, header, part))
        assert (code, cause) == (grpc.StatusCode.FAILED_PRECONDITION, "FAILURE_INVALID_INPUT")
    # Another attempt's upload (a straggler of a killed generation).
    other = store_pb2.CheckpointUploadHeader(job_id="j", step=5, attempt="old", rank=0, epoch=staged.epoch)
    code, _, details = _refused(
        lambda: _upload(data, other, store_pb2.CheckpointFileData(name=sha, kind=chunk, size=3000, data=good))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no open save" in details
    # Nothing of any of them was kept, anywhere under the store's root.
    assert list(staging.iterdir()) == [] and not any(p.is_file() for p in chunks.rglob("*"))
    assert not (tmp_path / "escape").exists() and not (root / "checkpoints" / "escape").exists()
    # The good chunk is taken (whole, in two parts) and held.
    put = _upload(
        data,
        header,
        store_pb2.CheckpointFileData(name=sha, kind=chunk, size=3000, data=good[:1000]),
        store_pb2.CheckpointFileData(data=good[1000:]),
    )
    assert (put.files, put.bytes) == (1, 3000)
    assert (chunks / sha[:2] / sha).read_bytes() == good
    held = data.HeldCheckpointChunks(
        store_pb2.HeldCheckpointChunksQuery(job_id="j", step=5, attempt="a1", epoch=staged.epoch), timeout=10
    )
    assert held.sha256 == bytes.fromhex(sha)
    # The data plane is L5-1's rank side's only: the training loop's identity is refused.
    loop = store_pb2_grpc.StoreServiceStub(channel(address, module=Module.L2_TRAINING_LOOP))
    code, _, _ = _refused(
        lambda: loop.HeldCheckpointChunks(store_pb2.HeldCheckpointChunksQuery(job_id="j", step=5), timeout=10)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED


# ---------------------------------------------------------------------- S3-compatible storage


@pytest.fixture
def s3(monkeypatch):
    """A local S3-compatible server (moto, on 127.0.0.1) with a bucket; its endpoint URL."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:  # pragma: no cover - `make setup` installs it (extra s3test)
        pytest.skip(f"no S3-compatible server: moto[server] is not installed ({e})")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)  # the store's and the ranks' credentials (child_env copies os.environ)
    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import urllib.request

    import s3fs

    # moto's backends are global to this process: start from an empty store every time.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10).close()
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("surge-ckpt")
    yield endpoint
    server.stop()


def test_two_ranks_save_and_load_through_s3_compatible_storage(procs, tmp_path, s3):
    import s3fs

    root = tmp_path / "store-root-the-ranks-never-see"
    url = "s3://surge-ckpt/run"
    address = start_store(procs, root, "--backend", "s3", "--s3-url", url, "--s3-endpoint", s3)
    save_load_kill(address, root, "TRANSFER_FSSPEC")
    fs = s3fs.S3FileSystem(endpoint_url=s3)
    # The chunks are objects of the bucket; the store's root holds the catalog and the index only.
    info = versions_of(address, "job")[-1]
    assert info.chunk_path.startswith(f"{url}/job/chunks/") and info.transfer == store_pb2.TRANSFER_FSSPEC
    objects = fs.find(info.chunk_path)
    assert len(objects) == info.files - 2  # every chunk of the version (its files: .metadata, chunks.json + chunks)
    assert not list((root / "checkpoints" / "job").glob("chunks/*/*/*"))
    # The killed save's objects (epoch 2) were garbage-collected by the next commit.
    assert info.chunk_path.endswith("/chunks/3") and not fs.find(f"{url}/job/chunks/2")
    assert fs.find(f"{url}/job/chunks/1")
    # A chunk damaged in the object store: a reader refuses it (typed, naming it), a scrub finds it.
    victim = sorted(objects)[0]
    fs.pipe_file(victim, b"\0" * fs.size(victim))
    client = StoreClient(address, lambda msg, payload=None: None)
    template = {"model": {"w0": torch.zeros(MIB * 262144), "w1": torch.zeros(MIB * 262144)}}
    template["model"]["shared"], template["train"] = torch.zeros(262144), {"step": torch.tensor(0)}
    try:
        with pytest.raises(CheckpointIntegrityError) as refused:
            client.load_checkpoint(store_pb2.LoadCheckpoint(version=info.version), template)
    finally:
        client.close(timeout=1)
    assert refused.value.failure_cause == FailureCause.FAILURE_DATA_CORRUPT
    assert refused.value.file == f"chunks/{info.chunk_path.rsplit('/', 1)[-1]}/{victim.rsplit('/', 1)[-1]}"
    ch, stub = store_stub(address)
    with ch:
        scrubbed = stub.Scrub(store_pb2.ScrubCheckpoints(job_id="job"), timeout=60)
    assert [c.version for c in scrubbed.newly_corrupt] == [info.version]
    # Deleting a version removes the objects only it referenced, from the bucket.
    ch, stub = store_stub(address)
    with ch:
        freed = stub.Delete(store_pb2.DeleteCheckpoint(version="job:1", job_ended=True), timeout=60).bytes_freed
    fs.invalidate_cache()  # this process's listings are s3fs's cached ones
    assert freed > 0 and not fs.find(f"{url}/job/chunks/1") and fs.find(info.chunk_path)


def test_a_store_refuses_to_start_on_storage_it_cannot_use(tmp_path, s3):
    def store(*extra: str) -> subprocess.CompletedProcess:
        port, metrics = free_ports(2)
        argv = [sys.executable, "-m", "services.store", "--port", str(port), "--metrics-port", str(metrics)]
        argv += ["--root", str(tmp_path / "root"), *extra]
        return subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)

    for extra, why in (
        (["--backend", "s3", "--s3-url", "s3://no-such-bucket/x", "--s3-endpoint", s3], "no such bucket"),
        (["--backend", "s3"], "needs --s3-url s3://BUCKET"),
        (["--transfer", "carrier-pigeon"], "expected one of path, stream"),
        (["--backend", "nfs"], "expected local or s3"),
    ):
        done = store(*extra)
        assert done.returncode == 2 and why in done.stderr.splitlines()[-1], (extra, done.stderr[-500:])
