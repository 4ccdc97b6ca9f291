"""The gRPC face of the data service: relays RPCs into the contract bus, nothing more.

``DataServicer.Mount``/``List`` are the operator's commands to L4-1 (sent as EXT_USER).
``DataServicer.Stream`` hands each stream to a fresh :class:`StreamRelay`: a rank's stream
is its own pipeline (its shuffle cursor, filter tally and packer buffer belong to it), so
the composition root builds one bus with one set of L4 modules per stream (``__main__``).

The relay stands in for the remote training loop (L2-1) inside this process, the way the
design's "a process's own relay carries them" reads: it holds L2-1's command ports to the
five L4 modules, pushes the commands ``OpenStream`` carries, once, and receives L2-1's
events (``MicroBatch``, ``FilterReport``, ``DataExhausted``). The only decision it takes is
the one the loop wrote into the request: ``repeat`` (open the next epoch when one ends).
A stream that resumes (``OpenStream.start``, from a checkpoint: epoch and row) carries its
start down in ``PackerConfig.start``: the shuffler emits the whole epoch's order (the packer
needs all of an epoch's documents to cut and order its rows) and the packer skips the rows
dealt before; later epochs start at their beginning. The packer's row order follows the
shuffle plan: ``PackerConfig.shuffle``/``seed`` are filled from ``OpenStream.shuffle``.

Threads: the pipeline runs on one producer thread per stream; batches wait in a bounded
queue, so the pipeline blocks (back-pressure) when the rank consumes slower than it packs.
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

import collections
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from services.contract import data_pb2, data_pb2_grpc
from services.contract.audit import abort_with_violation
from services.contract.bus import BoundaryViolation, CommandPort
from services.contract.failures import ModuleFailed, Unwind, cause_metadata
from services.contract.relay import Outbox, routed_trailers
from services.data.errors import (
    DataReadError,
    DatasetCorrupt,
    DatasetInUse,
    DatasetNotFound,
    InvalidConfig,
    NoDocuments,
    VersionConflict,
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

_END = object()  # the producer finished normally


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC code and one-line message for an error raised in the pipeline (a module that
    failed: the error its handler raised; its failure event is already published)."""
    if isinstance(error, ModuleFailed):
        error = error.error
    for kind, code in STATUS:
        if isinstance(error, kind):
            return code, _one_line(str(error))
    return grpc.StatusCode.INTERNAL, _one_line(f"data service: {type(error).__name__}: {error}")


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "data service error"


class _Cancelled(Unwind):
    """Unwinds the producer thread when the rank went away (never reaches the client)."""


class StreamRelay:
    """L2-1's side of one stream. Build with the composition root; use :meth:`batches` once."""

    def __init__(
        self,
        *,
        open_stream: CommandPort,
        set_prefetch: CommandPort,
        shuffle_plan: CommandPort,
        filter_rules: CommandPort,
        packer_config: CommandPort,
        close: Callable[[], None],
        queue_batches: int = 64,
    ):
        self._open_stream = open_stream
        self._set_prefetch = set_prefetch
        self._shuffle_plan = shuffle_plan
        self._filter_rules = filter_rules
        self._packer_config = packer_config
        self._close = close
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._cancelled = threading.Event()
        self._report = data_pb2.FilterReport()
        self._exhausted: data_pb2.DataExhausted | None = None
        # Failure events of the stream's modules for the rank's side (the composition root's
        # link puts them here); they go back with the stream's end.
        self.routed = Outbox()
        self.ready: data_pb2.DatasetReady | None = None
        self.batches_sent = 0
        self.tokens_sent = 0

    # ---- events addressed to L2-1 (subscribed by the composition root) -----------------

    def on_micro_batch(self, msg: data_pb2.MicroBatch, payload: object = None) -> None:
        msg.filter.CopyFrom(self._report)
        self._put(msg)

    def on_filter_report(self, msg: data_pb2.FilterReport, payload: object = None) -> None:
        self._report = msg

    def on_data_exhausted(self, msg: data_pb2.DataExhausted, payload: object = None) -> None:
        self._exhausted = msg

    # ---- the stream -------------------------------------------------------------------

    def batches(self, req: data_pb2.OpenStream) -> Iterator[data_pb2.MicroBatch]:
        """Micro-batches for ``req`` until the data ends (``repeat`` false), ``max_batches``
        are sent, or the consumer stops iterating.

        Raises:
            DataError subclasses, ValueError: the stream cannot go on (see ``STATUS``).
        """
        producer = threading.Thread(target=self._produce, args=(req,), name="data-stream", daemon=True)
        producer.start()
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self.batches_sent += 1
                self.tokens_sent += item.tokens
                yield item
                if req.max_batches and self.batches_sent >= req.max_batches:
                    return
        finally:
            self.cancel()
            producer.join(timeout=10)
            self._close()

    def cancel(self) -> None:
        """Stop producing (the consumer went away). Safe from any thread, more than once."""
        self._cancelled.set()
        try:
            while True:
                self._queue.get_nowait()  # free a producer blocked on a full queue
        except queue.Empty:
            pass

    # ---- producer thread ----------------------------------------------------------------

    def _produce(self, req: data_pb2.OpenStream) -> None:
        try:
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
            if req.packer.HasField("start") and req.packer.start != start:
                raise InvalidConfig("open_stream: packer.start differs from start")
            self._set_prefetch(req.prefetch)
            self._filter_rules(req.filter)
            packer = data_pb2.PackerConfig()
            packer.CopyFrom(req.packer)
            packer.start.CopyFrom(start)  # the batch after the checkpoint's comes first
            packer.repeat = req.repeat  # a single pass pads its last round (batch_packer.py)
            packer.shuffle, packer.seed = req.shuffle.enabled, req.shuffle.seed  # the row order
            self._packer_config(packer)
            self.ready = self._open_stream(req).message
            epoch, resume = start.epoch, start
            while not self._cancelled.is_set():
                self._exhausted = None
                plan = data_pb2.ShufflePlan()
                plan.CopyFrom(req.shuffle)
                plan.epoch = epoch
                self._shuffle_plan(plan)
                # An endless stream that cannot yield would cycle through empty epochs forever;
                # a single pass (eval) with nothing in it just ends: that is its true answer.
                # (An epoch shorter than a round of the deal is no fault: the next completes it.)
                rows = self._exhausted.rows if self._exhausted is not None else 0
                if req.repeat and rows == 0 and resume.row == 0:
                    raise NoDocuments(
                        f"dataset {req.mount.name}@{req.mount.version}: split {req.split}: no document "
                        f"left after filtering in epoch {epoch}"
                    )
                if not req.repeat or self._exhausted is None:
                    break
                epoch, resume = self._exhausted.position.epoch, self._exhausted.position
            self._put(_END)
        except _Cancelled:
            self._wake_consumer()
        except BaseException as e:  # handed to the consumer, which ends the RPC with a status
            try:
                self._put(e)
            except _Cancelled:
                self._wake_consumer()

    def _put(self, item: object) -> None:
        # Waits while the queue is full; wakes to notice a cancelled stream.
        while True:
            if self._cancelled.is_set():
                raise _Cancelled()
            try:
                self._queue.put(item, timeout=0.25)
                return
            except queue.Full:
                continue

    def _wake_consumer(self) -> None:
        # A consumer blocked on an empty queue must not wait for batches that will not come.
        try:
            self._queue.put_nowait(_END)
        except queue.Full:
            pass  # then it is not blocked: it takes a batch and finds the stream cancelled


