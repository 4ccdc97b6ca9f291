"""The node agent's in-memory checkpoint copies (services/worker/memory_copies.py) and the
rank's side of them (memory_client.py), over real gRPC servers in this process: three
agents' MemoryCopyService (A: the rank's node, B: A's peer, C: a node with nothing), the
rank's client, and part A's chunk reader with the store's files last.

The real stack (a worker killed, its rank recovered from the peer's copy): tests/faults/
test_memory_recovery.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import structlog

from services.common.grpc_server import ServiceServer
from services.contract import control_pb2, worker_pb2_grpc
from services.rank.memory_client import MemoryCopyClient
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkIntegrityError, DirectorySource, chunk_path
from services.worker import memory_chunks, memory_copies
from services.worker.memory_chunks import shared_memory_dir
from services.worker.memory_copies import MemoryCopies
from services.worker.memory_copy_service import MemoryCopyServicer

pytestmark = pytest.mark.timeout(60)
JOB = "mem-0a1b2c"


class Agent:
    def __init__(self, worker_id: str, limit: int = 1 << 30, shm: Path | None = None, lane: bool = True):
        self.copies = MemoryCopies(
            worker_id, structlog.get_logger(), limit, shm, lane_host="127.0.0.1" if lane else None
        )
        self.server = ServiceServer(worker_id, "127.0.0.1", 0)
        worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(self.copies), self.server.server)
        self.server.start(["surge.v1.MemoryCopyService"])
        self.address = f"127.0.0.1:{self.server.port}"
        self.worker_id = worker_id

    def peer(self, other: Agent) -> None:
        self.copies.set_peer(JOB, control_pb2.MemoryPeer(worker_id=other.worker_id, address=other.address))

    def close(self) -> None:
        self.copies.close()
        self.server.stop(0)


@pytest.fixture(params=["shared memory", "in process"])
def agents(request, monkeypatch, tmp_path):
    """Agents keeping their chunks in a shared-memory directory (here under tmp_path, as
    under /dev/shm: files a local rank reads) or as bytes in their process."""
    made: list[Agent] = []

    def make(worker_id: str, limit: int = 1 << 30, corrupt: str = "") -> Agent:
        if corrupt:
            monkeypatch.setenv(memory_copies.CORRUPT_ENV, corrupt)
        else:
            monkeypatch.delenv(memory_copies.CORRUPT_ENV, raising=False)
        shm = shared_memory_dir(worker_id, tmp_path) if request.param == "shared memory" else None
        a = Agent(worker_id, limit, shm)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def chunks(*payloads: bytes) -> dict[str, bytes]:
    return {hashlib.sha256(p).hexdigest(): p for p in payloads}


def save(client: MemoryCopyClient, step: int, parts: dict[str, bytes]):
    sink = client.begin(step)
    assert sink is not None
    for sha, data in parts.items():
        sink(sha, memoryview(data))
    client.end(True)
    return client.wait()


def replicated(agent: Agent, rank: int, want: set[str], timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if set(agent.copies.held(JOB, rank, True)) == want:
            return True
        time.sleep(0.02)
    return False


def store_dir(tmp_path: Path, parts: dict[str, bytes]) -> Path:
    root = tmp_path / "chunks"
    for sha, data in parts.items():
        p = chunk_path(root, sha)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def reader(tmp_path: Path, client: MemoryCopyClient, root: Path) -> ChunkReader:
    return ChunkReader(tmp_path, [*client.sources(), DirectorySource(root)])


def test_only_new_chunks_travel_the_newest_set_replaces_the_old_and_reaches_the_peer(agents):
    a, b = agents("wa"), agents("wb")
    a.peer(b)
    client = MemoryCopyClient(a.address, JOB, 0)
    try:
        v1 = chunks(b"a" * 1000, b"b" * 2000, b"c" * 3000)
        kept = save(client, 5, v1)
        assert (kept.chunks, kept.bytes, kept.missing, kept.received_bytes) == (3, 6000, 0, 6000)
        assert replicated(b, 0, set(v1))
        v2 = chunks(b"a" * 1000, b"B" * 2500, b"c" * 3000)  # one chunk changed
        kept = save(client, 10, v2)
        assert (kept.chunks, kept.bytes, kept.received_bytes) == (3, 6500, 2500)  # only the new one sent
        assert set(a.copies.held(JOB, 0, False)) == set(v2)
        assert a.copies._held == 6500  # the old chunk is freed, the shared ones held once
        assert replicated(b, 0, set(v2))
        assert b.copies._held == 6500
    finally:
        client.close()


def test_a_reader_gets_chunks_from_its_agent_then_the_peer_through_it_then_the_store(agents, tmp_path):
    a, b, c = agents("wa"), agents("wb"), agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(b"x" * 4096, b"y" * 4096)
    extra = chunks(b"only in the store")
    root = store_dir(tmp_path, {**v, **extra})
    writer = MemoryCopyClient(a.address, JOB, 0)
    here, elsewhere = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(c.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        r = reader(tmp_path, here, root)
        for sha, data in {**v, **extra}.items():
            assert r.fetch(sha, len(data)) == data
        assert dict(r.served) == {"memory": 2, "store": 1}
        assert dict(r.served_bytes) == {"memory": 8192, "store": len(b"only in the store")}
        # A rank on a node whose agent has nothing (C): its agent asks its peer (B).
        r = reader(tmp_path, elsewhere, root)
        for sha, data in v.items():
            assert r.fetch(sha, len(data)) == data
        assert dict(r.served) == {"peer": 2} and not r.mismatches
        # C kept what it fetched (in shared memory): the next load finds it there.
        r = reader(tmp_path, elsewhere, root)
        for sha, data in v.items():
            assert r.fetch(sha, len(data)) == data
        assert dict(r.served) == ({"memory": 2} if c.copies._chunks.dir is not None else {"peer": 2})
        # The recovered rank's next save on C replaces what C fetched (only the newest is kept).
        on_c = MemoryCopyClient(c.address, JOB, 0)
        try:
            newer = chunks(b"x" * 4096, b"z" * 4096)  # one chunk shared with what was fetched
            save(on_c, 10, newer)
            assert set(c.copies.job_files(JOB)[0] if c.copies._chunks.dir else newer) == set(newer)
            assert c.copies._held == 8192
        finally:
            on_c.close()
    finally:
        for cl in (writer, here, elsewhere):
            cl.close()


def test_a_bulk_read_through_the_peer_moves_every_chunk_on_streams_no_round_trip_per_chunk(
    agents, tmp_path, monkeypatch
):
    """A heal's reader names every chunk of its load first (``prefetch``): C fetches them from
    its peer B on parallel GetChunks streams while the reader takes them as they come; no
    GetChunk call (a round trip per chunk) is made anywhere, and a chunk B lacks is a miss the
    store fills."""
    per_chunk = []
    real = MemoryCopyServicer.GetChunk

    def counted(self, request, context):
        if request.via_peer:  # (the own agent's memory without shared memory is asked chunk by chunk)
            per_chunk.append(request.sha256)
        return real(self, request, context)

    monkeypatch.setattr(MemoryCopyServicer, "GetChunk", counted)
    a, b, c = agents("wa"), agents("wb"), agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(*(os.urandom(3000 + i) for i in range(11)))  # more chunks than parallel streams
    extra = chunks(b"only in the store")
    root = store_dir(tmp_path, {**v, **extra})
    writer, elsewhere = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(c.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        r = reader(tmp_path, elsewhere, root)
        wanted = {sha: len(data) for sha, data in {**v, **extra}.items()}
        for source in r.sources[:-1]:
            if hasattr(source, "prefetch"):
                source.prefetch(wanted)
        for sha, data in {**v, **extra}.items():
            assert r.fetch(sha, len(data)) == data
        assert r.served["store"] == 1 and r.served["memory"] + r.served["peer"] == len(v) and not r.mismatches
        assert per_chunk == []
    finally:
        writer.close()
        elsewhere.close()


def test_a_corrupt_peer_copy_read_in_bulk_is_refused_and_the_store_read(agents, tmp_path):
    a = agents("wa")
    b = agents("wb", corrupt=JOB.rpartition("-")[0])
    c = agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(os.urandom(5000), os.urandom(7000))
    root = store_dir(tmp_path, v)
    writer, elsewhere = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(c.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        r = reader(tmp_path, elsewhere, root)
        r.sources[1].prefetch({sha: len(data) for sha, data in v.items()})
        for sha, data in v.items():
            assert r.fetch(sha, len(data)) == data
        assert dict(r.mismatches) == {"peer": 2} and dict(r.served) == {"store": 2}
    finally:
        writer.close()
        elsewhere.close()


def test_a_corrupt_peer_copy_is_detected_counted_and_the_store_read(agents, tmp_path):
    a = agents("wa")
    b = agents("wb", corrupt=JOB.rpartition("-")[0])  # B flips a byte of every replica it stores
    c = agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(os.urandom(5000), os.urandom(7000))
    root = store_dir(tmp_path, v)
    writer, elsewhere = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(c.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        r = reader(tmp_path, elsewhere, root)
        for sha, data in v.items():
            assert r.fetch(sha, len(data)) == data
        assert dict(r.mismatches) == {"peer": 2}
        assert dict(r.served) == {"store": 2}
        # With the store's file gone too, the load fails, naming the chunk.
        sha = next(iter(v))
        chunk_path(root, sha).unlink()
        with pytest.raises(ChunkIntegrityError, match=sha):
            reader(tmp_path, elsewhere, root).fetch(sha, len(v[sha]))
    finally:
        writer.close()
        elsewhere.close()


def test_memory_is_bounded_older_sets_of_other_ranks_are_evicted_first(agents):
    a = agents("wa", limit=10_000)
    r0, r1 = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(a.address, JOB, 1)
    try:
        kept = save(r0, 5, chunks(b"p" * 6000))
        assert kept.chunks == 1
        kept = save(r1, 5, chunks(b"q" * 6000))  # does not fit beside rank 0's: rank 0's set goes
        assert (kept.chunks, kept.missing) == (1, 0)
        assert a.copies.held(JOB, 0, False) == [] and a.copies._held == 6000
        # Its own previous set goes last, then the second new chunk does not fit: not kept.
        kept = save(r1, 10, chunks(b"r" * 6000, b"s" * 6000))
        assert (kept.chunks, kept.missing) == (1, 1)
        assert a.copies._held == 6000
    finally:
        r0.close()
        r1.close()


def test_an_aborted_save_keeps_the_previous_set(agents):
    a = agents("wa")
    client = MemoryCopyClient(a.address, JOB, 0)
    try:
        v1 = chunks(b"k" * 100)
        save(client, 5, v1)
        sink = client.begin(10)
        sink(*next(iter(chunks(b"half written").items())))
        client.end(False)
        client.wait()
        assert set(a.copies.held(JOB, 0, False)) == set(v1)
        assert a.copies._held == 100
    finally:
        client.close()


def test_a_full_shared_memory_keeps_what_fits_and_says_what_it_did_not(monkeypatch, tmp_path):
    a, b = Agent("wa", shm=shared_memory_dir("wa", tmp_path)), Agent("wb", shm=shared_memory_dir("wb", tmp_path))
    a.peer(b)
    real = Path.write_bytes

    def full(self, data):
        if len(data) > 5000:
            raise OSError(28, "No space left on device")
        return real(self, data)

    # The peer's /dev/shm is full for the big chunk (ENOSPC) when the replica arrives.
    monkeypatch.setattr(Path, "write_bytes", full)
    client = MemoryCopyClient(a.address, JOB, 0)
    try:
        small, big = chunks(b"s" * 100), chunks(b"L" * 6000)
        kept = save(client, 5, {**small, **big})
        assert (kept.chunks, kept.missing) == (2, 0)  # the rank wrote its files itself
        assert replicated(b, 0, set(small))
        assert b.copies._held == 100
        assert [p.name for p in b.copies._chunks.dir.iterdir() if p.name != "lanes.sock"] == list(small)
    finally:
        client.close()
        a.close()
        b.close()


def test_the_directories_of_dead_agents_are_removed_and_a_live_ones_kept(tmp_path):
    """A SIGKILLed agent leaves its shared-memory directory; the next agent (and `surgectl
    down`) removes it, never a live agent's."""
    import subprocess
    import sys

    live = shared_memory_dir("w2", tmp_path)  # this process's
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    dead = tmp_path / f"{memory_chunks.SHM_PREFIX}w1-{gone.pid}"
    (dead / "ab").mkdir(parents=True)
    (dead / "ab" / "chunk").write_bytes(b"x" * 10)
    assert memory_chunks.remove_dead_dirs(tmp_path) == [dead]
    assert not dead.exists() and live is not None and live.is_dir()


