"""The rank's side of the in-memory checkpoint copies (issue 14, part 3).

Used by the rank's L5 relay (``store_client.py``) only, and only with its own node agent
(the ``--session`` address: a rank knows no other agent):

* saving: :meth:`MemoryCopyClient.begin` returns the chunk writer's ``sink`` for one save.
  It asks the agent which chunks of this rank it already holds (``HeldChunks``: the
  previous save's) and writes the others as files into the staging directory the agent
  names in its shared memory (a copy into host memory, no bytes on gRPC), or, from an agent
  without one, streams them (copied: the writer's view is valid during the call only) on
  one ``PutChunks`` stream from a thread of its own; :meth:`MemoryCopyClient.end` closes the stream with the list of every
  chunk of the save (the agent's new set for this rank), or aborts it when the write failed.
* loading: :meth:`MemoryCopyClient.sources` are the reader's first two chunk sources, the
  agent's own memory (``memory``: the agent lists the job's chunk files in its shared-memory
  directory once per load, and the rank reads them, so the bytes do not cross gRPC; an
  agent without one sends each chunk's bytes) and its peer's through it (``peer``: bytes);
  the store's files come last. A source returns what it got; the reader verifies every
  chunk (SHA-256) and falls back to the next source on a mismatch or a miss. The peer source
  is told every chunk of the load first (``prefetch``: one GetChunks stream through the
  agent, which pulls them from its peer on parallel streams, or opens bulk lanes to its
  peer and hands them here: the rank then receives the chunks' raw bytes on each lane into
  its own buffers, at most ``LANE_BUFFER_BYTES`` a lane ahead of the load), not asked one by
  one; the reader reads the store's end of the same list at once (``chunk_race.py``:
  ``has``/``resolved``/``listen``/``discard`` here) and ``cancel``s the stream and the lanes
  when its load is done.

A copy is never needed for correctness: any failure here is logged and the rank goes on (a
save without its memory copy, a load from the store). Before a save's copy is written into
the agent's shared memory, the room there is checked (``services/common/free_space.py``:
statvfs of the staging directory and the cgroup's memory left, since tmpfs pages past a
cgroup's bound are an OOM kill, not a failed write): a copy expected to need more is skipped
before anything is written, reported as ``MemoryCopySkipped`` (typed, graded by L1-3), and
the next save tries again. An agent without the tier
(``UNIMPLEMENTED``: ``SURGE_WORKER_MEMORY_COPY_BYTES=0``) turns it off for the process.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.common import bulk_lane, free_space
from services.common.grpc_server import channel
from services.contract import Module, route_pb2, store_pb2, worker_pb2, worker_pb2_grpc

HELD_TIMEOUT_S = 5.0
GET_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 600.0
QUEUE_BYTES = 256 << 20  # chunks copied but not yet sent; the writer waits beyond this
PREVIOUS_STREAM_WAIT_S = 1.0  # the loop waits for it at a save: never long
LANE_BUFFER_BYTES = 64 << 20  # per bulk lane: chunks received that the load has not taken yet
# A source that failed this way is not asked again by this process (each ask would wait).
_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED}
_END = object()

log = structlog.get_logger()


class _Save:
    """One save's PutChunks stream: chunks queued by the sink, sent by a thread."""

    def __init__(
        self,
        stub: worker_pb2_grpc.MemoryCopyServiceStub,
        job_id: str,
        rank: int,
        step: int,
        held: set,
        staging: str = "",
    ):
        self._stub = stub
        self._staging = Path(staging) if staging else None
        self._header = worker_pb2.SnapshotHeader(job_id=job_id, rank=rank, step=step)
        self._held = held
        self._digests: dict[str, int] = {}  # every chunk of the save, in order, once
        self._queue: list[Any] = []
        self._queued = 0
        self._cond = threading.Condition()
        self._failed = False
        self.sent_bytes = 0
        self.t0 = time.perf_counter()
        self.kept: worker_pb2.ChunksKept | None = None
        self.thread = threading.Thread(target=self._run, name="memory-copy", daemon=True)
        self.thread.start()

    def sink(self, sha: str, data: memoryview | bytes) -> None:
        if sha in self._digests:
            return
        self._digests[sha] = len(data)
        if sha in self._held or self._failed:
            return
        if self._staging is not None:  # the agent's shared memory: a file, no bytes on gRPC
            tmp = self._staging / f".{sha}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._staging / sha)
                self.sent_bytes += len(data)
            except OSError as e:  # (full, or the agent removed it): the rest of this save is not copied
                tmp.unlink(missing_ok=True)
                self._failed = True
                log.warning("memory_copy_not_stored", step=self._header.step, error=f"{type(e).__name__}: {e}")
            return
        part = worker_pb2.ChunkPut(chunk=worker_pb2.ChunkData(sha256=sha, data=bytes(data)))
        with self._cond:
            while self._queued > QUEUE_BYTES and not self._failed:
                self._cond.wait(1.0)
            self._queue.append(part)
            self._queued += len(data)
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        end = worker_pb2.SnapshotEnd(aborted=not ok)
        if ok:
            end.sha256.extend(self._digests)
            end.nbytes.extend(self._digests.values())
        with self._cond:
            self._queue.append(worker_pb2.ChunkPut(end=end))
            self._queue.append(_END)
            self._cond.notify_all()

    def _parts(self) -> Iterator[worker_pb2.ChunkPut]:
        yield worker_pb2.ChunkPut(header=self._header)
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                part = self._queue.pop(0)
                if part is not _END and part.WhichOneof("part") == "chunk":
                    self._queued -= len(part.chunk.data)
                    self.sent_bytes += len(part.chunk.data)
                self._cond.notify_all()
            if part is _END:
                return
            yield part

    def _run(self) -> None:
        try:
            self.kept = self._stub.PutChunks(self._parts(), timeout=STREAM_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("memory_copy_not_stored", step=self._header.step, code=e.code().name)
            with self._cond:
                self._failed = True
                self._queue.clear()
                self._queued = 0
                self._cond.notify_all()
            return
        log.info(
            "memory_copy_sent",
            step=self._header.step,
            chunks=self.kept.chunks,
            bytes=self.kept.bytes,
            sent_bytes=self.kept.received_bytes,
            missing=self.kept.missing,
            seconds=round(time.perf_counter() - self.t0, 4),
        )


class AgentSource:
    """A reader's chunk source: the local agent's memory, or (``via_peer``) its peer's."""

    def __init__(self, stub: worker_pb2_grpc.MemoryCopyServiceStub, job_id: str, name: str, via_peer: bool):
        self.name = name
        self._stub = stub
        self._job_id = job_id
        self._via_peer = via_peer
        self.reads_in_bulk = via_peer  # (prefetch reads: the reader's two-ended read takes part)
        self._gone = False
        self._files: dict[str, str] | None = None  # the agent's shared-memory files of the job (local only)
        self._asked = False
        self._files_lock = threading.Lock()
        self._bulk: dict[str, str | bytes | bytearray] = {}  # prefetched: sha -> its file, or its bytes
        self._pending: set[str] = set()  # asked for in bulk, not arrived yet
        self._bulk_asked = False  # a bulk read was asked for: a chunk not in it is a miss
        self._bulk_cond = threading.Condition()
        self._arrived = 0.0  # when the bulk stream last brought a chunk (monotonic seconds)
        self._call: Any = None  # the bulk read's GetChunks call (cancelled when the load is done)
        self._cancelled = False
        self._lanes: list[Any] = []  # bulk lanes being read (sockets), shut when the load is done
        self._lane_owned: set[str] = set()  # chunks a lane brings (pending until it does or ends)
        self._lane_held: dict[int, int] = {}  # per lane: bytes received and not taken yet
        self._owner: dict[str, int] = {}  # a received chunk's lane
        self._unwanted: set[str] = set()  # served by another source: not kept when it arrives
        self._listener: Callable[[], None] | None = None  # told of each arrival (a two-ended read)
        self._stop_at: Callable[[str], bool] | None = None  # where a lane may stop (a two-ended read)
        self.bytes = 0  # returned (verified or not: the reader counts its mismatches)
        self.misses = 0

    def holds(self, sha: str) -> bool | None:
        """(The own agent's memory.) Whether the agent holds ``sha`` (one look-up per load),
        None when it cannot say (no shared memory: each chunk is asked for)."""
        if self._via_peer or self._gone:
            return False
        files = self._job_files()
        return None if files is None else sha in files

    def discard(self, sha: str) -> None:
        """(Bulk.) The load took ``sha`` from another source: drop it (now or when it comes)."""
        with self._bulk_cond:
            self._unwanted.add(sha)
            self._release(sha)

    def _release(self, sha: str) -> None:
        """Forget a received chunk's bytes (lock held); its lane may receive more."""
        held = self._bulk.pop(sha, None)
        lane = self._owner.pop(sha, None)
        if lane is not None and held is not None:
            self._lane_held[lane] -= len(held)
            self._bulk_cond.notify_all()

    def has(self, sha: str) -> bool:
        """(Bulk.) Whether ``sha`` arrived and is in hand."""
        with self._bulk_cond:
            return sha in self._bulk

    def resolved(self, sha: str) -> bool:
        """(Bulk.) Whether :meth:`get` of ``sha`` returns at once (arrived, lacking, or the
        stream ended)."""
        with self._bulk_cond:
            return sha not in self._pending

    def listen(self, callback: Callable[[], None], stop_at: Callable[[str], bool] | None = None) -> None:
        """(Bulk.) ``callback()`` after each arrival and at the stream's end; a lane stops
        before a chunk ``stop_at`` names (the store's end of a two-ended read has it and every
        chunk after it)."""
        self._listener = callback
        self._stop_at = stop_at

    def cancel(self) -> None:
        """(Bulk.) The load is done: stop the stream (its agent stops pulling from the peer)
        and the lanes."""
        with self._bulk_cond:
            self._cancelled = True
            lanes = list(self._lanes)
            self._bulk.clear()
            self._bulk_cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        for sock in lanes:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a receive in progress)
            except OSError:
                pass

    def prefetch(self, wanted: Mapping[str, int]) -> None:
        """(The peer source only.) Every chunk a load will read, asked for at once on one
        GetChunks stream through this rank's agent, which fetches what it lacks from its peer
        on parallel streams and keeps it in its shared memory: the bytes cross the network
        once, in bulk, and the rank reads them there (or, from an agent without shared memory,
        receives them on the stream). The stream is read on a thread of its own while the
        load goes on: :meth:`get` of a chunk still on its way waits for it (fetching overlaps
        the reader's hashing and copying), as long as the stream brought a chunk within
        ``GET_TIMEOUT_S``. A chunk the stream said it lacks, or never brought
        (the stream broke), is a miss; an agent without GetChunks (an older one) leaves
        :meth:`get` asking chunk by chunk."""
        if not self._via_peer or self._gone or not wanted:
            return
        with self._bulk_cond:
            self._pending = set(wanted)
            self._bulk_asked = True
            self._arrived = time.monotonic()
        threading.Thread(target=self._pull, args=(list(wanted),), name="memory-prefetch", daemon=True).start()

    def _pull(self, shas: list[str]) -> None:
        query = worker_pb2.ChunksQuery(job_id=self._job_id, sha256=shas, via_peer=True, local_path=True, lanes=True)
        try:
            self._call = self._stub.GetChunks(query, timeout=STREAM_TIMEOUT_S)
            if self._cancelled:
                self._call.cancel()
            for reply in self._call:
                if reply.HasField("lane"):  # the peer's chunks on a lane its agent opened: read here
                    with self._bulk_cond:
                        self._lane_owned.update(reply.lane.sha256)
                        lane_id = len(self._lane_held)
                        self._lane_held[lane_id] = 0
                    threading.Thread(
                        target=self._read_lane, args=(reply.lane, lane_id), name="memory-lane", daemon=True
                    ).start()
                    continue
                with self._bulk_cond:
                    if reply.found:
                        self._bulk[reply.sha256] = reply.path or reply.data
                    self._pending.discard(reply.sha256)
                    self._arrived = time.monotonic()
                    self._bulk_cond.notify_all()
                if self._listener is not None:
                    self._listener()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                with self._bulk_cond:
                    self._bulk_asked = False  # an older agent: chunk by chunk
            elif not self._cancelled:
                log.warning("memory_copy_source_failed", source=self.name, code=e.code().name)
        finally:
            with self._bulk_cond:
                self._pending &= self._lane_owned  # (what lanes still bring stays pending)
                self._bulk_cond.notify_all()
            if self._listener is not None:
                self._listener()

    def _read_lane(self, lane: worker_pb2.BulkLane, lane_id: int) -> None:
        """The chunks of one bulk lane, received straight into buffers of this process (the
        kernel's copy is the only one) and kept until the load takes them, at most
        ``LANE_BUFFER_BYTES`` ahead of it. A lane that breaks (the peer went away) leaves
        the rest missing: the next source reads them."""
        shas = list(lane.sha256)
        try:
            sock = bulk_lane.take(lane.handoff, lane.token)
            with sock:
                with self._bulk_cond:
                    if self._cancelled:
                        return
                    self._lanes.append(sock)
                for _ in shas:
                    i, n = bulk_lane.read_header(sock)
                    sha = shas[i]
                    if self._stop_at is not None and self._stop_at(sha):
                        return  # the store's end has this chunk and the rest of this lane's
                    if n != bulk_lane.GONE:
                        with self._bulk_cond:  # the load is far behind: wait (the peer waits in turn)
                            while self._lane_held[lane_id] >= LANE_BUFFER_BYTES and not self._cancelled:
                                self._bulk_cond.wait(1.0)
                                self._arrived = time.monotonic()  # (not a stall of the peer's)
                        buf = bytearray(n)
                        bulk_lane.recv_into_all(sock, memoryview(buf))
                    with self._bulk_cond:
                        if self._cancelled:
                            return
                        if n != bulk_lane.GONE and sha not in self._unwanted:
                            self._bulk[sha] = buf
                            self._owner[sha] = lane_id
                            self._lane_held[lane_id] += n
                        self._pending.discard(sha)
                        self._arrived = time.monotonic()
                        self._bulk_cond.notify_all()
                    if self._listener is not None:
                        self._listener()
        except OSError as e:  # (socket.timeout included: a peer that stalls)
            if not self._cancelled:
                log.warning("memory_copy_source_failed", source=self.name, code=f"lane {type(e).__name__}")
        finally:
            with self._bulk_cond:
                self._pending.difference_update(shas)
                self._lane_owned.difference_update(shas)
                self._bulk_cond.notify_all()
            if self._listener is not None:
                self._listener()

    def _from_bulk(self, sha: str) -> tuple[bool, str | bytes | None]:
        """(asked for in bulk, what came, None: a miss); waits while ``sha`` is on its way."""
        with self._bulk_cond:
            while sha in self._pending:
                self._bulk_cond.wait(1.0)
                if sha in self._pending and time.monotonic() - self._arrived > GET_TIMEOUT_S:
                    # Nothing came for a while (a peer that hangs): the rest of this load is
                    # read from the next source; what is still on its way is not waited for.
                    log.warning("memory_copy_source_failed", source=self.name, code="STALLED")
                    self._pending = set()
            if not self._bulk_asked:
                return False, None
            held = self._bulk.get(sha)
            if held is not None and not isinstance(held, str):
                self._release(sha)  # (bytes are held once: a second read of it is a miss)
            return True, held

    def get(self, sha: str, nbytes: int) -> bytes | None:
        if self._gone:
            return None
        if self._bulk_asked:  # asked for in bulk: no RPC now
            bulk, held = self._from_bulk(sha)
            if bulk:
                return self._taken(held)
        files = self._job_files()
        if self._gone:
            return None
        if files is not None:  # one look-up for the whole load: no RPC per chunk
            path = files.get(sha)
            data = None
            if path is not None:
                try:
                    with open(path, "rb") as f:  # the agent's shared memory, read-only
                        data = f.read()
                except OSError:  # freed since (a newer save): a miss
                    pass
            if data is None:
                self.misses += 1
                return None
            self.bytes += len(data)
            return data
        query = worker_pb2.ChunkQuery(  # (its own agent is on this node: a file there may be named)
            job_id=self._job_id, sha256=sha, nbytes=nbytes, via_peer=self._via_peer, local_path=True
        )
        try:
            reply = self._stub.GetChunk(query, timeout=GET_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() in _GONE:
                self._gone = True
            log.warning("memory_copy_source_failed", source=self.name, code=e.code().name)
            return None
        data: bytes | None = reply.data
        if reply.found and reply.path:
            try:
                with open(reply.path, "rb") as f:  # the agent's shared memory, read-only
                    data = f.read()
            except OSError:  # freed since (a newer save), or not readable: a miss
                data = None
        if not reply.found or data is None:
            self.misses += 1
            return None
        self.bytes += len(data)
        return data

    def _taken(self, held: str | bytes | bytearray | None) -> bytes | None:
        """A prefetched chunk: its bytes (a lane's buffer as it is), read from its
        shared-memory file when named so."""
        data: Any = held if isinstance(held, (bytes, bytearray)) else None
        if isinstance(held, str):
            try:
                with open(held, "rb") as f:  # the agent's shared memory, read-only
                    data = f.read()
            except OSError:  # freed since (a newer save): a miss
                data = None
        if data is None:
            self.misses += 1
            return None
        self.bytes += len(data)
        return data

    def _job_files(self) -> dict[str, str] | None:
        """The agent's shared-memory files of this job, asked once per source (a source
        serves one load); None for the peer source or an agent without shared memory (then
        each chunk is asked for)."""
        if self._via_peer:
            return None
        with self._files_lock:
            if not self._asked:
                self._asked = True
                try:
                    reply = self._stub.HeldChunks(
                        worker_pb2.HeldQuery(job_id=self._job_id, job_files=True), timeout=HELD_TIMEOUT_S
                    )
                    if reply.files:
                        self._files = dict(zip(reply.sha256, reply.path, strict=True))
                except grpc.RpcError as e:
                    if e.code() in _GONE:
                        self._gone = True
                    log.warning("memory_copy_source_failed", source=self.name, code=e.code().name)
            return self._files


class CountedSource:
    """Counts the bytes another source returned (the store's files, for the load's log)."""

    def __init__(self, source: Any):
        self.name = source.name
        self._source = source
        self.bytes = 0

    def get(self, sha: str, nbytes: int) -> bytes | None:
        data = self._source.get(sha, nbytes)
        if data is not None:
            self.bytes += len(data)
        return data


class MemoryCopyClient:
    """The rank's L5 relay's link to its own node agent's ``MemoryCopyService``.

    Args:
        agent_address: the node agent's address (the rank's session address).
        job_id, rank: whose copies these are.
        report: publishes an event of L5-1 (the relay's emitter): ``MemoryCopySkipped``.
            None: logged only.
        room: the room a write at a path has (``free_space.room``; tests pass their own).
    """

    def __init__(
        self,
        agent_address: str,
        job_id: str,
        rank: int,
        report: Callable[[Any], None] | None = None,
        room: Callable[[str], free_space.Room | None] = free_space.room,
    ):
        self._channel = channel(agent_address, module=Module.L5_CHECKPOINT_MANAGER)
        self._stub = worker_pb2_grpc.MemoryCopyServiceStub(self._channel)
        self._job_id, self._rank = job_id, rank
        self._report = report
        self._room = room
        self._off = False
        self._save: _Save | None = None

    def begin(self, step: int, expected_bytes: int = 0) -> Callable[[str, memoryview | bytes], None] | None:
        """The sink for the save of ``step`` (None: no copy this time). Call :meth:`end`
        when the save's write is done. ``expected_bytes``: the size of this rank's part of
        the save (0: unknown, not checked); a shared-memory target with less room skips the
        copy (``MemoryCopySkipped``)."""
        if self._off:
            return None
        previous = self._save
        if previous is not None and previous.thread.is_alive():
            previous.thread.join(PREVIOUS_STREAM_WAIT_S)  # (its write is done: the relay settled it)
            if previous.thread.is_alive():  # the agent is behind: this save gets no copy
                log.warning("memory_copy_skipped", step=step, reason="the previous copy is still being stored")
                return None
        self._save = None
        try:
            held = self._stub.HeldChunks(
                worker_pb2.HeldQuery(job_id=self._job_id, rank=self._rank), timeout=HELD_TIMEOUT_S
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._off = True
                log.info("memory_copy_off", reason="the node agent keeps no memory copies")
            else:
                log.warning("memory_copy_skipped", step=step, code=e.code().name)
            return None
        if held.staging and expected_bytes > 0 and not self._fits(step, held.staging, expected_bytes):
            return None
        self._save = _Save(self._stub, self._job_id, self._rank, step, set(held.sha256), held.staging)
        return self._save.sink

    def _fits(self, step: int, staging: str, expected_bytes: int) -> bool:
        """Whether the copy of ``expected_bytes`` fits the room at ``staging``; if not, say
        so (log and ``MemoryCopySkipped``). Unknown room: it is tried (a full tmpfs still
        fails the write, caught in the sink). Never raises."""
        room = self._room(staging)
        if room is None or room.bytes >= expected_bytes:
            return True
        log.warning(
            "memory_copy_skipped", step=step, reason="not enough room", needed_bytes=expected_bytes,
            room=room.describe(),
        )  # fmt: skip
        if self._report is not None:
            try:
                self._report(
                    store_pb2.MemoryCopySkipped(
                        job_id=self._job_id,
                        rank=self._rank,
                        step=step,
                        write_error=route_pb2.WRITE_NO_SPACE,
                        needed_bytes=expected_bytes,
                        free_bytes=room.bytes,
                        path=staging,
                    )  # fmt: skip
                )
            except Exception as e:  # noqa: BLE001 - a report must not fail the save it is about
                log.error("memory_copy_skipped_not_reported", error=f"{type(e).__name__}: {e}")
        return False

    def end(self, ok: bool) -> None:
        """The save's write is done (``ok``) or failed: close its stream. Never raises."""
        save = self._save
        if save is not None:
            save.finish(ok)

    def wait(self, timeout: float = PREVIOUS_STREAM_WAIT_S) -> worker_pb2.ChunksKept | None:
        """Wait for the last save's stream to be stored (tests, benches); its reply."""
        save = self._save
        if save is None:
            return None
        save.thread.join(timeout)
        return save.kept

    def sources(self) -> list[AgentSource]:
        """The reader's memory sources, in order: this agent's memory, then its peer's."""
        if self._off:
            return []
        return [
            AgentSource(self._stub, self._job_id, "memory", via_peer=False),
            AgentSource(self._stub, self._job_id, "peer", via_peer=True),
        ]

    def close(self) -> None:
        save = self._save
        if save is not None and save.thread.is_alive():
            save.thread.join(5.0)
        self._channel.close()
