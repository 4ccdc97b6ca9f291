"""L1-1 orchestrator: the only decision maker for start, pause, resume, stop and failure.

Seed 000 L1-1. It owns each job's state machine and publishes what it decides as
``JobEvent`` (one per decision or state change, journaled in SQLite) and ``JobStatus``
snapshots. It never touches tensors, data or devices, and never polls: everything it knows
arrives as an event (rank events relayed from the node agents, fault reports, replies).

    STANDBY (queued) -> WARMING_UP -> RUNNING <-> PAUSED
    any non-terminal -> FAULT_FROZEN (recovering) -> RUNNING | TERMINATED
    any non-terminal -> TERMINATED  (outcome FINISHED | STOPPED | FAILED)
    TERMINATED (STOPPED | FAILED), PAUSED (ranks gone) -> WARMING_UP  (operator resume only)

Pause and stop name a step boundary (``at_step`` = latest reported step + 2) so that every
rank stops at the same step and no rank waits in a collective for a paused peer. Both
checkpoint that step first unless the operator says not to (the ranks report paused or
finished after the commit). A drain (`surgectl down`) is a pause whose job is then parked:
its ranks go with the stack, a restarted control waits for none, and the next `up` resumes
it. An operator resume of a STOPPED, FAILED or parked job relaunches its ranks (a new
generation) from the newest version the checkpoint manager verifies, or the one named, at
another data-parallel layout when asked (`surgectl resume --dp`: the global batch kept, the
job's spec replaced and journaled; see ``resume_job_request``).

The queue (issue 15): a submitted job whose ranks do not fit now is not refused: it stays
STANDBY in a queue (services/control/job_queue.py: FIFO within priority, only the head is
tried; a job needing more ranks than the registered workers have slots holds back none
behind it while it waits for workers to join), its status saying its place and what it
waits for, journaled with its place. The
head starts when ranks may have freed up: a job ended or left the queue, a recovery or an
operator resume placed its ranks, a worker registered (L1-2's ``ResourcesReady`` with no
job). Live jobs come first: the queue is held while a job recovers and its ranks are not
relaunched yet, or a job drained by `surgectl down` waits for the `up` that resumes it.
Starting queued jobs is handed to the deadline pool's thread (no delay), never run on the
thread that applies the node agents' events. ``surgectl cancel`` (StopJobRequest.queued_only)
or a stop takes a job out of the queue (TERMINATED, STOPPED).

Faults: a graded ``FaultReport`` opens an incident and gets one decision, by the job
spec's ``fault_policy`` (class first, then grade): ignore (record and count), stop (FAILED),
or a relaunch -- restart_ranks (from the newest checkpoint, or from scratch), rollback (the
newest checkpoint not after the faulting step that verifies), exclude_node (restart_ranks
without the worker the fault came from). A relaunch spends one restart of the fault class's
budget (exhausted: FAILED); the job is FAULT_FROZEN while it recovers, and RUNNING again
once every rank has restored. A recovery is a sequence of steps, each a command and the
event that answers it, none of them a blocking call (see "the recovery sequence" below):
verification (the store's recorded verdicts: only a corrupt one strikes a version; the
store unreachable or slow: wait and ask again, up to ``store_wait_seconds``), placement
(the recovery controller has the allocator kill and relaunch the ranks to load the version
named here; no free slots: wait for capacity, up to ``capacity_wait_seconds``), restore
(every relaunched rank ready within ``restore_seconds``). A wait that runs out is decided by
the policy (``store_unreachable``, ``no_capacity``, ``recovery_timeout``). While it recovers, reports from ranks
of the failed generation (a survivor's collective error, its exit, the kills) are recorded
as consequences of the incident, not decided on again: the incident is named after the
rank that failed first. Every decision is a "decision" event with its reason.

Control restart: what a restarted ``control`` needs is journaled with every event (state,
status and the bookkeeping in ``_runtime``: ranks started/finished, a pause or stop in
flight, restart budgets, checkpoint versions, workers excluded, the recovery in flight, the
verdicts on the current step's faults and the standing orders withdrawn), and
every applied step in the journal's step table. A live job is restored in its state; its
node agents re-attach its ranks and resend the events not yet applied (exactly once, see
``server.SessionHub``). A job caught mid-recovery resumes that recovery without spending
its restart again (see ``_restore``). Skipped steps
(``StepCompleted.skipped``) are "skip" events with their reason and counted in
``surge_skipped_steps_total{reason}``.

Inputs: the operator's commands (SubmitJobRequest, JobQuery, Pause/Resume/StopJobRequest),
TrainingLoopStarted / StepCompleted / EvalCompleted / TrainingLoopPaused /
TrainingLoopFinished / TrainingLoopFailed (L2-1 via the relay), SaveCompleted (L5-1 via the
relay), FaultReport (L1-3; one with no job is a worker's own fault: a device_error cordons the
worker), ResourcePressure (L1-2, observed and recorded), ResourcesReady
without a job (L1-2: a worker registered; the queue's head is tried), WorkerCordoned (L1-2: a
cordon in force or ended; journaled, listed with the jobs),
CheckpointVerification / SnapshotFailed / CheckpointCorrupt (L5-1 via the store relay: the
verification's answer, a failed save or verification with its typed cause, a scrub finding).
Outputs: AllocateResources / ReleaseResources / CordonWorker (L1-2), StartFaultMonitoring / ResetFaultLedger
(L1-3), StartRecovery (L1-4), VerifyCheckpoints (L5-1), Start/Pause/Resume/StopTraining (L2-1 of the job's ranks, via
the session relay), JobStatus / JobList / JobEvent (the operator).
"""

from __future__ import annotations

import base64
import math
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.common.sizes import size_text
from services.contract import Module, control_pb2, engine_pb2, route_pb2, store_pb2
from services.contract.bus import CommandPort, Emitter, Reply
from services.contract.failures import Refusal
from services.control import fault_decision as fd
from services.control.deadlines import Deadline, Deadlines
from services.control.job_queue import JobQueue, QueueEntry, check_priority
from services.control.job_store import JobStore
from services.control.metrics import ControlMetrics
from services.control.monitoring import start_monitoring
from services.control.reattach import Reattaching
from services.hf_config import check_spec_directory
from services.jobspec import (
    IN_PLACE_ACTIONS,
    JobSpec,
    JobSpecError,
    at_data_parallel_size,
    parse_job_spec,
    rebuild_refusal,
    spec_from_json,
    spec_to_json,
    with_layout,
)

JobState = control_pb2.JobState
JobOutcome = control_pb2.JobOutcome
FaultGrade = control_pb2.FaultGrade
ORCH = Module.L1_ORCHESTRATOR

# JobQuery payload asking for the job's event log (as a reply payload: tuple of JobEvent).
EVENT_LOG = "event_log"

RESTART_MESSAGE = "control restarted; ranks not re-attached"
# A job that was mid-recovery when control restarted resumes that recovery.
RESUME_MESSAGE = "control restarted mid-recovery; resuming it"
# A job live when control restarted keeps its state: its node agents re-attach its ranks.
REATTACH_MESSAGE = "control restarted; waiting for the ranks to re-attach"
# ... and once an event of every rank arrived after the restart (replaces REATTACH_MESSAGE).
REATTACHED_MESSAGE = "control restarted; every rank re-attached"

