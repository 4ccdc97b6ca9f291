"""A heal read from both ends (services/state/chunk_race.py): the peer's memory from the front,
on a bulk lane (services/common/bulk_lane.py) its node agent opens and hands to the reading
rank, and the store's files from the back, through DCP's load with the rank's ChunkReader.
Real agents' MemoryCopyService on loopback (A: the saving rank's node, B: A's peer, C: the
healing rank's node, which holds nothing), real files, a real DCP save and load.

The faster source takes over: with a per-chunk delay put into one source, the other serves
most chunks and both serve some; a corrupt peer copy is refused by its SHA-256 and read from
the store; a peer killed mid-transfer (a process of its own, SIGKILLed) leaves the rest to
the store. Each load is bit-identical to the saved state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed.checkpoint as dcp

from services.common.grpc_server import ServiceServer, channel
from services.contract import Module, control_pb2, worker_pb2, worker_pb2_grpc
from services.rank.memory_client import MemoryCopyClient
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkWriter, DirectorySource, read_chunk_index
from services.worker import memory_copies
from services.worker.memory_chunks import shared_memory_dir
from services.worker.memory_copies import MemoryCopies
from services.worker.memory_copy_service import MemoryCopyServicer
from tests.ports import free_port

pytestmark = pytest.mark.timeout(120)
JOB = "heal-0a1b2c"
CHUNK = 16 << 10  # 16 KiB: 256 chunks for the 4 MB state


class Agent:
    def __init__(self, worker_id: str, shm_root: Path):
        self.copies = MemoryCopies(
            worker_id, structlog.get_logger(), 1 << 30, shared_memory_dir(worker_id, shm_root), lane_host="127.0.0.1"
        )
        self.server = ServiceServer(worker_id, "127.0.0.1", 0)
        worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(self.copies), self.server.server)
        self.server.start(["surge.v1.MemoryCopyService"])
        self.address = f"127.0.0.1:{self.server.port}"
        self.worker_id = worker_id

    def peer(self, worker_id: str, address: str) -> None:
        self.copies.set_peer(JOB, control_pb2.MemoryPeer(worker_id=worker_id, address=address))

    def close(self) -> None:
        self.copies.close()
        self.server.stop(0)


class SlowStore(DirectorySource):
    """The store's chunk files, ``delay`` seconds a chunk (a slow disk)."""

    def __init__(self, root: Path, delay: float):
        super().__init__(root)
        self.delay = delay

    def get(self, sha: str, nbytes: int) -> bytes | None:
        time.sleep(self.delay)
        return super().get(sha, nbytes)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(768, 1024, generator=g), "b": torch.randn(1024, 256, generator=g)},
        "train": {"step": 5},
    }


def _empty() -> dict:
    return {"model": {"w": torch.zeros(768, 1024), "b": torch.zeros(1024, 256)}, "train": {"step": 0}}


