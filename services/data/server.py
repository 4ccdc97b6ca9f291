"""The gRPC face of the data service: relays RPCs into the contract bus, nothing more.

``DataServicer.Mount``/``List``/``Delete`` are the operator's commands to L4-1 (sent as
EXT_USER). ``DataServicer.Stream`` hands each stream to a fresh :class:`StreamRelay`: a
rank's stream is its own pipeline (its position, filter tally and open token file belong to
it), so the composition root builds one bus with one set of L4 modules per stream
(``__main__``); what is heavy (the sample index, the banned-token scan) is built once on
disk and shared by every stream of the same settings (``sample_index.py``).

The relay stands in for the remote training loop (L2-1) inside this process, the way the
design's "a process's own relay carries them" reads: it holds L2-1's command ports to the
five L4 modules, pushes the commands ``OpenStream`` carries, once, and receives L2-1's
events (``MicroBatch``, ``FilterReport``, ``DataExhausted``). The only decision it takes is
the one the loop wrote into the request: ``repeat`` (open the next epoch when one ends).
A stream that resumes (``OpenStream.start``, from a checkpoint: epoch and row) carries its
start down in ``PackerConfig.start``; the packer seeks to that row of the epoch's sample
index. The packer's row order follows the shuffle plan: ``PackerConfig.shuffle``/``seed``
are filled from ``OpenStream.shuffle``.

Pull, not push: the relay opens the stream (:meth:`StreamRelay.open`: the configs,
``OpenStream``, the first epoch's plan), then asks the packer for batches on demand
(:meth:`StreamRelay.next_batches`: ``AssembleBatches{count}``), each call a short piece of
work. The servicer runs on ``grpc.aio``: a stream is an async generator that holds no
thread; its pipeline's pieces of work run on one bounded executor shared by every stream
(and by Mount/List/Delete), with a small read-ahead (the next piece is assembled while the
last is sent; gRPC's flow control holds the generator when the rank reads slower, and a
shared pipeline waits for its slowest stream). A stream message carries what the pipeline
holds for the stream, up to the rank's ``OpenStream.batches_per_message``, the later batches
in the first one's ``more`` (:func:`together`; it never waits to fill one). A stream hung up by the rank is cancelled:
its generator ends, it detaches, and the last stream of a pipeline closes it.

Errors end the stream with a gRPC status and a one-line message (``STATUS`` below). A send
the route table refused is PERMISSION_DENIED carrying the violation report in its trailing
metadata: this process has no channel up, so the calling rank reports it. The same way, the
failure events the stream's modules sent to L2-1 or an L1 module (ShuffleFailed,
PrefetchFailed, ...) go back with the stream's end, each a ``surge.v1.Routed`` in the
trailing metadata (``surge-routed-bin``): the rank's relay puts them on its bus, and its
session carries those routed to L1 up (services/contract/relay.py). A module that fails on
the data path (SamplesRead, SamplesShuffled, SamplesFiltered) ends the stream at its first
failure: the bus raises its ``ModuleFailed`` up through the stages above it (data, unlike an
event, breaks the stream it feeds), out of the command L2-1's relay sent, as a command's failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor

import grpc
from prometheus_client import Counter

from services.contract import data_pb2, data_pb2_grpc
from services.contract.audit import VIOLATION_METADATA, violation_event
from services.contract.bus import BoundaryViolation, CommandPort
from services.contract.failures import ModuleFailed, cause_metadata
from services.contract.relay import Outbox, routed_trailers
from services.data import blend, sample_index
from services.data.batch_packer import format_refused
from services.data.errors import (
    DataReadError,
    DatasetCorrupt,
    DatasetInUse,
    DatasetNotFound,
    InvalidConfig,
    NoDocuments,
    VersionConflict,
)
from services.data.mixture import MixtureStream
from services.data.mixture import format_refused as mixture_format_refused
from services.data.stream_share import JOIN_GRACE_S, KEEP_HEAD, PipelineRegistry

# The data service's throughput (its /metrics), by dataset name (a mixture: its components'
# names joined by "+"): micro-batches and their non-padding tokens sent to ranks.
BATCHES = Counter("surge_data_batches_total", "Micro-batches the data service sent to ranks, by dataset.", ["dataset"])
TOKENS = Counter(
    "surge_data_tokens_total", "Non-padding tokens of the micro-batches sent to ranks, by dataset.", ["dataset"]
)

STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (DatasetNotFound, grpc.StatusCode.NOT_FOUND),
    (DatasetCorrupt, grpc.StatusCode.FAILED_PRECONDITION),
    (DatasetInUse, grpc.StatusCode.FAILED_PRECONDITION),
    (VersionConflict, grpc.StatusCode.ALREADY_EXISTS),
    (InvalidConfig, grpc.StatusCode.INVALID_ARGUMENT),
    (NoDocuments, grpc.StatusCode.OUT_OF_RANGE),
    (DataReadError, grpc.StatusCode.DATA_LOSS),
    (OSError, grpc.StatusCode.DATA_LOSS),
    (BoundaryViolation, grpc.StatusCode.PERMISSION_DENIED),
]


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC code and one-line message for an error raised in the pipeline (a module that
    failed: the error its handler raised; its failure event is already published)."""
    if isinstance(error, ModuleFailed):
        error = error.error
    for kind, code in STATUS:
        if isinstance(error, kind):
            return code, _one_line(str(error))
    return grpc.StatusCode.INTERNAL, _one_line(f"data service: {type(error).__name__}: {error}")


