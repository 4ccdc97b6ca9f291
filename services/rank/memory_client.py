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
  chunk (SHA-256) and falls back to the next source on a mismatch or a miss.

A copy is never needed for correctness: any failure here is logged and the rank goes on (a
save without its memory copy, a load from the store). An agent without the tier
(``UNIMPLEMENTED``: ``SURGE_WORKER_MEMORY_COPY_BYTES=0``) turns it off for the process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.common.grpc_server import channel
from services.contract import Module, worker_pb2, worker_pb2_grpc

HELD_TIMEOUT_S = 5.0
GET_TIMEOUT_S = 10.0
STREAM_TIMEOUT_S = 600.0
QUEUE_BYTES = 256 << 20  # chunks copied but not yet sent; the writer waits beyond this
PREVIOUS_STREAM_WAIT_S = 1.0  # the loop waits for it at a save: never long
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
        self._gone = False
        self._files: dict[str, str] | None = None  # the agent's shared-memory files of the job (local only)
        self._asked = False
        self._files_lock = threading.Lock()
        self.bytes = 0  # returned (verified or not: the reader counts its mismatches)
        self.misses = 0

    def get(self, sha: str, nbytes: int) -> bytes | None:
        if self._gone:
            return None
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
    """

    def __init__(self, agent_address: str, job_id: str, rank: int):
        self._channel = channel(agent_address, module=Module.L5_CHECKPOINT_MANAGER)
        self._stub = worker_pb2_grpc.MemoryCopyServiceStub(self._channel)
        self._job_id, self._rank = job_id, rank
        self._off = False
        self._save: _Save | None = None

    def begin(self, step: int) -> Callable[[str, memoryview | bytes], None] | None:
        """The sink for the save of ``step`` (None: no copy this time). Call :meth:`end`
        when the save's write is done."""
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
        self._save = _Save(self._stub, self._job_id, self._rank, step, set(held.sha256), held.staging)
        return self._save.sink

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