_ALLOWED: dict[int, frozenset[int]] = {
    JobState.STANDBY: frozenset({JobState.WARMING_UP, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.WARMING_UP: frozenset({JobState.RUNNING, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.FAULT_FROZEN, JobState.TERMINATED}),
    JobState.FAULT_FROZEN: frozenset(
        {JobState.RUNNING, JobState.PAUSED, JobState.TERMINATED}
    ),  # PAUSED: recovered, paused before
    JobState.TERMINATED: frozenset(),
}

# Fault classes that state a rank process ended (FaultReport.fault_class, see the detector).
_EXITS = frozenset({"rank_exit", "rank_exit_clean", "rank_released", "worker_lost", "worker_departed"})

# Failure events routed to L1-1 as well as to L1-3 that L1-1 handles and records itself as
# they arrive (FaultReport.event): SnapshotFailed, a skipped save ("training continues"), a
# failed load or verification. L1-3's grade of one is decided like any report, but an ignore
# leaves no second record: see Orchestrator._handled_on_receipt.
_HANDLED_ON_RECEIPT = frozenset({"SnapshotFailed"})

_log = structlog.get_logger("orchestrator")

# The steps of a recovery (``_Incident.phase``), in order. Each is a command out and the
# event that answers it; the wait states retry their step with backoff until the fault
# policy's deadline for them, after which the policy decides.
VERIFYING = "verifying"  # VerifyCheckpoints sent; CheckpointVerification / SnapshotFailed answers
WAITING_STORE = "waiting_store"  # the store could not be asked (unreachable, timeout): retry
PLACING = "placing"  # StartRecovery sent (answered at once by L1-4)
WAITING_CAPACITY = "waiting_capacity"  # not enough free slots: retry as workers come
RESTORING = "restoring"  # ranks relaunched; waiting for every one to report ready
# A pause or stop names a boundary at least this far ahead in time (seconds; see _boundary).
BOUNDARY_MARGIN_S = 1.0
# Backoff of a retried step: doubles from the first, capped (seconds).
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 4.0
# Classes the orchestrator names itself when a recovery step gives up (fault policy keys).
STORE_UNREACHABLE, NO_CAPACITY, RECOVERY_TIMEOUT = "store_unreachable", "no_capacity", "recovery_timeout"
StoreFailureCause = store_pb2.StoreFailureCause
RecoveryFailureCause = control_pb2.RecoveryFailureCause


class JobNotFound(LookupError, Refusal):
    """No job has this id (gRPC NOT_FOUND)."""


class JobDoesNotFit(ValueError, Refusal):
    """The job's estimated memory per rank fits no registered slot (gRPC INVALID_ARGUMENT):
    one line naming the estimate and the largest device; nothing is persisted."""


class IllegalTransition(RuntimeError, Refusal):
    """The command does not apply to the job's current state (gRPC FAILED_PRECONDITION).
    ``refusal``: why, typed, where a client acts on it (``control_pb2.RefusalReason``; the
    server sends it in the call's trailing metadata)."""

    refusal = control_pb2.REFUSAL_UNSPECIFIED

    def __init__(self, message: str, refusal: int | None = None):
        super().__init__(message)
        if refusal is not None:
            self.refusal = refusal


class InsufficientResources(IllegalTransition):
    """The allocator cannot place the job's ranks; nothing was persisted."""

    refusal = control_pb2.REFUSED_NO_CAPACITY


@dataclass
class _Incident:
    """A fault being recovered from: its cause, and the ranks of failed generations whose
    exit has not been seen yet (rank -> exits still to come)."""

    cause: control_pb2.FaultReport
    fault_class: str
    action: str
    decided: float  # time.monotonic() of the decision
    dying: Counter[int] = field(default_factory=Counter)
    version: str = ""
    bound: int | None = None  # rollback: no version after this step
    exclude: list[str] = field(default_factory=list)  # exclude_node: the worker(s) left out
    relaunched: bool = False  # RecoveryCompleted applied (journaled with its event)
    # Restored from the journal after a control restart: whether the relaunch reached the
    # node agents is unknown until a relaunched rank reports ready (``relaunched`` or not:
    # a journaled relaunch was only queued to the sessions when control died).
    resumed: bool = False
    # When that relaunch was commanded again (unix time): reports graded before it are
    # about the ranks it replaced, already accounted for.
    repeated_unix: float = 0.0
    phase: str = VERIFYING  # the recovery step in flight (journaled)
    waiting_for: str = ""  # the wait state the step is in (kept across its retries)
    waiting_since: float = 0.0  # time.monotonic() that wait began
    asked_since: float = 0.0  # time.monotonic() the store was first asked (a wait counts from it)
    retries: int = 0  # retries of the current step
    timer: Deadline | None = None  # the current step's retry or deadline (not journaled)
    paused: bool = False  # the job was paused (or pausing) when the fault came
    # Bytes the relaunched ranks read per source ("memory", "peer", "store": their
    # TrainingLoopStarted.restored_bytes_from, summed; not journaled).
    restored_from: Counter[str] = field(default_factory=Counter)
    # rebuild (issue 16): the ranks replaced (the others survive and rebuild their group in
    # place), and the rank each ready rank's state came from (TrainingLoopStarted; not journaled).
    lost: list[int] = field(default_factory=list)
    healed_from: dict[int, int] = field(default_factory=dict)
    recovered_unix: float = 0.0  # when every rank was ready again (not journaled)
    at_step: int = 0  # the job's last completed step when it was decided (not journaled)
    # shrink (issue 16): the job at the smaller data-parallel size its ranks go on at, once no
    # slot was free for a replacement (journaled as the layout's three numbers).
    shrunk: JobSpec | None = None


@dataclass
class _HeldFailure:
    """A save or load broken in its collectives, waiting for the fault that caused it
    (``Orchestrator._broken_by_peer``; not journaled: a control restarted meanwhile loses
    the record, not a decision)."""

    msg: store_pb2.SnapshotFailed
    what: str
    timer: Deadline | None = None


@dataclass
class _Scale:
    """A resize of a running job in flight (issue 16: `surgectl scale`, or growing back after
    a shrink): its ranks pause at a common step boundary, then the kept ones rebuild their
    group at the new size with the new ranks, which heal from a live peer."""

    spec: JobSpec  # the job at the new layout
    why: str  # "scale by the operator", "grow back": said in the events
    phase: str = "pausing"  # pausing (PauseTraining sent) | rebuilding (RebuildCommunicator done)
    old_dp: int = 0
    since: float = 0.0  # time.monotonic() it was asked
    healed_from: dict[int, int] = field(default_factory=dict)  # rank -> source (TrainingLoopStarted)


@dataclass
class _Job:
    status: control_pb2.JobStatus
    spec: JobSpec
    seq: int = 0  # last event seq written
    started: set[int] = field(default_factory=set)  # ranks that reported started
    paused: set[int] = field(default_factory=set)
    finished: dict[int, bool] = field(default_factory=dict)  # rank -> stopped
    pending: str = ""  # "pause" | "stop" while in flight
    pending_at: int = 0
    running_since: float = 0.0  # unix time RUNNING was first entered
    last_persist: float = 0.0
    exited: set[int] = field(default_factory=set)  # ranks of this generation seen ended
    incident: _Incident | None = None  # the recovery in progress
    recovered: _Incident | None = None  # recovered, awaiting its first step
    # The last incident once recovered: a symptom of it that reaches control late (the fault
    # detector holds a comm_error to attribute it; a rank of the relaunched generation reported
    # its failed collective as it was killed) is no new fault.
    last_incident: _Incident | None = None
    held: list[_HeldFailure] = field(default_factory=list)  # failures waiting for their cause
    restarts: Counter[str] = field(default_factory=Counter)  # fault class -> relaunches spent
    ignored: Counter[str] = field(default_factory=Counter)  # fault class -> faults ignored
    versions: list[tuple[int, str]] = field(default_factory=list)  # (step, version) committed
    unusable: set[str] = field(default_factory=set)  # versions that failed verification
    excluded: set[str] = field(default_factory=set)  # workers left out by exclude_node decisions
    placement: dict[int, str] = field(default_factory=dict)  # rank -> worker it reported ready on
    start_held: bool = False  # recovered while paused: the ready ranks wait for StartTraining
    boundary_failed: bool = False  # the checkpoint of the pause/stop boundary in flight could not be saved
    # Versions committed after the one an operator resume went back to: another branch of
    # the job's history, never chosen by a recovery or a plain resume (only by name).
    abandoned: set[str] = field(default_factory=set)
    step_seconds: float = 0.0  # rank 0's recent step time (from its StepCompleted times; not journaled)
    last_step_unix: tuple[int, float] = (0, 0.0)  # (step, unix_time) of the last one applied
    # JobStatus.tokens_per_second, the one definition `surgectl status` and the end-of-run
    # summary both show: tokens / step seconds summed over the steps applied since this
    # control took the job, its first step (compilation, warm-up) left out; not journaled.
    throughput: tuple[int, float] = (0, 0.0)
    throughput_warm: bool = False  # the first step was seen (and left out)
    # Operator actions (issue 12 part 7). ``draining``: the pause in flight is a drain
    # (`surgectl down`); ``parked``: PAUSED and its ranks are gone (drained, or stopped with
    # the stack): not waited for after a control restart, and a resume relaunches them from
    # a checkpoint; ``resuming``: an operator resume is asking the store (not journaled).
    draining: bool = False
    parked: bool = False
    resuming: bool = False
    # (step, StepFaultKind) -> the verdict (apply or skip) sent to the job's ranks blocked on
    # that step fault: one decision per fault whichever rank reports it first; sent again to a
    # rank that asks again (its reminder: the verdict may have been lost). Journaled with the
    # decision, so a restarted control answers a reminder with it instead of deciding again
    # (an ignore counted twice). Only the current step's are kept: every rank reporting a fault
    # at step s passed L3-5's all-reduce of s, so none still waits on an earlier verdict.
    verdicts: dict[tuple[int, int], engine_pb2.StepVerdict] = field(default_factory=dict)
    # StandingOrder.id -> the step after which this generation's ranks no longer follow it
    # (RevokeStandingOrder sent); a relaunched generation gets the policy's orders again.
    revoked: dict[int, int] = field(default_factory=dict)
    queued: QueueEntry | None = None  # its place while it waits in the queue (journaled)
    scale: _Scale | None = None  # a resize in flight (journaled)
    # The layout (dp, micro_batch_size, grad_accum) a job shrunk by a fault grows back to as
    # slots return (empty: none; journaled). An operator's scale sets the size: it is forgotten.
    grow_to: tuple[int, ...] = ()
    # The largest micro-batch its ranks ran with (journaled): a resize picks none larger, and
    # scaling back returns to it (was: each resize could only shrink it: 6 -> 4 -> 3 -> 2).
    micro_batch_cap_seen: int = 0

    @property
    def micro_batch_cap(self) -> int:
        return max(self.micro_batch_cap_seen, self.spec.data.micro_batch_size)


class Orchestrator:
    """Owns every job's state machine. Thread-safe: one lock orders all decisions.

    Args:
        allocator: command port to L1-2 (AllocateResources, ReleaseResources).
        faults: command port to L1-3 (StartFaultMonitoring, ResetFaultLedger).
        recovery: command port to L1-4 (StartRecovery).
        loop: command port to the job's L2-1 loops through the session relay, which
            knows the node agents that launched the job's ranks.
        emit: publishes JobEvent to the operator side.
        journal: where jobs and their event logs persist; jobs found there are restored.
        data_address, store_address: pushed to the ranks in InitJob (host:port).
        persist_interval_s: step progress is journaled at most this often (seconds);
            state changes are always journaled at once.
        metrics: where fault counts, detection latency and recovery time are observed.
        checkpoints: command port to L5-1 (VerifyCheckpoints): which versions of a job are
            intact, asked before naming the version a recovery loads. None: the versions
            reported by SaveCompleted are trusted (the recovery controller still verifies
            the one named).
    """

    def __init__(
        self,
        *,
        allocator: CommandPort,
        faults: CommandPort,
        recovery: CommandPort,
        loop: CommandPort,
        emit: Emitter,
        journal: JobStore,
        data_address: str,
        store_address: str,
        persist_interval_s: float = 1.0,
        metrics: ControlMetrics | None = None,
        checkpoints: CommandPort | None = None,
    ):
        self._allocator, self._faults, self._loop, self._emit = allocator, faults, loop, emit
        self._checkpoints = checkpoints
        self._recovery = recovery
        self._metrics = metrics or ControlMetrics()
        self._journal = journal
        self._data_address, self._store_address = data_address, store_address
        self._persist_interval_s = persist_interval_s
        # Re-entrant: a command this module sends may come back as an event on this thread.
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._reattaching = Reattaching()  # restored live jobs: ranks not heard from since
        self._answers: dict[str, _Answer] = {}  # job -> an operator resume waiting for the store's verdicts
        # The recovery steps' retries and deadlines: callbacks take the lock like any event.
        self._deadlines = Deadlines("orchestrator", workers=1)
        self._queue = JobQueue()
        self._start_armed: Deadline | None = None  # the queue's head is about to be tried
        self._cordoned: dict[str, control_pb2.WorkerCordoned] = {}  # worker id -> its cordon in force
        self._restore()

    def close(self) -> None:
        """No retry or step deadline fires any more (control is stopping: a restarted
        control resumes the journaled recoveries)."""
        self._deadlines.close()

    # ------------------------------------------------------------ operator commands

    def submit_job_request(self, msg: control_pb2.SubmitJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Validate the spec, journal the job, and start it (allocate its ranks: WARMING_UP),
        or queue it (STANDBY, see "The queue" above): when its ranks do not fit now, when a
        job of its priority or higher waits ahead of it (one that does not just wait for
        workers to join), or while the queue is held.

        Atomic: a start that fails at any point after the allocation (an event that cannot
        be journaled) takes the ranks back (killed, their slots free again) and removes
        whatever was journaled of the job, then raises. The job is journaled (STANDBY)
        before its ranks launch: a control killed in between finds it at its restart
        (FAULT_FROZEN, "ranks not re-attached"; a stop releases what was launched), never
        ranks of a job it does not know holding slots.

        Admission by memory: a job whose estimated memory per rank fits too few of the
        registered workers' slots (L1-2's refusal says so) is refused here, or, tried from
        the queue, ends FAILED saying why; where no worker is registered yet it is queued.

        Raises:
            JobSpecError: the spec is invalid (one line naming file and field).
            JobDoesNotFit (a ValueError): its memory per rank fits no registered slot (one line
                naming the estimate and the largest slot); nothing is persisted.
            PriorityOutOfRange (a ValueError): ``priority`` out of range (one line); nothing is persisted.
        """
        spec = parse_job_spec(msg.spec_yaml, msg.spec_path or "job.yaml")
        check_spec_directory(spec, msg.spec_path or "job.yaml")  # init_from.hf (file reads: outside the lock)
        spec_json = spec_to_json(spec)
        priority = check_priority(msg.priority)
        with self._lock:
            job_id = self._new_id(spec.name)
            now = time.time()
            # Built before anything is allocated: a value that does not fit fails here.
            status = control_pb2.JobStatus(
                job_id=job_id,
                name=spec.name,
                state=JobState.STANDBY,
                total_steps=spec.steps,
                eval_loss=math.nan,
                created_unix=now,
                updated_unix=now,
                world_size=spec.world_size,
                priority=priority,
            )
            _set_layout(status, spec)
            job = _Job(status=status, spec=spec)
            self._journal.create_job(status, spec_json)  # (fails: nothing allocated yet)
            self._jobs[job_id] = job
            held = "waits for the jobs queued ahead of it" if self._queue.blocks(priority) else ""
            held = held or self._queue_held()
            reply = None if held else self._launch(job)
            if reply is not None and reply.rank_memory_bytes:  # it cannot start on these workers
                self._jobs.pop(job_id, None)
                self._journal.delete_job(job_id)
                raise JobDoesNotFit(f"{msg.spec_path or 'job.yaml'}: {reply.reason}")
            if held or reply is not None:
                try:
                    entry = self._queue.add(job_id, priority)
                    self._queue.mark_beyond_cluster(job_id, reply is not None and _beyond_cluster(reply))
                    self._enqueue(job, entry, held or _waits_for(job, reply))
                except BaseException:
                    self._queue.take(job_id)
                    self._jobs.pop(job_id, None)
                    self._journal.delete_job(job_id)
                    raise
            return self._snapshot(job)

    def _launch(self, job: _Job, note: str = "") -> control_pb2.ResourcesInsufficient | None:
        """Under the lock: allocate the ranks of a journaled STANDBY job and journal it
        WARMING_UP. Returns the allocator's refusal when they do not fit (nothing reserved,
        nothing journaled). A failure after the allocation takes the ranks back and forgets
        the job (``_abandon_start``), then raises."""
        job_id, spec = job.status.job_id, job.spec
        init = engine_pb2.InitJob(
            job_id=job_id,
            spec_json=spec_to_json(spec),
            data_address=self._data_address,
            store_address=self._store_address,
            standing_orders=fd.standing_orders(spec.fault_policy),
            rebuild_in_place=spec.fault_policy.rebuilds,
        )
        # Monitoring starts before the ranks launch, so a rank that dies at once is still
        # reported; a job whose allocation fails simply never produces faults.
        self._faults(start_monitoring(job_id, spec))
        try:
            reply = self._allocator(
                control_pb2.AllocateResources(
                    job_id=job_id, world_size=spec.world_size, backend=spec.parallel.backend, init=init
                )
            ).message
            if isinstance(reply, control_pb2.ResourcesInsufficient):
                return reply  # nothing was reserved
            assert isinstance(reply, control_pb2.ResourcesReady), reply
            self._record(
                job,
                ORCH,
                "decision",
                f"{reply.world_size} ranks allocated on {', '.join(reply.worker_ids)}; "
                f"rendezvous {reply.master_addr}:{reply.master_port}",
            )
            self._transition(job, JobState.WARMING_UP, ORCH, f"{note}ranks launching")
        except BaseException as e:
            self._abandon_start(job_id, e)
            raise
        return None

    def _abandon_start(self, job_id: str, cause: BaseException) -> None:
        """A job whose start failed half-way must not run untracked nor hold slots: its ranks
        are killed and released, and no record of it stays (the journal's and ours)."""
        _log.warning("job start failed; taking its ranks back", job_id=job_id, error=str(cause))
        self._jobs.pop(job_id, None)
        try:
            self._allocator(control_pb2.ReleaseResources(job_id=job_id, kill=True))
        finally:
            self._journal.delete_job(job_id)

    def job_query(
        self, msg: control_pb2.JobQuery, payload: Any = None
    ) -> control_pb2.JobStatus | control_pb2.JobList | Reply:
        """An empty job id lists every job (JobList). Otherwise the job's JobStatus (with
        ``spec_json``, its effective spec, when ``with_spec``); with payload ``EVENT_LOG``
        the reply payload is its events with seq >= from_seq.

        Raises:
            JobNotFound: unknown job id.
        """
        with self._lock:
            if not msg.job_id:
                return control_pb2.JobList(
                    jobs=[self._snapshot(j) for j in self._jobs.values()], cordoned=list(self._cordoned.values())
                )
            job = self._get(msg.job_id)
            if payload == EVENT_LOG:
                return Reply(self._snapshot(job), tuple(self._journal.events(msg.job_id, msg.from_seq)))
            status = self._snapshot(job)
            if msg.with_spec:  # the effective spec, as journaled (a resume --dp replaced it there too)
                status.spec_json = spec_to_json(job.spec)
            return status

    def pause_job_request(self, msg: control_pb2.PauseJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Ask every rank to pause after step latest+2, checkpointing that step first (unless
        ``no_checkpoint``); PAUSED once all have paused (after the commit).

        ``drain`` (`surgectl down`: the stack stops once the job is PAUSED): always with a
        checkpoint; once paused the job is ``drained`` (the next `up` resumes it) and parked
        (its ranks are gone after the stop: nothing is waited for after a control restart).
        A PAUSED job is only parked (it stays PAUSED after `up`); a pause in flight becomes a
        drain.

        Raises:
            JobNotFound, IllegalTransition (the job is not RUNNING, or a pause/stop is in flight).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if msg.drain and job.status.state == JobState.PAUSED and not job.pending:
                if not job.parked:
                    job.parked = True
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"drain: PAUSED at step {job.status.step}; its ranks stop with the stack; "
                        f"`surgectl resume {job.status.job_id}` relaunches them from {_newest(job)}",
                    )
                return self._snapshot(job)
            if msg.drain and job.pending == "pause":
                if not job.draining:
                    job.draining = True
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"drain: the pause after step {job.pending_at} in flight "
                        "becomes a drain (the stack stops once it is PAUSED)",
                    )
                return self._snapshot(job)
            self._require(job, JobState.RUNNING)
            self._require_idle(job)
            checkpoint = msg.drain or not msg.no_checkpoint
            job.pending, job.pending_at = "pause", self._boundary(job)
            job.boundary_failed = False
            job.draining = msg.drain
            job.paused.clear()
            self._loop(
                engine_pb2.PauseTraining(job_id=job.status.job_id, at_step=job.pending_at, checkpoint=checkpoint)
            )
            what = "drain (pause, then the stack stops)" if msg.drain else "pause"
            how = f"checkpoint step {job.pending_at} and pause" if checkpoint else "pause"
            self._record(
                job,
                ORCH,
                "decision",
                f"{what} requested: ranks {how} after step {job.pending_at}"
                + ("" if checkpoint else " (no checkpoint)"),
            )
            return self._snapshot(job)

    def resume_job_request(self, msg: control_pb2.ResumeJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Resume a job. A PAUSED one whose ranks run: RUNNING at once (ranks send nothing
        until their next step). A STOPPED or FAILED (TERMINATED) one, or a PAUSED one whose
        ranks are gone (parked: drained by `surgectl down`): from its newest checkpoint the
        store verifies (or ``from_version``), on ranks allocated again (a new generation,
        WARMING_UP, restart budgets reset), bit-exactly where that checkpoint left off.

        A new data-parallel layout (``dp``, ``micro_batch_size``, ``grad_accum``; 0 = the
        job's own) is validated before anything else is asked or changed: the global batch
        (micro_batch_size x grad_accum x dp rows) stays the job's, tp and pp stay, the spec's
        rules hold; then the allocator places the new world size. Accepted, the job's spec
        (journaled, with the decision) becomes the new one and the ranks load the checkpoint
        resharded (the data position is global: the same global batches follow). Only for a
        relaunch: a PAUSED job whose ranks run is refused ("stop it first").

        Raises:
            JobNotFound; IllegalTransition (one line): the job is live, FINISHED, already
            resuming, has no checkpoint ("no checkpoint to resume from; submit again"), none
            that verifies, an unknown ``from_version``, or the store could not be asked;
            JobSpecError (one line naming the field): the new layout changes the global
            batch or breaks a rule of the spec; InsufficientResources: its ranks do not fit
            now (nothing changed).
        """
        with self._lock:
            job = self._get(msg.job_id)
            job_id = job.status.job_id
            if not self._relaunchable(job):
                if job.status.state == JobState.TERMINATED:
                    raise IllegalTransition(
                        f"job {job_id} is TERMINATED (FINISHED): all {job.status.total_steps} "
                        "steps done; nothing to resume"
                    )
                self._require(job, JobState.PAUSED)
                if msg.from_version:
                    raise IllegalTransition(
                        f"--from: job {job_id} is PAUSED with its ranks running; "
                        f"`surgectl resume {job_id}` continues it where it paused"
                    )
                if _new_layout(job.spec, msg) is not None:  # (its own layout named: a plain resume)
                    raise IllegalTransition(
                        f"{_layout_flags(msg)}: job {job_id} is PAUSED with its ranks running; a new layout needs new "
                        f"ranks: `surgectl stop {job_id}` first (it checkpoints), then resume it with {_layout_flags(msg)}"
                    )
                if job.start_held:  # recovered while paused: its ready ranks never started
                    job.start_held = False
                    self._loop(engine_pb2.StartTraining(job_id=job_id))
                else:
                    self._loop(engine_pb2.ResumeTraining(job_id=job_id))
                self._transition(job, JobState.RUNNING, ORCH, f"resumed at step {job.status.step}")
                return self._snapshot(job)
            if job.resuming:
                raise IllegalTransition(f"job {job_id} is already being resumed")
            spec = _new_layout(job.spec, msg)  # (refused: nothing asked, nothing changed)
            job.resuming = True
        try:
            verdicts = self._ask_versions(job_id)  # outside the lock: the store answers on the applier thread
            with self._lock:
                return self._relaunch(job, msg.from_version, verdicts, spec)
        finally:
            with self._lock:
                job.resuming = False

    def scale_job_request(self, msg: control_pb2.ScaleJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Resize a RUNNING job to ``dp`` data-parallel ranks without restarting the ranks
        that stay (issue 16, ``surgectl scale``): the ranks pause after a common step
        boundary (no checkpoint), L1-4 has L1-2 release the ranks >= dp or launch the new
        ones, every kept rank rebuilds its group at the new size, the new ranks heal from a
        live peer, and the job goes on at the same global batches (the global batch is kept:
        :func:`services.jobspec.at_data_parallel_size`). Where the new ranks do not fit, the
        ranks go on at the old size (the events say so).

        Raises:
            JobNotFound; IllegalTransition: the job is not RUNNING, or a pause, stop, scale or
            recovery is in flight; JobSpecError (one line naming the field): the plan cannot
            be resized in place (tp or pp > 1, FSDP2) or the global batch does not split into
            the new layout. Nothing changed.
        """
        with self._lock:
            job = self._get(msg.job_id)
            flags = f"--dp {msg.dp}" + "".join(
                f" {flag} {v}"
                for flag, v in (("--micro-batch-size", msg.micro_batch_size), ("--grad-accum", msg.grad_accum))
                if v
            )
            if msg.dp < 1:
                raise JobSpecError(f"--dp: the new data-parallel size must be >= 1, got {msg.dp}")
            why = rebuild_refusal(job.spec, structural=True)
            if why:
                raise JobSpecError(f"{flags}: scaling in place {why}; `surgectl stop` then `surgectl resume --dp`")
            self._require(job, JobState.RUNNING)
            self._require_idle(job)
            if msg.dp == job.spec.parallel.dp and not (msg.micro_batch_size or msg.grad_accum):
                return self._snapshot(job)  # (already at that size: nothing to do; `surgectl scale` says so)
            spec = at_data_parallel_size(
                job.spec,
                msg.dp,
                micro_batch_size=msg.micro_batch_size,
                grad_accum=msg.grad_accum,
                largest=job.micro_batch_cap,
                source=flags,
            )
            if _layout_of(spec) == _layout_of(job.spec):
                return self._snapshot(job)  # (already at that layout: nothing to do)
            job.grow_to = ()  # the operator chose the size
            self._start_scale(job, spec, "scale by the operator")
            return self._snapshot(job)

    def _start_scale(self, job: _Job, spec: JobSpec, why: str) -> None:
        """Under the lock: pause every rank after a common boundary (no checkpoint: nothing
        is lost, no rank restarts) for a resize to ``spec``'s layout (``_resize`` goes on
        once all have paused)."""
        job.scale = _Scale(spec, why, old_dp=job.spec.parallel.dp, since=time.monotonic())
        job.pending, job.pending_at = "scale", self._boundary(job)
        job.paused.clear()
        self._loop(engine_pb2.PauseTraining(job_id=job.status.job_id, at_step=job.pending_at, checkpoint=False))
        self._record(
            job,
            ORCH,
            "decision",
            f"{why}: {_layout_change(job.spec, spec)}; ranks pause after step {job.pending_at}, then rebuild "
            "their group at the new size (the ranks that stay keep their processes, new ranks heal from a live peer)",
        )

    def _resize(self, job: _Job, step: int) -> None:
        """Under the lock, every rank paused after ``step`` for the scale in flight: command
        the rebuild at the new layout (L1-4, then L1-2), then have the paused ranks leave
        their pause into it (ResumeTraining.rebuild). Where it cannot be placed, they go on
        at the old size."""
        scale, job_id = job.scale, job.status.job_id
        job.pending, scale.phase, job.status.step = "", "rebuilding", step
        old_world = job.status.world_size
        reply = self._recovery(
            control_pb2.StartRecovery(
                job_id=job_id,
                reason=f"{scale.why}: dp {scale.old_dp} -> {scale.spec.parallel.dp}",
                in_place=True,
                layout=_layout_msg(scale.spec),
            )
        ).message
        if isinstance(reply, control_pb2.RecoveryFailed):
            job.scale = None
            self._loop(engine_pb2.ResumeTraining(job_id=job_id))
            self._record(
                job,
                Module.L1_RECOVERY_CONTROLLER,
                "scale",
                f"{scale.why} to dp {scale.spec.parallel.dp} not done: {reply.reason}; "
                f"the ranks go on at dp {scale.old_dp} from step {step}",
            )
            return
        job.started = set()
        self._take_layout(job, scale.spec)
        self._loop(engine_pb2.ResumeTraining(job_id=job_id, rebuild=True))
        self._record_relaunch(job, reply, "a live peer's memory", old_world=old_world)

    def _take_layout(self, job: _Job, spec: JobSpec) -> None:
        """Under the lock: ``spec`` (a new data-parallel layout) is the job's now, its ranks
        above the new size released; journaled with the next event (``_record``'s spec)."""
        job.micro_batch_cap_seen = job.micro_batch_cap
        job.spec = spec
        job.status.world_size = spec.world_size
        _set_layout(job.status, spec)
        job.placement = {r: w for r, w in job.placement.items() if r < spec.world_size}

    def _scaled(self, job: _Job, msg: engine_pb2.TrainingLoopStarted) -> None:
        """Under the lock: every rank of the resized group is ready: start them."""
        scale, job.scale = job.scale, None
        if job.grow_to and job.spec.parallel.dp >= job.grow_to[0]:
            job.grow_to = ()  # (grown back the whole way)
        self._loop(engine_pb2.StartTraining(job_id=msg.job_id))
        self._faults(control_pb2.ResetFaultLedger(job_id=msg.job_id))
        healed = sorted((r, src) for r, src in scale.healed_from.items() if r >= scale.old_dp)  # (the new ranks)
        how = ", ".join(f"rank {r} healed from rank {src}'s memory" for r, src in healed)
        kept = min(scale.old_dp, scale.spec.parallel.dp)
        self._record(
            job,
            ORCH,
            "scale",
            status_message=f"{scale.why} done at step {msg.start_step}: dp {scale.old_dp} -> {scale.spec.parallel.dp}",
            message=f"{scale.why} done: dp {scale.old_dp} -> {scale.spec.parallel.dp} at step {msg.start_step}"
            + (f" ({how})" if how else "")
            + f"; {_kept_text(kept)}; "
            f"{time.monotonic() - scale.since:.1f} s after it was asked; training resumed",
        )

    def _grow_soon(self, job_id: str, free: int) -> None:
        """Under the lock: try growing the job back on the deadline pool's thread (no delay;
        never on the caller's, the thread that applies the node agents' events: it sends
        commands)."""
        self._deadlines.after(0.0, self._grow_back, (job_id, free))

    def _grow_back(self, job_id: str, free: int) -> None:
        """A worker registered: a job shrunk by a fault grows back toward its size, as far
        as the free slots allow (the allocator places the new ranks; none placed: it goes on
        at its size and tries again at the next registration)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or not job.grow_to or job.status.state != JobState.RUNNING:
                return
            if job.pending or job.incident is not None or job.scale is not None:
                return
            # The whole way back at the job's own layout, else as far as the global batch
            # splits (tried largest first: the allocator says what fits).
            full, mbs, accum = job.grow_to
            for target in range(min(full, job.spec.parallel.dp + free), job.spec.parallel.dp, -1):
                layout = {"micro_batch_size": mbs, "grad_accum": accum} if target == full else {}
                try:
                    spec = at_data_parallel_size(
                        job.spec, target, largest=job.micro_batch_cap, source="grow back", **layout
                    )
                except JobSpecError:
                    continue
                self._start_scale(job, spec, "grow back (slots returned)")
                return

    def delete_job_request(self, msg: control_pb2.DeleteJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Forget a TERMINATED job: its journaled status, event log and steps go, and it is
        no longer listed. Answers its last status. Its checkpoints and metrics are the
        store's (not touched here).

        Raises:
            JobNotFound, IllegalTransition (the job is live: not TERMINATED; nothing changed).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if job.status.state != JobState.TERMINATED:
                raise IllegalTransition(
                    f"job {msg.job_id} is {JobState.Name(job.status.state)}: only an ended job's records can be "
                    f"deleted (`surgectl stop {msg.job_id}` first)"
                )
            self._journal.delete_job(msg.job_id)
            del self._jobs[msg.job_id]
            _log.info("job deleted", job_id=msg.job_id)
            return self._snapshot(job)

    def stop_job_request(self, msg: control_pb2.StopJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Stop a job, checkpointing its boundary step first (unless ``no_checkpoint``).
        RUNNING: ranks stop after step latest+2; PAUSED: at the next boundary (at_step 0);
        TERMINATED with outcome STOPPED once every rank finished (after the commit). A job
        whose ranks are gone (FAULT_FROZEN, STANDBY, PAUSED and parked) or still starting
        (WARMING_UP: no step to checkpoint; they are killed) is released and terminated
        now. Stopping a job already stopping returns its status. A
        queued job leaves the queue (see ``_cancel``); with ``queued_only`` (`surgectl
        cancel`) any other job is refused.

        Raises:
            JobNotFound, IllegalTransition (the job is already TERMINATED).
        """
        with self._lock:
            job = self._get(msg.job_id)
            if msg.queued_only or job.queued is not None:
                return self._cancel(job)
            state = job.status.state
            if state == JobState.TERMINATED:
                outcome = JobOutcome.Name(job.status.outcome)
                raise IllegalTransition(f"job {job.status.job_id} is already TERMINATED ({outcome})")
            # WARMING_UP: the ranks are still starting (importing, building or loading the
            # model); a rank reads StopTraining only once its set-up is done, which a model too
            # large for its host never is. Nothing was trained since they launched, so there
            # is no step to checkpoint: they are killed now, like ranks being recovered.
            if state in (JobState.FAULT_FROZEN, JobState.STANDBY, JobState.WARMING_UP) or (
                state == JobState.PAUSED and job.parked
            ):
                why = (
                    "its ranks were being recovered"
                    if job.incident
                    else "its ranks were stopped with the stack"
                    if job.parked
                    else "its ranks were still starting (killed; nothing trained since they launched)"
                    if state == JobState.WARMING_UP
                    else "its ranks were gone"
                )
                job.parked = job.draining = False
                job.status.drained = False
                self._terminate(job, JobOutcome.STOPPED, f"stopped by the operator; {why}", kill=True)
                return self._snapshot(job)
            if job.pending == "stop":
                return self._snapshot(job)
            if job.scale is not None:  # (its ranks pause for it: a stop's boundary would never come)
                raise IllegalTransition(
                    f"job {job.status.job_id} is being resized to dp {job.scale.spec.parallel.dp} ({job.scale.why}); "
                    "stop it once its events say the resize is done (seconds)"
                )
            checkpoint = not msg.no_checkpoint
            at_step = self._boundary(job) if state == JobState.RUNNING else 0
            job.pending, job.pending_at = "stop", at_step
            job.boundary_failed = False
            self._loop(engine_pb2.StopTraining(job_id=job.status.job_id, at_step=at_step, checkpoint=checkpoint))
            where = f"after step {at_step}" if at_step else "at the next step boundary"
            how = "checkpoint and stop" if checkpoint else "stop (no checkpoint)"
            self._record(job, ORCH, "decision", f"stop requested: ranks {how} {where}")
            return self._snapshot(job)

    # ------------------------------------------------------------ the queue

    def on_resources_ready(self, msg: control_pb2.ResourcesReady, payload: Any = None) -> None:
        """L1-2 published that a worker registered with slots (no job id; ``free_ranks`` free
        now): the queue's head may fit. (A reply to AllocateResources comes back to its
        command, not here.)"""
        if msg.job_id or not msg.free_ranks:
            return
        with self._lock:
            self._queue.clear_beyond_cluster()  # a job waiting for workers may fit now: it blocks until tried
            self._start_soon()
            for job in self._jobs.values():
                if job.grow_to and job.status.state == JobState.RUNNING:
                    self._grow_soon(job.status.job_id, msg.free_ranks)

    def _enqueue(self, job: _Job, entry: QueueEntry, why: str) -> None:
        """Under the lock: ``job`` (STANDBY, journaled) waits in the queue at ``entry``."""
        job.queued = entry
        where = f"position {self._queue.position(entry.job_id)} of {len(self._queue)}, priority {entry.priority}"
        self._record(job, ORCH, "queue", f"queued at {where}: {why}", status_message=f"queued: {why}")

    def _queue_held(self) -> str:
        """Why no queued job may start now ("": none may). Live jobs come first: one that
        recovers and whose ranks are not relaunched yet, or one drained by `surgectl down`
        that the next `up` resumes, needs the ranks a queued job would take."""
        for j in self._jobs.values():
            if j.incident is not None and not j.incident.relaunched and j.status.state == JobState.FAULT_FROZEN:
                return f"waits while job {j.status.job_id} recovers (live jobs first)"
            if j.parked and j.status.drained:
                return (
                    f"waits for drained job {j.status.job_id} to be resumed (`surgectl up` resumes it, "
                    "`surgectl stop` ends it; live jobs first)"
                )
        return ""

    def _start_soon(self) -> None:
        """Under the lock: ranks may have freed up, so the queue's head is tried, on the
        deadline pool's thread (no delay; never on the caller's, which may be the thread that
        applies the node agents' events), once however many ask before it runs."""
        if len(self._queue) and self._start_armed is None:
            self._start_armed = self._deadlines.after(0.0, self._start_queued)

    def _start_queued(self) -> None:
        """Start queued jobs in queue order while their ranks fit and nothing holds the queue;
        the first that does not fit stays where it is, its status saying what it waits for,
        and the rest wait behind it -- unless it needs more ranks than the registered
        workers have slots: it waits for workers to join, holding back none of the jobs
        behind it, which are tried next."""
        with self._lock:
            self._start_armed = None
            for entry in self._queue.ordered():
                if entry.job_id not in self._queue:  # (taken out meanwhile)
                    continue
                job = self._jobs[entry.job_id]
                held = self._queue_held()
                if held:
                    self._waiting(job, held)
                    return
                self._queue.take(entry.job_id)
                job.queued = None
                # Journaled out of the queue before its ranks launch: a control killed in
                # between finds it STANDBY and not queued (FAULT_FROZEN, see _restore), never
                # queued again while its ranks run.
                try:
                    self._keep(job)
                except Exception as e:  # noqa: BLE001 - still queued (journal and here); tried again later
                    job.queued = self._queue.put(entry)
                    _log.error("a queued job could not be taken out of the queue", job_id=entry.job_id, error=str(e))
                    return
                waited = time.time() - job.status.created_unix
                try:
                    reply = self._launch(job, note=f"left the queue after {waited:.0f} s; ")
                except Exception as e:  # noqa: BLE001 - _launch forgot the job; the rest stay queued
                    _log.error("a queued job could not be started", job_id=entry.job_id, error=str(e))
                    return
                if reply is not None and reply.rank_memory_bytes:  # it cannot start on these workers
                    job.status.outcome = JobOutcome.FAILED
                    self._transition(job, JobState.TERMINATED, ORCH, f"FAILED: refused: {reply.reason}")
                    continue
                if reply is not None:
                    job.queued = self._queue.put(entry)  # its place kept
                    beyond = _beyond_cluster(reply)
                    self._queue.mark_beyond_cluster(entry.job_id, beyond)
                    self._waiting(job, _waits_for(job, reply))
                    if not beyond:
                        return

    def _waiting(self, job: _Job, why: str) -> None:
        """Under the lock: the queued ``job`` still waits, for ``why``: an event when the
        reason changed (none at every retry), its place journaled either way."""
        message = f"queued: {why}"
        if job.status.message == message:
            self._keep(job)
            return
        where = f"position {self._queue.position(job.status.job_id)} of {len(self._queue)}"
        self._record(job, ORCH, "queue", f"still queued at {where}: {why}", status_message=message)

    def _cancel(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock: take a queued job out of the queue (TERMINATED, STOPPED; it never
        ran). Raises IllegalTransition when it is not queued (nothing changes)."""
        job_id = job.status.job_id
        if job.queued is None:
            state = JobState.Name(job.status.state)
            if job.status.state == JobState.TERMINATED:  # nothing to take out, nothing to stop
                raise IllegalTransition(f"job {job_id} is {state} ({JobOutcome.Name(job.status.outcome)}), not queued")
            raise IllegalTransition(f"job {job_id} is {state}, not queued: `surgectl stop {job_id}` stops it")
        where = self._queue.position(job_id)
        self._queue.take(job_id)
        job.queued = None
        job.status.outcome = JobOutcome.STOPPED
        self._transition(
            job, JobState.TERMINATED, ORCH, f"STOPPED: taken out of the queue (position {where}) by the operator"
        )
        self._start_soon()  # the jobs behind it move up
        return self._snapshot(job)

    # ------------------------------------------------------------ operator resume from a checkpoint

    def _relaunchable(self, job: _Job) -> bool:
        """Whether an operator resume relaunches ``job`` from a checkpoint: STOPPED or FAILED,
        or PAUSED with its ranks gone."""
        s = job.status
        ended = s.state == JobState.TERMINATED and s.outcome in (JobOutcome.STOPPED, JobOutcome.FAILED)
        return ended or (s.state == JobState.PAUSED and job.parked)

    def _ask_versions(self, job_id: str) -> list[store_pb2.CheckpointVerdict] | None:
        """The store's verdict on every committed version of the job (VerifyCheckpoints; the
        answer comes back as an event, on the applier thread, or in the call in-process).
        None without a checkpoint port (the versions reported by SaveCompleted are used).

        Raises:
            IllegalTransition: the store could not be asked, or did not answer in time."""
        if self._checkpoints is None:
            return None
        answer = self._answers[job_id] = _Answer()
        try:
            try:
                reply = self._checkpoints(store_pb2.VerifyCheckpoints(job_id=job_id)).message
            except Exception as e:  # noqa: BLE001 - a relay that cannot even send
                reply = store_pb2.SnapshotFailed(
                    job_id=job_id,
                    operation="verify",
                    cause=store_pb2.UNREACHABLE,
                    reason=f"not sent: {type(e).__name__}: {e}",
                )
            if not isinstance(reply, (store_pb2.CheckpointVerification, store_pb2.SnapshotFailed)):
                if not answer.event.wait(RESUME_VERIFY_WAIT_S):
                    raise IllegalTransition(
                        f"cannot resume {job_id}: the store did not say within "
                        f"{RESUME_VERIFY_WAIT_S:.0f} s which checkpoints verify; try again"
                    )
                reply = answer.reply
        finally:
            self._answers.pop(job_id, None)
        if isinstance(reply, store_pb2.SnapshotFailed):
            cause = store_pb2.StoreFailureCause.Name(reply.cause).lower() if reply.cause else "failed"
            raise IllegalTransition(
                f"cannot resume {job_id}: the store could not verify its checkpoints "
                f"({cause}: {reply.reason}); try again"
            )
        return list(reply.versions)

    def _resume_answered(self, msg: store_pb2.CheckpointVerification | store_pb2.SnapshotFailed) -> bool:
        """Hand the store's answer to an operator resume waiting for it (True), if any."""
        answer = self._answers.get(msg.job_id)
        if answer is None or answer.event.is_set():
            return False
        if isinstance(msg, store_pb2.SnapshotFailed) and msg.operation != "verify":
            return False
        answer.reply = msg
        answer.event.set()
        return True

    def _relaunch(
        self, job: _Job, from_version: str, verdicts: list | None, spec: JobSpec | None = None
    ) -> control_pb2.JobStatus:
        """Under the lock: pick the version, allocate the job's ranks again to load it, and
        start the new generation (WARMING_UP). ``spec``: the job's spec at a new
        data-parallel layout (validated by ``_new_layout``), None: its own. Nothing changes
        when it is refused."""
        job_id = job.status.job_id
        if not self._relaunchable(job):
            raise IllegalTransition(
                f"job {job_id} changed while its checkpoints were verified "
                f"(now {JobState.Name(job.status.state)}); not resumed"
            )
        if verdicts is None:
            candidates = [(step, v, v not in job.unusable, "") for step, v in job.versions]
        else:
            candidates = [
                (d.info.step, d.info.version, d.ok and d.info.version not in job.unusable, d.reason) for d in verdicts
            ]
        if not candidates:
            raise IllegalTransition(f"job {job_id} has no checkpoint to resume from; submit again")
        if from_version:
            named = [c for c in candidates if c[1] == from_version]
            if not named:
                raise IllegalTransition(
                    f"--from {from_version}: not a committed checkpoint of {job_id} "
                    f"(its versions: {', '.join(c[1] for c in candidates)})"
                )
            chosen = named[0]
            if not chosen[2]:
                raise IllegalTransition(
                    f"--from {from_version}: fails verification ({chosen[3] or 'struck'}); never loaded"
                )
        else:
            usable = [c for c in candidates if c[2] and c[1] not in job.abandoned]
            if not usable:
                why = "; ".join(f"{v}: {reason or 'struck'}" for _, v, _, reason in candidates)
                raise IllegalTransition(f"job {job_id}: no checkpoint verifies ({why}); submit again")
            chosen = max(usable, key=lambda c: (c[0], _version_number(c[1])))
        step, version = chosen[0], chosen[1]
        new = spec or job.spec
        spec_json = spec_to_json(new)
        init = engine_pb2.InitJob(
            job_id=job_id,
            spec_json=spec_json,
            resume_version=version,
            data_address=self._data_address,
            store_address=self._store_address,
            standing_orders=fd.standing_orders(new.fault_policy),
            rebuild_in_place=new.fault_policy.rebuilds,
        )
        reply = self._allocator(
            control_pb2.AllocateResources(
                job_id=job_id, world_size=new.world_size, backend=new.parallel.backend, init=init
            )
        ).message
        if isinstance(reply, control_pb2.ResourcesInsufficient):
            raise InsufficientResources(
                f"cannot resume {job_id} now: it needs {reply.requested_ranks} ranks "
                f"({_degrees(new)}) but {reply.reason}"
            )
        assert isinstance(reply, control_pb2.ResourcesReady), reply
        before, before_runtime, before_spec = control_pb2.JobStatus(), _runtime(job), job.spec
        before.CopyFrom(job.status)
        was = JobState.Name(job.status.state) + (
            f" ({JobOutcome.Name(job.status.outcome)})" if job.status.outcome else ""
        )
        try:
            # A new generation: nothing of the old one's ranks, pause, stop or recovery is kept;
            # the restart budgets start again (the operator decided to go on). Except which
            # old ranks finished: the clean exit of one reported after this is no fault
            # (each entry goes when the rank's new process reports ready).
            job.started, job.paused, job.exited, job.placement = set(), set(), set(), {}
            job.pending, job.pending_at, job.incident, job.recovered = "", 0, None, None
            job.restarts, job.ignored, job.excluded = Counter(), Counter(), set()
            job.verdicts, job.revoked = {}, {}
            job.parked = job.draining = False
            # Going back to an older version starts a new branch: what was committed after it
            # is never a recovery's choice (the fresh-user trial saw a fault right after
            # `resume --from J:17` relaunch from J:20, the branch the operator left).
            job.abandoned = (
                job.abandoned | {v for v in _known(job, candidates) if _version_number(v) > _version_number(version)}
            ) - {version}
            job.versions = [(st, v) for st, v in job.versions if v not in job.abandoned]
            s = job.status
            s.outcome, s.drained, s.step, s.checkpoint_version = JobOutcome.OUTCOME_UNSPECIFIED, False, step, version
            layout = "" if spec is None else f" at a new layout: {_layout_change(job.spec, spec)}"
            job.spec, s.world_size = new, new.world_size
            _set_layout(s, new)
            self._faults(start_monitoring(job_id, job.spec))
            self._faults(control_pb2.ResetFaultLedger(job_id=job_id))
            self._record(
                job,
                ORCH,
                "decision",
                f"resume {was} from checkpoint {version} (step {step}) by the operator{layout}: "
                f"{reply.world_size} ranks allocated on {', '.join(reply.worker_ids)}; "
                f"rendezvous {reply.master_addr}:{reply.master_port}; restart budgets reset",
                spec_json=spec_json if spec is not None else None,  # (the new spec, with the decision)
            )
            self._reopen(job, f"ranks launching to resume from checkpoint {version} at step {step}")
        except BaseException:
            self._allocator(control_pb2.ReleaseResources(job_id=job_id, kill=True))
            job.status.CopyFrom(before)
            _load_runtime(job, before_runtime)
            if job.spec is not before_spec:
                job.spec = before_spec
                try:  # (the decision may have been journaled with the new spec before the failure)
                    self._journal.save_status(job.status, None, before_runtime, spec_json=spec_to_json(before_spec))
                except Exception as e:  # noqa: BLE001 - the failure being raised is the one to report
                    _log.error("the job's spec could not be put back in the journal", job_id=job_id, error=str(e))
            raise
        self._start_soon()  # (the queue was held while it was drained)
        return self._snapshot(job)

    def _reopen(self, job: _Job, message: str) -> None:
        """TERMINATED or PAUSED (ranks gone) -> WARMING_UP: the one transition out of
        TERMINATED, taken only by an operator resume (``_relaunch``)."""
        old = job.status.state
        assert old in (JobState.TERMINATED, JobState.PAUSED), JobState.Name(old)
        job.status.state = JobState.WARMING_UP
        self._record(job, ORCH, "state", f"{JobState.Name(old)} -> WARMING_UP: {message}", status_message=message)

    def _restore_parked(self, job: _Job) -> bool:
        """After a control restart: a PAUSED job whose ranks were stopped with the stack
        (drained or parked by `surgectl down`) has nothing to re-attach; it waits for a
        resume (`surgectl up` sends one for a drained job). True when ``job`` is one."""
        if job.status.state != JobState.PAUSED or not job.parked:
            return False
        job.draining = False
        if job.status.drained:
            text = (
                f"drained by `surgectl down` at step {job.status.step}; `surgectl up` (or `surgectl resume "
                f"{job.status.job_id}`) continues it from {_newest(job)}"
            )
        else:
            text = (
                f"paused; its ranks stopped with the stack: `surgectl resume {job.status.job_id}` relaunches "
                f"them from {_newest(job)}"
            )
        self._record(job, ORCH, "state", f"PAUSED: {text}", status_message=text)
        return True

    # ------------------------------------------------------------ rank events (L2-1, L5-1)

    def on_training_loop_started(self, msg: engine_pb2.TrainingLoopStarted, payload: Any = None) -> None:
        """A rank is initialised (restored, after a recovery) and waits for StartTraining;
        when all have, start them all."""
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            scaling = msg.job_id in self._jobs and _rebuilding(self._jobs[msg.job_id].scale)
            states = (JobState.WARMING_UP, JobState.FAULT_FROZEN) + ((JobState.RUNNING,) if scaling else ())
            job = self._live(msg.job_id, states, msg)
            if job is None:
                return
            if job.status.state == JobState.FAULT_FROZEN and job.incident is None:
                return  # frozen by a control restart: these ranks are not known here
            if job.incident is not None and job.incident.resumed:
                # Only a relaunched rank reports ready during a recovery (the failed
                # generation's ready reports were applied before the fault): the relaunch
                # reached the node agents before control went down; it is not repeated.
                job.incident.relaunched, job.incident.resumed = True, False
                self._record(
                    job,
                    ORCH,
                    "recovery",
                    f"the relaunch commanded before the restart happened: rank {msg.rank} of the "
                    "relaunched ranks is ready; not relaunched again",
                )
            job.started.add(msg.rank)
            job.finished.pop(msg.rank, None)  # (an old generation's, kept by an operator resume)
            if job.incident is not None:
                job.incident.restored_from.update(dict(msg.restored_bytes_from))
                if msg.healed:
                    job.incident.healed_from[msg.rank] = msg.healed_from_rank
            elif scaling and msg.healed:
                job.scale.healed_from[msg.rank] = msg.healed_from_rank
            if msg.worker_id:  # journaled: a restarted control knows where each rank ran
                job.placement[msg.rank] = msg.worker_id
            incident = job.incident
            if incident is not None and incident.action in IN_PLACE_ACTIONS and msg.rank not in incident.lost:
                # A survivor: its process never restarted; its seconds are the rebuild's (a trial read start-up).
                how = f"kept its process, rejoined in {msg.startup_seconds:.1f} s"
            else:
                how = f"{msg.startup_seconds:.1f} s start-up"
            self._record(
                job,
                Module.L2_TRAINING_LOOP,
                "rank",
                f"rank {msg.rank} ready at step {msg.start_step} ({msg.num_parameters} parameters, {how})",
            )
            if len(job.started) < job.status.world_size or job.pending == "stop":
                return
            job.status.step = msg.start_step
            if scaling:
                self._scaled(job, msg)
                return
            held = incident is not None and incident.paused  # the operator's pause outlives the fault
            if not held:
                self._loop(engine_pb2.StartTraining(job_id=msg.job_id))
            if incident is None:
                job.running_since = time.time()
                self._transition(
                    job, JobState.RUNNING, ORCH, f"all {job.status.world_size} ranks ready; training started"
                )
                return
            # Recovered. The failed generation's last events came before these ranks' own on
            # every worker that runs one, so the incident is over here.
            self._cancel_timer(incident)
            job.incident, job.recovered = None, incident
            incident.recovered_unix = time.time()
            job.last_incident = incident
            job.running_since = job.running_since or time.time()  # (a fault while warming up)
            self._faults(control_pb2.ResetFaultLedger(job_id=msg.job_id))
            source = f"checkpoint {incident.version}" if incident.version else "scratch"
            read = restored_from_text(incident.restored_from) if incident.version else ""
            source += f", {read}," if read else ""
            restored = f"all {job.status.world_size} ranks restored from {source}"
            if incident.action in IN_PLACE_ACTIONS:
                restored = _healed_text(incident, job.status.world_size)
            if held:
                job.recovered, job.start_held = None, True
                self._transition(
                    job,
                    JobState.PAUSED,
                    ORCH,
                    f"recovered from {incident.fault_class} of rank {incident.cause.rank}: {restored} "
                    f"at step {msg.start_step}; paused, as before the fault "
                    "(resume continues it)",
                )
                return
            self._transition(
                job,
                JobState.RUNNING,
                ORCH,
                f"recovered from {incident.fault_class} of rank {incident.cause.rank}: {restored} "
                f"at step {msg.start_step} "
                f"{time.monotonic() - incident.decided:.1f} s after the decision; training resumed",
            )

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> None:
        """Rank 0's step summary (global loss, all-rank tokens) updates the status; it is
        journaled at most every ``persist_interval_s``. A new step that arrives after a fault
        that is being rebuilt in place counts too: the survivors keep it (the job goes on
        from the highest step every rank completed), so its tokens and its journal record
        would otherwise be missing (the trial's "tokens seen" was one step short)."""
        if msg.rank != 0:
            with self._lock:
                self._heard_from(msg.job_id, msg.rank)
            return  # every rank reports the same global numbers; rank 0 speaks for them
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            job = self._jobs.get(msg.job_id)
            kept = (
                job is not None
                and job.status.state == JobState.FAULT_FROZEN
                and job.incident is not None
                and job.incident.action in IN_PLACE_ACTIONS
                and msg.step > job.status.step
            )
            if not kept:
                job = self._live(msg.job_id, (JobState.RUNNING, JobState.PAUSED), msg)
            if job is None:
                return
            s = job.status
            last_step, last_unix = job.last_step_unix
            if msg.unix_time and last_unix and msg.step > last_step:
                rate = (msg.unix_time - last_unix) / (msg.step - last_step)
                job.step_seconds = rate if not job.step_seconds else 0.8 * job.step_seconds + 0.2 * rate
            job.last_step_unix = (msg.step, msg.unix_time)
            s.step, s.tokens_per_second = msg.step, self._throughput(job, msg)
            if not msg.skipped:
                s.train_loss = msg.loss
            s.tokens_seen += msg.tokens
            # Every applied step, in order (the journal of progress a restart resumes from;
            # an event applied twice would show here as a repeated step).
            self._journal.record_step(s.job_id, msg.step, msg.loss, msg.tokens, msg.unix_time or time.time())
            if msg.skipped:
                reason = getattr(msg, "skip_reason", "") or "overflow"  # (field 22: "overflow" | "non_finite_loss")
                self._metrics.step_skipped(reason)
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "skip",
                    f"step {msg.step} skipped ({reason}): no update applied; loss {msg.loss}",
                )
            if job.recovered is not None:
                incident, job.recovered = job.recovered, None
                seconds = time.monotonic() - incident.decided
                self._metrics.recovered(incident.fault_class, seconds)
                self._record(
                    job,
                    ORCH,
                    "recovery",
                    f"first step after the recovery from {incident.fault_class} of rank {incident.cause.rank}: "
                    f"step {msg.step}, {seconds:.1f} s after the decision "
                    f"({time.time() - incident.cause.occurred_unix:.1f} s after the fault)",
                )
            if time.monotonic() - job.last_persist >= self._persist_interval_s:
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "step",
                    f"step {msg.step}/{s.total_steps} loss {msg.loss:.4f} {s.tokens_per_second:.0f} tok/s",
                )

    @staticmethod
    def _throughput(job: _Job, msg: engine_pb2.StepCompleted) -> float:
        """The job's tokens/s after ``msg``: tokens over step seconds of its steps but the
        first this control saw (``_Job.throughput``); that step's own rate until there is
        another (or when the steps carry no step time). Under the lock."""
        if msg.step_seconds > 0:
            if job.throughput_warm:
                tokens, seconds = job.throughput
                job.throughput = (tokens + msg.tokens, seconds + msg.step_seconds)
            job.throughput_warm = True
        tokens, seconds = job.throughput
        return tokens / seconds if seconds > 0 else msg.tokens_per_second

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> None:
        if msg.rank != 0:
            return
        with self._lock:
            job = self._live(msg.job_id, (JobState.RUNNING, JobState.PAUSED), msg)
            if job is None:
                return
            job.status.eval_loss = msg.loss
            self._record(job, Module.L2_TRAINING_LOOP, "eval", f"step {msg.step} eval loss {msg.loss:.4f}")

    def on_save_completed(self, msg: store_pb2.SaveCompleted, payload: Any = None) -> None:
        with self._lock:
            # FAULT_FROZEN too: a commit that completed while its ranks were being killed is a
            # verified version all the same.
            job = self._live(
                msg.job_id, (JobState.RUNNING, JobState.PAUSED, JobState.WARMING_UP, JobState.FAULT_FROZEN), msg
            )
            if job is None or any(v == msg.version for _, v in job.versions):
                return  # every rank relays the same commit; record it once
            job.status.checkpoint_version = msg.version
            job.versions.append((msg.step, msg.version))
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                checkpoint_text(msg),
            )

    def on_training_loop_paused(self, msg: engine_pb2.TrainingLoopPaused, payload: Any = None) -> None:
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            job = self._live(msg.job_id, (JobState.RUNNING,), msg)
            if job is None or job.pending not in ("pause", "scale"):
                return
            job.paused.add(msg.rank)
            if job.pending == "scale":
                if len(job.paused) < job.status.world_size:
                    self._keep(job)
                else:
                    self._resize(job, msg.step)
                return
            if len(job.paused) < job.status.world_size:
                self._keep(job)
            else:
                job.pending = ""
                job.status.step = msg.step
                text = f"all ranks paused after step {msg.step}"
                if job.draining and job.boundary_failed:
                    # Not parked: stopping its ranks now would lose the steps since the newest
                    # checkpoint (`surgectl down` sees it and keeps the stack running).
                    job.draining = False
                    text += (
                        f"; not drained: its checkpoint of step {msg.step} could not be saved, the ranks stay "
                        f"paused (resume, or `surgectl down` again once the store answers)"
                    )
                if job.draining:  # its ranks go away with the stack: the next `up` resumes it
                    job.draining, job.parked, job.status.drained = False, True, True
                    text += f"; drained: `surgectl up` resumes it from {_newest(job)}"
                self._transition(job, JobState.PAUSED, Module.L2_TRAINING_LOOP, text)

    def on_training_loop_finished(self, msg: engine_pb2.TrainingLoopFinished, payload: Any = None) -> None:
        """When every rank has finished: TERMINATED (FINISHED, or STOPPED if stopped early)."""
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            job = self._live(msg.job_id, (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED), msg)
            if job is None:
                return
            job.finished[msg.rank] = msg.stopped
            job.status.step = max(job.status.step, msg.step)
            # (Ranks beyond the world size are an older generation's, kept by an operator
            # resume at a smaller dp so that their late clean exits are no faults.)
            ours = {r: stopped for r, stopped in job.finished.items() if r < job.status.world_size}
            if len(ours) < job.status.world_size:
                self._keep(job)
                return
            stopped = any(ours.values()) or job.pending == "stop"
            outcome = JobOutcome.STOPPED if stopped else JobOutcome.FINISHED
            how = "stopped" if stopped else "finished"
            # Stopped: say where a resume continues (the stop's checkpoint, or an older one
            # when that save was skipped or not asked for).
            then = f"; `surgectl resume` continues from {_newest(job)}" if stopped else ""
            self._terminate(job, outcome, f"all ranks {how} at step {job.status.step}{then}", kill=False)

    def on_training_loop_failed(self, msg: engine_pb2.TrainingLoopFailed, payload: Any = None) -> None:
        """Recorded only: the decision waits for the fault detector's grade."""
        with self._lock:
            job = self._live(msg.job_id, (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED), msg)
            if job is not None:
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "rank",
                    f"rank {msg.rank} failed at step {msg.step}: {msg.fault_class}: {msg.detail}",
                )

    def on_step_fault_reported(self, msg: engine_pb2.StepFaultReported, payload: Any = None) -> None:
        """A rank's loop is blocked on a step fault (every rank finds the same one at the
        same step): decide once per (step, kind) by the policy (services/control/
        fault_decision.py) and send the verdict to every rank of the job. A report of a rank
        the recovery in flight replaces is a consequence: that rank is being released."""
        fault_class = fd.STEP_FAULT_CLASS.get(msg.kind, "")
        received = time.time()
        with self._lock:
            self._heard_from(msg.job_id, msg.rank)
            job = self._jobs.get(msg.job_id)
            if job is None or job.status.state == JobState.TERMINATED or not fault_class:
                return  # (its ranks are being released)
            key = (msg.step, msg.kind)
            for earlier in [k for k in job.verdicts if k[0] < msg.step]:
                del job.verdicts[earlier]  # (every rank passed that step: see _Job.verdicts)
            sent = job.verdicts.get(key)
            if sent is not None:
                if msg.reminder:
                    self._record(
                        job,
                        ORCH,
                        "decision",
                        f"verdict on {fault_class} at step {msg.step} sent again: "
                        f"rank {msg.rank} still waits after {msg.waited_seconds:.0f} s",
                    )
                    self._loop(sent)
                return
            text = f"rank {msg.rank} blocked at step {msg.step}: {msg.detail}"
            incident = job.incident
            if incident is not None and incident.dying[msg.rank] > 0:
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "fault",
                    f"{fault_class}: {text} (consequence of rank {incident.cause.rank}'s {incident.fault_class})",
                )
                return
            # Ungraded (GRADE_UNSPECIFIED): decided by its class alone (fault_decision.decide).
            report = control_pb2.FaultReport(
                job_id=msg.job_id,
                fault_class=fault_class,
                source=Module.L2_TRAINING_LOOP,
                rank=msg.rank,
                detail=text,
                detected_unix=received,
                occurred_unix=received,
                step=msg.step,
                worker_id=job.placement.get(msg.rank, ""),
            )
            self._metrics.fault_reported(report, received)
            self._record(job, Module.L2_TRAINING_LOOP, "fault", f"{fault_class}: {text}")
            decision = self._decide(job, report, step_fault=msg)
            # (kept in job.verdicts only if the ranks go on: a relaunched generation that meets
            # the step again is asked anew)
            self._loop(job.verdicts.get(key) or _step_verdict(msg, decision))

    def _withdraw_standing_order(self, job_id: str, order: int) -> int:
        """Withdraw the job's standing order ``order`` (StandingOrder.id) at a boundary every
        rank has yet to reach (as a pause's, see ``_boundary``); returns that step. A fault
        of its kind after it is decided by the policy, one verdict per fault.

        L1-1's one producer of RevokeStandingOrder (the loop's side: tests/engine). No input
        calls it yet: nothing in a job's fault policy changes its standing orders during the
        run, and an operator's command to withdraw one (EXT_USER -> L1-1) is not part of
        issue 13, so it is not a public method pretending to be a handler. Tested on its own
        (tests/control/test_fault_policy.py). A relaunched generation gets the policy's
        orders again in its InitJob: a withdrawal lasts for the ranks it reached.

        Raises:
            JobNotFound, IllegalTransition: no such job, or it is not RUNNING or PAUSED.
        """
        with self._lock:
            job = self._get(job_id)
            if job.status.state not in (JobState.RUNNING, JobState.PAUSED):
                raise IllegalTransition(
                    f"job {job_id} is {JobState.Name(job.status.state)}: no ranks to revoke an order of"
                )
            if order in job.revoked:  # (these ranks have it already; journaled: also after a control restart)
                return job.revoked[order]
            at = job.revoked[order] = self._boundary(job)
            self._loop(engine_pb2.RevokeStandingOrder(job_id=job_id, order=order, after_step=at))
            self._record(job, ORCH, "decision", f"standing order {order} revoked after step {at}")
            return at

    # ------------------------------------------------------------ fault reports (L1-3)

    def on_fault_report(self, msg: control_pb2.FaultReport, payload: Any = None) -> None:
        """Decide on a graded fault, once per incident, by the job's fault policy.

        A report from a rank of a generation being recovered from is a consequence of the
        incident: recorded, not decided on. An exit control asked for (``rank_released``)
        or the clean exit of a rank that had finished needs no decision. A clean exit of a
        rank that never finished is a lost rank (decided as ``rank_exit``).
        """
        if not msg.job_id:
            self._on_worker_fault(msg)
            return
        received = time.time()
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None or job.status.state == JobState.TERMINATED:
                return  # e.g. ranks exiting after the job ended: expected, nothing to decide
            self._metrics.fault_reported(msg, received)
            if self._handled_on_receipt(job, msg):
                return
            text = f"{FaultGrade.Name(msg.grade)} {msg.fault_class}: {msg.detail}"
            ended = msg.fault_class in _EXITS
            incident = job.incident
            if incident is not None and (
                incident.resumed
                or (incident.repeated_unix and msg.detected_unix and msg.detected_unix <= incident.repeated_unix)
            ):
                self._on_resumed_fault(job, incident, msg, text, ended)
                return
            late = job.last_incident if incident is None else None  # (a symptom from before it recovered)
            if late is not None and _late_symptom(late, msg):
                self._record(
                    job,
                    Module.L1_FAULT_DETECTOR,
                    "fault",
                    _consequence(msg, f"rank {late.cause.rank}'s {late.fault_class}, reported after the recovery"),
                )
                return
            if incident is not None and (incident.dying[msg.rank] > 0 or _survivor_symptom(incident, msg)):
                if ended and incident.dying[msg.rank] > 0:
                    incident.dying[msg.rank] -= 1
                cause = incident.cause
                self._record(
                    job,
                    Module.L1_FAULT_DETECTOR,
                    "fault",
                    _consequence(msg, f"rank {cause.rank}'s {cause.fault_class}"),
                )
                return
            if ended:
                job.exited.add(msg.rank)
            if msg.fault_class == "rank_exit_clean" and msg.rank in job.finished:
                self._keep(job)
                return  # its loop reported finished first: the normal end of that rank, no fault
            self._record(job, Module.L1_FAULT_DETECTOR, "fault", text)
            if msg.fault_class == "rank_released":
                return
            self._decide(job, msg)

    # ------------------------------------------------------------ fault decisions

    def _handled_on_receipt(self, job: _Job, msg: control_pb2.FaultReport) -> bool:
        """L1-3's grade of a failure event this module handled itself when it arrived
        (``_HANDLED_ON_RECEIPT``), which the job's policy ignores (the default: MINOR): the
        decision is counted, nothing is recorded. Why: the event's own record ("checkpoint save
        of ... failed (timeout: ...); training continues") already tells the operator what
        happened and what follows; a "fault" record and an "ignore ... N ignored so far"
        decision next to it read as a second fault, and a store outage is none (no restart,
        no step lost). A policy that does not ignore the class is decided as any fault."""
        if msg.event not in _HANDLED_ON_RECEIPT:
            return False
        if job.spec.fault_policy.action_for(fd.fault_class_of(msg), FaultGrade.Name(msg.grade)) != "ignore":
            return False
        self._metrics.decided(fd.fault_class_of(msg), "ignore")
        return True

    def _decide(
        self, job: _Job, msg: control_pb2.FaultReport, step_fault: engine_pb2.StepFaultReported | None = None
    ) -> fd.Decision:
        """Decide on ``msg`` (services/control/fault_decision.py) and do what it says.
        ``step_fault``: the loop's report ``msg`` was made from; a verdict that lets the
        ranks go on (apply, skip) is kept in ``job.verdicts``."""
        previous = job.incident
        decision = fd.decide(job.spec.fault_policy, fd.JobView(
            restarts=job.restarts, ignored=job.ignored, stop_requested=job.pending == "stop",
            loading_version=previous.version if previous is not None else "",
            no_rebuild=_no_rebuild(job, msg),
        ), msg)  # fmt: skip
        fault_class, action = decision.fault_class, decision.action
        self._metrics.decided(fault_class, decision.counted)
        # What the decision leaves in the bookkeeping is journaled with its event: a control
        # restarted right after it neither counts the ignored fault again nor decides the
        # ranks' reminder of it afresh.
        if action == "ignore":
            job.ignored[fault_class] += 1
        if step_fault is not None and decision.verdict in (engine_pb2.STEP_APPLY, engine_pb2.STEP_SKIP):
            job.verdicts[step_fault.step, step_fault.kind] = _step_verdict(step_fault, decision)
        self._record(job, ORCH, "decision", decision.text)
        if action in ("ignore", "skip_step"):
            return decision
        if action == "stop":
            self._terminate(job, decision.outcome, decision.final, kill=True)
            return decision
        job.restarts[fault_class] += 1
        if decision.strike and decision.strike not in job.unusable:  # (struck already if its load's report came first)
            job.unusable.add(decision.strike)
            self._record(
                job,
                ORCH,
                "checkpoint",
                f"checkpoint {decision.strike} fails its digest check on load; never loaded again",
            )
        bound, exclude = decision.bound, list(decision.exclude)
        incident = _Incident(
            cause=msg,
            fault_class=fault_class,
            action=action,
            decided=time.monotonic(),
            at_step=job.status.step,
            bound=bound,
            exclude=exclude,
            # The operator's pause outlives the fault: recovered, the job stays paused.
            paused=job.status.state == JobState.PAUSED
            or job.pending == "pause"
            or (previous is not None and previous.paused),
        )
        if action in IN_PLACE_ACTIONS:
            # Only the lost ranks end (the recovery kills them if they still run); the others
            # survive: their collective's failure, reported as they rebuild, is a consequence.
            # A rebuild during a rebuild also replaces the ranks the first one was replacing
            # (they hold no state yet: relaunched from a spare, they heal with the others).
            incident.lost = sorted(set(_lost_ranks(job, msg)) | set(previous.lost if previous is not None else ()))
            incident.dying.update(r for r in incident.lost if r not in job.exited)
        else:
            # Every rank of the failing generation not yet seen ended will end (the recovery
            # kills it): its reports until then are consequences of this incident.
            incident.dying.update(r for r in range(job.status.world_size) if r not in job.exited)
        if previous is not None:
            incident.dying.update(previous.dying)
            self._cancel_timer(previous)
        job.incident, job.recovered, job.exited = incident, None, set()
        self._release_held(job, incident)  # (a save that broke a moment before this fault came)
        job.started, job.paused, job.finished, job.placement = set(), set(), {}, {}  # (a new generation)
        job.verdicts.clear()
        job.revoked.clear()
        job.pending = ""  # a pause in flight ends here: the incident keeps it (``paused``)
        if job.scale is not None:  # (its new layout stays if it was already commanded)
            self._record(
                job, ORCH, "scale", f"{job.scale.why} to dp {job.scale.spec.parallel.dp} given up: {decision.text}"
            )
            job.scale = None
        job.start_held = False
        job.excluded.update(exclude)  # journaled with the decision: a restarted control keeps it
        if job.status.state != JobState.FAULT_FROZEN:
            self._transition(job, JobState.FAULT_FROZEN, ORCH, f"recovering from {fault_class} of rank {msg.rank}")
        self._recover(job, incident)
        return decision

    def _on_resumed_fault(
        self, job: _Job, incident: _Incident, msg: control_pb2.FaultReport, text: str, ended: bool
    ) -> None:
        """A fault report while a recovery restored from the journal waits to learn whether
        its relaunch reached the node agents. The exit of a rank of the failed generation
        (one the recovery kills) is a consequence; anything else (a rank not re-attached in
        time and declared silent, a rank that died, a stall) says the relaunched ranks are
        not all there: the relaunch is commanded again, for the same incident (its restart
        was spent when it was decided)."""
        cause = incident.cause
        if incident.repeated_unix or (ended and incident.dying[msg.rank] > 0):
            # (a report graded before the relaunch was commanded again: about the ranks it replaced)
            if ended and incident.dying[msg.rank] > 0:
                incident.dying[msg.rank] -= 1
            self._record(
                job, Module.L1_FAULT_DETECTOR, "fault", _consequence(msg, f"rank {cause.rank}'s {cause.fault_class}")
            )
            return
        self._record(
            job,
            Module.L1_FAULT_DETECTOR,
            "fault",
            f"{text} (during the recovery from rank {cause.rank}'s {cause.fault_class}, resumed after "
            "a control restart)",
        )
        if msg.fault_class == "rank_released":
            return  # an exit control asked for: says nothing of the relaunch
        # Once: later reports are this relaunch's business (decided as usual). The ranks it
        # kills exit as released (no decision); the failed generation's are still counted
        # in ``dying``. Not journaled: killed again before it completes, it is resumed again.
        incident.resumed, incident.repeated_unix = False, time.time()
        job.started, job.exited, job.placement = set(), set(), {}
        self._record(
            job,
            ORCH,
            "decision",
            f"relaunch again for the recovery from {incident.fault_class} of rank {cause.rank} interrupted "
            f"by the control restart: the relaunched ranks are not all there ({msg.fault_class} of rank "
            f"{msg.rank}); no further restart spent",
        )
        self._recover(job, incident)

    def _recover(self, job: _Job, incident: _Incident) -> None:
        """Start the incident's recovery at its first step: ask the checkpoint manager which
        versions are intact. The answer comes back as an event (``on_checkpoint_verification``
        or ``on_snapshot_failed``); nothing here waits for it. Without a checkpoint port
        (tests), the versions reported by SaveCompleted are trusted."""
        self._cancel_timer(incident)
        incident.phase, incident.retries, incident.waiting_for = VERIFYING, 0, ""
        incident.asked_since = time.monotonic()
        if self._checkpoints is None or incident.action in IN_PLACE_ACTIONS:  # (a rebuild loads no version)
            self._place(job, incident)
            return
        self._ask_verification(job, incident)

    def _ask_verification(self, job: _Job, incident: _Incident) -> None:
        job_id = job.status.job_id
        try:
            reply = self._checkpoints(store_pb2.VerifyCheckpoints(job_id=job_id)).message
        except Exception as e:  # noqa: BLE001 - a relay that cannot even send: the store is unreachable
            _log.warning("verification not sent", job_id=job_id, error=str(e))
            reply = store_pb2.SnapshotFailed(
                job_id=job_id,
                operation="verify",
                cause=StoreFailureCause.UNREACHABLE,
                reason=f"not sent: {type(e).__name__}",
            )
        # A relay that answers in the call (in-process tests) answers here; the gRPC relay
        # answers later, on the applier thread, with the same events. (An answer delivered as
        # an event during the call has moved the recovery on already: not applied twice.)
        if job.incident is not incident or incident.phase not in (VERIFYING, WAITING_STORE):
            return
        if isinstance(reply, store_pb2.CheckpointVerification):
            self._verified(job, incident, reply)
        elif isinstance(reply, store_pb2.SnapshotFailed):
            self._verification_failed(job, incident, reply)

    def on_checkpoint_verification(self, msg: store_pb2.CheckpointVerification, payload: Any = None) -> None:
        """The checkpoint manager's verdicts on a job's versions: the answer to the recovery's
        verification step (a late or repeated answer changes nothing but the record)."""
        if self._resume_answered(msg):
            return
        with self._lock:
            job = self._jobs.get(msg.job_id)
            incident = job.incident if job is not None else None
            if incident is None or incident.phase not in (VERIFYING, WAITING_STORE):
                return
            self._verified(job, incident, msg)

    def on_checkpoint_corrupt(self, msg: store_pb2.CheckpointCorrupt, payload: Any = None) -> None:
        """The store's scrub found a committed version's bytes wrong: it is never named for
        a load again (verified at commit, re-verified in the background, never on the
        recovery's path)."""
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None or msg.version in job.unusable:
                return
            job.unusable.add(msg.version)
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                f"checkpoint {msg.version} at step {msg.step} found {StoreFailureCause.Name(msg.cause).lower()} by the "
                f"store's scrub ({msg.reason}); never loaded",
            )

    def on_snapshot_failed(self, msg: store_pb2.SnapshotFailed, payload: Any = None) -> None:
        """A store operation failed, with its typed cause. ``verify``: the recovery's
        verification step could not be done (the store unreachable or slow): the job waits
        and the step is retried. ``save``: a checkpoint could not be written; training goes on
        and the next interval tries again (no decision: a store outage is not a training
        fault)."""
        if self._resume_answered(msg):
            return
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None or job.status.state == JobState.TERMINATED:
                return
            if msg.operation == "verify":
                incident = job.incident
                if incident is not None and incident.phase in (VERIFYING, WAITING_STORE):
                    self._verification_failed(job, incident, msg)
                return
            self._save_failed(job, msg)

    def _save_failed(self, job: _Job, msg: store_pb2.SnapshotFailed) -> None:
        """A save the store could not take (training went on), or a rank's load that failed
        (its loop reports the failure itself, decided as a fault). A load that found the
        version's bytes wrong has the store re-hash the job's versions (``ScrubCheckpoints``),
        so that its catalog, and so ``latest``, knows it too."""
        cause = StoreFailureCause.Name(msg.cause).lower() if msg.cause else _failure_name(msg)
        self._metrics.checkpoint_failed(cause)
        what = f"checkpoint {msg.operation}" + (f" of {msg.version}" if msg.version else "")
        if msg.operation == "save" and job.pending and msg.step == job.pending_at:
            # The boundary checkpoint of a pause, stop or drain: nothing continues after it.
            job.boundary_failed = True
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                f"{what} failed ({cause}: {msg.reason}): the {job.pending} after step {msg.step} has no "
                f"checkpoint of it; the newest is {_newest(job) or 'none'}",
            )
            return
        if not msg.cause and msg.failure.cause == route_pb2.FailureCause.FAILURE_COMMUNICATION:
            self._broken_by_peer(job, msg, what)
            return
        self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _failed_text(what, cause, msg))
        corrupt = msg.cause in (StoreFailureCause.CORRUPT, StoreFailureCause.MISSING_FILE)
        if msg.operation == "load" and corrupt:
            # The rank read the version's bytes and they fail their digest (or a file is gone):
            # a finding about the bytes, so the version is struck at once (L1-3's report of it,
            # checkpoint_error, is then decided by the policy and relaunches from an older one).
            if msg.version and msg.version not in job.unusable:
                job.unusable.add(msg.version)
                self._record(
                    job,
                    ORCH,
                    "checkpoint",
                    f"checkpoint {msg.version} fails its digest check on load; never loaded again",
                )
            if self._checkpoints is not None:
                self._checkpoints(store_pb2.ScrubCheckpoints(job_id=job.status.job_id))  # answered as events

    def _broken_by_peer(self, job: _Job, msg: store_pb2.SnapshotFailed, what: str) -> None:
        """A save or load whose own collectives failed: almost always a peer lost during it
        (its rank killed, its node gone), whose fault L1-3 reports on its own path, often a
        moment after this (a node agent's session closing, a silence). Recorded as that
        incident's consequence, never as a failure of its own: the save is lost with the
        generation, and the recovery, not the store, is what the operator needs to read
        about. With no incident open yet, the record waits as long as L1-3 holds a comm_error
        for its cause (``_attribution_window``); an incident opened by then is the cause, else
        the failure is recorded as it is (a save's next interval tries again either way)."""
        incident = job.incident or _old_world_save(job.last_incident, msg)
        if incident is not None:
            self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(what, msg, incident))
            return
        held = _HeldFailure(msg, what)
        held.timer = self._deadlines.after(
            _attribution_window(job.spec), self._broken_by_peer_due, (job.status.job_id, held)
        )
        job.held.append(held)

    def _broken_by_peer_due(self, job_id: str, held: _HeldFailure) -> None:
        """A held failure's window passed with no incident opened: recorded as it is."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and any(h is held for h in job.held):  # (not yet released by an incident or the end)
                job.held = [h for h in job.held if h is not held]
                self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(held.what, held.msg, None))

    def _release_held(self, job: _Job, incident: _Incident | None) -> None:
        """Record the failures held for their cause (``_broken_by_peer``), oldest first: as
        ``incident``'s consequences (it opened), or as they are (a window passed, the job
        ends)."""
        held, job.held = job.held, []
        for h in held:
            if h.timer is not None:
                h.timer.cancel()
            self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(h.what, h.msg, incident))

    def on_checkpoint_scrubbed(self, msg: store_pb2.CheckpointScrubbed, payload: Any = None) -> None:
        """The store re-hashed a job's versions: those it found corrupt for the first time
        are struck, as when its scrub publishes them."""
        for corrupt in msg.newly_corrupt:
            self.on_checkpoint_corrupt(corrupt)

    def _verified(self, job: _Job, incident: _Incident, msg: store_pb2.CheckpointVerification) -> None:
        """Learn the verdicts (a version is struck only for its bytes: a digest mismatch or a
        missing file), then go on to placement."""
        known = {v for _, v in job.versions} | job.abandoned  # (another branch is not a lost report)
        for verdict in msg.versions:
            version, step = verdict.info.version, verdict.info.step
            if version in job.abandoned:
                continue
            if not verdict.ok:
                if _corrupt(verdict) and version not in job.unusable:
                    job.unusable.add(version)
                    self._record(
                        job,
                        Module.L5_CHECKPOINT_MANAGER,
                        "checkpoint",
                        f"checkpoint {version} at step {step} fails verification ({verdict.reason}); never loaded",
                    )
            elif version not in known:
                job.versions.append((step, version))
                self._record(
                    job,
                    Module.L5_CHECKPOINT_MANAGER,
                    "checkpoint",
                    f"checkpoint {version} at step {step} verified: committed by the store, "
                    "its completion report never arrived",
                )
        job.versions.sort()
        if incident.waiting_for == WAITING_STORE:
            incident.waiting_for = ""
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "recovery",
                f"the store answered after {time.monotonic() - incident.waiting_since:.1f} s of waiting; "
                "the recovery goes on",
            )
        self._place(job, incident)

    def _verification_failed(self, job: _Job, incident: _Incident, msg: store_pb2.SnapshotFailed) -> None:
        """The store could not be asked. Nothing is struck: the job waits FAULT_FROZEN and
        the verification is asked again with backoff, up to the policy's
        ``store_wait_seconds``; then the policy decides (``store_unreachable``)."""
        if msg.cause not in (StoreFailureCause.UNREACHABLE, StoreFailureCause.TIMEOUT):
            # The store answered but refused (e.g. it knows no version of the job): the
            # versions reported by SaveCompleted are all there is to choose from.
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "recovery",
                f"checkpoint verification refused ({msg.reason}); choosing among the versions reported",
            )
            self._place(job, incident)
            return
        cause = StoreFailureCause.Name(msg.cause).lower()
        self._wait(
            job,
            incident,
            WAITING_STORE,
            STORE_UNREACHABLE,
            job.spec.fault_policy.store_wait_seconds,
            f"waiting for the store ({cause}: {msg.reason}) to verify the checkpoints",
        )

    def _place(self, job: _Job, incident: _Incident) -> None:
        """Name the version (the newest usable one, within the rollback bound) and command
        the recovery controller to relaunch the ranks to load it. Scratch only when the job
        has no usable committed version."""
        self._cancel_timer(incident)
        in_place = incident.action in IN_PLACE_ACTIONS
        version = "" if in_place else self._pick_version(job, incident.bound)
        incident.version = version
        incident.phase = PLACING
        source = f"checkpoint {version}" if version else "scratch"
        if in_place:
            source = "a live peer's memory"
        reply = self._recovery(
            control_pb2.StartRecovery(
                job_id=job.status.job_id,
                checkpoint_version=version,
                exclude_worker_ids=incident.exclude,
                reason=f"{incident.action} after {incident.fault_class} of rank {incident.cause.rank}",
                in_place=in_place,
                lost_ranks=incident.lost,
                layout=_layout_msg(incident.shrunk) if incident.shrunk is not None else None,
            )
        ).message
        if isinstance(reply, control_pb2.RecoveryCompleted):
            old_world = job.status.world_size
            if incident.shrunk is not None and incident.shrunk.world_size != old_world:
                job.grow_to = job.grow_to or _layout_of(job.spec)  # (a second shrink grows back to the first's)
                self._take_layout(job, incident.shrunk)
            incident.relaunched, incident.phase, incident.retries = True, RESTORING, 0  # journaled with the event
            if incident.waiting_for == WAITING_CAPACITY:
                self._record(
                    job,
                    Module.L1_RESOURCE_ALLOCATOR,
                    "recovery",
                    f"capacity came back after {time.monotonic() - incident.waiting_since:.1f} s of waiting",
                )
            incident.waiting_for = ""
            self._record_relaunch(job, reply, source, old_world=old_world, lost=incident.lost)
            self._start_soon()  # (the queue was held for it)
            policy = job.spec.fault_policy
            limit = policy.rebuild_seconds if in_place else policy.restore_seconds
            self._arm(incident, limit, self._restore_overdue, job.status.job_id)
            return
        assert isinstance(reply, control_pb2.RecoveryFailed), reply
        # (Shrunk only when ranks to launch did not fit: not when the placement is unknown.)
        if incident.action == "shrink" and incident.shrunk is None and reply.requested_ranks > reply.available_ranks:
            smaller = _shrink_to(job, incident, reply.available_ranks)
            if smaller is not None:
                incident.shrunk = smaller
                self._record(
                    job,
                    ORCH,
                    "decision",
                    f"shrink after {incident.fault_class} of rank {incident.cause.rank}: {reply.reason}; the job goes "
                    f"on at {_layout_change(job.spec, smaller)}, and grows back to dp {job.spec.parallel.dp} "
                    "when slots return",
                )
                self._place(job, incident)
                return
        if in_place:
            # The survivors cannot be kept (no slot for a replacement, the placement unknown
            # after a control restart): every rank is relaunched from the newest checkpoint.
            self._record(
                job,
                ORCH,
                "decision",
                f"restart_ranks instead of rebuild after {incident.fault_class} of rank {incident.cause.rank}: "
                f"{reply.reason}; every rank relaunched from the newest checkpoint",
            )
            incident.action, incident.lost, incident.shrunk = "restart_ranks", [], None
            incident.dying.update(
                r for r in range(job.status.world_size) if r not in job.exited and not incident.dying[r]
            )
            self._recover(job, incident)
            return
        if reply.cause == RecoveryFailureCause.RECOVERY_NO_PLACEMENT:
            needs = f"needs {reply.requested_ranks or job.status.world_size} ranks, {reply.available_ranks} free"
            self._wait(
                job,
                incident,
                WAITING_CAPACITY,
                NO_CAPACITY,
                job.spec.fault_policy.capacity_wait_seconds,
                f"waiting for capacity to resume from {source}: {needs} ({reply.reason})",
            )
            return
        self._terminate(job, JobOutcome.FAILED, f"recovery failed: {reply.reason}", kill=True)

    def _retry(self, job_id: str, incident: _Incident, phase: str) -> None:
        """A wait's backoff ran out: the step it waits in is commanded again."""
        with self._lock:
            job = self._current(job_id, incident, phase)
            if job is None:
                return
            if phase == WAITING_STORE:  # (its answer may take the RPC's whole deadline)
                job.status.message = f"asking the store again (retry {incident.retries}) to verify the checkpoints"
                job.status.updated_unix = time.time()
                self._ask_verification(job, incident)
            else:
                self._place(job, incident)

    def _restore_overdue(self, job_id: str, incident: _Incident) -> None:
        """The relaunched ranks did not all report ready within ``restore_seconds`` (a rebuild
        in place: ``rebuild_seconds``, survivors included): a fault of the recovery itself
        (``recovery_timeout``), decided by the policy like any other."""
        with self._lock:
            job = self._current(job_id, incident, RESTORING)
            if job is None:
                return
            missing = sorted(set(range(job.status.world_size)) - job.started)
            report = control_pb2.FaultReport(
                job_id=job_id,
                grade=FaultGrade.SEVERE,
                fault_class=RECOVERY_TIMEOUT,
                source=Module.L1_RECOVERY_CONTROLLER,
                # A rebuild's is named after the rank it replaces (the survivors not ready are
                # in the detail: naming one would blame a healthy peer); a relaunch's after its first missing rank.
                rank=incident.cause.rank if incident.action in IN_PLACE_ACTIONS else missing[0] if missing else 0,
                detected_unix=time.time(),
                occurred_unix=time.time(),
                detail=_overdue(job, incident, missing),
            )
            self._record(job, Module.L1_RECOVERY_CONTROLLER, "fault", f"SEVERE {RECOVERY_TIMEOUT}: {report.detail}")
            self._decide(job, report)

    def _wait(self, job: _Job, incident: _Incident, phase: str, fault_class: str, limit_s: float, what: str) -> None:
        """Enter (or stay in) a wait state: say what the job waits for in its status, retry
        the step with backoff; past ``limit_s`` of waiting the policy decides ``fault_class``."""
        now = time.monotonic()
        incident.phase = phase
        if incident.waiting_for != phase:
            # The store's wait counts from the first question (its first timeout took a
            # deadline already: the fresh-user trial saw an 8 s budget give up after 22 s).
            since = incident.asked_since if phase == WAITING_STORE and incident.asked_since else now
            incident.waiting_for, incident.waiting_since, incident.retries = phase, since, 0
        waited = now - incident.waiting_since
        if waited >= limit_s:
            self._give_up(job, incident, fault_class, f"{what}: gave up after {waited:.0f} s")
            return
        incident.retries += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (incident.retries - 1), max(0.0, limit_s - waited))
        message = f"{what}; retry {incident.retries} in {delay:.1f} s, the fault policy decides after {limit_s:.0f} s"
        if incident.retries == 1:
            self._record(job, ORCH, "recovery", message, status_message=message)
        else:  # the status says it at every retry; the event log only at the first (no flood)
            job.status.message, job.status.updated_unix = message, time.time()
            self._keep(job)
        self._arm(incident, delay, self._retry, job.status.job_id, phase)

    def _give_up(self, job: _Job, incident: _Incident, fault_class: str, why: str) -> None:
        """A recovery step waited as long as the policy allows: its class decides. ``stop``
        ends the job FAILED with every version kept (``surgectl resume`` continues it
        later). Any other action goes on: without the store's verdicts (``store_unreachable``:
        the newest version reported is named; the ranks check its digests as they load it),
        or waiting another period for capacity (``no_capacity``: nothing else can place the
        ranks)."""
        action = job.spec.fault_policy.action_for(fault_class, "SEVERE")
        self._metrics.decided(fault_class, action)
        self._record(job, ORCH, "decision", f"{action} after {fault_class}: {why} (fault policy)")
        if action == "stop":
            self._terminate(job, JobOutcome.FAILED, f"{why}; every checkpoint is kept", kill=True)
            return
        if fault_class == NO_CAPACITY:
            incident.waiting_for = ""  # a new period of waiting
        self._place(job, incident)

    def _current(self, job_id: str, incident: _Incident, phase: str) -> _Job | None:
        """The job if ``incident`` is still its recovery in ``phase`` (a timer may fire after
        the incident ended or moved on)."""
        job = self._jobs.get(job_id)
        if job is None or job.incident is not incident or incident.phase != phase:
            return None
        incident.timer = None
        return job

    def _arm(self, incident: _Incident, seconds: float, fn: Any, job_id: str, *args: Any) -> None:
        self._cancel_timer(incident)
        incident.timer = self._deadlines.after(seconds, fn, (job_id, incident, *args))

    @staticmethod
    def _cancel_timer(incident: _Incident | None) -> None:
        if incident is not None and incident.timer is not None:
            incident.timer.cancel()
            incident.timer = None

    def _record_relaunch(
        self, job: _Job, reply: control_pb2.RecoveryCompleted, source: str, *, old_world: int = 0, lost: list[int] = ()
    ) -> None:
        """The recovery controller's relaunch, as an event; ``old_world``: the group's size
        before a resize (the job's new spec is journaled with it), ``lost``: its ranks that
        were lost (the others above the new size are released)."""
        workers = ", ".join(reply.worker_ids)
        if reply.in_place:
            launched = ", ".join(str(r) for r in reply.replaced_ranks)
            resized = old_world and old_world != job.status.world_size
            if not resized:
                what = f"replacement for rank(s) {launched or 'none'} launched on {workers or 'no worker'}"
                what += ", the survivors keep their processes"
            else:
                what = f"{old_world} -> {job.status.world_size} ranks: "
                what += f"rank(s) {launched} launched on {workers}" if launched else "no rank launched"
                released = [r for r in range(job.status.world_size, old_world) if r not in lost]
                if released:
                    what += f", rank(s) {', '.join(map(str, released))} released"
                what += "; the other ranks keep their processes"
            self._record(
                job,
                Module.L1_RECOVERY_CONTROLLER,
                "recovery",
                f"rebuild in place commanded (generation {reply.generation}, rendezvous "
                f"{reply.master_addr}:{reply.master_port}): {what}",
                spec_json=spec_to_json(job.spec) if old_world else None,
            )
            return
        self._record(
            job,
            Module.L1_RECOVERY_CONTROLLER,
            "recovery",
            f"ranks killed and relaunched on {workers} (rendezvous {reply.master_addr}:{reply.master_port}) "
            f"to resume from {source}; commanded in {reply.seconds:.2f} s (the ranks report ready as they restore)",
        )

    def _pick_version(self, job: _Job, bound: int | None) -> str:
        """The newest committed version not known unusable (and not after step ``bound``)."""
        for step, version in reversed(job.versions):
            if version not in job.unusable and (bound is None or step <= bound):
                return version
        return ""

    # ------------------------------------------------------------ resource events (L1-2)

    def on_resource_pressure(self, msg: control_pb2.ResourcePressure, payload: Any = None) -> None:
        """Append a "resource" event to the log of every live job named, e.g. ``memory
        pressure on wa: 1.2 GiB of 24.0 GiB available`` (GiB = 2**30 bytes)."""
        # Recorded only: what to do about pressure (pause, shrink, checkpoint and move)
        # is the fault policy's to decide, in a later issue; this method takes no action.
        what = "memory pressure" if msg.under_pressure else "memory pressure relieved"
        where = f"{msg.worker_id} {msg.device}" if msg.device else msg.worker_id  # (a device's, or the host's)
        text = f"{what} on {where}: {_gib(msg.available_bytes)} of {_gib(msg.total_bytes)} available"
        with self._lock:
            for job_id in msg.job_ids:
                job = self._jobs.get(job_id)
                if job is not None and job.status.state != JobState.TERMINATED:
                    self._record(job, Module.L1_RESOURCE_ALLOCATOR, "resource", text)

    # ------------------------------------------------------------ worker health (L1-3, L1-2)

    def _on_worker_fault(self, msg: control_pb2.FaultReport) -> None:
        """A fault of a worker itself (a report with no job: a device's error, reported once
        for its node whether or not a job runs there). A class that cordons
        (``fd.CORDON_CLASSES``) takes the worker out of placement for every job, new or
        relaunched, until its node agent registers again as another incarnation (L1-2 ends
        it then). The jobs with ranks there decide on their own reports, by their policies."""
        if msg.fault_class not in fd.CORDON_CLASSES:
            return
        with self._lock:
            if msg.worker_id in self._cordoned:
                return  # (a second device of the node, or the same error again)
        reason = f"{msg.fault_class}: {msg.detail}"
        cordon = self._allocator(
            control_pb2.CordonWorker(worker_id=msg.worker_id, reason=reason, unix_time=time.time())
        )
        _log.warning("worker cordoned", worker_id=msg.worker_id, reason=reason)
        self.on_worker_cordoned(cordon.message)

    def on_worker_cordoned(self, msg: control_pb2.WorkerCordoned, payload: Any = None) -> None:
        """A cordon in force (L1-2's reply to CordonWorker) or ended (``cleared``: the
        worker's node agent registered as another incarnation): journaled, so a restarted
        control commands it again, and listed with the jobs (``JobList.cordoned``)."""
        with self._lock:
            if msg.cleared:
                ended = self._cordoned.pop(msg.worker_id, None)
            else:
                self._cordoned[msg.worker_id] = msg
        if not msg.cleared:
            self._journal.save_cordon(msg)
            return
        if ended is not None:
            _log.info("worker cordon ended: its node agent registered again", worker_id=msg.worker_id)
        self._journal.delete_cordon(msg.worker_id)  # (also one restored for an agent gone meanwhile)

    def _restore_cordons(self) -> None:
        """The journaled cordons, commanded to L1-2 again with the node agent incarnation
        each holds for (another registering ends it)."""
        for c in self._journal.load_cordons():
            again = control_pb2.CordonWorker(
                worker_id=c.worker_id, reason=c.reason, incarnation=c.incarnation, unix_time=c.unix_time
            )
            self.on_worker_cordoned(self._allocator(again).message)

    # ------------------------------------------------------------ private

    def _restore(self) -> None:
        """Jobs from the journal. A live job (warming up, running, paused) keeps its state
        and bookkeeping: its node agents keep its ranks training while control is down and
        re-attach them, resending the events control has not applied; the fault detector
        watches it again, and a rank that does not re-attach in time is declared silent
        (then recovered by the policy). Workers excluded by earlier exclude_node decisions
        stay excluded (the adopted allocation names them).

        A job that was mid-recovery (FAULT_FROZEN with its incident journaled) resumes it:
        monitored and adopted like a live job, its incident restored with the restart it
        already spent. A relaunch journaled as done waits for the relaunched ranks to
        re-attach and report ready. One not known done waits for the re-attached ranks to
        tell: a relaunched rank's ready report says it happened (not repeated); a fault
        report first (a rank not re-attached in time, an exit) says it did not, and it is
        commanded again (``_on_resumed_fault``). A frozen job without a journaled incident
        (journal of an older control) stays frozen; the operator can stop it. Cordoned
        workers stay cordoned."""
        self._restore_cordons()
        for stored in self._journal.load_jobs():
            job = _Job(status=stored.status, spec=spec_from_json(stored.spec_json), seq=stored.last_seq)
            _load_runtime(job, stored.runtime)
            _set_layout(job.status, job.spec)  # (a journal of an older control has none)
            self._jobs[stored.status.job_id] = job
            state = job.status.state
            if state != JobState.FAULT_FROZEN:
                job.incident = None  # (journaled only while frozen)
            if state == JobState.STANDBY and stored.runtime.get("queued"):  # waits in the queue, in its place
                job.queued = self._queue.restore(job.status.job_id, stored.runtime["queued"])
                continue
            if self._restore_parked(job):  # (operator half: drained / parked jobs have no ranks to wait for)
                continue
            if state in (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED) or (
                state == JobState.FAULT_FROZEN and job.incident
            ):
                self._faults(start_monitoring(job.status.job_id, job.spec, restored=True, placement=job.placement))
                # The allocator learns the job again (what a recovery relaunches), with the
                # workers it must not use; its slots are taken as the node agents re-attach
                # the ranks.
                self._allocator(
                    control_pb2.AllocateResources(
                        job_id=job.status.job_id,
                        world_size=job.status.world_size,
                        backend=job.spec.parallel.backend,
                        init=engine_pb2.InitJob(
                            job_id=job.status.job_id,
                            spec_json=stored.spec_json,
                            data_address=self._data_address,
                            store_address=self._store_address,
                            standing_orders=fd.standing_orders(job.spec.fault_policy),
                            rebuild_in_place=job.spec.fault_policy.rebuilds,
                        ),
                        exclude_worker_ids=sorted(job.excluded),
                        adopt=True,
                    )
                )
                if state != JobState.FAULT_FROZEN:
                    self._reattaching.restored(job.status.job_id, job.status.world_size)
                    self._record(
                        job,
                        ORCH,
                        "state",
                        f"{JobState.Name(state)}: {REATTACH_MESSAGE}",
                        status_message=REATTACH_MESSAGE,
                    )
                    continue
                incident = job.incident
                what = f"{incident.action} after {incident.fault_class} of rank {incident.cause.rank}"
                if incident.relaunched:
                    how = "its ranks were relaunched; waiting for them to re-attach and report ready"
                else:
                    how = (
                        "its relaunch was commanded but not confirmed; waiting for the ranks to re-attach "
                        "(ready relaunched ranks: done; a rank missing: relaunched again)"
                    )
                self._record(
                    job, ORCH, "state", f"FAULT_FROZEN: {RESUME_MESSAGE} ({what}): {how}", status_message=RESUME_MESSAGE
                )
            elif state == JobState.FAULT_FROZEN:
                self._record(job, ORCH, "state", f"FAULT_FROZEN: {RESTART_MESSAGE}", status_message=RESTART_MESSAGE)
            elif state == JobState.STANDBY:
                self._transition(job, JobState.FAULT_FROZEN, ORCH, RESTART_MESSAGE)

    def _heard_from(self, job_id: str, rank: int) -> None:
        """A loop event of ``rank`` after a control restart: once every rank's came, the
        status stops saying control waits for them (unless something replaced it since)."""
        job = self._jobs.get(job_id)
        if job is not None and self._reattaching.heard(job_id, rank) and job.status.message == REATTACH_MESSAGE:
            self._record(
                job,
                ORCH,
                "state",
                f"{JobState.Name(job.status.state)}: {REATTACHED_MESSAGE}",
                status_message=REATTACHED_MESSAGE,
            )

    def _new_id(self, name: str) -> str:
        while True:
            job_id = f"{name}-{secrets.token_hex(3)}"
            if job_id not in self._jobs:
                return job_id

    def _get(self, job_id: str) -> _Job:
        if not job_id:
            raise ValueError("job_id is required")
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} not found")
        return job

    def _live(self, job_id: str, states: tuple[int, ...], msg: Any) -> _Job | None:
        job = self._jobs.get(job_id)
        if job is None or job.status.state not in states:
            _log.info(
                "event ignored",
                job_id=job_id,
                message=type(msg).__name__,
                state=JobState.Name(job.status.state) if job else "unknown job",
            )
            return None
        return job

    def _require(self, job: _Job, state: int) -> None:
        if job.status.state != state:
            raise IllegalTransition(
                f"job {job.status.job_id} is {JobState.Name(job.status.state)}, not {JobState.Name(state)}"
            )

    def _boundary(self, job: _Job) -> int:
        """The step boundary a pause or stop names: far enough ahead that every rank gets the
        command before it passes it (the ranks are ahead of the last step control applied by
        however many steps run while the command travels). Why: with fast steps, +2 was
        behind a rank by the time it arrived; that rank stopped one boundary later than its
        peer, whose stop checkpoint then waited in a collective the other never joined (a
        deadlock found by the fresh-user trial: 70 steps/s, DP=2). A margin, not an agreement:
        a command delayed past ``BOUNDARY_MARGIN_S`` can still miss it."""
        ahead = math.ceil(BOUNDARY_MARGIN_S / job.step_seconds) if job.step_seconds > 0 else 0
        return job.status.step + max(2, ahead)

    def _require_idle(self, job: _Job) -> None:
        if job.pending in ("pause", "stop"):
            doing = {"pause": "pausing", "stop": "stopping"}[job.pending]
            reason = {"pause": control_pb2.REFUSED_PAUSE_PENDING, "stop": control_pb2.REFUSED_STOP_PENDING}[job.pending]
            raise IllegalTransition(f"job {job.status.job_id} is already {doing} after step {job.pending_at}", reason)
        if job.scale is not None:
            raise IllegalTransition(
                f"job {job.status.job_id} is being resized to dp {job.scale.spec.parallel.dp} ({job.scale.why}); "
                "try again once its events say it is done"
            )

    def _terminate(self, job: _Job, outcome: int, message: str, *, kill: bool) -> None:
        self._cancel_timer(job.incident)
        job.status.outcome = outcome
        job.pending = ""
        job.incident = job.recovered = None
        # Journal the terminal state first: a failing release must never lose it.
        self._transition(job, JobState.TERMINATED, ORCH, f"{JobOutcome.Name(outcome)}: {message}")
        self._allocator(control_pb2.ReleaseResources(job_id=job.status.job_id, kill=kill))
        self._start_soon()

    def _transition(self, job: _Job, new: int, source: int, message: str) -> None:
        old = job.status.state
        if new not in _ALLOWED[old]:
            raise IllegalTransition(
                f"job {job.status.job_id}: {JobState.Name(old)} -> {JobState.Name(new)} is not allowed"
            )
        if new == JobState.TERMINATED:
            self._release_held(job, None)  # (the job's last records: nothing comes after its end)
        job.status.state = new
        self._record(
            job, source, "state", f"{JobState.Name(old)} -> {JobState.Name(new)}: {message}", status_message=message
        )

    def _snapshot(self, job: _Job) -> control_pb2.JobStatus:
        copy = control_pb2.JobStatus()
        copy.CopyFrom(job.status)
        copy.checkpoint_step = next((st for st, v in job.versions if v == copy.checkpoint_version), 0)
        copy.queue_position = self._queue.position(copy.job_id)
        if job.running_since and copy.state != JobState.TERMINATED:
            copy.elapsed_seconds = time.time() - job.running_since
        return copy

    def _keep(self, job: _Job) -> None:
        """Journal the job's bookkeeping (``_runtime``) without an event, with the cursor of
        the worker event being applied. Why: an event that changes only the bookkeeping (one
        rank of several finished or paused) was otherwise journaled as applied with no trace,
        and a control restarted before the last rank's event forgot it: it then took the
        finished rank's clean exit for a lost rank and relaunched a finished job (seen in
        tests/cli/test_restart.py)."""
        self._journal.save_status(job.status, None, _runtime(job))

    def _record(
        self,
        job: _Job,
        source: int,
        kind: str,
        message: str,
        *,
        status_message: str | None = None,
        spec_json: str | None = None,
    ) -> None:
        """Append one event to the job's log: journal status + event atomically (with the
        job's new spec, ``spec_json``, when it changed), publish."""
        now = time.time()
        s = job.status
        s.updated_unix = now
        if job.running_since:  # frozen at TERMINATED: no event follows that one
            s.elapsed_seconds = now - job.running_since
        if status_message is not None:
            s.message = status_message
        s.queue_position = self._queue.position(s.job_id)
        job.seq += 1
        event = control_pb2.JobEvent(
            job_id=s.job_id, seq=job.seq, unix_time=now, source=source, type=kind, message=message, status=s
        )
        self._journal.save_status(s, event, _runtime(job), spec_json=spec_json)
        job.last_persist = time.monotonic()
        _log.info("job event", job_id=s.job_id, seq=job.seq, type=kind, message=message)
        self._emit(event)


