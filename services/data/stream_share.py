"""Streams of byte-identical ``OpenStream`` requests share one pipeline (issue 27, item 2).

The tensor- and pipeline-parallel peers of one data-parallel replica open the same stream:
the loop builds its ``OpenStream`` from the job spec, the replica's dp rank and size and the
data position (``services/engine/training_loop/data_stream.py``, ``_open_stream``), none of which differs
between peers. The batches a stream yields are a pure function of its request and of the
(immutable) dataset version, so identical requests yield identical sequences, and one
pipeline (one :class:`~services.data.server.StreamRelay`: one bus, five L4 modules, one
read of the tokens) can feed them all, as long as each gets the whole sequence from its
start. Here:

- The key is the request's deterministic serialization: "identical" is byte-identical, so
  a field that might change the batches can never be overlooked.
- A pipeline is *joinable* while it still holds its first batch and has not failed; a
  consumer that comes later (the window moved on) opens a pipeline of its own, which
  becomes the one its key finds.
- Each consumer has its own cursor. The pipeline holds the batches from the slowest
  attached consumer's cursor to the newest one assembled: a batch is dropped once every
  attached consumer passed it.
- Back-pressure: the producer assembles its next piece (``read_ahead`` batches) only while
  the slowest attached consumer is fewer than ``window - read_ahead`` batches behind the
  newest, so it waits for the slowest (peers of one replica move in lockstep: they train the
  same step) and holds at most ``window`` batches ahead of it, as one stream's read-ahead did.
- The head of the sequence waits for late peers: for ``join_grace_s`` after a pipeline
  starts, and while its slowest consumer has passed at most ``keep_head`` batches, nothing is
  dropped, so a peer whose stream opens a little later (its rank formed the group a moment
  after, while the first one's rank already read ahead: the loop's inbox, gRPC's buffers)
  still joins. A pipeline holds at most ``keep_head + window`` batches, for that time only.
- A consumer that hangs up detaches; the last one to go closes the pipeline (its work in
  flight ends first, on the executor). ``max_batches`` is part of the request, so every
  consumer of a pipeline has the same and the relay ends the sequence there.
- A failure ends the sequence for every consumer with the same error and the same failure
  events (each rank reports what its own stream brought back, as before).

Everything here runs on the server's asyncio loop (one thread): the registry and the
cursors need no lock; only the relay's pieces of work run on the executor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor, Future

from prometheus_client import Counter

from services.contract import data_pb2

# A new pipeline's head kept for peers opening later: 32 batches (at seq 2048 x 4 rows, 1 MiB),
# 10 s: ranks of one replica open their streams once their group formed, together, but the
# first may read ahead (2 x grad_accum + 2 batches in its loop's inbox, more in gRPC's buffers).
KEEP_HEAD = 32
JOIN_GRACE_S = 10.0

PIPELINES = Counter("surge_data_pipelines_total", "Stream pipelines (StreamRelays) the data service built")
CONSUMERS = Counter(
    "surge_data_pipeline_consumers_total",
    "Streams served by a pipeline, by whether the stream opened it or joined one another stream opened",
    ["joined"],  # "no": it built the pipeline; "yes": it shared a peer's
)


class SharedPipeline:
    """One stream's pipeline and the consumers reading it; see the module docstring.

    ``new_stream`` builds the relay and ``request`` opens it (both on ``executor``);
    ``on_close(pipeline)`` is called once, on the loop, when the last consumer detaches."""

    def __init__(
        self,
        request: data_pb2.OpenStream,
        *,
        new_stream: Callable,
        executor: Executor,
        read_ahead: int,
        window: int,
        keep_head: int = 0,
        join_grace_s: float = 0.0,
        on_close: Callable[[SharedPipeline], None],
    ):
        self.request = request
        self.key = request.SerializeToString(deterministic=True)
        self._new_stream = new_stream
        self._executor = executor
        self._read_ahead = read_ahead
        self._window = max(window, read_ahead)
        self._keep_head = keep_head
        self._grace_ends = time.monotonic() + join_grace_s
        self._on_close = on_close
        self.relay = None
        self._held: collections.deque[data_pb2.MicroBatch] = collections.deque()
        self._first = 0  # the sequence index of _held[0]
        self._cursors: dict[int, int] = {}  # consumer -> index of the next batch it reads
        self._ids = itertools.count()
        self._finished = False  # the sequence ended (or failed): nothing more will be held
        self.error: Exception | None = None
        self.routed: list = []  # the failure events the relay brought back with the error
        self._closing = False
        self._work: Future | None = None  # the relay's piece of work in flight, if any
        self._changed = asyncio.Event()
        self.consumers_served = 0
        self.batches_made = 0
        self.tokens_made = 0
        self._producer = asyncio.get_running_loop().create_task(self._produce())

    @property
    def joinable(self) -> bool:
        """A new consumer would get the whole sequence from its start here."""
        return self._first == 0 and not self._closing and self.error is None

    async def consume(self) -> AsyncIterator[data_pb2.MicroBatch]:
        """Every batch of the sequence, in order, for one consumer; raises the pipeline's
        error after the batches it made before failing. Attaches at once (the caller checked
        :attr:`joinable`); detaches when the generator ends, fails or is closed/cancelled."""
        async with contextlib.aclosing(self.consume_together(1)) as pieces:
            async for piece in pieces:
                yield piece[0]

    async def consume_together(self, most: int) -> AsyncIterator[list[data_pb2.MicroBatch]]:
        """As :meth:`consume`, in pieces of up to ``most`` batches: each piece is what the
        pipeline holds past this consumer's cursor when it is asked (it waits only while
        nothing is held, never to fill a piece: a stream that is slower than its rank sends
        each batch as it comes, as before). The batches are the pipeline's own, shared with
        its other consumers: read them, never change them."""
        me = next(self._ids)
        self._cursors[me] = self._first
        self.consumers_served += 1
        try:
            while True:
                i = self._cursors[me]
                while i >= self._first + len(self._held) and not self._finished:
                    await self._changed.wait()
                if i < self._first + len(self._held):
                    end = min(i + most, self._first + len(self._held))
                    yield [self._held[j - self._first] for j in range(i, end)]
                    self._cursors[me] = end  # gRPC took them: this consumer passed them
                    self._trim()
                    continue
                if self.error is not None:
                    raise self.error
                return
        finally:
            del self._cursors[me]
            self._trim()
            if not self._cursors:
                self._close()

    # ---- the producer -------------------------------------------------------------------

    async def _produce(self) -> None:
        try:
            self.relay = await self._submit(self._new_stream)
            PIPELINES.inc()
            await self._submit(self.relay.open, self.request)
            while True:
                while self._first + len(self._held) - self._slowest() + self._read_ahead > self._window:
                    await self._changed.wait()  # back-pressure: the slowest consumer reads
                batches = await self._submit(self.relay.next_batches, self._read_ahead)
                if not batches:
                    return
                self._held.extend(batches)
                self.batches_made += len(batches)
                self.tokens_made += sum(b.tokens for b in batches)
                self._notify()
        except asyncio.CancelledError:
            raise  # every consumer hung up (_close)
        except Exception as e:  # noqa: BLE001 - every consumer ends with it (server.py's STATUS)
            self.error = e
            self.routed = self.relay.routed.drain() if self.relay is not None else []
        finally:
            self._finished = True
            self._notify()
            self._release()

    def _submit(self, fn: Callable, *args) -> asyncio.Future:
        self._work = self._executor.submit(fn, *args)
        return asyncio.wrap_future(self._work)

    def _release(self) -> None:
        """Close the relay once the piece of work in flight (if any) ended: on the executor,
        never on the loop (closing joins the prefetcher's reads)."""
        work = self._work

        def close(_: object = None) -> None:
            relay = self.relay
            if relay is None and work is not None and not work.cancelled() and work.exception() is None:
                relay = work.result()  # cancelled while it was being built: it is ours to close
            if relay is not None:
                try:
                    self._executor.submit(relay.close)
                except RuntimeError:  # the executor shut down (the service stops): close it here
                    relay.close()

        if work is not None and not work.done():
            work.add_done_callback(close)
        else:
            close()

    # ---- bookkeeping --------------------------------------------------------------------

    def _slowest(self) -> int:
        return min(self._cursors.values()) if self._cursors else self._first

    def _trim(self) -> None:
        """Drop the batches every attached consumer passed (but the head while late peers
        may still join), and wake the producer."""
        if not self._cursors:
            return
        slowest = self._slowest()
        if self._first == 0 and slowest <= self._keep_head and time.monotonic() < self._grace_ends:
            slowest = 0  # (the head is kept: a peer opening now still gets the whole sequence)
        while self._held and self._first < slowest:
            self._held.popleft()
            self._first += 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._held.clear()
        self._producer.cancel()  # (its finally releases the relay; a no-op once it has ended)
        self._on_close(self)


class PipelineRegistry:
    """The joinable pipeline of each request key, on the server's loop.

    ``window``: the most batches a pipeline holds ahead of its slowest stream (default twice
    ``read_ahead``: one piece being sent while the next is assembled); ``keep_head`` and
    ``join_grace_s``: how much of a new pipeline's head is kept, and how long, for peers that
    open a little later (see the module docstring). ``log``: where each pipeline's close is told,
    with how many streams it served."""

    def __init__(
        self,
        *,
        new_stream: Callable,
        executor: Executor,
        read_ahead: int,
        log,
        window: int = 0,
        keep_head: int = KEEP_HEAD,
        join_grace_s: float = JOIN_GRACE_S,
    ):
        self._new_stream = new_stream
        self._executor = executor
        self._read_ahead = read_ahead
        self._window = window or 2 * read_ahead
        self._keep_head = keep_head
        self._join_grace_s = join_grace_s
        self._log = log
        self._joinable: dict[bytes, SharedPipeline] = {}
        self.pipelines_built = 0  # pipelines started (each builds one StreamRelay)
        self.pipelines_open = 0

    def attach(self, request: data_pb2.OpenStream) -> SharedPipeline:
        """The pipeline a stream of ``request`` reads: the joinable one of its key, else a
        new one (which becomes the joinable one). Iterate its :meth:`~SharedPipeline.consume`
        at once (before the next await) to hold it."""
        key = request.SerializeToString(deterministic=True)
        pipeline = self._joinable.get(key)
        if pipeline is not None and pipeline.joinable:
            CONSUMERS.labels(joined="yes").inc()
            return pipeline
        pipeline = SharedPipeline(
            request,
            new_stream=self._new_stream,
            executor=self._executor,
            read_ahead=self._read_ahead,
            window=self._window,
            keep_head=self._keep_head,
            join_grace_s=self._join_grace_s,
            on_close=self._closed,
        )
        self._joinable[key] = pipeline
        self.pipelines_built += 1
        self.pipelines_open += 1
        CONSUMERS.labels(joined="no").inc()
        return pipeline

    def _closed(self, pipeline: SharedPipeline) -> None:
        if self._joinable.get(pipeline.key) is pipeline:
            del self._joinable[pipeline.key]
        self.pipelines_open -= 1
        r = pipeline.request
        self._log.info(
            "stream pipeline closed",
            dataset=f"{r.mount.name}@{r.mount.version}",
            split=r.split,
            rank=r.packer.rank,
            world_size=r.packer.world_size,
            consumers=pipeline.consumers_served,
            batches=pipeline.batches_made,
            tokens=pipeline.tokens_made,
        )