class DataServicer(data_pb2_grpc.DataServiceServicer):
    """Relays the three RPCs; see the module docstring."""

    def __init__(
        self,
        *,
        mount: CommandPort,
        list_datasets: CommandPort,
        new_stream: Callable[[], StreamRelay],
        log,
        delete: CommandPort | None = None,
    ):
        self._mount = mount
        self._list = list_datasets
        self._new_stream = new_stream
        self._log = log
        self._delete = delete
        # (name, version) -> streams open now: a version being read is not deleted. The
        # lock is held across a delete, so no stream opens on a version while it goes.
        self._reading: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reading_lock = threading.Lock()

    def Delete(self, request: data_pb2.DeleteDataset, context: grpc.ServicerContext) -> data_pb2.DatasetDeleted:
        """Remove one prepared version (L4-1), told how many streams read it now."""
        if self._delete is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "data: Delete is not served here")
        try:
            with self._reading_lock:
                done = self._delete(request, self._reading[(request.name, request.version)]).message
        except Exception as e:
            self._abort(context, e, "delete", dataset=f"{request.name}@{request.version}")
        self._log.info("dataset deleted", dataset=f"{done.name}@{done.version}", bytes_freed=done.bytes_freed)
        return done

    def Mount(self, request: data_pb2.MountDataset, context: grpc.ServicerContext) -> data_pb2.DatasetReady:
        try:
            ready = self._mount(request).message
        except Exception as e:
            self._abort(context, e, "mount", dataset=f"{request.name}@{request.version}")
        self._log.info(
            "mounted",
            dataset=f"{ready.name}@{ready.version}",
            verify=request.verify,
            manifest=ready.manifest_sha256[:12],
        )
        return ready

    def List(self, request: data_pb2.DatasetQuery, context: grpc.ServicerContext) -> data_pb2.DatasetList:
        try:
            return self._list(request).message
        except Exception as e:
            self._abort(context, e, "list")

    def Stream(self, request: data_pb2.OpenStream, context: grpc.ServicerContext) -> Iterator[data_pb2.MicroBatch]:
        relay = self._new_stream()
        context.add_callback(relay.cancel)  # the rank hung up or the server stops
        where = dict(
            dataset=f"{request.mount.name}@{request.mount.version}",
            split=request.split,
            rank=request.packer.rank,
            world_size=request.packer.world_size,
        )
        start = request.start
        key = (request.mount.name, request.mount.version)
        with self._reading_lock:
            self._reading[key] += 1
        self._log.info("stream opened", **where, start=f"{start.epoch}/{start.row}")
        try:
            yield from relay.batches(request)
        except Exception as e:
            self._abort(context, e, "stream", routed=relay.routed.drain(), **where)
        finally:
            with self._reading_lock:
                self._reading[key] -= 1
                if self._reading[key] <= 0:
                    del self._reading[key]
            self._log.info("stream closed", **where, batches=relay.batches_sent, tokens=relay.tokens_sent)

    def _abort(self, context: grpc.ServicerContext, error: Exception, what: str, routed=(), **where) -> None:
        code, message = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            self._log.exception(f"{what} failed", **where)
        else:
            self._log.warning(f"{what} refused", **where, code=code.name, error=message)
        if isinstance(error, BoundaryViolation):
            abort_with_violation(context, error, "data")
        # The typed cause rides along (the rank's relay reads it; never the text), and the
        # failure events the modules sent the rank's side.
        context.set_trailing_metadata((*cause_metadata(error), *routed_trailers(routed)))
        context.abort(code, message)