def _identical(a: dict, b: dict) -> bool:
    return a["train"] == b["train"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _held_by_peer(address: str, want: set[str], timeout: float = 30.0) -> None:
    with channel(address, module=Module.EXT_HARDWARE) as ch:
        stub = worker_pb2_grpc.MemoryCopyServiceStub(ch)
        deadline = time.monotonic() + timeout
        while set(stub.HeldChunks(worker_pb2.HeldQuery(job_id=JOB, rank=0, replica=True)).sha256) != want:
            assert time.monotonic() < deadline, "the peer holds no replica"
            time.sleep(0.05)


def _save(tmp_path: Path, a: Agent) -> tuple[Path, Path, set[str]]:
    """The state saved once: the store's files, A's memory, replicated to A's peer."""
    version, root = tmp_path / "v5", tmp_path / "chunks"
    client = MemoryCopyClient(a.address, JOB, 0)
    try:
        writer = ChunkWriter(version, root, chunk_bytes=CHUNK, sink=client.begin(5), sync_files=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming single process"
            dcp.save(_state(), storage_writer=writer, no_dist=True)
        client.end(True)
        assert client.wait(30).missing == 0
    finally:
        client.close()
    return version, root, {c["sha"] for c in read_chunk_index(version)["chunks"]}


def _load(version: Path, c: Agent, store: DirectorySource) -> tuple[dict, ChunkReader]:
    client = MemoryCopyClient(c.address, JOB, 0)
    try:
        reader = ChunkReader(version, [*client.sources(), store])
        out = _empty()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=reader, no_dist=True)
        return out, reader
    finally:
        client.close()


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    monkeypatch.delenv(memory_copies.CORRUPT_ENV, raising=False)
    made: list[Agent] = []

    def make(worker_id: str) -> Agent:
        made.append(Agent(worker_id, tmp_path))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


@pytest.mark.parametrize("slow", ["peer", "store"])
def test_the_faster_source_takes_over_and_both_serve_a_bit_identical_state(nodes, tmp_path, slow):
    a, b, c = nodes("wa"), nodes("wb"), nodes("wc")
    a.peer(b.worker_id, b.address)
    c.peer(b.worker_id, b.address)
    version, root, shas = _save(tmp_path, a)
    _held_by_peer(b.address, shas)
    lanes = []
    real_open, real_lookup = b.copies.open_lane, b.copies._lane._lookup
    b.copies.open_lane = lambda job_id, part: lanes.append(len(part)) or real_open(job_id, part)
    peer_delay, store_delay = (0.05, 0.005) if slow == "peer" else (0.005, 0.05)

    def slow_lookup(sha):  # the peer sends a chunk every peer_delay seconds on each lane
        time.sleep(peer_delay)
        return real_lookup(sha)

    b.copies._lane._lookup = slow_lookup
    out, reader = _load(version, c, SlowStore(root, store_delay))
    assert _identical(_state(), out)
    fast = "store" if slow == "peer" else "peer"
    served = dict(reader.served)
    assert set(served) == {"peer", "store"} and sum(served.values()) == len(shas), served
    assert served[fast] > served[slow] > 0, served
    assert not reader.mismatches and sum(lanes) > 0  # (the peer's chunks came on its bulk lanes)
    print(f"slow {slow}: chunks from {served}")


def test_a_corrupt_peer_chunk_is_refused_by_its_hash_and_read_from_the_store(nodes, tmp_path, monkeypatch):
    monkeypatch.setenv(memory_copies.CORRUPT_ENV, JOB.rpartition("-")[0])  # B flips a byte of each replica
    b = nodes("wb")
    monkeypatch.delenv(memory_copies.CORRUPT_ENV)
    a, c = nodes("wa"), nodes("wc")
    a.peer(b.worker_id, b.address)
    c.peer(b.worker_id, b.address)
    version, root, shas = _save(tmp_path, a)
    _held_by_peer(b.address, shas)
    out, reader = _load(version, c, SlowStore(root, 0.02))  # (a slow store: the peer's end reads too)
    assert _identical(_state(), out)
    assert reader.mismatches["peer"] > 0 and dict(reader.served) == {"store": len(shas)}, (
        reader.served,
        reader.mismatches,
    )


PEER = """
import sys, threading, time
import structlog
from services.common.grpc_server import ServiceServer
from services.contract import worker_pb2_grpc
from services.worker.memory_chunks import shared_memory_dir
from services.worker.memory_copies import MemoryCopies
from services.worker.memory_copy_service import MemoryCopyServicer
from pathlib import Path

port, shm_root = int(sys.argv[1]), Path(sys.argv[2])
copies = MemoryCopies("wb", structlog.get_logger(), 1 << 30, shared_memory_dir("wb", shm_root), lane_host="127.0.0.1")
real = copies._lane._lookup
def slow(sha):  # a chunk every 10 ms on each lane: the test kills it mid-transfer
    time.sleep(0.01)
    return real(sha)
copies._lane._lookup = slow
server = ServiceServer("wb", "127.0.0.1", port)
worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(copies), server.server)
server.start(["surge.v1.MemoryCopyService"])
threading.Event().wait()
"""


def test_a_peer_killed_mid_transfer_leaves_the_rest_to_the_store(nodes, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), str(tmp_path)], env=env)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # (the peer process listens)
            try:
                _held_by_peer(address, set(), timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert peer.poll() is None and time.monotonic() < deadline, "the peer agent did not start"
                time.sleep(0.2)
        a, c = nodes("wa"), nodes("wc")
        a.peer("wb", address)
        c.peer("wb", address)
        version, root, shas = _save(tmp_path, a)
        _held_by_peer(address, shas)
        result: dict = {}
        store = SlowStore(root, 0.03)  # the peer is the faster source until it dies

        def load() -> None:
            result["out"], result["reader"] = _load(version, c, store)

        loading = threading.Thread(target=load)
        loading.start()
        deadline = time.monotonic() + 30
        while c.copies._relay is not None and time.monotonic() < deadline:
            if sum(1 for t in threading.enumerate() if t.name == "memory-lane") > 0:
                break  # the rank reads the peer's lanes
            time.sleep(0.005)
        time.sleep(0.3)  # some chunks come from the peer, then it dies
        os.kill(peer.pid, signal.SIGKILL)
        loading.join(60)
        assert not loading.is_alive() and "reader" in result, "the load did not finish"
        reader = result["reader"]
        assert _identical(_state(), result["out"])
        served = dict(reader.served)
        assert served.get("peer", 0) > 0 and served.get("store", 0) > 0, served
        assert sum(served.values()) == len(shas) and not reader.mismatches, served
        print(f"peer killed mid-transfer: chunks from {served}")
    finally:
        peer.kill()
        peer.wait()


def test_a_lane_is_opened_by_a_peer_agent_only_and_serves_its_one_time_token_only(nodes, tmp_path):
    import hashlib

    import grpc

    from services.common import bulk_lane

    a, b = nodes("wa"), nodes("wb")
    a.peer(b.worker_id, b.address)
    _, _, shas = _save(tmp_path, a)
    _held_by_peer(b.address, shas)
    first = sorted(shas)[0]
    query = worker_pb2.ChunksQuery(job_id=JOB, sha256=[first, "0" * 64])
    with channel(b.address, module=Module.L5_CHECKPOINT_MANAGER) as ch:  # a rank: refused
        with pytest.raises(grpc.RpcError) as refused:
            worker_pb2_grpc.MemoryCopyServiceStub(ch).OpenBulkRead(query, timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel(b.address, module=Module.EXT_HARDWARE) as ch:
        lane = worker_pb2_grpc.MemoryCopyServiceStub(ch).OpenBulkRead(query, timeout=10)
    assert list(lane.sha256) == [first] and len(lane.token) == bulk_lane.TOKEN_BYTES  # (only what it holds)
    with bulk_lane.connect(b.address, lane.port, bytes(bulk_lane.TOKEN_BYTES)) as wrong:
        assert wrong.recv(1) == b""  # closed unanswered
    with bulk_lane.connect(b.address, lane.port, lane.token) as right:
        index, n = bulk_lane.read_header(right)
        assert index == 0 and hashlib.sha256(bulk_lane.recv_exact(right, n)).hexdigest() == first
    with bulk_lane.connect(b.address, lane.port, lane.token) as again:
        assert again.recv(1) == b""  # a token serves one connection
