"""The fault detector (L1-3) composed: its frozen rule table, its state, the commands from
L1-1 and the fault events it grades (a rank's exit, a device's error, a module's failure
event, a refused send, ...).

Each other concern is a mixin in its own file (liveness, stalls, attribution, grading);
``FaultDetector`` joins them. The package docstring (``__init__.py``) describes the module
as a whole."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import structlog

from services.common.deadlines import Deadline, Deadlines
from services.contract import (
    Module,
    audit_pb2,
    control_pb2,
    data_pb2,
    engine_pb2,
    route_pb2,
    store_pb2,
)
from services.contract.bus import Emitter
from services.control import metrics
from services.control.beat_stamps import BeatStamps
from services.control.control_health import ControlHealth
from services.control.fault_detector.attribution import Attribution
from services.control.fault_detector.disruption import Disruption
from services.control.fault_detector.grading import Grading
from services.control.fault_detector.links import Links
from services.control.fault_detector.liveness import Liveness
from services.control.fault_detector.rules import (
    ALIASES,
    BOUNDARY_VIOLATION,
    DATA_OUTAGE,
    DEFAULT_RULES,
    EXIT_CAUSE_CLASSES,
    LOOP_FAILURE,
    MEMORY_COPY_SKIPPED,
    RANK_EXIT,
    RANK_EXIT_CLEAN,
    RANK_LOG_FLOOD,
    RANK_RELEASED,
    WORKER_DEPARTED,
    WORKER_LOST,
    FaultGrade,
    _sole_sender,
    device_fault_class,
    failure_class,
)
from services.control.fault_detector.stalls import Stalls
from services.control.fault_detector.watch import (
    _DATA_PHASES,
    DEFAULT_CHECKPOINT_STAGING_S,
    DEFAULT_COMPILE_S,
    DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_PROFILE_EXPORT_S,
    DEFAULT_STALL_MIN_S,
    DEFAULT_STALL_STEP_FACTOR,
    _Job,
    _RankWatch,
)
from services.control.sick_nodes import SickNodePolicy, SickNodes
from services.control.slow_ranks import SlowRanks

_log = structlog.get_logger("fault_detector")


class FaultDetector(Liveness, Disruption, Stalls, Attribution, Links, Grading):
    """Grades fault events by a frozen rule table and publishes ``FaultReport``.

    Args:
        emit: publishes this module's events (FaultReport).
        rules: fault class -> ``FaultGrade`` value; merged over ``DEFAULT_RULES``.
        stamps: the agents' beats taken on control's loop (beat_stamps.py; shared with the
            event applier); None: its own, which no loop writes.
        health: control's own lag (control_health.py); None: never behind.

    Raises:
        ValueError: a rule names an unknown grade (the message names the class).
    """

    def __init__(
        self,
        emit: Emitter,
        rules: Mapping[str, int] | None = None,
        sick_nodes: SickNodePolicy | None = None,
        in_order: Callable[[Callable[[], None], str], None] | None = None,
        stamps: BeatStamps | None = None,
        health: ControlHealth | None = None,
    ):
        table = dict(DEFAULT_RULES)
        for fault_class, grade in (rules or {}).items():
            if grade not in FaultGrade.values() or grade == FaultGrade.GRADE_UNSPECIFIED:
                raise ValueError(f"fault rules: {fault_class}: unknown grade {grade!r}")
            table[fault_class] = grade
        # Frozen after init: no command carries rules (the seed lists none), and the table
        # itself is read-only, so nobody may change the grading at run time.
        self._rules: Mapping[str, int] = MappingProxyType(table)
        self._emit = emit
        # Sharded by job (issue 28 item 2: two jobs' beats never wait for each other): each
        # job's state (its entries in ``_jobs``, ``_processes``, ``_failures``, ``_counts``) is
        # read and written under that job's own lock (``_job_lock``: re-entrant, a report is
        # published outside it, but its timers and handlers share it); the cluster-wide agent
        # and node state (``_agents``, ``_silent_agents``, ``_sick``) under ``_cluster``, a
        # leaf: taken inside a job's lock, never around one. No lock is held across jobs.
        self._job_locks: dict[str, threading.RLock] = {}
        self._cluster = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        # Every silence, stall and attribution deadline on one heap (not a thread each).
        self._deadlines = Deadlines("fault-detector", workers=16)
        # Where a silence or stall deadline that fired is decided (``_in_order``): on the
        # event applier's queue of the messages that re-arm it (``in_order``: the composition
        # root's ``event_applier.InOrder``), after every message control received before it
        # fired: a beat waiting in a backlog re-arms it first, and control's own lag is never
        # taken for a rank's or an agent's silence (found at 1,024 simulated agents: their
        # beats waited 10 s in the node queue and every agent was reported silent, then heard
        # again). Without one (an in-process detector, no queues): at once.
        self._post = in_order or (lambda fn, key: fn())
        self._counts: Counter[tuple[str, str]] = Counter()  # (job_id, class) -> faults seen (累计)
        # (job_id, rank) -> (module, operation, cause) of module failures reported: a loop
        # failure that repeats one (it commanded the failed module) is not reported twice.
        self._failures: defaultdict[tuple[str, int], deque] = defaultdict(lambda: deque(maxlen=16))
        # job_id -> rank -> (worker_id, pid) -> (RankProcessState.State, detail, unix_time):
        # what the node agents last stated of each process of the rank, until its exit.
        self._processes: dict[str, dict[int, dict[tuple[str, int], tuple[int, str, float]]]] = {}
        # Rank faults by node across jobs, for a node that keeps failing (FaultBacklogAlert).
        self._sick = SickNodes(sick_nodes)
        # worker id -> its node agent's silence deadline (re-armed by each AgentHeartbeat), and
        # the workers reported agent_silent whose agent has not beaten since (with the receipt of
        # their last beat, time.monotonic()).
        self._agents: dict[str, tuple[object, Deadline]] = {}
        self._silent_agents: dict[str, float] = {}
        # The agents' beats taken on control's gRPC loop (the composition root's, shared with
        # the event applier: beat_stamps.py), and control's own lag (control_health.py):
        # verdicts whose deadline passed while control was behind are held (disruption.py):
        # worker id -> (its deadline's token, wait), with the one check that looks at them again.
        self._stamps = stamps if stamps is not None else BeatStamps()
        self._health = health
        self._held_agents: dict[str, tuple[object, float]] = {}
        self._held_ranks: dict[tuple[str, int], Any] = {}  # (job, rank) -> its watch, verdict held
        self._hold_check: Deadline | None = None
        self._share_cache: tuple[float, int, int] | None = None
        self._disrupted = False  # most agents were quiet at once, and not yet few of them again
        # Data-plane links (links.py): each end's last view, each link's combined state (absent:
        # up), and the links a link_down was reported for, by job, in which incident round.
        self._link_views: dict[tuple[str, str], Any] = {}
        self._link_states: dict[tuple[str, str], int] = {}
        self._link_reported: dict[tuple[str, tuple[str, str]], int] = {}
        self._link_told: dict[tuple[str, str], dict[str, str]] = {}
        # worker id -> (receipt of its agent's last beat, its period, when its last quiet spell
        # ended): a link that looks lossy while an end's agent was paused is that agent's pause
        # (its probes stopped with it), not the link's (links.py: the hold of a degraded link).
        self._agent_beats: dict[str, tuple[float, float, float]] = {}
        self._link_holds: dict[tuple[str, str], object] = {}  # pair -> the hold armed for it
        # pair -> the LinkStateChanged of a degraded link whose hold ended with an end's agent
        # quiet: held again when that agent beats again (``_agent_back``).
        self._link_waiting: dict[tuple[str, str], Any] = {}

    def _job_lock(self, job_id: str) -> threading.RLock:
        """The lock of ``job_id``'s state (made on first use: a job's process states may
        come before its monitoring starts)."""
        lock = self._job_locks.get(job_id)
        if lock is None:
            lock = self._job_locks.setdefault(job_id, threading.RLock())  # (atomic: one lock per job)
        return lock

    def close(self) -> None:
        """Composition root, when control stops: no silence, stall or attribution deadline
        fires any more. Why: control ends the node agents' sessions before its server stops,
        so their beats stop arriving; a deadline firing then graded a live rank silent and
        the orchestrator journaled a recovery the restarted control went on with (seen on
        `surgectl restart control`)."""
        self._deadlines.close()

    # ------------------------------------------------------------ commands (L1-1)

    def start_fault_monitoring(self, msg: control_pb2.StartFaultMonitoring, payload: Any = None) -> None:
        """开启全域故障监听指令: report faults of ``msg.job_id`` from now on, with its deadlines.
        With ``world_size`` and ``reattach_seconds`` (control restarted): each of the ranks
        gets a silence deadline of ``reattach_seconds`` from now, re-armed by its heartbeats."""
        with self._job_lock(msg.job_id):
            if msg.job_id in self._jobs:
                return  # once per job: the deadlines were pushed with the first command
            job = self._jobs[msg.job_id] = _Job(
                heartbeat_timeout_s=msg.heartbeat_timeout_seconds or DEFAULT_HEARTBEAT_TIMEOUT_S,
                stall_min_s=msg.stall_min_seconds or DEFAULT_STALL_MIN_S,
                stall_step_factor=msg.stall_step_factor or DEFAULT_STALL_STEP_FACTOR,
                attribution_s=msg.attribution_seconds,
                eval_s=msg.eval_seconds,
                eval_batches=msg.eval_batches,
                staging_s=msg.checkpoint_staging_seconds or DEFAULT_CHECKPOINT_STAGING_S,
                compile_s=msg.compile_seconds or DEFAULT_COMPILE_S,
                profile_export_s=msg.profile_export_seconds or DEFAULT_PROFILE_EXPORT_S,
                data_outage_s=msg.data_outage_seconds,
                slow=SlowRanks(stage_size=msg.ranks_per_stage),
            )
            job.running_timeout_s = max(
                msg.heartbeat_timeout_running_seconds or DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S, job.heartbeat_timeout_s
            )
            if msg.reattach_seconds > 0:
                job.reattaching, job.reattach_s = set(range(msg.world_size)), msg.reattach_seconds
                now = job.restored_unix = time.time()
                job.restored_step = msg.step
                job.generations = {r: g for r, g in enumerate(msg.rank_generations) if g}
                workers = list(msg.rank_worker_ids)
                job.reattach_awaited = {w for w in workers if w}
                job.reattach_until = time.monotonic() + msg.reattach_seconds
                for rank in range(msg.world_size):
                    worker_id = workers[rank] if rank < len(workers) else ""
                    watch = job.ranks[rank] = _RankWatch(worker_id=worker_id, last_beat_unix=now, unheard=True)
                    watch.silence = self._deadlines.after(
                        msg.reattach_seconds,
                        self._silence_passed,
                        (msg.job_id, rank, watch),
                        post=self._after_sessions(msg.job_id),
                    )

    def _in_order(self, key: str) -> Callable[[Callable[[], None]], None]:
        """A deadline's ``post``: decided on the queue ``key`` of control's messages (a job id:
        that job's; "": the node agents' own), behind what was received before it fired."""
        return lambda run: self._post(run, key)

    def _after_sessions(self, job_id: str) -> Callable[[Callable[[], None]], None]:
        """A re-attach deadline's ``post``: decided after the node agents' sessions opened
        before it fired (their registrations, on the node queue: after a control restart,
        3,000 agents' registrations waited there up to 30 s), then after the job's messages
        those sessions sent (its queue): a rank whose agent came back in time is not lost."""
        return lambda run: self._post(lambda: self._post(run, job_id), "")

    def reset_fault_ledger(self, msg: control_pb2.ResetFaultLedger, payload: Any = None) -> None:
        """重置故障台账指令: the job's incident is over (recovered); the next fault opens a new one."""
        with self._job_lock(msg.job_id):
            job = self._jobs.get(msg.job_id)
            if job is not None:
                job.round_faults = 0
                job.round += 1

    # ------------------------------------------------------------ fault events

    def on_rank_exited(self, msg: control_pb2.RankExited, payload: Any = None) -> None:
        """A rank process ended: its deadlines end with it. Every exit of a monitored job is
        graded: a code-0 exit is normal once the loop finished, but only the orchestrator
        knows that; an exit after a release is one control asked for. The exit of a replaced
        incarnation (``replaced``, stated by the session relay) is graded as usual and reported
        ``replaced`` (L1-1 decides; no node's sick count takes it); it ends the rank's deadlines
        only where they are still that process's (last beat from its node: its successor has
        not beaten yet, or runs on the same node, as before), never its successor's elsewhere.
        After a control restart the relay cannot always say ``replaced`` (its fence is memory
        only); an exit of a generation older than the journaled newest (``rank_generations``)
        is taken as replaced here too, as L1-1's triage does."""
        with self._job_lock(msg.job_id):
            self._forget_process(msg.job_id, msg.rank, msg.worker_id, msg.pid)
            job = self._jobs.get(msg.job_id)
            replaced = msg.replaced or (job is not None and 0 < msg.generation < job.generations.get(msg.rank, 0))
            own = job.ranks.get(msg.rank) if job is not None else None
            if job is not None and replaced and (own is None or own.worker_id != msg.worker_id):
                job = None  # (the rank's deadlines and slowdown are its newer incarnation's)
            watch = job.ranks.pop(msg.rank, None) if job is not None else None
            if watch is not None:
                watch.cancel()
            ended_slow = job.slow.forget(msg.rank) if job is not None else None
            # Its process ended: its slowdown ratio is no longer measured, so its series goes
            # (a finished job's stayed on control's /metrics until control restarted).
            metrics.forget_rank_slowdown(msg.job_id, msg.rank)
            if job is not None and not msg.worker_lost:
                job.back.add(msg.worker_id)  # its node agent reaped it and is back
        if msg.worker_lost:
            fault_class = WORKER_LOST
            detail = f"rank {msg.rank} lost with worker {msg.worker_id}: {msg.detail}"
        else:
            if msg.released:
                fault_class = RANK_RELEASED
            elif msg.departing:
                fault_class = WORKER_DEPARTED
            else:
                fault_class = EXIT_CAUSE_CLASSES.get(msg.cause, RANK_EXIT if msg.exit_code != 0 else RANK_EXIT_CLEAN)
            how = f"signal {-msg.exit_code}" if msg.exit_code < 0 else f"exit code {msg.exit_code}"
            detail = f"rank {msg.rank} on worker {msg.worker_id} ended ({how})"
            if msg.detail:
                detail += f": {msg.detail}"
        step = watch.step if watch is not None and watch.step >= 0 else 0
        self._report(
            msg.job_id,
            fault_class,
            Module.EXT_HARDWARE,
            msg.rank,
            detail,
            occurred=msg.unix_time,
            worker_id=msg.worker_id,
            step=step,
            exit_cause=msg.cause,
            generation=msg.generation,
            replaced=replaced,
        )
        if replaced:
            return
        if ended_slow is not None:  # (its replacement is judged afresh)
            self._report_slow(msg.job_id, ended_slow, 0)
        # (after the report: held with the rest, and ordered with it)
        if self._reattached(msg.job_id, msg.rank):
            self._release_held(msg.job_id)

    def on_hardware_error(self, msg: engine_pb2.HardwareError, payload: Any = None) -> None:
        """硬件故障事件 from a node agent's NVML sampler: graded by :func:`device_fault_class`
        and reported for every monitored job with a rank on that worker (one report per job,
        for its lowest rank there; a rank is known there by its heartbeats or by the agent's
        process states, so a rank still starting counts too). The report names the worker:
        the default policy for ``device_error`` excludes it (exclude_node).

        Reported first for the node itself (``job_id`` empty), whether or not a job runs
        there: whether the worker stays placeable for every job is L1-1's to decide (a
        ``device_error`` cordons it), and a device can fail on an idle node."""
        fault_class = device_fault_class(msg)
        where: dict[str, int] = {}
        for job_id in list(self._jobs):  # (each job under its own lock, one at a time)
            with self._job_lock(job_id):
                job = self._jobs[job_id]
                for rank, watch in job.ranks.items():
                    if watch.worker_id == msg.worker_id:
                        where[job_id] = min(rank, where.get(job_id, rank))
                for rank, processes in self._processes.get(job_id, {}).items():
                    if any(w == msg.worker_id for w, _ in processes):
                        where[job_id] = min(rank, where.get(job_id, rank))
        detail = (
            f"device {msg.device} of {msg.worker_id}: {msg.detail or engine_pb2.HardwareError.Error.Name(msg.error)}"
        )
        # The node first: a cordon is in force before any job on it decides where to relaunch.
        now = time.time()
        self._emit(
            control_pb2.FaultReport(
                grade=self._grade(fault_class),
                fault_class=fault_class,
                source=Module.EXT_HARDWARE,
                detail=detail,
                detected_unix=now,
                occurred_unix=msg.unix_time or now,
                worker_id=msg.worker_id,
                event=msg.DESCRIPTOR.name,
            )
        )
        for job_id, rank in sorted(where.items()):
            self._report(
                job_id,
                fault_class,
                Module.EXT_HARDWARE,
                rank,
                detail,
                occurred=msg.unix_time,
                worker_id=msg.worker_id,
                event=msg.DESCRIPTOR.name,
            )

    def on_rank_log_flood(self, msg: control_pb2.RankLogFlood, payload: Any = None) -> None:
        """A node agent states a rank's output came faster than its bound (once per rank
        process): ``rank_log_flood``, a warning naming the rank."""
        detail = (
            f"rank {msg.rank} on {msg.worker_id} logs {msg.bytes_per_second / 2**20:.1f} MiB/s over "
            f"{msg.window_seconds:.0f} s (warning above {msg.threshold_bytes_per_second / 2**20:.1f} MiB/s); its log "
            f"is rotated at {msg.max_file_bytes / 2**20:.0f} MiB with {msg.backups} older files kept"
        )
        self._report(
            msg.job_id,
            RANK_LOG_FLOOD,
            Module.EXT_HARDWARE,
            msg.rank,
            detail,
            occurred=msg.unix_time,
            worker_id=msg.worker_id,
            event=msg.DESCRIPTOR.name,
        )

    def on_memory_copy_skipped(self, msg: store_pb2.MemoryCopySkipped, payload: Any = None) -> None:
        """A rank's L5 relay skipped the in-memory copy of a save (its target lacks the
        space): ``memory_copy_skipped``, for the record; the save itself goes on."""
        why = route_pb2.WriteError.Name(msg.write_error) if msg.write_error else "not written"
        detail = (
            f"rank {msg.rank}: memory copy of step {msg.step} skipped ({why}): needs {msg.needed_bytes / 2**20:.1f} "
            f"MiB, {msg.free_bytes / 2**20:.1f} MiB free in {msg.path}; the next save tries again"
        )
        self._report(
            msg.job_id,
            MEMORY_COPY_SKIPPED,
            Module.L5_CHECKPOINT_MANAGER,
            msg.rank,
            detail,
            step=msg.step,
            event=msg.DESCRIPTOR.name,
        )

    def on_training_loop_failed(self, msg: engine_pb2.TrainingLoopFailed, payload: Any = None) -> None:
        """A rank's training loop stopped on an error. Its class is the one the rank named
        (a typed exception's ``fault_class``: non_finite_loss, port_in_use, ...), else the
        rule table's for its typed cause (``msg.failure``). A loop that failed because a
        module it commanded failed repeats that module's failure (``failure.module``): when
        that module's own event was reported for the rank, this one is its consequence and
        is not reported again. A communication error is held for the job's attribution
        window: its cause may still be on its way."""
        failure = msg.failure
        event = msg.DESCRIPTOR.name
        if (
            msg.HasField("failure")
            and failure.module not in (0, Module.L2_TRAINING_LOOP)
            and self._seen_failure(msg.job_id, msg.rank, failure)
        ):
            _log.info(
                "loop failure follows a reported module failure",
                job_id=msg.job_id,
                rank=msg.rank,
                module=Module.Name(failure.module),
                cause=route_pb2.FailureCause.Name(failure.cause),
            )
            return
        if msg.fault_class:
            fault_class = msg.fault_class
        elif msg.HasField("failure"):
            fault_class = failure_class(event, failure.cause)
        else:
            fault_class = LOOP_FAILURE
        subclass = ""
        if fault_class in ALIASES:
            subclass, fault_class = fault_class, ALIASES[fault_class]
        detail = f"rank {msg.rank} failed at step {msg.step}: " + (f"{subclass}: " if subclass else "") + msg.detail
        report = self._graded(
            msg.job_id,
            fault_class,
            Module.L2_TRAINING_LOOP,
            msg.rank,
            detail,
            step=msg.step,
            subclass=subclass,
            event=event,
            cause=failure.cause,
            generation=failure.generation,
            replaced=failure.replaced,
        )
        if report is None:
            return
        if failure.replaced:  # (a replaced incarnation's, for the record: never held, never a cause)
            self._report_graded(msg.job_id, report)
            return
        self._hold_or_report(msg.job_id, msg.rank, report)

    def on_data_service_unreachable(self, msg: data_pb2.DataServiceUnreachable, payload: Any = None) -> None:
        """A rank's data relay cannot reach the data service and reconnects (or, ``back``, it
        answers again): reported as ``data_outage`` (``cleared`` when back) for L1-1, which
        waits for the service up to the job's data_outage_seconds. Meanwhile the rank's data
        wait is no stall: its budget has that wait on top (the relay gives up after it, and
        L1-1 decides before that), re-armed from the rank's last progress; once it is back, the
        plain budget from then."""
        with self._job_lock(msg.job_id):
            job = self._jobs.get(msg.job_id)
            if job is None:
                return
            watch = job.ranks.get(msg.rank)
            if watch is not None and watch.data_outage != (not msg.back):
                watch.data_outage = not msg.back
                if watch.stall is not None and watch.phase in _DATA_PHASES:
                    watch.stall.cancel()
                    budget = job.phase_deadline_s(watch.phase, watch.phase_total, watch.data_outage)
                    # Back: the whole budget from now. The wait for the service is excused, not
                    # spent of the budget: counted from the last progress before the outage, a
                    # wait longer than the budget fired at once, before the beat of the batch that
                    # came back, and a peer waiting in the all-reduce for this rank was held as
                    # its consequence and reported (ci27's extra restart in test_data_outage).
                    left = budget if msg.back else budget - max(0.0, time.time() - watch.last_progress_unix)
                    watch.stall = self._deadlines.after(
                        max(0.0, left),
                        self._stall_passed,
                        (msg.job_id, msg.rank, watch),
                        post=self._in_order(msg.job_id),
                    )
        where = f"{msg.split} stream" if msg.split else "mount"
        if msg.back:
            detail = f"data service at {msg.address} answers again after {msg.waited_seconds:.1f} s (rank {msg.rank}'s {where})"
        else:
            detail = (
                f"data service at {msg.address} unreachable (rank {msg.rank}'s {where}, reconnecting): {msg.reason}"
            )
        report = self._graded(
            msg.job_id,
            DATA_OUTAGE,
            Module.L4_DATASET_VERSIONS,
            msg.rank,
            detail,
            event=msg.DESCRIPTOR.name,
            cause=route_pb2.FailureCause.FAILURE_UNAVAILABLE,
        )
        if report is not None:
            report.cleared = msg.back
            self._emit(report)  # (never held: a wait, no symptom of another rank's fault)

    def on_failure(self, msg: Any, payload: Any = None) -> None:
        """A module's failure event (any route flagged ``failure`` that names L1-3, other than
        TrainingLoopFailed): graded by (event, cause) through FAILURE_CLASSES. Where: the
        failure's job and rank (the bus and the relays stamp them), else the event's own
        ``job_id`` / ``rank`` fields. An event sent without its ``failure`` part (no handler
        raised: e.g. a save the store refused while the rank trains on) is its route's
        sender's, in its own words (``reason`` / ``detail``). A communication error is held
        for attribution as a loop's is."""
        failure = msg.failure
        event = msg.DESCRIPTOR.name
        fields = msg.DESCRIPTOR.fields_by_name
        job_id = failure.job_id or (msg.job_id if "job_id" in fields else "")
        rank = failure.rank if failure.HasField("rank") else (msg.rank if "rank" in fields else 0)
        step = msg.step if "step" in fields and isinstance(msg.step, int) else 0
        # A class the event declares (its module's typed exception's, e.g. L2-2's
        # port_in_use from its bind probe) when the rule table grades it; else by (event, cause).
        declared = msg.fault_class if "fault_class" in fields and isinstance(msg.fault_class, str) else ""
        fault_class = declared if declared in self._rules else failure_class(event, failure.cause)
        module = failure.module or _sole_sender(msg)
        who = Module.Name(module) if module else event
        if msg.HasField("failure") and (failure.cause or failure.detail):
            # (A part holding only where the event came from, stamped by the relay that carried
            # it, says nothing: the event's own words below.)
            where = f" (rank {rank})" if failure.HasField("rank") else ""
            detail = f"{who}{where} failed handling {failure.operation or 'an event'}: {failure.detail}"
        else:
            said = next((getattr(msg, f) for f in ("reason", "detail") if f in fields and getattr(msg, f)), "")
            where = f", rank {rank}" if "rank" in fields else ""
            detail = f"{who} ({event}{where}): {said or 'no detail'}"
        subclass = ""
        if fault_class in ALIASES:
            subclass, fault_class = fault_class, ALIASES[fault_class]
        report = self._graded(
            job_id,
            fault_class,
            module,
            rank,
            detail,
            step=step,
            subclass=subclass,
            event=event,
            cause=failure.cause,
            generation=failure.generation,
            replaced=failure.replaced,
        )
        if report is None:
            _log.warning(
                "failure of no monitored job",
                failure_event=event,
                module=who,
                job_id=job_id,
                cause=route_pb2.FailureCause.Name(failure.cause),
                detail=failure.detail,
            )
            return
        if failure.replaced:  # (a replaced incarnation's, for the record: never held, never a cause)
            self._report_graded(job_id, report)
            return
        if report.grade != FaultGrade.MINOR:
            # A failure whose report is decided: the loop failing with it is its consequence.
            # One reported for the record (a snapshot_failed: training would go on after a
            # failed save) is not, when the loop died of it (a load refused): that report,
            # the loop's, is the one to decide (it waited ten minutes for a restore deadline).
            with self._job_lock(job_id):
                self._failures[(job_id, rank)].append((failure.module, failure.operation, failure.cause))
        self._hold_or_report(job_id, rank, report)

    def _seen_failure(self, job_id: str, rank: int, failure: route_pb2.Failure) -> bool:
        with self._job_lock(job_id):
            return (failure.module, failure.operation, failure.cause) in self._failures.get((job_id, rank), ())

    def on_boundary_violation_reported(self, msg: audit_pb2.BoundaryViolationReported, payload: Any = None) -> None:
        """A process's contract layer refused a send. Graded for the job of the process
        that reported it; a violation outside any job (``job_id`` "") is nobody's job to
        decide on here: the contract layer has counted and logged it."""
        receiver = Module.Name(msg.receiver) if msg.receiver else "any receiver"
        detail = f"{msg.process}: {Module.Name(msg.sender)} may not send {msg.message} to {receiver}"
        if msg.detail:
            detail += f" ({msg.detail})"
        self._report(msg.job_id, BOUNDARY_VIOLATION, msg.sender, msg.rank, detail)
