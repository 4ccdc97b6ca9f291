"""Versions in object storage (a local S3-compatible server, moto): a pushed version, gone
from the data root, streams from the bucket exactly as it did locally, through a block cache
whose directory never outgrows its bound; an unknown remote version is one line naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from services.cli import dataset_transfer
from services.contract import data_pb2
from services.contract.failures import FailureCause
from services.data.__main__ import build_registry, build_stream
from services.data.block_cache import CACHE_DIR, BlockCache, CachedFile, RemoteFile
from services.data.documents import TokenStore
from services.data.errors import DataReadError, DatasetNotFound, InvalidConfig
from services.data.prefetcher import TokenReader
from services.data.remote_versions import REMOTE_DIR, RemoteVersions
from tests.checkpoint.test_no_shared_fs import s3  # noqa: F401 (the local S3-compatible server, moto)

from .helpers import open_stream

REPO = Path(__file__).resolve().parents[2]
URL = "s3://surge-ckpt/corpora"
BLOCK = 2048  # tiny blocks: the tiny corpus (~67 KB of tokens) spans many


def _batches(root, remote=None, **kw) -> list[tuple[bytes, bytes, int, int]]:
    relay = build_stream(root, remote=remote)
    return [(b.input_ids, b.labels, b.next.epoch, b.next.row) for b in relay.batches(open_stream(**kw))]


def _dir_bytes(path) -> int:
    total = 0
    for e in os.scandir(path):
        try:
            total += e.stat().st_size
        except FileNotFoundError:  # evicted, or a fetch renamed into place, since the listing
            pass
    return total


def test_a_pushed_version_deleted_here_streams_from_the_bucket_identically_in_a_bounded_cache(
    dataset,
    root,
    s3,  # noqa: F811  (the fixture imported above)
):
    kw = dict(seq_len=32, micro_batch_size=3, rank=1, world_size=2, min_tokens=8, banned_bytes=b"\0", threads=4)
    local = _batches(root, **kw)
    assert len(local) > 10
    dataset_transfer.push(root, "tiny@v1", URL, s3)
    tokens_bytes = (dataset.path / "train.bin").stat().st_size
    cache = BlockCache(root / CACHE_DIR, block_bytes=BLOCK, capacity_bytes=3 * BLOCK)
    remote = RemoteVersions(URL, root, cache, endpoint_url=s3)
    assert tokens_bytes > 8 * cache.capacity_bytes  # the corpus is far larger than the bound

    # While the local copy is here it wins: the bucket is not read.
    assert _batches(root, remote, **kw) == local
    assert cache.fetches == 0 and not (root / REMOTE_DIR).exists()
    # Deleted here (with its sample index): from now on it lives in the bucket only.
    _, versions = build_registry(root, remote=remote)
    versions.delete_dataset(data_pb2.DeleteDataset(name="tiny", version="v1"))
    assert not (root / "tiny").exists() and not list((root / ".index").rglob("*.npy"))

    peak, stop = [0], threading.Event()

    def watch() -> None:  # the directory as the disk sees it, not the cache's own count
        while not stop.is_set():
            peak[0] = max(peak[0], _dir_bytes(root / CACHE_DIR))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        from_bucket = _batches(root, remote, **kw)
    finally:
        stop.set()
        watcher.join()
    assert from_bucket == local
    assert 0 < peak[0] <= 3 * BLOCK and cache.used_bytes() <= 3 * BLOCK
    assert cache.fetches > tokens_bytes // BLOCK  # every block came at least once: the cache evicted
    # The small files came whole and checked; the token file never did.
    held = sorted(p.name for p in (root / REMOTE_DIR / "tiny" / "v1").iterdir())
    assert "manifest.json" in held and "train.bin" not in held and "val.bin" not in held
    assert any(n.endswith(".npy") for n in held)

    # The registry lists it (only there).
    listed = versions.dataset_query(data_pb2.DatasetQuery())
    assert [(d.name, d.version) for d in listed.datasets] == [("tiny", "v1")]
    assert listed.datasets[0].train_tokens == tokens_bytes // 2


def test_an_unknown_remote_version_is_one_line_naming_it(
    dataset,
    root,
    tmp_path,
    s3,  # noqa: F811  (the fixture imported above)
):
    dataset_transfer.push(root, "tiny@v1", URL, s3)
    other = tmp_path / "other-root"
    remote = RemoteVersions(URL, other, BlockCache(other / CACHE_DIR, BLOCK, 3 * BLOCK), endpoint_url=s3)
    with pytest.raises(DatasetNotFound) as missing:
        _batches(other, remote, version="v9")
    assert str(missing.value) == f"dataset tiny@v9 not found here (have: none under {other}) nor at {URL}/tiny/v9"


def test_ranges_across_blocks_read_back_exactly_and_a_missing_object_is_a_typed_read_error(
    tmp_path,
    s3,  # noqa: F811  (the fixture imported above)
):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3)
    data = np.random.default_rng(0).integers(0, 256, 10 * BLOCK + 123, dtype=np.uint8).tobytes()
    fs.pipe_file("surge-ckpt/blob", data)
    cache = BlockCache(tmp_path / "blocks", block_bytes=BLOCK, capacity_bytes=2 * BLOCK)
    blob = CachedFile(cache, RemoteFile(fs, "surge-ckpt/blob", len(data), "f" * 64, "s3://surge-ckpt/blob"))
    rng = np.random.default_rng(1)
    ranges = [(0, len(data)), (BLOCK - 1, 2), (len(data) - 5, 5)]
    ranges += [(int(a), int(rng.integers(0, 3 * BLOCK))) for a in rng.integers(0, len(data) - 3 * BLOCK, 40)]
    with ThreadPoolExecutor(8) as pool:  # concurrent readers, misses of the same blocks
        got = list(pool.map(lambda r: blob.read(*r), ranges))
    assert got == [data[a : a + n] for a, n in ranges]
    assert _dir_bytes(tmp_path / "blocks") <= 2 * BLOCK

    # Concurrent misses of one block are one GET.
    cold = BlockCache(tmp_path / "cold", block_bytes=BLOCK, capacity_bytes=4 * BLOCK)
    one = CachedFile(cold, blob.file)
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: one.read(5, 100), range(16))) == {data[5:105]}
    assert cold.fetches == 1

    gone = CachedFile(cold, RemoteFile(fs, "surge-ckpt/nothing", 10, "e" * 64, "s3://surge-ckpt/nothing"))
    with pytest.raises(DataReadError, match=r"^s3://surge-ckpt/nothing: missing from the object store$"):
        gone.read(0, 10)
    with pytest.raises(DataReadError, match=r"past its end"):
        blob.read(len(data) - 1, 2)


class _Flaky:
    """The real filesystem behind a network that drops the first ``drops`` ranged GETs and then
    answers short ``short`` times (fault injection at the network boundary)."""

    def __init__(self, fs, drops: int, short: int = 0):
        self._fs, self.drops, self.short, self.calls = fs, drops, short, 0

    def cat_file(self, path, start=None, end=None):
        self.calls += 1
        if self.drops:
            self.drops -= 1
            raise ConnectionError("connection reset by peer")
        data = self._fs.cat_file(path, start=start, end=end)
        if self.short:
            self.short -= 1
            return data[:-1]
        return data


def test_a_dropped_or_short_fetch_is_retried_with_backoff_then_a_typed_read_error(
    tmp_path,
    s3,  # noqa: F811  (the fixture imported above)
):
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3)
    data = bytes(range(256)) * 40
    fs.pipe_file("surge-ckpt/blob", data)
    cache = BlockCache(tmp_path / "blocks", block_bytes=BLOCK, capacity_bytes=2 * BLOCK, attempts=4, backoff_s=0.01)
    flaky = _Flaky(fs, drops=2, short=1)
    blob = CachedFile(cache, RemoteFile(flaky, "surge-ckpt/blob", len(data), "d" * 64, "s3://surge-ckpt/blob"))
    assert blob.read(100, 3000) == data[100:3100]  # blocks 0 and 1: 2 drops, 1 short, then whole
    assert flaky.calls == 5 and cache.fetches == 2

    down = _Flaky(fs, drops=10)
    blob = CachedFile(cache, RemoteFile(down, "surge-ckpt/blob", len(data), "c" * 64, "s3://surge-ckpt/blob"))
    with pytest.raises(DataReadError) as failed:
        blob.read(0, 10)
    assert str(failed.value) == (
        "s3://surge-ckpt/blob: block 0 unreadable after 4 attempts (ConnectionError: connection reset by peer)"
    )
    assert down.calls == 4 and not [p for p in (tmp_path / "blocks").iterdir() if p.name.startswith("c")]
    # Through the prefetcher's reader: the same typed failure as a local read, naming the dataset.
    bounds = np.array([0, 10], np.int64)
    store = TokenStore("t@v1", "train", Path("train.bin"), np.dtype("<u2"), bounds, "bytes", remote=blob)
    reader = TokenReader(store, ThreadPoolExecutor(2), 2, 8)
    with pytest.raises(DataReadError, match=r"^dataset t@v1: s3://surge-ckpt/blob: block 0 unreadable after 4 "):
        reader.read(0, 5)
    assert DataReadError.failure_cause == FailureCause.FAILURE_IO


@pytest.mark.timeout(180)
def test_the_service_process_serves_a_remote_version_and_refuses_storage_it_cannot_use(
    dataset,
    root,
    tmp_path,
    s3,  # noqa: F811  (the fixture imported above; it sets the AWS_* credentials the child inherits)
):
    import grpc

    from services.contract import data_pb2_grpc
    from tests.callers import any_caller_channel
    from tests.ports import free_port

    kw = dict(seq_len=64, micro_batch_size=4)
    local = _batches(root, **kw)
    dataset_transfer.push(root, "tiny@v1", URL, s3)
    shutil.rmtree(root / "tiny")

    def start(*extra: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "services.data", "--host", "127.0.0.1", "--data-root", str(root), *extra]
        env = {**os.environ, "SURGE_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    port = free_port()
    proc = start(
        "--port",
        str(port),
        "--remote",
        URL,
        "--s3-endpoint",
        s3,
        "--cache-bytes",
        str(4 * BLOCK),
        "--cache-block-bytes",
        str(BLOCK),
    )
    ch = any_caller_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = data_pb2_grpc.DataServiceStub(ch)
        assert [(d.name, d.version) for d in stub.List(data_pb2.DatasetQuery(), timeout=30).datasets] == [
            ("tiny", "v1")
        ]
        served = [(b.input_ids, b.labels, b.next.epoch, b.next.row) for b in stub.Stream(open_stream(**kw), timeout=60)]
        assert served == local
        with pytest.raises(grpc.RpcError) as missing:
            stub.Mount(data_pb2.MountDataset(name="tiny", version="v9"), timeout=30)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert (
            missing.value.details() == f"dataset tiny@v9 not found here (have: none under {root}) nor at {URL}/tiny/v9"
        )
    finally:
        ch.close()
        proc.kill()  # by its handle: the process this test started
        proc.communicate(timeout=30)
    assert 0 < _dir_bytes(root / CACHE_DIR) <= 4 * BLOCK  # the options' bound

    bad = start("--port", str(free_port()), "--remote", "s3://no-such-bucket/x", "--s3-endpoint", s3)
    _, err = bad.communicate(timeout=60)
    # (the lines before it are the service's structured log)
    assert bad.returncode == 2 and err.strip().splitlines()[-1] == (
        "error: --remote: s3://no-such-bucket/x: cannot list (FileNotFoundError: The specified bucket does not exist)"
    ), err


def test_a_restarted_cache_adopts_its_blocks_within_a_lowered_bound_and_drops_partial_ones(tmp_path):
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    for i in range(5):
        (blocks / f"{'a' * 64}.{BLOCK}.{i}").write_bytes(bytes([i]) * BLOCK)
        os.utime(blocks / f"{'a' * 64}.{BLOCK}.{i}", (1000 + i, 1000 + i))  # block 0 read longest ago
    (blocks / f"{'b' * 64}.{BLOCK}.0.part").write_bytes(b"cut short")
    cache = BlockCache(blocks, block_bytes=BLOCK, capacity_bytes=3 * BLOCK)
    assert sorted(p.name.rsplit(".", 1)[1] for p in blocks.iterdir()) == ["2", "3", "4"]
    assert cache.used_bytes() == 3 * BLOCK
    held = CachedFile(cache, RemoteFile(None, "unused", 5 * BLOCK, "a" * 64, "s3://x/held"))
    assert held.read(3 * BLOCK - 1, 2) == bytes([2, 3]) and cache.fetches == 0  # hits: no storage touched
    with pytest.raises(InvalidConfig, match=r"^cache capacity: must hold one block \(2048 bytes\), got 100$"):
        BlockCache(tmp_path / "other", block_bytes=BLOCK, capacity_bytes=100)