def test_a_bulk_read_from_a_peer_that_hangs_gives_up_and_the_store_is_read(agents, tmp_path, monkeypatch):
    import time

    from services.rank import memory_client

    a, b, c = agents("wa"), agents("wb"), agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(os.urandom(4000), os.urandom(5000))
    root = store_dir(tmp_path, v)
    writer, elsewhere = MemoryCopyClient(a.address, JOB, 0), MemoryCopyClient(c.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        monkeypatch.setattr(memory_client, "GET_TIMEOUT_S", 0.5)
        real = b.copies.get_many

        def hangs(*args, **kwargs):
            time.sleep(4)  # the peer answers nothing for longer than the reader waits
            yield from real(*args, **kwargs)

        monkeypatch.setattr(b.copies, "get_many", hangs)
        if b.copies._lane is not None:  # (its bulk lane: the peer sends nothing for as long)
            real_lookup = b.copies._lane._lookup

            def slow_lookup(sha):
                time.sleep(4)
                return real_lookup(sha)

            monkeypatch.setattr(b.copies._lane, "_lookup", slow_lookup)
        r = reader(tmp_path, elsewhere, root)
        r.sources[1].prefetch({sha: len(data) for sha, data in v.items()})
        t0 = time.monotonic()
        for sha, data in v.items():
            assert r.fetch(sha, len(data)) == data
        assert time.monotonic() - t0 < 3 and dict(r.served) == {"store": 2}
    finally:
        writer.close()
        elsewhere.close()


def test_a_bulk_read_that_ends_early_stops_its_pulls_from_the_peer(agents):
    import threading
    import time

    a, b, c = agents("wa"), agents("wb"), agents("wc")
    a.peer(b)
    c.peer(b)
    v = chunks(*(os.urandom(3000) for _ in range(60)))  # more than the agent's queue of arrived chunks holds
    writer = MemoryCopyClient(a.address, JOB, 0)
    try:
        save(writer, 5, v)
        assert replicated(b, 0, set(v))
        replies = c.copies.get_many(JOB, list(v), via_peer=True)
        assert next(replies).found
        replies.close()  # the reader went away (its stream cancelled) after one chunk
        deadline = time.monotonic() + 5
        while any(t.name == "memory-peer-read" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [t.name for t in threading.enumerate() if t.name == "memory-peer-read"]
    finally:
        writer.close()


def test_a_copy_without_room_is_skipped_before_writing_typed_and_the_next_save_tries_again(agents):
    """Issue 29 item 8: the room in the agent's shared memory (statvfs, the cgroup's memory
    left) is checked before a save's copy is written; too little skips that copy with a typed
    event (the save to the store is not this client's), and the next save is copied."""
    from services.common.free_space import Room
    from services.contract import route_pb2, store_pb2

    a = agents("wa")
    room = [Room("/dev/shm", free_bytes=4000, cgroup_bytes=None)]
    reports: list = []
    client = MemoryCopyClient(a.address, JOB, 0, report=reports.append, room=lambda path: room[0])
    try:
        v = chunks(b"a" * 3000, b"b" * 3000)
        sink = client.begin(5, expected_bytes=6000)
        if a.copies._chunks.dir is None:  # (no shared memory: the agent's bound applies, not the room)
            assert sink is not None and reports == []
            return
        assert sink is None  # skipped: nothing written, nothing held
        assert a.copies.held(JOB, 0, False) == [] and list((a.copies._chunks.dir / "incoming").glob("*/*")) == []
        (skipped,) = reports
        assert isinstance(skipped, store_pb2.MemoryCopySkipped)
        assert (skipped.job_id, skipped.rank, skipped.step, skipped.write_error) == (
            JOB,
            0,
            5,
            route_pb2.WRITE_NO_SPACE,
        )
        assert (skipped.needed_bytes, skipped.free_bytes) == (6000, 4000) and "incoming" in skipped.path
        room[0] = Room("/dev/shm", free_bytes=1 << 30, cgroup_bytes=5000)  # the cgroup bounds it too
        assert client.begin(10, expected_bytes=6000) is None and reports[-1].free_bytes == 5000
        room[0] = Room("/dev/shm", free_bytes=1 << 30, cgroup_bytes=1 << 30)  # room again: copied
        kept = save_expecting(client, 15, v, 6000)
        assert (kept.chunks, kept.bytes) == (2, 6000) and len(reports) == 2
    finally:
        client.close()


def save_expecting(client: MemoryCopyClient, step: int, parts: dict[str, bytes], expected: int):
    sink = client.begin(step, expected_bytes=expected)
    assert sink is not None
    for sha, data in parts.items():
        sink(sha, memoryview(data))
    client.end(True)
    return client.wait()


def test_the_cgroup_memory_left_is_read_from_v2_or_v1(tmp_path):
    from services.common.free_space import cgroup_headroom

    proc = tmp_path / "cgroup"
    v2 = tmp_path / "sys" / "job"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("250000\n")
    proc.write_text("0::/job\n")
    assert cgroup_headroom(tmp_path / "sys", proc) == 750000
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom(tmp_path / "sys", proc) is None
    v1 = tmp_path / "sys" / "memory"  # a container's view: its own cgroup at the hierarchy's root
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("2000000\n")
    (v1 / "memory.usage_in_bytes").write_text("500000\n")
    proc.write_text("4:memory:/outside/the/container\n0::/\n")
    assert cgroup_headroom(tmp_path / "sys", proc) == 1500000
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unbounded
    assert cgroup_headroom(tmp_path / "sys", proc) is None


def test_a_saves_payload_bytes_count_its_tensors():
    import torch

    from services.rank.checkpoint_io import payload_bytes

    payload = {"model": {"w": torch.zeros(10, 10), "b": torch.zeros(10, dtype=torch.float16)}, "step": 3,
               "optim": {"state": [{"exp_avg": torch.zeros(100)}], "lr": 0.1}}  # fmt: skip
    assert payload_bytes(payload) == 400 + 20 + 400