def _runtime(job: _Job) -> dict:
    """The bookkeeping a restarted control needs to continue the job (journaled with every
    event): who started / paused / finished, a pause or stop in flight, restart budgets
    spent, checkpoint versions, the workers excluded, the recovery in flight (its cause,
    the version it loads, whether its relaunch was commanded and completed), the verdicts the
    ranks may ask for again and the standing orders withdrawn from them."""
    return {
        "started": sorted(job.started),
        "paused": sorted(job.paused),
        "finished": {str(r): stopped for r, stopped in job.finished.items()},
        "pending": job.pending,
        "pending_at": job.pending_at,
        "running_since": job.running_since,
        "exited": sorted(job.exited),
        "restarts": dict(job.restarts),
        "ignored": dict(job.ignored),
        "versions": [list(v) for v in job.versions],
        "unusable": sorted(job.unusable),
        "excluded": sorted(job.excluded),
        "placement": {str(r): w for r, w in job.placement.items()},
        "start_held": job.start_held,
        "abandoned": sorted(job.abandoned),
        "incident": _incident_to_json(job.incident) if job.incident is not None else None,
        "draining": job.draining,
        "parked": job.parked,
        "verdicts": [base64.b64encode(v.SerializeToString()).decode() for v in job.verdicts.values()],
        "revoked": {str(order): step for order, step in job.revoked.items()},
        "queued": job.queued.to_json() if job.queued is not None else None,
        "grow_to": list(job.grow_to),
        "micro_batch_cap": job.micro_batch_cap_seen,
        "scale": _scale_to_json(job.scale) if job.scale is not None else None,
    }