def together(piece: list[data_pb2.MicroBatch]) -> data_pb2.MicroBatch:
    """One stream message for ``piece`` (consecutive batches of a stream, in order): the first
    batch carrying the others in ``more``. A copy when there are several: the pipeline's
    batches are shared by its consumers and stay as they are."""
    if len(piece) == 1:
        return piece[0]
    head = data_pb2.MicroBatch()
    head.CopyFrom(piece[0])
    head.more.extend(piece[1:])
    return head


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "data service error"


class StreamRelay:
    """L2-1's side of one stream. Build with the composition root; :meth:`open` once, then
    :meth:`next_batches` until it returns nothing (or :meth:`batches` for both), then
    :meth:`close`. Not thread-safe: one piece of work at a time (the servicer awaits each)."""

    def __init__(
        self,
        *,
        open_stream: CommandPort,
        set_prefetch: CommandPort,
        shuffle_plan: CommandPort,
        filter_rules: CommandPort,
        packer_config: CommandPort,
        assemble_batches: CommandPort,
        close: Callable[[], None],
        component: Callable[[], StreamRelay] | None = None,
        routed: Outbox | None = None,
    ):
        self._open_stream = open_stream
        self._set_prefetch = set_prefetch
        self._shuffle_plan = shuffle_plan
        self._filter_rules = filter_rules
        self._packer_config = packer_config
        self._assemble = assemble_batches
        self._close = close
        # A mixture's component streams (mixture.py): each its own pipeline, built on demand.
        self._component = component
        self._mixture: MixtureStream | None = None
        self._closed = False
        self._req: data_pb2.OpenStream | None = None
        self._epoch = 0
        self._epoch_start_row = 0
        # Rows of the global stream this stream has passed (dealt or skipped), and of them
        # those in the epochs before the current one: the stream's own position (``position``).
        self._consumed = 0
        self._before_epoch = 0
        self._last_next: tuple[int, data_pb2.DataPosition] | None = None  # (_consumed, the last batch's next)
        self._done = False
        self._report = data_pb2.FilterReport()
        self._exhausted: data_pb2.DataExhausted | None = None
        self._got: list[data_pb2.MicroBatch] = []
        # Failure events of the stream's modules for the rank's side (the composition root's
        # link puts them here); they go back with the stream's end.
        self.routed = routed if routed is not None else Outbox()
        self.ready: data_pb2.DatasetReady | None = None
        self.batches_sent = 0
        self.tokens_sent = 0

    # ---- events addressed to L2-1 (subscribed by the composition root) -----------------

    def on_micro_batch(self, msg: data_pb2.MicroBatch, payload: object = None) -> None:
        msg.filter.CopyFrom(self._report)
        self._got.append(msg)

    def on_filter_report(self, msg: data_pb2.FilterReport, payload: object = None) -> None:
        self._report = msg

    def on_data_exhausted(self, msg: data_pb2.DataExhausted, payload: object = None) -> None:
        self._exhausted = msg

    # ---- the stream -------------------------------------------------------------------

    @property
    def report(self) -> data_pb2.FilterReport:
        """The filter's tally so far (cumulative)."""
        return self._report

    @property
    def position(self) -> data_pb2.DataPosition:
        """Where the global stream continues after the rows passed so far (dealt or skipped):
        (epoch, row of its row order), as a checkpoint would resume it."""
        if self._last_next is not None and self._last_next[0] == self._consumed:
            return self._last_next[1]  # the packer's own word (after an epoch's last row: (epoch + 1, 0))
        row = self._epoch_start_row + self._consumed - self._before_epoch
        return data_pb2.DataPosition(epoch=self._epoch, row=row, format=sample_index.FORMAT)

    def open(self, req: data_pb2.OpenStream) -> None:
        """Push the configs ``req`` carries, open the stream and plan its first epoch; a
        mixture (``req.mixture``) opens its components instead (mixture.py).

        Raises:
            DataError subclasses, ValueError: the stream cannot open (see ``STATUS``).
        """
        if req.mixture:
            if self._component is None:
                raise InvalidConfig("open_stream.mixture: this data service builds no component streams")
            self._req = req
            self._mixture = MixtureStream(req, self._component)
            self._mixture.open()
            return
        start = req.start if req.HasField("start") else data_pb2.DataPosition(epoch=req.shuffle.epoch)
        if req.HasField("start") and req.shuffle.epoch not in (0, start.epoch):
            raise InvalidConfig(
                f"open_stream: start.epoch {start.epoch} differs from shuffle.epoch {req.shuffle.epoch}"
            )
        # OpenStream.start is where the stream resumes; the config that carries it down
        # (PackerConfig.start) is filled from it here. Positions are (epoch, row).
        if start.document or start.offset or req.shuffle.start_document:
            raise InvalidConfig(
                f"open_stream: start {start.epoch}/{start.document}/{start.offset} "
                f"(shuffle.start_document {req.shuffle.start_document}) is a position by document; "
                "a position is (epoch, row)"
            )
        if start.format == blend.FORMAT:
            raise InvalidConfig(mixture_format_refused("open_stream.start", start.format, sample_index.FORMAT))
        if start.format not in sample_index.COMPATIBLE:
            raise InvalidConfig(format_refused("open_stream.start", start.format))
        if req.packer.HasField("start") and req.packer.start != start:
            raise InvalidConfig("open_stream: packer.start differs from start")
        self._req = req
        self._set_prefetch(req.prefetch)
        self._filter_rules(req.filter)
        packer = data_pb2.PackerConfig()
        packer.CopyFrom(req.packer)
        packer.start.CopyFrom(start)  # the batch after the checkpoint's comes first
        packer.repeat = req.repeat  # a single pass pads its last round (batch_packer.py)
        packer.shuffle, packer.seed = req.shuffle.enabled, req.shuffle.seed  # the row order
        self._packer_config(packer)
        self.ready = self._open_stream(req).message
        self._plan(start.epoch, int(start.row))

    def next_batches(self, count: int, skip: int = 0) -> list[data_pb2.MicroBatch]:
        """Up to ``count`` more micro-batches, after passing over ``skip`` rows of the global
        stream (a mixture's component: no token of them read); none when the stream has
        ended (the data ended with ``repeat`` false, or ``max_batches`` were sent).

        Raises:
            DataError subclasses, ValueError: the stream cannot go on (see ``STATUS``).
        """
        req = self._req
        if req is None:
            raise RuntimeError("stream relay: next_batches before open")
        if self._mixture is not None:
            got = self._mixture.next_batches(count)
            self.batches_sent, self.tokens_sent = self._mixture.batches_sent, self._mixture.tokens_sent
            return got
        if req.max_batches:
            count = min(count, req.max_batches - self.batches_sent)
        skipping = skip > 0
        self._consumed += skip
        while not self._done and (count > 0 or skipping):
            self._got, self._exhausted = [], None
            self._assemble(data_pb2.AssembleBatches(count=max(count, 0), skip=skip))
            skip = 0  # the packer holds what is left of it across the epoch's end
            got, exhausted = self._got, self._exhausted
            self._got = []
            if exhausted is None:
                skipping = False  # (the packer passes over the rows before it deals any)
                if not got and count <= 0:
                    return []
            if not got and exhausted is None:  # (the packer owes one or the other)
                raise RuntimeError("stream relay: AssembleBatches gave neither a batch nor the epoch's end")
            if exhausted is not None:
                # An endless stream that cannot yield would cycle through empty epochs
                # forever; a single pass (eval) with nothing in it just ends: that is its
                # true answer. (An epoch shorter than a round of the deal is no fault.)
                if req.repeat and exhausted.rows == 0 and self._epoch_start_row == 0:
                    raise NoDocuments(
                        f"dataset {req.mount.name}@{req.mount.version}: split {req.split}: no document "
                        f"left after filtering in epoch {self._epoch}"
                    )
                self._before_epoch += exhausted.rows
                if req.repeat:
                    self._plan(exhausted.position.epoch, 0)
                else:
                    self._done = True
            if got:
                self._consumed += len(got) * req.packer.micro_batch_size * max(req.packer.world_size, 1)
                self._last_next = (self._consumed, got[-1].next)
                self.batches_sent += len(got)
                self.tokens_sent += sum(b.tokens for b in got)
                if req.max_batches and self.batches_sent >= req.max_batches:
                    self._done = True
                return got
        return []

    def batches(self, req: data_pb2.OpenStream, read_ahead: int = 4) -> Iterator[data_pb2.MicroBatch]:
        """The whole stream on the calling thread (in-process use and tests): open, pull,
        close when the consumer stops."""
        try:
            self.open(req)
            while batch := self.next_batches(read_ahead):
                yield from batch
        finally:
            self.close()

    def close(self) -> None:
        """Free the stream's pipeline (its open token file). More than once is harmless."""
        if not self._closed:
            self._closed = True
            if self._mixture is not None:
                self._mixture.close()
            self._close()

    def _plan(self, epoch: int, start_row: int) -> None:
        self._epoch, self._epoch_start_row = epoch, start_row
        plan = data_pb2.ShufflePlan()
        plan.CopyFrom(self._req.shuffle)
        plan.epoch = epoch
        self._shuffle_plan(plan)


