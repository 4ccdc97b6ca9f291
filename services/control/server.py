"""The gRPC face of `control` (``ControlServicer``): relays between the wire and the
contract bus.

No seed module lives here and no decision is taken here. Each relay speaks on the bus for
the remote party the route table names, and holds only routing knowledge:

* ``ControlServicer`` (this file): operator RPCs become commands from EXT_USER to the
  orchestrator; its replies (JobStatus, JobList) and events (JobEvent) become responses
  and streams. ``WorkerSession`` opens a node agent's session (``surge-registered`` /
  ``surge-last-seq`` headers: the agent resends everything after the last applied seq;
  ``surge-liveness-bin``: where and with which key it sends its liveness beats as datagrams).
* ``liveness_datagrams.py`` (``LivenessDatagrams``): the agents' liveness beats over UDP, read
  on one thread and taken as their sessions' beats would be (the same route, another transport).
* ``session_hub.py`` (``SessionHub``): one bidi session per node agent: its stream
  messages onto the bus as the modules it speaks for, commands down to it, exactly-once
  across a control restart (``exactly_once.py``, a part of it), and the rank log plumbing
  behind ``StreamLogs``.
* ``event_applier.py`` (``EventApplier``): applies the sessions' stream messages, each
  job's in arrival order on the job's own queue, jobs in parallel on a bounded pool of
  threads, a burst at a time (``SessionHub.on_worker_events``).
* ``loop_queue.py`` (``LoopQueue``): ``WorkerSession`` is an asyncio handler (control
  serves on ``grpc.aio``, see ``AioServiceServer``): a node agent's session costs no
  thread; its commands reach it through an asyncio queue. Why: with a thread per session
  (and one more reading it), 1,000 agents were 2,000 threads and a GIL hand-off per
  message, and control saturated (bench/control_scale.py). ``WatchJob`` and ``StreamLogs``
  are asyncio handlers too: grpc.aio never tells a plain handler its caller left, so a
  plain follow held a pool thread (and delayed a SIGTERM stop) until the job's next event.
  The operator commands stay plain code in a thread pool.
* ``watch_hub.py`` (``WatchHub``): per-job subscriber queues fed by JobEvent (no polling).
* ``store_relay.py`` (``StoreRelay``): VerifyCheckpoints for L5-1, forwarded to the
  `store` service without blocking; the answer comes back as L5-1's event.
* ``access.py`` (``ControlAccess``): with a tokens file, a team sees and controls its own
  jobs only and nodes need the admin role; asked before a command is relayed, and lists
  filtered, here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from services.contract import control_pb2, control_pb2_grpc
from services.contract.bus import CommandPort, Reply
from services.contract.failures import CAUSE_METADATA, REFUSAL_METADATA
from services.control.access import AccessRefused, ControlAccess
from services.control.event_applier import EventApplier
from services.control.liveness_datagrams import LIVENESS_HEADER, LivenessDatagrams
from services.control.loop_queue import LoopQueue
from services.control.metrics import command_kind, count_message, event_kind
from services.control.orchestrator import EVENT_LOG, IllegalTransition, JobNotFound
from services.control.session_hub import AgentSession, SessionHub
from services.control.watch_hub import WatchHub
from services.jobspec import JobSpecError

JobState = control_pb2.JobState
# Initial-metadata key of WorkerSession: sent once the registration is in the registry.
REGISTERED_HEADER = "surge-registered"
# Initial-metadata key of WorkerSession: the last WorkerEvent.seq of this agent incarnation
# that control applied (0: none); the agent resends every event after it.
LAST_SEQ_HEADER = "surge-last-seq"
# Initial-metadata key of WorkerSession: "1": this control reads ``WorkerEvent.batch`` (several
# sequenced events of the agent in one message, each applied as if sent alone); an agent sends
# batches only to a control that says so.
BATCHES_HEADER = "surge-batches"
# WatchJob's ``types``: each is a parameter of the journal's query (there are ~20 event words).
MAX_WATCH_TYPES = 64
_log = structlog.get_logger("control.server")


class ControlServicer(control_pb2_grpc.ControlServiceServicer):
    """ControlService over gRPC.

    ``WorkerSession``, ``WatchJob`` and ``StreamLogs`` are asyncio handlers (serve this on a
    ``grpc.aio`` server, e.g. ``AioServiceServer``); the other RPCs are plain code (its
    thread pool runs them).

    Args:
        user: command port EXT_USER -> L1_ORCHESTRATOR.
        watches: the JobEvent subscriber hub.
        sessions: the node agent session hub.
        applier: the thread that applies the sessions' messages (default: one of its own).
        max_sessions: node agent sessions held at once; the next is refused with
            RESOURCE_EXHAUSTED.
        access: per-team access (control/access.py; default: not enforced, as without a
            tokens file).
        liveness: control's liveness socket: each session is granted a slot and key there
            (the ``surge-liveness-bin`` header). None: no grant, agents beat on their sessions.
    """

    def __init__(
        self,
        user: CommandPort,
        watches: WatchHub,
        sessions: SessionHub,
        applier: EventApplier | None = None,
        max_sessions: int = 8192,
        access: ControlAccess | None = None,
        liveness: LivenessDatagrams | None = None,
    ):
        self._user, self._watches, self._sessions = user, watches, sessions
        # Where the agents send their liveness beats as datagrams (liveness_datagrams.py);
        # None: they beat on their sessions.
        self._liveness = liveness
        self._access = access or ControlAccess()
        self.applier = applier or EventApplier(sessions)
        self._max_sessions = max_sessions
        self._live = 0  # sessions being served (touched on the server's loop only)

    def SubmitJob(self, request, context):
        try:
            request = self._access.submit("SubmitJob", request)
        except AccessRefused as e:
            _abort(context, e)
        status = self._command(context, request)
        self._checked(context, "SubmitJob", status)  # (a request id another team's submit made)
        return status

    def GetJob(self, request, context):
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GetJob: job_id is required")
        return self._checked(context, "GetJob", self._command(context, request))

    def ListJobs(self, request, context):
        listed = self._command(context, control_pb2.JobQuery())
        try:
            jobs = self._access.visible("ListJobs", listed.jobs)
            team_view = self._access.team_view("ListJobs")
        except AccessRefused as e:
            _abort(context, e)
        # The workers lost without notice beside the cordons: out of placement, like them,
        # until an agent of theirs registers again (the session hub's word, not a decision). A
        # lost worker's placement hold (its agent went silent, then its session ended) reads lost.
        hub = self._sessions  # (None: a servicer without node agent sessions, as some tests build it)
        gone = {c.worker_id: c for c in (hub.lost_workers() if hub is not None else ())}
        cordons = [c for c in listed.cordoned if not (c.held and c.worker_id in gone)]
        cordoned = {c.worker_id for c in cordons}
        lost = [c for w, c in gone.items() if w not in cordoned]
        if len(jobs) == len(listed.jobs) and not lost and not team_view:
            return listed
        return control_pb2.JobList(jobs=jobs, cordoned=[*cordons, *lost], team_view=team_view)

    def PauseJob(self, request, context):
        return self._job_command(context, "PauseJob", request)

    def ResumeJob(self, request, context):
        return self._job_command(context, "ResumeJob", request)

    def ScaleJob(self, request, context):
        return self._job_command(context, "ScaleJob", request)

    def StopJob(self, request, context):
        return self._job_command(context, "StopJob", request)

    def DeleteJob(self, request, context):
        return self._job_command(context, "DeleteJob", request)

    def RevokeOrder(self, request, context):
        return self._job_command(context, "RevokeOrder", request)

    def AnnotateJob(self, request, context):
        return self._job_command(context, "AnnotateJob", request)

    def ProfileJob(self, request, context):
        return self._job_command(context, "ProfileJob", request)

    def UncordonWorker(self, request, context):
        self._admin(context, "UncordonWorker", "uncordon a node")
        if not request.worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "UncordonWorker: worker_id is required")
        # A worker neither registered nor cordoned is the operator's typo: said so (was: "is not
        # cordoned", as if it were a node). A cordoned node that left may still be uncordoned.
        known = self._sessions.worker_ids() if self._sessions is not None else None
        if known is not None and request.worker_id not in known:
            cordoned = {c.worker_id for c in self._command(context, control_pb2.JobQuery()).cordoned}
            if request.worker_id not in cordoned:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"uncordon: no such worker {request.worker_id!r} (registered: {', '.join(known) or 'none'})",
                )
        return self._command(context, request)

    def DrainWorker(self, request, context):
        self._admin(context, "DrainWorker", "drain a node")
        # An unknown node is the operator's typo: refused here, where the node agents' sessions
        # are known, before anything is cordoned.
        known = self._sessions.worker_ids()
        if request.worker_id not in known:
            listed = ", ".join(known) if known else "none"
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"drain: worker {request.worker_id!r} is not registered (registered: {listed})",
            )
        return self._command(context, request)

    def SetTeamQuota(self, request, context):
        self._admin(context, "SetTeamQuota", "set or remove a team's quota")
        if not request.quota.name and not request.set_max_wait:  # (the starvation bound names no team)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "SetTeamQuota: quota.name is required")
        return self._command(context, request)

    def ListTeams(self, request, context):
        listed = self._command(context, control_pb2.TeamQuery())
        try:
            team_view = self._access.team_view("ListTeams")
        except AccessRefused as e:
            _abort(context, e)
        if not team_view:
            return listed
        # A user's view: every team's usage and quota (fair share is seen by all), the waiting
        # jobs of its own team only (their places kept: where it stands in the whole queue).
        out = control_pb2.TeamList()
        out.CopyFrom(listed)
        del out.queue[:]
        out.queue.extend(q for q in listed.queue if q.team == team_view)
        return out

    async def WatchJob(self, request, context) -> AsyncIterator[control_pb2.JobEvent]:
        """History from ``from_seq``, then (with ``follow``) live events until TERMINATED.
        Subscribing before reading the history and skipping seen seqs closes the gap
        between the two. Runs on the server's loop: a caller leaving cancels it at once
        (a plain handler would hold a pool thread until the job's next event, since grpc.aio
        never calls a plain handler's ``add_callback``; tested)."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WatchJob: job_id is required")
        if len(set(request.types)) > MAX_WATCH_TYPES:  # (each is an SQL parameter)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"WatchJob: at most {MAX_WATCH_TYPES} types, got {len(request.types)}"
            )
        types = frozenset(request.types)
        live = LoopQueue(asyncio.get_running_loop())
        self._watches.subscribe(request.job_id, live)
        try:
            status, history = await self._history(context, request)
            await self._checked_async(context, "WatchJob", status)
            last = 0
            for ev in history:
                last = ev.seq
                yield ev
            if not request.follow or status.state == JobState.TERMINATED:
                return
            while True:
                ev = await live.get()
                if ev.seq <= last or ev.seq < request.from_seq:
                    continue
                last = ev.seq
                if not types or ev.type in types:
                    yield ev
                if ev.status.state == JobState.TERMINATED:  # (the stream ends there, its event shown or not)
                    return
        finally:
            self._watches.unsubscribe(request.job_id, live)

    async def StreamLogs(self, request, context) -> AsyncIterator[control_pb2.LogLine]:
        """The job's rank log lines, relayed from the node agents that ran its ranks (each
        tails its files, see TailRankLogs); with ``follow`` until those ranks have exited
        and their files are drained. Ends when every agent asked said done; the caller
        leaving sends them StopTailing. Blocks on the request's queue, never polls; runs on
        the server's loop, like WatchJob and for the same reason."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "StreamLogs: job_id is required")
        job = await self._call(context, control_pb2.JobQuery(job_id=request.job_id))  # NOT_FOUND for an unknown job
        await self._checked_async(context, "StreamLogs", job.message)
        rank = request.rank if request.rank >= 0 else -1
        tail = self._sessions.open_tail(request.job_id, request.follow, rank, LoopQueue(asyncio.get_running_loop()))
        pending = set(tail.sessions)
        try:
            while pending:
                session, batch = await tail.answers.get()
                if batch is None and self._sessions.stopping:  # not the job's end: say so
                    # (typed: the caller tells this answer from a control it could not reach)
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        "control is stopping",
                        trailing_metadata=((CAUSE_METADATA, "FAILURE_UNAVAILABLE"),),
                    )
                if batch is None or batch.done:
                    pending.discard(session)
                    continue
                if rank >= 0 and batch.rank != rank:
                    continue
                for line in batch.lines:
                    yield control_pb2.LogLine(job_id=request.job_id, rank=batch.rank, line=line)
        finally:
            self._sessions.close_tail(tail, pending)

    async def WorkerSession(self, request_iterator, context):
        """First message: ``register``; control answers with the initial-metadata header
        ``surge-registered: <worker_id>`` once the worker's slots are allocatable. Then rank
        events up, WorkerCommands down, until either side closes; the stream closing is
        the fact that the node agent is gone. Runs on the server's loop: the messages go to
        the applier thread, the commands come from the session's asyncio queue."""
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        count_message("in", event_kind(first), first.ByteSize())
        if first.WhichOneof("event") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "WorkerSession: the first WorkerEvent must be register"
            )
        reg = first.register
        if not reg.worker_id or reg.slots == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"WorkerSession: registration needs a worker_id and slots > 0 (got {reg.worker_id!r}, {reg.slots})",
            )
        if self._live >= self._max_sessions:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"WorkerSession: control holds {self._max_sessions} node agent sessions (--max-sessions); "
                f"{reg.worker_id} refused",
            )
        self._live += 1
        try:
            commands = LoopQueue(asyncio.get_running_loop())
            session = await self.applier.open(reg, commands)
            reader = None
            try:
                # The acknowledgement: once a node agent sees this header, its slots can be
                # allocated; it resends its events after the last applied seq.
                header = [
                    (REGISTERED_HEADER, reg.worker_id),
                    (LAST_SEQ_HEADER, str(session.applied)),
                    (BATCHES_HEADER, "1"),
                ]
                if self._liveness is not None:  # its liveness beats as datagrams, with this key
                    header.append((LIVENESS_HEADER, self._liveness.grant(session).SerializeToString()))
                await context.send_initial_metadata(tuple(header))
                reader = asyncio.create_task(self._read_session(session, requests))
                while (item := await commands.get()) is not None:
                    cmd = self._sessions.command(session, item)
                    count_message("out", command_kind(cmd), cmd.ByteSize())
                    yield cmd
            finally:
                if reader is not None:
                    reader.cancel()
                if self._liveness is not None:
                    self._liveness.release(session)
                self.applier.close(session)  # idempotent; after the messages already read
        finally:
            self._live -= 1

    # ------------------------------------------------------------ private

    async def _read_session(self, session: AgentSession, requests) -> None:
        try:
            async for ev in requests:
                count_message("in", event_kind(ev), ev.ByteSize())
                if ev.HasField("batch"):  # each of its events as if it had come alone, in order
                    self.applier.events((session, one) for one in unbatched(session, ev))
                else:
                    self.applier.event(session, ev)
        except Exception:  # noqa: BLE001 - the stream broke: same fact as closing it
            pass
        finally:
            self.applier.close(session)

    async def _history(self, context, request) -> tuple[control_pb2.JobStatus, tuple]:
        query = control_pb2.JobQuery(
            job_id=request.job_id, from_seq=request.from_seq, tail=request.tail, types=request.types
        )
        reply = await self._call(context, query, EVENT_LOG)
        return reply.message, reply.payload

    async def _call(self, context, request, payload: Any = None) -> Reply:
        """``self._user(request, payload)`` from a handler on the server's loop: run in a
        pool thread (it waits on the orchestrator's lock); an error aborts the RPC."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._user, request, payload)
        except Exception as e:
            await context.abort(*_status(e), _trailers(e))

    def _command(self, context, request):
        try:
            return self._user(request).message
        except Exception as e:
            _abort(context, e)

    def _job_command(self, context, method: str, request):
        """A command on one job, relayed once the caller may control that job (its team's,
        or an admin; always without a tokens file)."""
        if self._access.enforced and request.job_id:  # (no id: the command's own refusal, NOT_FOUND)
            self._checked(context, method, self._command(context, control_pb2.JobQuery(job_id=request.job_id)))
        return self._command(context, request)

    def _checked(self, context, method: str, job: control_pb2.JobStatus) -> control_pb2.JobStatus:
        """``job``, once the caller may see it (else the call is refused)."""
        try:
            self._access.check_job(method, job)
        except AccessRefused as e:
            _abort(context, e)
        return job

    async def _checked_async(self, context, method: str, job: control_pb2.JobStatus) -> None:
        try:
            self._access.check_job(method, job)
        except AccessRefused as e:
            await context.abort(*_status(e))

    def _admin(self, context, method: str, what: str) -> None:
        try:
            self._access.require_admin(method, what)
        except AccessRefused as e:
            _abort(context, e)


def _abort(context, e: Exception):
    trailers = _trailers(e)
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(*_status(e))


def _trailers(e: Exception) -> tuple[tuple[str, str], ...]:
    """A refusal's typed reason, when it has one (the client acts on it, not on the words)."""
    refusal = e.refusal if isinstance(e, IllegalTransition) else control_pb2.REFUSAL_UNSPECIFIED
    return ((REFUSAL_METADATA, control_pb2.RefusalReason.Name(refusal)),) if refusal else ()


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and one-line details a control command's error is answered with."""
    if isinstance(e, AccessRefused):
        code = e.code
    elif isinstance(e, JobSpecError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(e, JobNotFound):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(e, IllegalTransition):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(e, ValueError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    else:
        _log.exception("control command failed")
        code = grpc.StatusCode.INTERNAL
    return code, str(e).splitlines()[0] if str(e) else type(e).__name__


def unbatched(session: AgentSession, ev: control_pb2.WorkerEvent) -> list[control_pb2.WorkerEvent]:
    """The events of a ``WorkerEvent.batch``, each to be applied as if sent alone. A batch
    inside a batch, or a registration in one, is no event of the protocol: dropped and logged
    (what is sent has a seq each: a dropped one is a gap the cursor skips, as for any lost event)."""
    events = []
    for one in ev.batch.events:
        if one.WhichOneof("event") in ("batch", "register", None):
            _log.warning("worker event refused in a batch", worker_id=session.worker_id, kind=one.WhichOneof("event"))
            continue
        events.append(one)
    return events
