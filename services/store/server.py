"""The gRPC face of the store: a relay that puts each request on the bus.

The relay is not a module and decides nothing. A request arrives from a module in another
process; the relay sends it on the bus *as that module* (through the command port the
composition root gave it for that sender and receiver), and the bus checks it against the
route table both ways: the command from the sender to L5-1/L5-2, the reply event back.

Who sent it: the module the caller's channel names in ``x-surge-module`` (a
``surge.v1.Module`` name, e.g. ``L1_ORCHESTRATOR``), which the server checked before the
handler ran (``services/common/identity.py``: present, routed to send this request, and
under mutual TLS one its certificate's role may claim); a call without one never gets here.
A sender the route does not allow is refused with PERMISSION_DENIED and counted in
``surge_boundary_violations_total``; the violation report rides in the trailing metadata,
so the caller reports it up (this process has no channel up).

The failure events the store's modules send to the caller's side while serving a call
(SnapshotFailed to L1/L2-1, LogWriteFailed to L1) go back with the call's end, each a
``surge.v1.Routed`` in the trailing metadata (``surge-routed-bin``, services/contract/relay.py):
the calling rank puts them on its bus, its session carries those routed to L1 up; control's
store relay puts them on control's bus.

``WatchCheckpoints`` is a subscription: the relay stands in for the remote L1-1 as the
receiver of L5-1's ``CheckpointCorrupt`` events and fans each one out to the open watch
streams (each with a bounded queue; a watcher that falls 1000 events behind loses the
oldest). ``Record`` takes a node agent's records in batches (``MetricBatch``) and answers
each record with its own ``MetricsAck`` (``seq`` echoed, one ``MetricAcks`` per batch), so
the rank can forget what the store has written; the failure events sent while taking it
(``LogWriteFailed``: a sink failed, the record was written) ride in that ack's ``routed``,
the stream having no trailers until it ends.

``ReadMetrics`` (surgectl plot, samples) streams a job's metric records as L5-2 wrote them:
the relay reads its files (``records``: ``<root>/metrics``) in the bulk pool, whole lines only;
a read for the operator, never a command to L5-2 (which only L2-1 commands).

Per-team access (access.py): with a tokens file the operator's requests (List, Load, Delete,
Verify, Scrub, ReadMetrics) and every write of a job's data (BeginSave, CommitSave, Record's
records, PutCheckpointFiles, HeldCheckpointChunks, PutProfile; GetCheckpointFiles and
WatchCheckpoints as reads) pass the gate before they reach the bus or the files; a refusal is
one line. Each job's team is learned from its writes as they pass (job_teams.py).

The checkpoint data plane (``PutCheckpointFiles``, ``HeldCheckpointChunks``,
``GetCheckpointFiles``: a rank without the store's filesystem streams its save's files here
and reads a version's back; exception checkpoint-bytes-stream) carries bytes, not messages:
the relay hands each stream to L5-1's data-plane methods directly (``files``: the checkpoint
manager, which checks every name, size and digest and decides where the bytes live). Only a
rank's L5 relay may open them (services/common/identity.py PLUMBING_CALLERS).

Threads (issue 27): the relay serves on ``grpc.aio``. A long-lived stream (``Record``,
``WatchCheckpoints``, the data plane's) is an asyncio handler and holds no thread while it
waits; its blocking work (a metric write, a part of a file read or written, a verification's
hashing) runs in one of two bounded pools of the relay's own: ``_records`` (metric writes,
the watch's first answer) and ``_bulk`` (checkpoint bytes, Verify, Scrub). The save's control
calls (BeginSave, CommitSave, Load, List, Delete) are plain handlers, run by the aio server's
own pool, which nothing else uses: however many streams are open or transfers queued, they
never wait behind them. Plain code in a pool thread ends its call through ``_ThreadContext``
(``abort`` raises, the asyncio handler aborts on its loop), so the mapping of errors to
statuses, trailers and typed causes below is one code for both kinds.

Errors become one-line gRPC statuses: INVALID_ARGUMENT (bad job id, version form, empty
record), NOT_FOUND (unknown version), FAILED_PRECONDITION (no open save, verification
failed), PERMISSION_DENIED (route), INTERNAL (I/O failure, with the OS error).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from services.common import metric_select
from services.common.identity import MODULE_METADATA
from services.common.rotated_files import rotated_paths
from services.contract import Module, store_pb2, store_pb2_grpc
from services.contract.audit import abort_with_violation
from services.contract.bus import BoundaryViolation, CommandPort
from services.contract.failures import ModuleFailed, cause_metadata
from services.contract.relay import Outbox, Routed, routed_trailers
from services.store import metric_files, metric_scans
from services.store.access import AccessRefused, StoreAccess
from services.store.checkpoint_manager import (
    CheckpointDamaged,
    CheckpointNotFound,
    CheckpointRejected,
    CheckpointTransferRefused,
)

SENDER_METADATA = MODULE_METADATA  # the caller's module, checked by the server (identity.py)
# Trailing metadata of a Load refused for a damaged version: its StoreFailureCause name.
STORE_CAUSE_METADATA = "surge-store-cause"
_DAMAGE_CAUSE = {store_pb2.VERDICT_CORRUPT: "CORRUPT", store_pb2.VERDICT_MISSING_FILE: "MISSING_FILE"}
CKPT, METRICS = Module.L5_CHECKPOINT_MANAGER, Module.L5_METRICS_LOGGER

WATCH_QUEUE = 1000
# Threads of the relay's two pools (see StoreRelay): the data plane's byte streams and whole-
# store verifications, and the metric writes of every Record stream. The save's control calls
# run in the aio server's own pool (services/store/__main__.py CONTROL_THREADS), never these.
BULK_THREADS = 16
RECORD_THREADS = 4


class StoreRelay(store_pb2_grpc.StoreServiceServicer):
    """Serve it on a ``grpc.aio`` server (``AioServiceServer``): the streams are asyncio
    handlers, the save's control calls plain ones (the server's own pool runs them).

    Args:
    ports: ``(sender, receiver) -> CommandPort`` for every remote sender the route table
        lets command L5-1 or L5-2 (built by the composition root).
    log: a structlog logger.
    check: the bus's route check (``Bus.check``), for a sender that has no port at all:
        the refusal is then counted and reported like any other.
    """

    def __init__(
        self,
        ports: Mapping[tuple[int, int], CommandPort],
        log: Any,
        check: Callable[[int, str, int], None] | None = None,
        files: Any = None,
        profiles: Any = None,
        bulk_threads: int = BULK_THREADS,
        record_threads: int = RECORD_THREADS,
        access: StoreAccess | None = None,
        records: Path | None = None,
    ):
        """``files``: L5-1's data plane (held_chunks, receive_files, send_files); None: the
        data-plane RPCs answer UNIMPLEMENTED. ``bulk_threads``, ``record_threads``: the sizes
        of the two pools the streams' blocking work runs in (bytes and verification; metric
        writes): however many streams are open, that many threads work for them at once.
        ``profiles``: where a PutProfile stream is staged (``ProfileFiles.receive``) before L5-2
        keeps it; None: PutProfile answers UNIMPLEMENTED. ``access``: the per-team gate in
        front of the operator's requests (access.py; None: every caller reaches every job)."""
        self._access = access or StoreAccess()
        # L5-2's records (<root>/metrics: its JSONL files, as it wrote them), read for ReadMetrics.
        self._records_dir = records
        self._chart_scans = metric_scans.ChartScans()
        self._files = files
        self._profiles = profiles
        self._ports = dict(ports)
        self._log = log
        self._check = check
        self._bulk = ThreadPoolExecutor(max_workers=bulk_threads, thread_name_prefix="store-bulk")
        self._records = ThreadPoolExecutor(max_workers=record_threads, thread_name_prefix="store-records")
        self._watch_lock = threading.Lock()
        # Open watch streams: (job id or "" for all, their loop, their queue).
        self._watchers: list[tuple[str, asyncio.AbstractEventLoop, asyncio.Queue]] = []

    def close(self) -> None:
        """Stop the relay's pools (after the server stopped: no call is left to use them)."""
        self._bulk.shutdown(wait=False, cancel_futures=True)
        self._records.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ as the remote L1-1

    def on_checkpoint_corrupt(self, msg: store_pb2.CheckpointCorrupt, payload: Any = None) -> None:
        """L1_ORCHESTRATOR receiver (standing in for control): queue the event on every
        watch stream of its job (or of every job). Any thread: each queue is fed on its loop."""
        self._log.warning(
            "checkpoint_corrupt",
            version=msg.version,
            step=msg.step,
            cause=store_pb2.StoreFailureCause.Name(msg.cause),
            reason=msg.reason,
        )
        with self._watch_lock:
            watchers = [(loop, q) for job, loop, q in self._watchers if not job or job == msg.job_id]
        for loop, q in watchers:
            loop.call_soon_threadsafe(_put_dropping_oldest, q, msg)

    def BeginSave(self, request: store_pb2.SaveCheckpoint, context: grpc.ServicerContext) -> Message:
        self._gate(context, lambda: self._access.check_write("BeginSave", request.job_id))
        return self._relay("BeginSave", CKPT, request, context)

    def CommitSave(self, request: store_pb2.CommitCheckpoint, context: grpc.ServicerContext) -> Message:
        self._gate(context, lambda: self._access.check_write("CommitSave", request.job_id))
        reply = self._relay("CommitSave", CKPT, request, context)
        if self._access.teams is not None:  # the version's spec names the job's team (job_teams.py)
            self._access.teams.learn_from_spec(request.job_id, request.spec_json)
        self._log.info(
            "checkpoint_committed",
            version=reply.version,
            step=reply.step,
            bytes=reply.bytes,
            files=reply.files,
            seconds=round(reply.seconds, 3),
        )
        return reply

    def Load(self, request: store_pb2.LoadCheckpoint, context: grpc.ServicerContext) -> Message:
        self._gate(context, lambda: self._access.check_version("Load", request.version))
        return self._relay("Load", CKPT, request, context)

    def List(self, request: store_pb2.CheckpointQuery, context: grpc.ServicerContext) -> Message:
        if request.job_id:
            self._gate(context, lambda: self._access.check_job("List", request.job_id))
        reply = self._relay("List", CKPT, request, context)
        if request.job_id:
            return reply
        # Every job's: the caller's team's versions only (an admin's and a process's: all).
        kept = self._access.visible("List", reply.checkpoints, lambda info: info.job_id)
        return store_pb2.CheckpointList(checkpoints=kept)

    def Delete(self, request: store_pb2.DeleteCheckpoint, context: grpc.ServicerContext) -> Message:
        self._gate(context, lambda: self._access.check_version("Delete", request.version))
        return self._relay("Delete", CKPT, request, context)

    def RetireSeries(self, request: store_pb2.RetireMetricSeries, context: grpc.ServicerContext) -> Message:
        """L1-1's word that a job ended or its ranks were relaunched: L5-2 retires the job's
        series (a dict walk and a timer each: the control calls' pool runs it)."""
        self._gate(context, lambda: self._access.check_write("RetireSeries", request.job_id))
        return self._relay("RetireSeries", METRICS, request, context)

    def RetireJobCheckpointSeries(
        self, request: store_pb2.RetireCheckpointSeries, context: grpc.ServicerContext
    ) -> Message:
        """L1-1's word that a job ended: L5-1 retires the job's checkpoint series (a walk of
        its series and a timer: the control calls' pool runs it)."""
        self._gate(context, lambda: self._access.check_write("RetireJobCheckpointSeries", request.job_id))
        return self._relay("RetireJobCheckpointSeries", CKPT, request, context)

    async def Verify(self, request: store_pb2.VerifyCheckpoints, context: grpc.aio.ServicerContext) -> Message:
        """Re-hashes versions: in the bulk pool, not the control calls' threads."""
        # (checked here, on the loop: the caller's principal is not carried into the pool's thread)
        await self._here(
            context, lambda call: self._gate(call, lambda: self._access.check_job("Verify", request.job_id))
        )
        reply = await self._blocking(self._bulk, context, functools.partial(self._relay, "Verify", CKPT, request))
        bad = [v.info.version for v in reply.versions if not v.ok]
        self._log.info("checkpoints_verified", job=reply.job_id, versions=len(reply.versions), bad=bad)
        return reply

    async def Scrub(self, request: store_pb2.ScrubCheckpoints, context: grpc.aio.ServicerContext) -> Message:
        """Re-hashes every version: in the bulk pool, not the control calls' threads."""
        check = (
            (lambda: self._access.check_job("Scrub", request.job_id))
            if request.job_id
            else (lambda: self._access.require_admin("Scrub", "a scrub of every job"))
        )
        await self._here(context, lambda call: self._gate(call, check))
        reply = await self._blocking(self._bulk, context, functools.partial(self._relay, "Scrub", CKPT, request))
        self._log.info(
            "checkpoints_scrubbed",
            job=reply.job_id,
            versions=len(reply.versions),
            newly_corrupt=[c.version for c in reply.newly_corrupt],
            seconds=round(reply.seconds, 3),
        )
        return reply

    async def WatchCheckpoints(
        self, request: store_pb2.WatchCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.CheckpointCorrupt]:
        """Every version recorded corrupt now (L5-1's answer to the subscription), then each
        one found from here on, until the caller cancels (which cancels this coroutine: an
        idle watch holds no thread)."""
        check = (
            (lambda: self._access.check_job("WatchCheckpoints", request.job_id))
            if request.job_id
            else (lambda: self._access.require_admin("WatchCheckpoints", "a watch of every job"))
        )
        await self._here(context, lambda call: self._gate(call, check))
        q: asyncio.Queue = asyncio.Queue(maxsize=WATCH_QUEUE)
        entry = (request.job_id, asyncio.get_running_loop(), q)
        with self._watch_lock:
            self._watchers.append(entry)  # before the snapshot: nothing found in between is missed
        try:
            sender = await self._here(context, functools.partial(self._sender, "WatchCheckpoints"))
            now = await self._blocking(
                self._records, context, functools.partial(self._send, sender, CKPT, request, payload_reply=True)
            )
            for found in now:
                yield found
            while True:
                yield await q.get()
        finally:
            with self._watch_lock:
                self._watchers.remove(entry)

    async def Record(
        self, request_iterator: AsyncIterator[store_pb2.MetricBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.MetricAcks]:
        """One MetricAcks per batch, an ack per record in order; the next batch is read once
        this one is written (flow control: a stream that sends faster than L5-2 writes waits
        in gRPC's window). A batch is one hop to the records pool, however many records."""
        sender = await self._here(context, functools.partial(self._sender, "Record"))
        i = 0
        async for batch in request_iterator:
            # (each record's job checked here, on the loop: the caller is not carried into the pool)
            await self._here(context, functools.partial(self._writes, batch))
            yield await self._blocking(self._records, context, functools.partial(self._batch, sender, i, batch))
            i += len(batch.records)

    def _batch(
        self, sender: int, first: int, batch: store_pb2.MetricBatch, context: grpc.ServicerContext
    ) -> store_pb2.MetricAcks:
        return store_pb2.MetricAcks(
            acks=[self._record(sender, first + k, rec, context) for k, rec in enumerate(batch.records)]
        )

    def _writes(self, batch: store_pb2.MetricBatch, context: grpc.ServicerContext) -> None:
        """Each record's job the caller's to write (access.py check_write); else the stream ends."""
        for job in dict.fromkeys(getattr(rec, w).job_id for rec in batch.records if (w := rec.WhichOneof("record"))):
            self._gate(context, functools.partial(self._access.check_write, "Record", job))

    def _record(
        self, sender: int, i: int, rec: store_pb2.MetricRecord, context: grpc.ServicerContext
    ) -> store_pb2.MetricsAck:
        which = rec.WhichOneof("record")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"metric record #{i}: empty (set step or eval)")
        if which == "config" and self._access.teams is not None:  # the loop's first word names its team
            self._access.teams.learn(rec.config.job_id, rec.config.team)
        outbox = Outbox()  # this record's failure events for the rank (a sink that failed)
        token = _CALL.set(outbox)
        try:
            ack = self._send_in_call(sender, METRICS, getattr(rec, which), context, False)
        finally:
            _CALL.reset(token)
        return store_pb2.MetricsAck(records=ack.records, seq=rec.seq, routed=outbox.drain())

    async def ReadMetrics(
        self, request: store_pb2.MetricsQuery, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.MetricsText]:
        """The job's records: ``found``, then its lines in parts (read in the bulk pool, a part
        at a time: flow control holds the reading while the caller is slow); only the ranks
        asked, each rank's step records thinned to ``points`` (metric_select.py: a page asks
        for a chart's points, never a 100,000-step x 64-rank file); such a read resumes the
        last one's scan (metric_scans.py: a live page's reload reads only the new bytes)."""
        if self._records_dir is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "ReadMetrics: this store serves no metric records")
        await self._here(
            context, lambda call: self._gate(call, lambda: self._access.check_job("ReadMetrics", request.job_id))
        )
        if not metric_files.JOB_ID.match(request.job_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f'ReadMetrics: job_id "{request.job_id}": must match {metric_files.JOB_ID.pattern}',
            )
        files = await asyncio.get_running_loop().run_in_executor(
            self._bulk, rotated_paths, self._records_dir / f"{request.job_id}.jsonl"
        )
        yield store_pb2.MetricsText(job_id=request.job_id, found=bool(files))
        sel = metric_select.Selection(request.type, frozenset(request.ranks), request.points)
        loop = asyncio.get_running_loop()
        if sel.points and 0 < len(sel.ranks) <= metric_scans.RANKS_KEPT:  # a chart's read: resumed (metric_scans.py)
            answer = await loop.run_in_executor(self._bulk, self._chart_scans.read, request.job_id, files, sel)
            for text in answer:
                yield store_pb2.MetricsText(job_id=request.job_id, text=text)
            return
        parts = metric_select.select(metric_files.lines(files, request.type), sel)
        while (text := await loop.run_in_executor(self._bulk, next, parts, None)) is not None:
            yield store_pb2.MetricsText(job_id=request.job_id, text=text)

    # ------------------------------------------------------------------ checkpoint data plane

    async def PutCheckpointFiles(
        self, request_iterator: AsyncIterator[store_pb2.CheckpointUpload], context: grpc.aio.ServicerContext
    ) -> store_pb2.CheckpointFilesPut:
        """L5-1 reads the stream in a bulk thread, one part at a time as it writes them
        (each part awaited on the server's loop: gRPC's flow control holds the sender)."""
        loop = asyncio.get_running_loop()
        parts = aiter(request_iterator)
        first = await anext(parts, None)
        if first is None or first.WhichOneof("part") != "header":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "PutCheckpointFiles: the stream must open with a header"
            )
        await self._here(
            context,
            lambda call: self._gate(call, lambda: self._access.check_write("PutCheckpointFiles", first.header.job_id)),
        )

        def files() -> Iterator[store_pb2.CheckpointFileData]:
            while (part := asyncio.run_coroutine_threadsafe(anext(parts, None), loop).result()) is not None:
                if part.WhichOneof("part") != "file":
                    raise CheckpointTransferRefused("PutCheckpointFiles: a second header inside the stream")
                yield part.file

        reply = await self._blocking(
            self._bulk,
            context,
            functools.partial(
                self._data_plane, "PutCheckpointFiles", lambda: self._files.receive_files(first.header, files())
            ),
        )
        self._log.info(
            "checkpoint_files_received",
            job=first.header.job_id,
            step=first.header.step,
            rank=first.header.rank,
            files=reply.files,
            bytes=reply.bytes,
            present=reply.chunks_present,
        )
        return reply

    async def HeldCheckpointChunks(
        self, request: store_pb2.HeldCheckpointChunksQuery, context: grpc.aio.ServicerContext
    ) -> store_pb2.HeldCheckpointChunksReply:
        await self._here(
            context,
            lambda call: self._gate(call, lambda: self._access.check_write("HeldCheckpointChunks", request.job_id)),
        )
        return await self._blocking(
            self._bulk,
            context,
            functools.partial(self._data_plane, "HeldCheckpointChunks", lambda: self._files.held_chunks(request)),
        )

    async def GetCheckpointFiles(
        self, request: store_pb2.CheckpointFilesQuery, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.CheckpointFileData]:
        """Each part read from disk in a bulk thread, sent from the loop (the next is read
        once gRPC took this one)."""
        await self._here(
            context,
            lambda call: self._gate(call, lambda: self._access.check_version("GetCheckpointFiles", request.version)),
        )
        parts = await self._blocking(
            self._bulk,
            context,
            functools.partial(self._data_plane, "GetCheckpointFiles", lambda: self._files.send_files(request)),
        )
        while (
            part := await self._blocking(self._bulk, context, functools.partial(self._next_part, parts))
        ) is not None:
            yield part

    def _next_part(self, parts: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            return next(parts, None)
        except Exception as e:  # noqa: BLE001 - mapped to a status (or raised again) by _abort
            self._abort("GetCheckpointFiles", e, context)

    async def PutProfile(
        self, request_iterator: AsyncIterator[store_pb2.ProfileUpload], context: grpc.aio.ServicerContext
    ) -> store_pb2.ProfileStored:
        """A rank's profile files: staged in a bulk thread as they arrive, then its StoreProfile
        (the stream's header) goes to L5-2 as a routed command with the staged files, so the
        route table decides who may send one, as for every other command."""
        if self._profiles is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "PutProfile: this store keeps no profiles")
        loop = asyncio.get_running_loop()
        parts = aiter(request_iterator)
        first = await anext(parts, None)
        if first is None or not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PutProfile: the stream must open with a header")
        await self._here(
            context, lambda call: self._gate(call, lambda: self._access.check_write("PutProfile", first.header.job_id))
        )

        def rest() -> Iterator[store_pb2.ProfileUpload]:
            while (part := asyncio.run_coroutine_threadsafe(anext(parts, None), loop).result()) is not None:
                yield part

        def store(call: grpc.ServicerContext) -> store_pb2.ProfileStored:
            try:
                staged = self._profiles.receive(first.header, rest())
            except ValueError as e:
                call.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                return self._send(self._sender("PutProfile", call), METRICS, first.header, call, payload=staged)
            finally:
                self._profiles.discard(staged)  # (what L5-2 did not keep: a refusal leaves nothing behind)

        stored = await self._blocking(self._bulk, context, store)
        self._log.info(
            "profile_stored", job=first.header.job_id, rank=first.header.rank, seq=first.header.seq, bytes=stored.bytes
        )
        return stored

    def _data_plane(self, rpc: str, fn: Callable[[], Any], context: grpc.ServicerContext) -> Any:
        """``fn()`` (a data-plane call of L5-1), its errors mapped to statuses as a routed
        call's are (the cause typed in the trailing metadata)."""
        if self._files is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: this store has no checkpoint data plane")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - mapped to a status (or raised again) by _abort
            self._abort(rpc, e, context)

    def _not_found_text(self, e: CheckpointNotFound) -> str:
        """A missing version's words: with per-team access, without the versions of other
        jobs it would name (``bare``: another team's job ids are not the caller's to see)."""
        return getattr(e, "bare", str(e)) if self._access.teams is not None else str(e)

    def _abort(self, rpc: str, e: Exception, context: grpc.ServicerContext) -> None:
        if isinstance(e, CheckpointNotFound):
            context.abort(grpc.StatusCode.NOT_FOUND, self._not_found_text(e))
        if isinstance(e, CheckpointRejected):
            self._log.warning("checkpoint_transfer_refused", request=rpc, error=str(e))
            _trailers(
                context,
                *cause_metadata(e),
                *(((STORE_CAUSE_METADATA, _DAMAGE_CAUSE[e.cause]),) if isinstance(e, CheckpointDamaged) else ()),
            )
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if isinstance(e, ValueError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if isinstance(e, OSError):
            self._log.error("store_io_failed", request=rpc, error=str(e))
            _trailers(context, *cause_metadata(e))
            context.abort(grpc.StatusCode.INTERNAL, f"store: {rpc}: {e}")
        raise e

    # ------------------------------------------------------------------ internals

    async def _blocking(self, pool: ThreadPoolExecutor, context: grpc.aio.ServicerContext, fn: Callable) -> Any:
        """``fn(call)`` in ``pool``, where ``call`` stands for ``context`` (the plain code
        above aborts and sets trailers as a sync handler does); its abort ends the call here."""
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, _ThreadContext(context))
        except _Aborted as a:
            aborted = a
        if aborted.trailers:
            context.set_trailing_metadata(aborted.trailers)
        await context.abort(aborted.code, aborted.details)

    async def _here(self, context: grpc.aio.ServicerContext, fn: Callable) -> Any:
        """``fn(call)`` on the loop (no I/O in it), its abort ending the call as ``_blocking``'s."""
        try:
            return fn(_ThreadContext(context))
        except _Aborted as a:
            if a.trailers:
                context.set_trailing_metadata(a.trailers)
            await context.abort(a.code, a.details)

    @staticmethod
    def _gate(context: grpc.ServicerContext, check: Callable[[], None]) -> None:
        """``check()`` (an access rule, access.py); its refusal ends the call in one line."""
        try:
            check()
        except AccessRefused as e:
            context.abort(e.code, str(e))

    def _relay(self, rpc: str, receiver: int, request: Message, context: grpc.ServicerContext) -> Message:
        return self._send(self._sender(rpc, context), receiver, request, context)

    def _sender(self, rpc: str, context: grpc.ServicerContext) -> int:
        """The calling module (the server's identity check let the call through, so the
        claim is there and names a module that may send this RPC's request)."""
        for key, value in context.invocation_metadata() or ():
            if key == SENDER_METADATA:
                try:
                    return Module.Value(value)
                except ValueError:
                    break
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{rpc}: no calling module in '{SENDER_METADATA}'")

    def routed_out(self, routed: Routed, msg: Message | None = None, payload: Any = None) -> None:
        """The composition root's link: a failure event for the caller's side, kept for the
        call this thread serves (none: sent outside a call, dropped)."""
        outbox = _CALL.get()
        if outbox is not None:
            outbox.put(routed)

    def _send(
        self,
        sender: int,
        receiver: int,
        msg: Message,
        context: grpc.ServicerContext,
        payload_reply: bool = False,
        payload: Any = None,
    ) -> Any:
        """The receiver's reply message (its payload instead, with ``payload_reply``);
        ``payload``: the command's payload on the bus (a profile's staged files)."""
        token = _CALL.set(Outbox())
        try:
            return self._send_in_call(sender, receiver, msg, context, payload_reply, payload)
        finally:
            _CALL.reset(token)

    def _send_in_call(
        self,
        sender: int,
        receiver: int,
        msg: Message,
        context: grpc.ServicerContext,
        payload_reply: bool,
        payload: Any = None,
    ) -> Any:
        name = msg.DESCRIPTOR.name
        port = self._ports.get((sender, receiver))
        try:
            if port is None and self._check is not None:
                self._check(sender, msg.DESCRIPTOR.full_name, receiver)  # raises: no route
            if port is None:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{Module.Name(sender)} may not command {Module.Name(receiver)} ({name})",
                )
            try:
                answer = port(msg, payload)
            except ModuleFailed as failed:  # its failure event is published: map the error to a status
                raise failed.error from None
            reply = answer.payload if payload_reply else answer.message
        except BoundaryViolation as e:
            abort_with_violation(context, e, "store")
        except CheckpointNotFound as e:
            _trailers(context)
            context.abort(grpc.StatusCode.NOT_FOUND, self._not_found_text(e))
        except CheckpointRejected as e:
            self._log.warning("checkpoint_rejected", request=name, error=str(e))
            # The typed verdict and cause ride along; never parse the text.
            _trailers(
                context,
                *cause_metadata(e),
                *(((STORE_CAUSE_METADATA, _DAMAGE_CAUSE[e.cause]),) if isinstance(e, CheckpointDamaged) else ()),
            )
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            _trailers(context)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OSError as e:
            self._log.error("store_io_failed", request=name, error=str(e))
            _trailers(context, *cause_metadata(e))
            context.abort(grpc.StatusCode.INTERNAL, f"store: {name}: {e}")
        except (RuntimeError, KeyError, TypeError, AttributeError) as e:  # a module's handler failed unexpectedly
            self._log.error("store_handler_failed", request=name, error=f"{type(e).__name__}: {e}")
            _trailers(context, *cause_metadata(e))
            context.abort(grpc.StatusCode.INTERNAL, f"store: {name}: {type(e).__name__}: {e}")
        assert reply is not None, f"{name} handler returned no reply"
        return reply


# The failure events for the caller's side of the call this thread serves (see routed_out).
_CALL: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar("surge_store_call", default=None)


def _trailers(context: grpc.ServicerContext, *metadata: tuple[str, Any]) -> None:
    """Set the call's trailing metadata: ``metadata`` and the failure events kept for it."""
    outbox = _CALL.get()
    routed = routed_trailers(outbox.drain()) if outbox is not None else ()
    if metadata or routed:
        context.set_trailing_metadata((*metadata, *routed))


class _Aborted(Exception):
    """How plain code in a pool thread ends an asyncio call: the status, and the trailers
    set before it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple):
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class _ThreadContext:
    """The part of a ``grpc.ServicerContext`` the relay's plain code uses, for an asyncio
    call served from a pool thread: the caller's metadata; ``abort`` raises ``_Aborted``
    (the asyncio handler then aborts the call on its loop)."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context
        self._trailers: tuple = ()

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailers = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details, self._trailers)


def _put_dropping_oldest(q: asyncio.Queue, item: Any) -> None:
    """On ``q``'s loop: a watcher that falls WATCH_QUEUE events behind loses the oldest."""
    if q.full():
        q.get_nowait()
    q.put_nowait(item)