# Beyond L1-3's hold of a comm_error, the time for its cause's decision to open an incident.
DECISION_MARGIN_SECONDS = 1.0
# A record held longer than this tells the operator nothing more (a heartbeat timeout of hours).
MAX_ATTRIBUTION_SECONDS = 60.0


def _attribution_window(spec: JobSpec) -> float:
    """How long a failed collective waits for its cause: as long as L1-3 holds a comm_error
    while a peer may be going quiet (its heartbeat timeout), plus the decision's margin."""
    live = spec.liveness
    window = max(live.attribution_seconds, live.heartbeat_timeout_seconds + 0.5) + DECISION_MARGIN_SECONDS
    return min(window, MAX_ATTRIBUTION_SECONDS)


def _old_world_save(incident: _Incident | None, msg: store_pb2.SnapshotFailed) -> _Incident | None:
    """``incident``, if ``msg`` is a save its survivors began before it (a step no later than
    the job's when it was decided): dropped with the group it rebuilt, reported by the relay
    at the next save, long after the recovery."""
    if incident is None or incident.action not in IN_PLACE_ACTIONS:
        return None
    return incident if msg.operation == "save" and 0 < msg.step <= incident.at_step else None


def _failed_text(what: str, cause: str, msg: store_pb2.SnapshotFailed) -> str:
    """E.g. "checkpoint save failed (timeout: ...); training continues, the next interval
    tries again"."""
    text = f"{what} failed ({cause}: {msg.reason})"
    return text + ("; training continues, the next interval tries again" if msg.operation == "save" else "")


