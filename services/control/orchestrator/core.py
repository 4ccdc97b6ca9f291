"""The orchestrator (L1-1) composed: its ports, its decision lock, the jobs, and the bookkeeping
every concern shares (a transition, a boundary command, the views published; recording an
event and its journal write are decision_writes.py's).

Each concern is a mixin in its own file (queue, operator commands, operator resume, resize,
rank events, fault intake, worker health, recovery, restore after a restart); ``Orchestrator``
joins them. The package docstring (``__init__.py``) describes the module as a whole.

Locks, outermost first (services/control/event_applier.py gives control's whole order):

1. ``_lock``, the decision lock: a decision reads and changes the jobs, the queue, the
   cordons and commands the other modules; re-entrant (a command this module sends may come
   back as an event on the same thread). Held for the decision only: the operator's queries
   never take it (they read ``JobViews``, published under it after each change), and a rank
   0 step's journal write is queued after it (``_write_later``) and not waited for;
2. a job's journal lock (``_journal_lock``): the order in which the job's journal writes are
   queued on the journal's group-commit writer (services/control/journal_writer.py: one
   FIFO, committed in groups, in order), so in the order decided. Taken under the decision
   lock, or alone by the thread a decision handed its writes to (it took the lock before it
   let the decision lock go, so no later decision's write of the job is queued before it);
   nothing is taken under it but leaf locks (the writer's queue; waiting on a write's commit
   under it is allowed: the writer takes no lock of this module).

A decision's journal writes and the commands held behind them until those are committed:
decision_writes.py.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future
from typing import Any

import structlog

from services.common.deadlines import Deadline, Deadlines
from services.contract import Module, control_pb2, engine_pb2
from services.contract.bus import CommandPort, Emitter, Reply
from services.control import fault_decision as fd
from services.control.cluster_metrics import watch_jobs
from services.control.job_queue import JobQueue
from services.control.job_store import JobStore
from services.control.metrics import ControlMetrics
from services.control.orchestrator.activity import REFUSE, Admission, Ask, admit, end
from services.control.orchestrator.annotations import Annotating
from services.control.orchestrator.commit_later import CommitLater
from services.control.orchestrator.decision_writes import DecisionWrites
from services.control.orchestrator.departure import Departures
from services.control.orchestrator.effects import Effects
from services.control.orchestrator.eval_hooks import EvalHooks
from services.control.orchestrator.faults import FaultIntake
from services.control.orchestrator.freeze import Freezing
from services.control.orchestrator.held_steps import HeldSteps, HeldStepWrites
from services.control.orchestrator.job import (
    _ALLOWED,
    EVENT_LOG,
    ORCH,
    REATTACH_MESSAGE,
    REATTACHED_MESSAGE,
    JobOutcome,
    JobState,
    _Job,
    _numbered,
    _where,
    checkpoint_step,
)
from services.control.orchestrator.journal import JournalRestore
from services.control.orchestrator.one_write import OneWrite
from services.control.orchestrator.operator import OperatorCommands
from services.control.orchestrator.outbox import Outbox
from services.control.orchestrator.preemption import PREEMPTION_CLAIM_S, PolicyTimer, Preempting
from services.control.orchestrator.profiles import Profiling
from services.control.orchestrator.queue import JobQueueing
from services.control.orchestrator.recovery import Recovery
from services.control.orchestrator.recovery_waits import RecoveryWaits
from services.control.orchestrator.refusals import IllegalTransition, JobNotFound
from services.control.orchestrator.resize import Resizing
from services.control.orchestrator.resume import OperatorResume, _Answer
from services.control.orchestrator.rollback import RollingBack
from services.control.orchestrator.stop_deadline import StopDeadlines
from services.control.orchestrator.teams import Teams
from services.control.orchestrator.texts import _newest, _usable
from services.control.orchestrator.training import RankEvents
from services.control.orchestrator.undos import Undos
from services.control.orchestrator.views import DecisionLock, JobViews
from services.control.orchestrator.worker_health import WorkerHealth
from services.control.reattach import Reattaching
from services.control.scheduler import QuotaBook
from services.jobspec import spec_to_json

_log = structlog.get_logger("orchestrator")


class Orchestrator(
    Effects,
    JobQueueing,
    OperatorCommands,
    OperatorResume,
    Resizing,
    RankEvents,
    FaultIntake,
    WorkerHealth,
    Recovery,
    RecoveryWaits,
    Freezing,
    RollingBack,
    Annotating,
    Profiling,
    Departures,
    Preempting,
    StopDeadlines,
    EvalHooks,
    JournalRestore,
    Teams,
    Undos,
    OneWrite,
    HeldStepWrites,
    CommitLater,
    DecisionWrites,
):
    """Owns every job's state machine. Thread-safe: one short lock orders all decisions
    (see the module docstring for the locks).

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
        quotas: the teams' quotas from the quota file (services/control/scheduler/quotas.py);
            None: none (every team unlimited, as before issue 30). Journaled `surgectl team`
            commands override it.
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
        metric_series: CommandPort | None = None,
        preemption_grace_s: float = 60.0,
        preemption_min_run_s: float = 120.0,
        resize_min_interval_s: float = 60.0,
        quotas: QuotaBook | None = None,
        preemption_claim_s: float = PREEMPTION_CLAIM_S,
    ):
        self._faults, self._emit = faults, emit
        # Commands to the ranks, and releases, go once the decision's journal write is committed.
        self._outbox = Outbox()
        self._last_write: dict[str, Future] = {}  # job id -> its last journal write queued by a decision
        self._held_steps = HeldSteps()  # rank 0 steps whose journal write failed (held_steps.py)
        journal.health.on_recovered(self._journal_recovered)  # (written again once it commits)
        self._decided = threading.local()  # this thread's decision: its writes (futures) and jobs commanded
        self._loop = self._after_journal(loop)
        self._allocator = self._after_journal(allocator, only=(control_pb2.ReleaseResources,))
        self._checkpoints = checkpoints
        # L5-1: a job's checkpoint series retired at its end, once journaled (recovery.py).
        self._checkpoint_series = self._after_journal(checkpoints) if checkpoints is not None else None
        # L5-2: a job's series retired at its end and its ranks' relaunch, once journaled.
        self._metric_series = self._after_journal(metric_series) if metric_series is not None else None
        self._recovery = recovery
        self._metrics = metrics or ControlMetrics()
        self._journal = journal
        self._data_address, self._store_address = data_address, store_address
        self._persist_interval_s = persist_interval_s
        # Re-entrant: a command this module sends may come back as an event on this thread.
        # Once a decision is over, the jobs it changed are published (``_publish_changed``).
        self._lock = DecisionLock(self._publish_changed, self._decision_over)  # (commit_later.py)
        self._changed: set[str] = set()  # jobs whose view is to be published as the decision ends
        self._places_changed = False  # the queue's order changed in this decision
        self._jobs: dict[str, _Job] = {}
        self._reserved: set[str] = set()  # ids of submits being journaled (outside the lock)
        self._reattaching = Reattaching()  # restored live jobs: ranks not heard from since
        # Restored live jobs -> their last boundary command number when control restarted:
        # those up to it still in flight go again once the ranks re-attach (_send_again).
        self._sent_before_restart: dict[str, int] = {}
        self._answers: dict[str, _Answer] = {}  # job -> an operator resume waiting for the store's verdicts
        # The recovery steps' retries and deadlines: callbacks take the lock like any event.
        self._deadlines = Deadlines("orchestrator", workers=1)
        self._views = JobViews()  # what the operator's queries read
        watch_jobs(self._views.census)  # and control's cluster gauges, when scraped
        self._queue = JobQueue(on_change=self._queue_changed)
        self._start_armed: Deadline | None = None  # the queue's head is about to be tried
        self._cordoned: dict[str, control_pb2.WorkerCordoned] = {}  # worker id -> its cordon in force
        self._held: dict[str, control_pb2.WorkerCordoned] = {}  # worker id -> its placement hold (worker_health.py)
        # Preemption (preemption.py): a victim's grace, a new job's protection, a preemptor's claim.
        self._preemption_grace_s, self._preemption_min_run_s = preemption_grace_s, preemption_min_run_s
        self._preemption_claim_s = preemption_claim_s
        # The preemption's and growing back's timers by name (preemption.py ``_arm_policy_timer``).
        self._policy_timers: dict[str, PolicyTimer] = {}
        # A preemptor found a lower job still starting (not preemptable yet): the queue is tried
        # again once a job runs and its minimum run time ends (preemption.py ``_preemption_on_run``).
        self._preempt_after_start = False
        self._hooks_submitting: set[tuple[str, int]] = set()  # eval.hooks asked, not yet a job (eval_hooks.py)
        self._resize_min_interval_s = resize_min_interval_s  # a job grows back at most once per this (grow_rule.py)
        self._journal_locks: dict[str, threading.RLock] = {}  # job id -> its journal writes' order
        self._init_teams(quotas)
        self._restore()
        with self._lock:
            for job in self._jobs.values():
                self._publish(job)
            self._rearm_preemptions()
            self._rearm_stops()
            self._publish_cordons()

    def close(self) -> None:
        """No retry or step deadline fires any more (control is stopping: a restarted
        control resumes the journaled recoveries)."""
        self._deadlines.close()

    def job_query(
        self, msg: control_pb2.JobQuery, payload: Any = None
    ) -> control_pb2.JobStatus | control_pb2.JobList | Reply:
        """An empty job id lists every job (JobList). Otherwise the job's JobStatus (with
        ``spec_json``, its effective spec, when ``with_spec``); with payload ``EVENT_LOG``
        the reply payload is its events with seq >= from_seq (of ``types``, the newest
        ``tail``: the journal's SQL selects them). Answered from the published
        views and the journal, never under the decision lock (a long history is read and
        deserialised while decisions go on).

        Raises:
            JobNotFound: unknown job id.
        """
        if not msg.job_id:
            jobs, cordoned = self._views.listing()
            return control_pb2.JobList(jobs=jobs, cordoned=cordoned, journal_failing=self._journal.health.failing())
        status = self._views.status(msg.job_id)
        if status is None:
            raise JobNotFound(f"job {msg.job_id} not found")
        if payload == EVENT_LOG:  # (those journaled before this query: its job's writes only are waited for)
            return Reply(
                status,
                tuple(
                    self._journal.events(
                        msg.job_id, msg.from_seq, self._last_write.get(msg.job_id), msg.tail, tuple(msg.types)
                    )
                ),
            )
        job = self._jobs.get(msg.job_id)
        if msg.with_spec and job is not None:  # the effective spec, as journaled (a resume --dp replaced it there too)
            status.spec_json = spec_to_json(job.spec)  # (a spec is replaced whole, never changed in place)
        return status

    def _heard_from(self, job_id: str, rank: int) -> None:
        """A loop event of ``rank`` after a control restart: once every rank's came, the
        status stops saying control waits for them (unless something replaced it since)."""
        job = self._jobs.get(job_id)
        if job is None or not self._reattaching.heard(job_id, rank):
            return
        self._send_again(job)
        if job.status.message == REATTACH_MESSAGE:
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
            if job_id not in self._jobs and job_id not in self._reserved:
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
            # (what to do next where one command does it: a fresh user's `scale` of a paused job)
            then = (
                f": `surgectl resume {job.status.job_id}` first"
                if job.status.state == JobState.PAUSED and state == JobState.RUNNING
                else ""
            )
            raise IllegalTransition(
                f"job {job.status.job_id} is {JobState.Name(job.status.state)}, not {JobState.Name(state)}{then}"
            )

    def _in_flight(self, job: _Job, what: str, cmd: Any) -> Any:
        """Under the lock: ``what`` (pause, scale, stop) is in flight as ``cmd``, numbered
        (``_numbered``); returns it, to be sent once journaled. Its boundary is not named
        here: the ranks agree on it in their step's all-reduce (services/common/
        boundary_commands.py; a guessed step, once ``step + max(2, ceil(1 s / step time))``,
        left a rank that got the command late at another boundary, and the stop's checkpoint
        collectives hung), and report it."""
        cmd = _numbered(job, cmd)
        job.pending_at, job.pending_seq = 0, cmd.seq
        if what in ("pause", "stop"):  # (a resize's or a rollback's pause: its activity holds it)
            job.pending = what
        return cmd

    def _start_group(self, job: _Job) -> None:
        """Under the lock: StartTraining to the job's ranks, with its last boundary command
        number, where the group's agreement starts (any command sent before is void for it)."""
        job.in_flight.clear()
        self._loop(engine_pb2.StartTraining(job_id=job.status.job_id, command_seq=job.commands))

    def _send_again(self, job: _Job) -> None:
        """Under the lock, every rank of a job restored after a control restart re-attached:
        the boundary commands in flight go again, in their order, with their numbers (one
        queued when control died may never have left; a rank that has one drops the copy),
        so each takes effect once. (Those this control sent went on their way.)"""
        before = self._sent_before_restart.pop(job.status.job_id, 0)
        again = [seq for seq in sorted(job.in_flight) if seq <= before]
        for seq in again:
            self._loop(job.in_flight[seq])
        if again:
            _log.info("boundary commands sent again", job_id=job.status.job_id, seqs=again)

    def _agreed(self, job: _Job, msg: engine_pb2.StepCompleted) -> None:
        """Under the lock, rank 0's step: the boundary commands every rank agreed on in it
        take effect at its boundary: the pause / stop in flight has its step, a revoke in
        flight is recorded with it."""
        if not msg.commands_agreed:
            return
        for seq in [seq for seq in job.in_flight if seq <= msg.commands_agreed]:
            del job.in_flight[seq]  # (every rank holds it: nothing to send again)
        if job.pending and job.pending_seq and job.pending_seq <= msg.commands_agreed and not job.pending_at:
            job.pending_at = msg.step
            self._record(job, Module.L2_TRAINING_LOOP, "rank", f"{job.pending}: every rank agreed on {_where(job)}")
        for order, (seq, step) in sorted(job.revoked.items()):
            if not step and seq <= msg.commands_agreed:
                job.revoked[order] = (seq, msg.step)
                self._record(
                    job,
                    Module.L2_TRAINING_LOOP,
                    "rank",
                    f"standing order {fd.order_name(job.spec.fault_policy, order)} revoked after step {msg.step}",
                )

    def _require_idle(self, job: _Job, ask: Ask) -> Admission:
        """Refuse ``ask`` while a pause or stop is in flight, or where ``activity.admit``
        refuses it beside the job's activity in flight; else its admission (START or FOLD)."""
        if job.pending in ("pause", "stop"):
            doing = {"pause": "pausing", "stop": "stopping"}[job.pending]
            reason = {"pause": control_pb2.REFUSED_PAUSE_PENDING, "stop": control_pb2.REFUSED_STOP_PENDING}[job.pending]
            raise IllegalTransition(f"job {job.status.job_id} is already {doing} ({_where(job)})", reason)
        admission = admit(job.status.job_id, job.activity, ask)
        if admission.verdict == REFUSE:
            raise IllegalTransition(admission.reason)
        return admission

    def _terminate(self, job: _Job, outcome: int, message: str, *, kill: bool) -> None:
        self._cancel_timer(job.incident)
        self._end_data_wait(job)
        job.status.outcome = outcome
        job.pending = ""
        end(job)  # (whatever was in flight ends with the job: a recovery awaiting its first step too)
        # An ended job is nobody's to resume by itself: a drain or a resume in flight ends with it.
        job.draining = job.parked = job.parked_live = job.resume_after_pause = job.status.drained = False
        job.drain_unsaved_step = 0
        job.departure = job.status.preempted_by = ""
        self._lose_profiles(job, f"job {JobOutcome.Name(outcome)}")  # (its ranks are gone: no report comes)
        if outcome == JobOutcome.FAILED and _usable(job):
            # (as a stop's end says: where `surgectl resume` would continue from; was said for STOPPED only)
            message += f"; `surgectl resume {job.status.job_id}` continues from {_newest(job)}"
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
        if new == JobState.TERMINATED:  # (its ranks' series on the store's /metrics go: recovery.py)
            self._metrics.job_ended(JobOutcome.Name(job.status.outcome))
            self._retire_series(job, JobOutcome.Name(job.status.outcome), ended=True)

    def _snapshot(self, job: _Job) -> control_pb2.JobStatus:
        """Under the lock: a copy of the job's status, for a reply; published as its view too
        (a command's reply and a later query say the same)."""
        self._publish(job)
        self._refresh_borrowed()  # (teams.py: the reply says what the query will)
        return self._copy(job)

    def _copy(self, job: _Job) -> control_pb2.JobStatus:
        copy = control_pb2.JobStatus()
        copy.CopyFrom(job.status)
        copy.checkpoint_step = checkpoint_step(job)
        copy.queue_position = self._queue.position(copy.job_id)
        if job.draining and copy.state == JobState.RUNNING:  # (a drain's pause in flight: no training)
            copy.draining, copy.draining_step = True, job.drain_save_step
        if job.running_since and copy.state != JobState.TERMINATED:
            copy.elapsed_seconds = time.time() - job.running_since
        return copy

    def _publish(self, job: _Job) -> None:
        """Under the lock: the job's status is what the operator's queries see once this
        decision is over."""
        self._changed.add(job.status.job_id)

    def _queue_changed(self, queue: JobQueue) -> None:
        self._places_changed = True

    def _publish_changed(self) -> None:
        """The decision is over (the lock's outermost holder lets it go): its changes are
        the queries' views."""
        self._refresh_borrowed()  # (teams.py: derived from this decision's holdings, published with it)
        for job_id in self._changed:
            job = self._jobs.get(job_id)
            if job is not None:
                self._views.publish(self._copy(job), job.running_since, job.spec.checkpoint.every_steps)
            else:
                self._views.forget(job_id)
        self._changed.clear()
        if self._places_changed:
            self._places_changed = False
            self._queue.forget_order()  # (the order as of the decision's end)
            self._views.publish_places(self._queue)
        self._queue.forget_order()  # (the next decision may see other usage, capacity, clock)