class DataServicer(data_pb2_grpc.DataServiceServicer):
    """Relays the four RPCs on a ``grpc.aio`` server; see the module docstring.

    ``executor``: where the bus work runs (bounded, shared by every stream and call).
    ``read_ahead``: micro-batches a pipeline assembles per piece of work; one piece is
    assembled while the previous one is sent, so at most ``window`` (default
    ``2 * read_ahead``) wait per pipeline ahead of its slowest stream, however many share
    it; ``keep_head``/``join_grace_s``: a new pipeline's head kept for peers that open a
    little later (``stream_share.py``).
    """

    def __init__(
        self,
        *,
        mount: CommandPort,
        list_datasets: CommandPort,
        new_stream: Callable[[], StreamRelay],
        log,
        executor: Executor,
        delete: CommandPort | None = None,
        read_ahead: int = 4,
        window: int = 0,
        keep_head: int = KEEP_HEAD,
        join_grace_s: float = JOIN_GRACE_S,
    ):
        self._mount = mount
        self._list = list_datasets
        self._log = log
        self._executor = executor
        self._delete = delete
        # (name, version) -> streams open now: a version being read is not deleted. The
        # lock is held across a delete, so no stream opens on a version while it goes.
        self._reading: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reading_lock = threading.Lock()
        self.streams_open = 0
        self._pipelines = PipelineRegistry(
            new_stream=new_stream,
            executor=executor,
            read_ahead=read_ahead,
            log=log,
            window=window,
            keep_head=keep_head,
            join_grace_s=join_grace_s,
        )

    @property
    def pipelines_built(self) -> int:
        """Stream pipelines (StreamRelays) built so far: one per set of streams sharing one."""
        return self._pipelines.pipelines_built

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def Delete(self, request: data_pb2.DeleteDataset, context) -> data_pb2.DatasetDeleted:
        """Remove one prepared version (L4-1), told how many streams read it now."""
        if self._delete is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "data: Delete is not served here")

        def delete() -> data_pb2.DatasetDeleted:
            with self._reading_lock:
                return self._delete(request, self._reading[(request.name, request.version)]).message

        try:
            done = await self._run(delete)
        except Exception as e:
            await self._abort(context, e, "delete", dataset=f"{request.name}@{request.version}")
        self._log.info("dataset deleted", dataset=f"{done.name}@{done.version}", bytes_freed=done.bytes_freed)
        return done

    async def Mount(self, request: data_pb2.MountDataset, context) -> data_pb2.DatasetReady:
        try:
            ready = (await self._run(self._mount, request)).message
        except Exception as e:
            await self._abort(context, e, "mount", dataset=f"{request.name}@{request.version}")
        self._log.info(
            "mounted",
            dataset=f"{ready.name}@{ready.version}",
            verify=request.verify,
            manifest=ready.manifest_sha256[:12],
        )
        return ready

    async def List(self, request: data_pb2.DatasetQuery, context) -> data_pb2.DatasetList:
        try:
            return (await self._run(self._list, request)).message
        except Exception as e:
            await self._abort(context, e, "list")

    async def Stream(self, request: data_pb2.OpenStream, context) -> AsyncIterator[data_pb2.MicroBatch]:
        where = dict(
            dataset=f"{request.mount.name}@{request.mount.version}",
            split=request.split,
            rank=request.packer.rank,
            world_size=request.packer.world_size,
        )
        key = (request.mount.name, request.mount.version)
        with self._reading_lock:
            self._reading[key] += 1
        self.streams_open += 1
        start = request.start
        # Peers of one replica (byte-identical requests) read one pipeline (stream_share.py).
        pipeline = self._pipelines.attach(request)
        self._log.info(
            "stream opened", **where, start=f"{start.epoch}/{start.row}", shared=pipeline.consumers_served > 0
        )
        sent = [0, 0]
        error: Exception | None = None
        # (resolved once per stream: labels() takes the metric's lock and hashes per call)
        dataset = request.mount.name or "+".join(sorted({c.mount.name for c in request.mixture})) or "unknown"
        batches_served, tokens_served = BATCHES.labels(dataset), TOKENS.labels(dataset)
        most = max(1, request.batches_per_message)  # (the rank's ask: several per message, issue 28 item 3)
        try:
            async with contextlib.aclosing(pipeline.consume_together(most)) as pieces:
                async for piece in pieces:
                    yield together(piece)
                    tokens = sum(b.tokens for b in piece)
                    sent[0] += len(piece)
                    sent[1] += tokens
                    batches_served.inc(len(piece))
                    tokens_served.inc(tokens)
        except Exception as e:  # noqa: BLE001 - ends the RPC with its status below
            error = e
        finally:
            # Cancelled (the rank hung up), failed or done: this stream detached (aclosing);
            # the last one to detach closes the pipeline, on the executor, not here.
            with self._reading_lock:
                self._reading[key] -= 1
                if self._reading[key] <= 0:
                    del self._reading[key]
            self.streams_open -= 1
            self._log.info("stream closed", **where, batches=sent[0], tokens=sent[1])
        if error is not None:
            await self._abort(context, error, "stream", routed=pipeline.routed, **where)

    async def _abort(self, context, error: Exception, what: str, routed=(), **where) -> None:
        code, message = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            self._log.error(f"{what} failed", **where, error=f"{type(error).__name__}: {error}", exc_info=error)
        else:
            self._log.warning(f"{what} refused", **where, code=code.name, error=message)
        if isinstance(error, BoundaryViolation):
            event = violation_event(error, "data")
            context.set_trailing_metadata(((VIOLATION_METADATA, event.SerializeToString()),))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        # The typed cause rides along (the rank's relay reads it; never the text), and the
        # failure events the modules sent the rank's side.
        context.set_trailing_metadata((*cause_metadata(error), *routed_trailers(routed)))
        await context.abort(code, message)