def _broken_text(what: str, msg: store_pb2.SnapshotFailed, incident: _Incident | None) -> str:
    """The record of a save or load whose collectives failed, e.g. "checkpoint save of j:7
    failed, expected: CommunicationFailed: ... (consequence of rank 1's rank_exit)" (what
    follows is the recovery's, in its own records)."""
    if incident is None:
        return _failed_text(what, "communication", msg)
    of = f"rank {incident.cause.rank}'s {incident.fault_class}"
    return f"{what} failed, expected: {_clipped(msg.reason)} (consequence of {of})"


def _failure_name(msg: store_pb2.SnapshotFailed) -> str:
    """A failure with no store cause, by its typed failure cause ("communication": a peer lost
    in the save's collectives); "unknown" only when it has none."""
    cause = msg.failure.cause if msg.HasField("failure") else 0
    return route_pb2.FailureCause.Name(cause).removeprefix("FAILURE_").lower() if cause else "unknown"


def _overdue(job: _Job, incident: _Incident, missing: list[int]) -> str:
    policy = job.spec.fault_policy
    if incident.action in IN_PLACE_ACTIONS:
        return (
            f"ranks {missing} not ready {policy.rebuild_seconds:g} s (fault_policy.rebuild_seconds) after the "
            f"rebuild in place for rank {incident.cause.rank}'s {incident.fault_class} was commanded"
        )
    return f"ranks {missing} not ready {policy.restore_seconds:g} s (fault_policy.restore_seconds) after the relaunch"


