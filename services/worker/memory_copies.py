"""The node agent's in-memory copies of its ranks' newest checkpoint (issue 14, part 3).

Every save of a local rank streams the content-addressed chunks of that rank's part
(``services/state/chunk_store.py``: SHA-256 of fixed-size pieces of each tensor's bytes) to
this agent over ``MemoryCopyService.PutChunks`` on loopback; the rank first asks which of
its chunks the agent holds (``HeldChunks``) and sends only the others. The save's last part
names every chunk of the save: that list replaces the rank's previous one, so only the
newest snapshot of each rank is kept, a chunk shared with the previous version stays (it
is not sent again), and a chunk no kept set names any more is freed.

The agent then replicates the rank's set to one peer node agent (``LaunchRanks.memory_peer``,
chosen by L1-2: the next placeable worker in registration order), the same way (the peer
says what it holds, the agent sends the rest). A recovery's reader asks its own agent for a
chunk (``GetChunk``), then its agent's peer through its agent (``via_peer``): a rank talks
to its own agent only, an agent to its peer only. Nothing here verifies a chunk on the read
path: the reader checks every chunk's SHA-256 and falls back to the next source (the store's
files last), so a corrupt copy costs a re-read, never a wrong restore.

Where (``memory_chunks.py``): one file per chunk in a shared-memory directory of this agent process
(``/dev/shm/surge-memory-<worker>-<pid>``, tmpfs: host memory; removed at exit, and a
directory of an agent process no longer alive is removed when the next agent starts), so a
rank of this node reads a chunk from it without its bytes crossing gRPC (``GetChunk`` names
the file; the files are written once and never changed). A chunk fetched from the peer for
a local rank is kept there as well (the job's ``fetched`` set; the reader checks it), so
the rank reads it from this node's memory and a second load finds it here. Without a
writable ``/dev/shm`` (or ``SURGE_WORKER_MEMORY_COPY_SHM=off``) the chunks are bytes in this
process and travel in the reply.

A heal's bulk read (``GetChunks`` from a local rank with ``lanes``) goes on bulk lanes where
both agents open them (``services/common/bulk_lane.py``: with shared memory, not under TLS):
this agent asks its peer for a lane per part of the list (``OpenBulkRead``: a one-time
token), connects to it and hands the connected socket to the rank, which receives the raw
chunks itself (sendfile from the peer's shared memory, recv_into the rank's buffers: no gRPC
copies, no tmpfs write and read here). Such chunks are not kept by this agent.

Held per (job, rank, replica): the newest set. Memory is bounded (``limit_bytes``,
``SURGE_WORKER_MEMORY_COPY_BYTES``, default a quarter of the host's memory; 0 turns the tier
off): a chunk that does not fit evicts whole sets, least recently stored first, the set it
replaces last (so the newest snapshot wins, without the chunks it shared with the old one);
one that still does not fit is not kept (``missing`` in the reply, counted). A reader finds
what is missing in the next source.

Data plane, not routed messages: exception ``memory-copies-data-plane`` in
``services/contract/exceptions.yaml`` (like DCP's writes to the store's files).

Test-only: ``SURGE_MEMORY_COPY_CORRUPT="<job name>[,...]"`` flips the first byte of every
replica chunk this agent stores for a job of that name (bit rot in the peer's memory), so a
test can see the reader detect it and fall back to the store.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from services.common import bulk_lane
from services.common.grpc_server import channel
from services.contract import Module, control_pb2, worker_pb2, worker_pb2_grpc
from services.worker.memory_chunks import ChunkHolder

FETCHED_RANK = 2**32 - 1  # the set of chunks an agent fetched from its peer for its ranks (per job)
CORRUPT_ENV = "SURGE_MEMORY_COPY_CORRUPT"
PEER_RPC_TIMEOUT_S = 10.0  # one chunk from the peer (a chunk is a few MiB at most)
PEER_STREAMS = 4  # parallel GetChunks streams of one bulk read from the peer
REPLICATE_TIMEOUT_S = 600.0  # one replication stream
MODULE_METADATA = "x-surge-module"

CHUNKS_RECEIVED = Counter(
    "surge_memory_copy_received_bytes_total",
    "Chunk bytes this agent received for its in-memory checkpoint copies",
    ["origin"],  # rank | peer
)
CHUNKS_SERVED = Counter(
    "surge_memory_copy_served_bytes_total",
    "Chunk bytes this agent served to a reader",
    ["holder"],  # local | peer (fetched from its peer for a local rank)
)
CHUNKS_REFUSED = Counter(
    "surge_memory_copy_refused_chunks_total", "Chunks not kept: over the memory bound of the copies"
)
HELD_BYTES = Gauge("surge_memory_copy_held_bytes", "Bytes of chunks held in memory by this agent")


def _job_name(job_id: str) -> str:
    return job_id.rpartition("-")[0] or job_id  # ids are "<name>-<6 hex>"


@dataclass
class _Set:
    step: int
    digests: tuple[str, ...]
    stored_at: float


class MemoryCopies:
    """The chunk memory of one node agent: newest set per (job, rank, replica), chunks
    shared between sets held once, and the replication of local ranks' sets to the peer.

    Args:
        worker_id: this agent (named as the holder of what it serves).
        log: a structlog logger.
        limit_bytes: bound on held chunk bytes (0: keep nothing).
    """

    def __init__(
        self, worker_id: str, log: Any, limit_bytes: int, shm_dir: Path | None = None, lane_host: str | None = None
    ):
        self._worker_id = worker_id
        self._log = log
        self._limit = limit_bytes
        self._lock = threading.Lock()
        self._chunks = ChunkHolder(shm_dir)
        self._refs: dict[str, int] = {}
        self._held = 0  # bytes in _chunks and in open streams
        self._sets: dict[tuple[str, int, bool], _Set] = {}
        self._peers: dict[str, control_pb2.MemoryPeer] = {}
        self._stubs: dict[str, tuple[grpc.Channel, worker_pb2_grpc.MemoryCopyServiceStub]] = {}
        self._corrupt = {n.strip() for n in os.environ.get(CORRUPT_ENV, "").split(",") if n.strip()}
        self._outbox: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._replicator = threading.Thread(target=self._replicate_loop, name="memory-replicator", daemon=True)
        self._replicator.start()
        # Bulk lanes (services/common/bulk_lane.py), with shared memory (files to sendfile; the relay's socket)
        # and a host to listen on (None: none, e.g. under TLS): the server a peer's heal reads
        # this agent's chunks on, and the relay handing lanes to this node's ranks.
        self._lane: bulk_lane.LaneServer | None = None
        self._relay: bulk_lane.LaneRelay | None = None
        if lane_host and shm_dir is not None:
            self._lane = bulk_lane.LaneServer(lane_host, self._lane_lookup, log)
            # An abstract Unix socket (Linux: a name, no file): a filesystem path is at most 107
            # bytes (a deep SURGE_HOME had no relay, so no lanes, silently) and a restarted
            # agent met its predecessor's file. The one-time key is what guards a handoff.
            tag = hashlib.sha256(str(shm_dir).encode()).hexdigest()[:16]
            self._relay = bulk_lane.LaneRelay(f"\0surge-lanes-{tag}-{os.getpid()}", log)

    # ------------------------------------------------------------ from the node agent

    def set_peer(self, job_id: str, peer: control_pb2.MemoryPeer) -> None:
        """The peer node agent of ``job_id``'s copies (from LaunchRanks)."""
        with self._lock:
            if peer.address:
                self._peers[job_id] = peer
            else:
                self._peers.pop(job_id, None)

    def close(self) -> None:
        self._closed.set()
        self._outbox.put(None)
        if self._lane is not None:
            self._lane.close()
        if self._relay is not None:
            self._relay.close()
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
            if self._chunks.dir is not None:
                shutil.rmtree(self._chunks.dir, ignore_errors=True)
        for ch, _ in stubs:
            ch.close()

    # ------------------------------------------------------------ the service's calls

    def staging(self, job_id: str, rank: int) -> str:
        """A fresh directory in shared memory where a local rank writes the new chunks of its
        next save ("" without shared memory)."""
        path = self._staging_path(job_id, rank)
        if path is None:
            return ""
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return str(path)

    def _staging_path(self, job_id: str, rank: int) -> Path | None:
        if self._chunks.dir is None:
            return None
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in job_id)
        return self._chunks.dir / "incoming" / f"{safe}.{rank}"

    def held(self, job_id: str, rank: int, replica: bool) -> list[str]:
        with self._lock:
            s = self._sets.get((job_id, rank, replica))
            return [d for d in s.digests if d in self._chunks] if s else []

    def job_files(self, job_id: str) -> tuple[list[str], list[str]] | None:
        """Every chunk held for ``job_id`` and its shared-memory file (None: no shared memory)."""
        with self._lock:
            if self._chunks.dir is None:
                return None
            shas = dict.fromkeys(d for k, s in self._sets.items() if k[0] == job_id for d in s.digests)
            shas = [d for d in shas if d in self._chunks]
            return shas, [self._chunks.path(d) for d in shas]

    def put(self, parts: Iterator[worker_pb2.ChunkPut]) -> worker_pb2.ChunksKept:
        """One PutChunks stream: header, chunks, end. The chunks received are held apart
        until the end names the set; a stream that breaks off keeps nothing new."""
        header = None
        fresh: dict[str, bytes] = {}
        received = refused = 0
        try:
            for part in parts:
                kind = part.WhichOneof("part")
                if kind == "header":
                    header = part.header
                elif kind == "chunk":
                    data = part.chunk.data
                    received += len(data)
                    if header is not None and header.replica and _job_name(header.job_id) in self._corrupt and data:
                        data = bytes([data[0] ^ 0xFF]) + data[1:]  # test-only: bit rot in the peer's copy
                    if not self._reserve(part.chunk.sha256, data, fresh, header):
                        refused += 1
                elif kind == "end":
                    if header is None:
                        raise ValueError("PutChunks: the end came before the header")
                    CHUNKS_RECEIVED.labels("peer" if header.replica else "rank").inc(received)
                    if part.end.aborted:
                        return worker_pb2.ChunksKept(received_bytes=received)
                    return self._commit(header, part.end, fresh, received, refused)
            return worker_pb2.ChunksKept(received_bytes=received)  # broken off: nothing new kept
        finally:
            with self._lock:  # what the stream held apart and no set took
                self._held -= sum(len(d) for d in fresh.values())
                HELD_BYTES.set(self._held)
            staged = self._staging_path(header.job_id, header.rank) if header and not header.replica else None
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)  # (an aborted or broken-off save's files)

    def open_lane(self, job_id: str, shas: list[str]) -> worker_pb2.BulkLane:
        """A one-time lane for the chunks of ``shas`` this agent holds (a peer's heal), or an
        empty reply (no lane here: the asker uses GetChunks)."""
        if self._lane is None:
            return worker_pb2.BulkLane()
        with self._lock:
            held = [(sha, self._chunks.size(sha)) for sha in dict.fromkeys(shas) if sha in self._chunks]
        token = self._lane.grant([sha for sha, _ in held])
        return worker_pb2.BulkLane(
            port=self._lane.port, token=token, sha256=[s for s, _ in held], nbytes=[n for _, n in held]
        )

    def _lane_lookup(self, sha: str) -> str | bytes | None:
        with self._lock:
            if sha not in self._chunks:
                return None
            return self._chunks.path(sha) or self._chunks.get(sha)

    def get(self, job_id: str, sha256: str, via_peer: bool, local_path: bool = False) -> worker_pb2.ChunkReply:
        """A chunk from this agent's memory, or (``via_peer``) its peer's. ``local_path``:
        the caller runs on this node: name the chunk's shared-memory file instead of
        sending its bytes (when the chunks live in one)."""
        if not via_peer:
            with self._lock:
                if sha256 not in self._chunks:
                    return worker_pb2.ChunkReply(found=False)
                size, path = self._chunks.size(sha256), self._chunks.path(sha256)
                data = self._chunks.get(sha256) if not path else None
            if path and not local_path:  # read outside the lock (a file in shared memory)
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except FileNotFoundError:  # freed meanwhile
                    return worker_pb2.ChunkReply(found=False)
                path = ""
            CHUNKS_SERVED.labels("local").inc(size)
            return worker_pb2.ChunkReply(found=True, data=data or b"", path=path, holder=self._worker_id)
        stub = self._peer_stub(job_id)
        if stub is None:
            return worker_pb2.ChunkReply(found=False)
        try:
            reply = stub.GetChunk(worker_pb2.ChunkQuery(job_id=job_id, sha256=sha256), timeout=PEER_RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            self._log.warning("memory_copy_peer_unreachable", job_id=job_id, code=e.code().name)
            return worker_pb2.ChunkReply(found=False)
        if not reply.found:
            return reply
        CHUNKS_SERVED.labels("peer").inc(len(reply.data))
        if local_path and self._chunks.dir is not None:
            path = self._keep_fetched(job_id, sha256, reply.data)
            if path:  # the rank reads it here; the next ask for it is a local hit
                return worker_pb2.ChunkReply(found=True, path=path, holder=reply.holder)
        return reply

    def get_many(
        self, job_id: str, shas: list[str], via_peer: bool, local_path: bool = False, lanes: bool = False
    ) -> Iterator[worker_pb2.ChunkReply]:
        """Chunks ``shas`` as a stream of replies (each names its ``sha256``), each sent as
        soon as it is at hand. Without ``via_peer``: from this agent's memory, in the query's
        order. With ``via_peer`` (a local rank's peer source): the chunks this agent lacks,
        fetched from its peer on up to ``PEER_STREAMS`` GetChunks streams at once and kept
        here (``_keep_fetched``), in the order they arrive; a chunk this agent holds is
        answered ``found`` false at once (it is the rank's memory source's to serve: the
        bytes are not fetched twice, and a local copy the reader refused is read from the
        store, not again from here). A chunk nobody holds: ``found`` false. ``local_path``
        as :meth:`get`. ``lanes`` (a rank of this node that takes them): the peer's chunks on
        bulk lanes this agent opens and hands to the rank (a ``lane`` reply per lane: the rank
        receives them itself; this agent keeps no copy), where the peer opens lanes."""
        todo = []
        for sha in dict.fromkeys(shas):
            if via_peer:
                with self._lock:
                    here = sha in self._chunks
                if here:
                    yield worker_pb2.ChunkReply(found=False, sha256=sha)
                else:
                    todo.append(sha)
                continue
            reply = self.get(job_id, sha, via_peer=False, local_path=local_path)
            reply.sha256 = sha
            yield reply
        if not todo:
            return
        stub = self._peer_stub(job_id)
        if stub is None:
            for sha in todo:
                yield worker_pb2.ChunkReply(found=False, sha256=sha)
            return
        yield from self._fetch_from_peer(stub, job_id, todo, local_path, lanes and local_path)

    def _fetch_from_peer(
        self,
        stub: worker_pb2_grpc.MemoryCopyServiceStub,
        job_id: str,
        shas: list[str],
        local_path: bool,
        lanes: bool = False,
    ) -> Iterator[worker_pb2.ChunkReply]:
        """``shas`` from the peer's memory on parallel server streams (gRPC moves one stream's
        messages on one thread: several keep a loopback or a network link full), passed on
        as they arrive; a chunk the peer lacks, or a stream that fails, is a miss."""
        streams = [shas[i::PEER_STREAMS] for i in range(min(PEER_STREAMS, len(shas)))]
        arrived: queue.Queue = queue.Queue(maxsize=4 * PEER_STREAMS)  # bounded: a slow reader paces the peer

        calls: list[Any] = []
        gone = threading.Event()  # the reader's stream ended (done, or cancelled): stop pulling
        lanes = lanes and self._relay is not None

        def put(item: worker_pb2.ChunkReply | None) -> bool:
            while not gone.is_set():
                try:
                    arrived.put(item, timeout=1.0)
                    return True
                except queue.Full:
                    continue
            return False

        def pull(part: list[str]) -> None:
            left = set(part)
            try:
                if lanes and self._hand_lane(stub, job_id, part, left, put):
                    return
                call = stub.GetChunks(worker_pb2.ChunksQuery(job_id=job_id, sha256=part), timeout=REPLICATE_TIMEOUT_S)
                calls.append(call)
                for reply in call:
                    left.discard(reply.sha256)
                    if not put(self._passed_on(job_id, reply, local_path)):
                        return
            except grpc.RpcError as e:
                if not gone.is_set():
                    self._log.warning("memory_copy_peer_unreachable", job_id=job_id, code=e.code().name)
            except OSError as e:  # no connection to the peer's lane
                if not gone.is_set():
                    self._log.warning("memory_copy_peer_unreachable", job_id=job_id, code=type(e).__name__)
            finally:
                for sha in left:
                    if not put(worker_pb2.ChunkReply(found=False, sha256=sha)):
                        break
                put(None)

        threads = [
            threading.Thread(target=pull, args=(part,), name="memory-peer-read", daemon=True) for part in streams
        ]
        for t in threads:
            t.start()
        running = len(threads)
        try:
            while running:
                reply = arrived.get()
                if reply is None:
                    running -= 1
                    continue
                yield reply
        finally:  # (a reader that went away: its pulls must not wait on a full queue forever)
            gone.set()
            for call in list(calls):
                call.cancel()

    def _hand_lane(
        self, stub: worker_pb2_grpc.MemoryCopyServiceStub, job_id: str, part: list[str], left: set[str], put: Any
    ) -> bool:
        """A bulk lane to the peer for ``part`` (services/common/bulk_lane.py), opened here and passed on to
        the local rank (``lane`` reply: the relay hands the connected socket to it); ``left``
        loses the chunks the lane carries. False when the peer opens no lane (an older agent,
        or one under TLS): the caller uses GetChunks. Raises OSError (no connection) or
        grpc.RpcError."""
        assert self._relay is not None
        try:
            lane = stub.OpenBulkRead(worker_pb2.ChunksQuery(job_id=job_id, sha256=part), timeout=PEER_RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        with self._lock:
            peer = self._peers.get(job_id)
        if not lane.token or peer is None:
            return False
        key = self._relay.offer(bulk_lane.connect(peer.address, lane.port, lane.token))
        left.difference_update(lane.sha256)
        CHUNKS_SERVED.labels("peer").inc(sum(lane.nbytes))
        handed = worker_pb2.BulkLane(token=key, sha256=lane.sha256, nbytes=lane.nbytes, handoff=self._relay.path)
        put(worker_pb2.ChunkReply(found=True, holder=peer.worker_id, lane=handed))
        return True

    def _passed_on(self, job_id: str, reply: worker_pb2.ChunkReply, local_path: bool) -> worker_pb2.ChunkReply:
        """A chunk from the peer as this agent passes it on: kept in its shared memory and
        named by file for a local reader (``local_path``), else its bytes; the reader checks
        it (a wrong copy is refused there)."""
        if not reply.found:
            return reply
        CHUNKS_SERVED.labels("peer").inc(len(reply.data))
        if local_path and self._chunks.dir is not None:
            path = self._keep_fetched(job_id, reply.sha256, reply.data)
            if path:
                return worker_pb2.ChunkReply(found=True, path=path, holder=reply.holder, sha256=reply.sha256)
        return reply

    # ------------------------------------------------------------ private

    def _keep_fetched(self, job_id: str, sha: str, data: bytes) -> str:
        """Keep a chunk fetched from the peer for a local rank in this agent's shared memory
        (the job's ``fetched`` set, evicted like any other). Not hashed here: the reader
        checks every chunk it reads (the one check on this path; hashing here as well cost a
        third of a heal's CPU), so a wrong copy is refused there and read from the store.
        Returns its file, or "" when it is not kept."""
        key = (job_id, FETCHED_RANK, True)
        with self._lock:
            if sha not in self._chunks:
                if not self._room_for_fetched(len(data), key):
                    return ""
                try:
                    self._chunks.put(sha, data)
                except OSError:
                    return ""
                self._held += len(data)
                HELD_BYTES.set(self._held)
            self._add_fetched(key, sha)
            return self._chunks.path(sha)

    def _room_for_fetched(self, n: int, key: tuple[str, int, bool]) -> bool:
        """Evict other sets until ``n`` more bytes fit (lock held); False when they cannot."""
        while self._held + n > self._limit:
            victims = sorted((s.stored_at, k) for k, s in self._sets.items() if k != key)
            if not victims:
                return False
            self._drop(victims[0][1])
        return True

    def _add_fetched(self, key: tuple[str, int, bool], sha: str) -> None:
        """Name a held chunk in the job's ``fetched`` set (lock held)."""
        old = self._sets.get(key)
        if old is None or sha not in old.digests:
            self._refs[sha] = self._refs.get(sha, 0) + 1
            self._sets[key] = _Set(0, (*(old.digests if old else ()), sha), time.monotonic())

    def _reserve(self, sha: str, data: bytes, fresh: dict[str, bytes], header: Any) -> bool:
        """Hold a received chunk apart for its stream, within the bound (evicting the
        least recently stored sets, never the one this stream replaces)."""
        with self._lock:
            if sha in self._chunks or sha in fresh:
                return True
            replaced = (header.job_id, header.rank, header.replica) if header is not None else None
            if not self._make_room(len(data), replaced):
                CHUNKS_REFUSED.inc()
                return False
            fresh[sha] = data
            self._held += len(data)
            HELD_BYTES.set(self._held)
            return True

    def _make_room(self, n: int, replaced: tuple[str, int, bool] | None) -> bool:
        """Evict sets until ``n`` more bytes fit (lock held): least recently stored first, the
        set ``replaced`` last (its chunks the new set shares were not sent again: they go
        missing with it). False when even an empty memory could not take them."""
        while self._held + n > self._limit:
            victims = sorted((k == replaced, s.stored_at, k) for k, s in self._sets.items())
            if not victims:
                return False
            *_, key = victims[0]
            self._drop(key)
            self._log.info("memory_copy_evicted", job_id=key[0], rank=key[1], replica=key[2])
        return True

    def _commit(
        self,
        header: worker_pb2.SnapshotHeader,
        end: worker_pb2.SnapshotEnd,
        fresh: dict[str, bytes],
        received: int,
        refused: int,
    ) -> worker_pb2.ChunksKept:
        key = (header.job_id, header.rank, header.replica)
        staged = None if header.replica else self._staging_path(header.job_id, header.rank)
        with self._lock:
            kept: list[str] = []
            nbytes = 0
            for sha in dict.fromkeys(end.sha256):  # (each once)
                data = fresh.pop(sha, None)
                if data is None and sha not in self._chunks and staged is not None and (staged / sha).is_file():
                    try:  # written by the rank into its staging directory: moved in, within the bound
                        size = (staged / sha).stat().st_size
                        if not self._make_room(size, key):
                            CHUNKS_REFUSED.inc()
                            continue
                        self._held += self._chunks.adopt(sha, staged / sha)
                        received += size
                        CHUNKS_RECEIVED.labels("rank").inc(size)
                    except OSError:
                        continue
                elif data is not None:
                    try:
                        self._chunks.put(sha, data)  # (already counted in _held when received)
                    except OSError as e:  # shared memory full (a small /dev/shm): not kept
                        self._held -= len(data)
                        CHUNKS_REFUSED.inc()
                        self._log.warning("memory_copy_chunk_not_stored", error=f"{type(e).__name__}: {e}")
                        continue
                elif sha not in self._chunks:
                    continue
                self._refs[sha] = self._refs.get(sha, 0) + 1
                kept.append(sha)
                nbytes += self._chunks.size(sha)
            self._drop(key)  # the previous set of this rank: its chunks go unless shared
            self._sets[key] = _Set(header.step, tuple(kept), time.monotonic())
            if not header.replica:
                self._drop((header.job_id, header.rank, True))  # a replica of this rank is older
                self._drop((header.job_id, FETCHED_RANK, True))  # so is what a recovery fetched
            HELD_BYTES.set(self._held)
            missing = len(set(end.sha256)) - len(kept)
        self._log.info(
            "memory_copy_stored",
            job_id=header.job_id,
            rank=header.rank,
            step=header.step,
            replica=header.replica,
            chunks=len(kept),
            bytes=nbytes,
            received_bytes=received,
            missing=missing,
            refused=refused,
        )
        if not header.replica:
            self._outbox.put((header.job_id, header.rank))
        return worker_pb2.ChunksKept(chunks=len(kept), bytes=nbytes, missing=missing, received_bytes=received)

    def _drop(self, key: tuple[str, int, bool]) -> None:
        """Forget a set (lock held); free its chunks no other set names."""
        old = self._sets.pop(key, None)
        if old is None:
            return
        for sha in old.digests:
            n = self._refs.get(sha, 0) - 1
            if n > 0:
                self._refs[sha] = n
                continue
            self._refs.pop(sha, None)
            self._held -= self._chunks.free(sha)

    def _peer_stub(self, job_id: str) -> worker_pb2_grpc.MemoryCopyServiceStub | None:
        with self._lock:
            peer = self._peers.get(job_id)
            if peer is None:
                return None
            have = self._stubs.get(peer.address)
            if have is None:
                ch = channel(peer.address, module=Module.EXT_HARDWARE)
                have = self._stubs[peer.address] = (ch, worker_pb2_grpc.MemoryCopyServiceStub(ch))
            return have[1]

    def _replicate_loop(self) -> None:
        """Send each local rank's newest set to the job's peer, one stream at a time; a set
        superseded while waiting is sent once, as its newest."""
        while True:
            item = self._outbox.get()
            if item is None or self._closed.is_set():
                return
            pending = {item}
            while True:  # coalesce what queued meanwhile
                try:
                    more = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                pending.add(more)
            for job_id, rank in sorted(pending):
                try:
                    self._replicate(job_id, rank)
                except Exception as e:  # noqa: BLE001 - a failed replication costs only the copy
                    self._log.warning(
                        "memory_copy_replication_failed", job_id=job_id, rank=rank, error=f"{type(e).__name__}: {e}"
                    )

    def _replicate(self, job_id: str, rank: int) -> None:
        stub = self._peer_stub(job_id)
        if stub is None:
            return
        with self._lock:
            s = self._sets.get((job_id, rank, False))
            if s is None:
                return
            digests = [d for d in s.digests if d in self._chunks]
            step = s.step
        t0 = time.perf_counter()
        held = set(stub.HeldChunks(worker_pb2.HeldQuery(job_id=job_id, rank=rank, replica=True), timeout=30).sha256)

        def parts() -> Iterator[worker_pb2.ChunkPut]:
            yield worker_pb2.ChunkPut(
                header=worker_pb2.SnapshotHeader(
                    job_id=job_id, rank=rank, step=step, replica=True, origin_worker_id=self._worker_id
                )
            )
            sent = []
            for sha in digests:
                if sha in held:
                    sent.append(sha)
                    continue
                with self._lock:
                    data = self._chunks.get(sha)
                if data is not None:  # (None: freed meanwhile, by a newer set: not sent)
                    sent.append(sha)
                    yield worker_pb2.ChunkPut(chunk=worker_pb2.ChunkData(sha256=sha, data=data))
            yield worker_pb2.ChunkPut(end=worker_pb2.SnapshotEnd(sha256=sent))

        kept = stub.PutChunks(parts(), timeout=REPLICATE_TIMEOUT_S)
        self._log.info(
            "memory_copy_replicated",
            job_id=job_id,
            rank=rank,
            step=step,
            peer=self._peers.get(job_id, control_pb2.MemoryPeer()).worker_id,
            chunks=kept.chunks,
            bytes=kept.bytes,
            sent_bytes=kept.received_bytes,
            missing=kept.missing,
            seconds=round(time.perf_counter() - t0, 4),
        )