def _no_rebuild(job: _Job, report: control_pb2.FaultReport) -> str:
    """Why the job's ranks cannot rebuild their group in place now for ``report`` ("": they
    can). During a rebuild another lost rank is rebuilt again as long as a rank that held
    the state before the first loss survives (a replacement that dies while it starts, or a
    second survivor lost, costs nothing of the training); only when none is left, or during
    another kind of recovery, is every rank relaunched from the checkpoint."""
    i = job.incident
    if i is not None and i.action in IN_PLACE_ACTIONS:
        holders = set(range(job.status.world_size)) - set(i.lost) - set(_lost_ranks(job, report))
        if holders:
            return ""
        return f"no rank that held the state survives (rebuild after {i.fault_class} of rank {i.cause.rank})"
    if i is not None:
        return f"a recovery is in flight ({i.action} after {i.fault_class} of rank {i.cause.rank})"
    if job.status.state != JobState.RUNNING:
        return f"the job is {JobState.Name(job.status.state)}, not training"
    if job.pending:
        return f"a {job.pending} is in flight"
    return rebuild_refusal(job.spec)


def _lost_ranks(job: _Job, report: control_pb2.FaultReport) -> list[int]:
    """The ranks a rebuild replaces: the rank the fault names, and for a lost node agent
    every rank it ran. A failed collective alone (comm_error) loses no rank: every rank
    survives and the group is rebuilt with the same processes."""
    if report.fault_class == "comm_error":
        return []
    lost = {report.rank}
    if report.fault_class in ("worker_lost", "worker_departed") and report.worker_id:
        lost |= {r for r, w in job.placement.items() if w == report.worker_id}
    return sorted(lost)


# What a survivor of a rebuild reports as its group breaks under it: consequences of the
# incident, not faults of their own.
_SURVIVOR_SYMPTOMS = frozenset({"comm_error", "rank_stalled_in_collective"})


CONSEQUENCE_DETAIL_CHARS = 160


def _consequence(report: control_pb2.FaultReport, of: str) -> str:
    """The event line of a report recorded as a consequence of an incident, not decided on:
    without L1-3's grade (SEVERE after every rebuild read as a new failure) and with the
    first ``CONSEQUENCE_DETAIL_CHARS`` of its detail (a broken collective's text runs to
    hundreds of characters and repeats in the report of every module it went through)."""
    return f"{report.fault_class}, expected: {_clipped(report.detail)} (consequence of {of})"


def _clipped(detail: str) -> str:
    """``detail`` on one line, its first ``CONSEQUENCE_DETAIL_CHARS``."""
    detail = " ".join(detail.split())
    if len(detail) > CONSEQUENCE_DETAIL_CHARS:
        detail = detail[: CONSEQUENCE_DETAIL_CHARS - 1].rstrip() + "…"
    return detail


def _survivor_symptom(incident: _Incident, report: control_pb2.FaultReport) -> bool:
    return (
        incident.action in IN_PLACE_ACTIONS
        and report.rank not in incident.lost
        and report.fault_class in _SURVIVOR_SYMPTOMS
    )


def _late_symptom(incident: _Incident, report: control_pb2.FaultReport) -> bool:
    """Whether ``report``, arriving after ``incident`` recovered, is a failed collective it
    caused before that: a rebuild's survivor's, or any rank's of a relaunched generation
    (every rank was replaced: seen when a rank died during a resize's pause, the survivors'
    comm_error came after the relaunch and was decided as a second fault)."""
    if report.fault_class not in _SURVIVOR_SYMPTOMS or not 0 < report.occurred_unix <= incident.recovered_unix:
        return False
    return incident.action not in IN_PLACE_ACTIONS or report.rank not in incident.lost


def _healed_text(incident: _Incident, world_size: int) -> str:
    """What a rebuild in place did, e.g. "group of 2 rebuilt in place: rank 1 healed from
    rank 0's memory, 1 rank kept its process"."""
    # (The survivors restore the source's state too: only the replacements are news.)
    healed = sorted((r, src) for r, src in incident.healed_from.items() if r in incident.lost and r != src)
    kept = len([r for r in range(world_size) if r not in incident.lost])
    text = f"group of {world_size} rebuilt in place: "
    if healed:
        text += ", ".join(f"rank {r} healed from rank {src}'s memory" for r, src in healed) + ", "
    return text + _kept_text(kept)


def _kept_text(kept: int) -> str:
    """E.g. "1 rank kept its process", "2 ranks kept their processes"."""
    return f"{kept} rank{'' if kept == 1 else 's'} kept {'its process' if kept == 1 else 'their processes'}"


def _incident_to_json(i: _Incident) -> dict:
    return {
        "cause": base64.b64encode(i.cause.SerializeToString()).decode(),
        "fault_class": i.fault_class,
        "action": i.action,
        "dying": {str(r): n for r, n in i.dying.items() if n > 0},
        "version": i.version,
        "bound": i.bound,
        "exclude": list(i.exclude),
        "lost": list(i.lost),
        "shrunk": spec_to_json(i.shrunk) if i.shrunk is not None else "",
        "relaunched": i.relaunched,
        "phase": i.phase,
        "paused": i.paused,
    }


def _incident_from_json(d: dict) -> _Incident:
    """The recovery in flight as journaled, ``resumed``: until a relaunched rank reports
    ready, nothing says its relaunch reached the node agents. Even one journaled as done
    (``relaunched``) was only queued to the sessions: control killed right after may never
    have sent it (seen in CI: the old ranks still ran and the new never came).
    Its clock (``decided``) starts again now: the time before the restart is not measured."""
    relaunched = bool(d.get("relaunched", False))
    return _Incident(
        cause=control_pb2.FaultReport.FromString(base64.b64decode(d["cause"])),
        fault_class=d["fault_class"],
        # A rebuild caught by a control restart stays one: if its ranks report ready, it
        # completed; if it must be commanded again, the allocator no longer knows the
        # placement and the orchestrator falls back to relaunching every rank (_place).
        action=d["action"],
        lost=[int(r) for r in d.get("lost", ())],
        shrunk=spec_from_json(d["shrunk"]) if d.get("shrunk") else None,
        decided=time.monotonic(),
        dying=Counter({int(r): int(n) for r, n in d.get("dying", {}).items()}),
        version=d.get("version", ""),
        bound=d.get("bound"),
        exclude=list(d.get("exclude", ())),
        relaunched=relaunched,
        resumed=True,
        phase=d.get("phase", RESTORING if relaunched else PLACING),
        paused=bool(d.get("paused", False)),
    )


def _load_runtime(job: _Job, rt: dict) -> None:
    job.started, job.paused = set(rt.get("started", ())), set(rt.get("paused", ()))
    job.finished = {int(r): bool(v) for r, v in rt.get("finished", {}).items()}
    job.pending, job.pending_at = rt.get("pending", ""), int(rt.get("pending_at", 0))
    job.running_since = float(rt.get("running_since", 0.0))
    job.exited = set(rt.get("exited", ()))
    job.restarts, job.ignored = Counter(rt.get("restarts", {})), Counter(rt.get("ignored", {}))
    job.versions = [(int(step), str(v)) for step, v in rt.get("versions", ())]
    job.unusable = set(rt.get("unusable", ()))
    job.excluded = set(rt.get("excluded", ()))
    job.placement = {int(r): str(w) for r, w in rt.get("placement", {}).items()}
    job.start_held = bool(rt.get("start_held", False))
    job.abandoned = set(rt.get("abandoned", ()))
    job.draining, job.parked = bool(rt.get("draining", False)), bool(rt.get("parked", False))
    verdicts = (engine_pb2.StepVerdict.FromString(base64.b64decode(v)) for v in rt.get("verdicts", ()))
    job.verdicts = {(v.step, v.kind): v for v in verdicts}
    job.revoked = {int(order): int(step) for order, step in rt.get("revoked", {}).items()}
    if rt.get("incident"):
        job.incident = _incident_from_json(rt["incident"])
    job.grow_to = tuple(int(n) for n in rt.get("grow_to", ()))
    job.micro_batch_cap_seen = int(rt.get("micro_batch_cap", 0))
    if rt.get("scale"):
        d = rt["scale"]
        job.scale = _Scale(
            spec_from_json(d["spec"]), d["why"], phase=d["phase"], old_dp=int(d["old_dp"]), since=time.monotonic()
        )


def _scale_to_json(scale: _Scale) -> dict:
    return {"spec": spec_to_json(scale.spec), "why": scale.why, "phase": scale.phase, "old_dp": scale.old_dp}


def _step_verdict(report: engine_pb2.StepFaultReported, decision: fd.Decision) -> engine_pb2.StepVerdict:
    """L1-1's verdict to the ranks blocked on the step fault ``report`` says, by ``decision``."""
    return engine_pb2.StepVerdict(
        job_id=report.job_id, step=report.step, kind=report.kind, action=decision.verdict, reason=decision.text
    )


def _known(job: _Job, candidates: list[tuple]) -> set[str]:
    """Every version of the job control or the store knows of."""
    return {v for _, v in job.versions} | {c[1] for c in candidates}


def _corrupt(verdict: store_pb2.CheckpointVerdict) -> bool:
    """Whether a failed verdict is about the version's bytes (the only reason to strike it)."""
    # (A store older than the typed verdict sends none: it said not-ok only for a hash failure.)
    return verdict.cause in (store_pb2.VERDICT_UNSPECIFIED, store_pb2.VERDICT_CORRUPT, store_pb2.VERDICT_MISSING_FILE)


class _Answer:
    """The store's answer to an operator resume's VerifyCheckpoints, delivered by the
    applier thread to the operator's thread that waits for it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: store_pb2.CheckpointVerification | store_pb2.SnapshotFailed | None = None


# How long an operator resume waits for the store's verdicts (seconds).
RESUME_VERIFY_WAIT_S = 30.0


def _version_number(version: str) -> int:
    """The commit number of ``<job>:<n>`` (0 if it has none)."""
    tail = version.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def checkpoint_text(msg: store_pb2.SaveCompleted) -> str:
    """The event of a committed version: its size, and what its save wrote (a baseline: every
    chunk; a delta: the chunks that changed). Parsers rely on "checkpoint V at step N (" and
    " bytes, " (tests/faults)."""
    total = size_text(msg.bytes)
    if msg.baseline:
        wrote = f"{total}, baseline"
    elif msg.written_bytes:
        wrote = f"{total} total, {size_text(msg.written_bytes)} written, delta"
    else:  # a version of plain files (or a delta that wrote nothing: SaveCompleted cannot tell)
        wrote = total
    return f"checkpoint {msg.version} at step {msg.step} ({wrote}; {msg.bytes} bytes, {msg.files} files)"


# How a recovery's event names where its ranks' chunks came from.
_SOURCE_TEXT = {"memory": "memory (own node)", "peer": "the peer's memory", "store": "the store"}


def restored_from_text(bytes_from: dict[str, int] | Counter[str]) -> str:
    """Where the ranks of a recovery read their checkpoint's chunks, from the bytes per
    source they reported: "read from memory (own node)" (one source), or with the bytes of
    each when mixed ("read from memory (own node) 1.2 MB + the peer's memory 300 KB");
    "" when nothing was reported (a version of plain files, or ranks of an older release)."""
    order = list(_SOURCE_TEXT) + sorted(set(bytes_from) - set(_SOURCE_TEXT))
    used = [(name, bytes_from[name]) for name in order if bytes_from.get(name)]
    if not used:
        return ""
    if len(used) == 1:
        return f"read from {_SOURCE_TEXT.get(used[0][0], used[0][0])}"
    return "read from " + " + ".join(f"{_SOURCE_TEXT.get(n, n)} {size_text(b)}" for n, b in used)


def _newest(job: _Job) -> str:
    """The job's newest committed version not known unusable, as text."""
    usable = [(step, v) for step, v in job.versions if v not in job.unusable]
    if not usable:
        return "(no checkpoint yet)"
    step, version = max(usable, key=lambda sv: (sv[0], _version_number(sv[1])))
    return f"checkpoint {version} (step {step})"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _beyond_cluster(reply: control_pb2.ResourcesInsufficient) -> bool:
    """Whether the allocator refused because the job needs more ranks than every registered
    worker's slots together (it can start only once more workers join)."""
    return reply.registered_ranks < reply.requested_ranks


def _waits_for(job: _Job, reply: control_pb2.ResourcesInsufficient) -> str:
    """What a queued job waits for, from the allocator's refusal to place it."""
    n = reply.requested_ranks or job.status.world_size
    needs = f"needs {n} rank{'' if n == 1 else 's'} ({_degrees(job.spec)})"
    if _beyond_cluster(reply):
        return f"{needs}, more than the {reply.registered_ranks} registered: waits for workers to join"
    return f"{needs}; {reply.reason}: waits for ranks to free up"


def _degrees(spec: JobSpec) -> str:
    """The parallel degrees a job's rank count comes from, as its spec names them."""
    p = spec.parallel
    return f"parallel.dp={p.dp}" + (f" x tp={p.tp} x pp={p.pp}" if p.tp * p.pp > 1 else "")


def _layout_asked(msg: control_pb2.ResumeJobRequest) -> bool:
    """Whether an operator resume names a data-parallel layout."""
    return bool(msg.dp or msg.micro_batch_size or msg.grad_accum)


def _layout_flags(msg: control_pb2.ResumeJobRequest) -> str:
    """The layout options of an operator resume, as `surgectl resume` spells them."""
    named = (("--dp", msg.dp), ("--micro-batch-size", msg.micro_batch_size), ("--grad-accum", msg.grad_accum))
    return " ".join(f"{flag} {value}" for flag, value in named if value)


def _new_layout(spec: JobSpec, msg: control_pb2.ResumeJobRequest) -> JobSpec | None:
    """The job's spec at the data-parallel layout an operator resume asks for (0: the job's
    own value); None when it asks for none, or for the job's own. The global batch
    (micro_batch_size x grad_accum x dp rows) must stay: the data position is a cursor into
    one global sequence of global batches, and the step count, schedule and losses are per
    global batch. tp and pp cannot be asked for (a reshape of the model's shards is another
    matter); the allocator says whether the new world size fits.

    Raises:
        JobSpecError: one line naming the options and the field at fault; nothing changed.
    """
    if not _layout_asked(msg):
        return None
    p, d = spec.parallel, spec.data
    dp, mbs, accum = msg.dp or p.dp, msg.micro_batch_size or d.micro_batch_size, msg.grad_accum or d.grad_accum
    if (dp, mbs, accum) == (p.dp, d.micro_batch_size, d.grad_accum):
        return None
    rows, kept = mbs * accum * dp, d.micro_batch_size * d.grad_accum * p.dp
    flags = _layout_flags(msg)
    if rows != kept:
        raise JobSpecError(
            f"{flags}: the global batch (data.micro_batch_size x data.grad_accum x parallel.dp) would be "
            f"{mbs} x {accum} x {dp} = {rows} rows, not the job's {kept} ({d.micro_batch_size} x {d.grad_accum} x "
            f"{p.dp}); a resume keeps it: choose --micro-batch-size and --grad-accum so the product stays {kept}"
        )
    return with_layout(spec, dp=dp, micro_batch_size=mbs, grad_accum=accum, source=flags)


def _layout_change(old: JobSpec, new: JobSpec) -> str:
    """What a resume at a new layout changes, as text (the decision's)."""
    fields = (
        ("parallel.dp", old.parallel.dp, new.parallel.dp),
        ("data.micro_batch_size", old.data.micro_batch_size, new.data.micro_batch_size),
        ("data.grad_accum", old.data.grad_accum, new.data.grad_accum),
        ("eval.batches", old.eval.batches, new.eval.batches),
    )
    changed = ", ".join(f"{name} {a} -> {b}" for name, a, b in fields if a != b)
    rows = new.parallel.dp * new.data.micro_batch_size * new.data.grad_accum
    return f"{changed} (world size {old.world_size} -> {new.world_size}; the global batch of {rows} rows kept)"


def _set_layout(status: control_pb2.JobStatus, spec: JobSpec) -> None:
    """The job's data-parallel layout in its published status."""
    status.dp, status.micro_batch_size, status.grad_accum = (
        spec.parallel.dp,
        spec.data.micro_batch_size,
        spec.data.grad_accum,
    )


def _layout_of(spec: JobSpec) -> tuple[int, int, int]:
    return spec.parallel.dp, spec.data.micro_batch_size, spec.data.grad_accum


def _layout_msg(spec: JobSpec) -> engine_pb2.DataParallelLayout:
    dp, mbs, accum = _layout_of(spec)
    return engine_pb2.DataParallelLayout(dp=dp, micro_batch_size=mbs, grad_accum=accum)


def _rebuilding(scale: _Scale | None) -> bool:
    """Whether a resize's ranks are rebuilding their group (they report ready next)."""
    return scale is not None and scale.phase == "rebuilding"


def _shrink_to(job: _Job, incident: _Incident, free_slots: int) -> JobSpec | None:
    """The job at the largest data-parallel size its remaining ranks allow (issue 16's
    shrink), or None: the survivors plus the free slots, below the job's size, with the
    global batch split evenly (:func:`services.jobspec.at_data_parallel_size`) and a
    survivor among the kept ranks 0..dp-1 (ranks keep their ids: one holding the state
    must remain to heal the others)."""
    world = job.status.world_size
    survivors = [r for r in range(world) if r not in incident.lost]
    for dp in range(min(len(survivors) + free_slots, world - 1), 0, -1):
        if not any(r < dp for r in survivors):
            continue
        try:
            return at_data_parallel_size(job.spec, dp, largest=job.micro_batch_cap, source="shrink")
        except JobSpecError:
            continue
    return None
