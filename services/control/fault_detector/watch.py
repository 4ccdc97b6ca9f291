"""What L1-3 keeps per job and per rank: the deadlines' defaults, a rank's watch (its
deadlines and the last facts its heartbeats stated) and a job's (its ranks, its step times for
the phase budgets, its held symptoms)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from services.common.deadlines import Deadline
from services.common.phase import profile_export_budget_s
from services.contract import control_pb2, worker_pb2
from services.control.slow_ranks import SlowRanks

# Deadlines when StartFaultMonitoring leaves one at 0 (seconds; job spec `liveness`).
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S = 15.0
DEFAULT_STALL_MIN_S = 30.0
DEFAULT_STALL_STEP_FACTOR = 5.0  # attribution_seconds 0: a comm_error is reported at once
DEFAULT_CHECKPOINT_STAGING_S = 600.0
DEFAULT_COMPILE_S = 900.0
DEFAULT_PROFILE_EXPORT_S = 120.0
_STEP_TIMES_KEPT = 64  # recent step durations of a job, for the median
RankPhase = worker_pb2.RankPhase  # (its values read as worker_pb2.PHASE_*: a plain module attribute; the
# enum wrapper's __getattr__ cost ~1 us a look-up, eight a rank beat)
# Not working on a step (a rank says idle only while not stepping; before its first step
# after StartTraining it is judged as a training step).
_RESTING = frozenset({worker_pb2.PHASE_IDLE})
# The phases that wait for batches (a training step's data wait, an evaluation's): a rank whose
# data relay reconnects (DataServiceUnreachable) has the job's data_outage_seconds on top there.
_DATA_PHASES = frozenset({worker_pb2.PHASE_DATA_WAIT, worker_pb2.PHASE_EVALUATION})


def phase_name(phase: int) -> str:
    """ "forward", "collective", ... ("" for a rank that does not say)."""
    if phase == worker_pb2.PHASE_UNSPECIFIED or phase not in RankPhase.values():
        return ""
    return RankPhase.Name(phase).removeprefix("PHASE_").lower()


@dataclass(eq=False)
class _RankWatch:
    """The deadlines of one rank process, and the last facts its heartbeats stated."""

    worker_id: str = ""
    step: int = -1
    last_beat_unix: float = 0.0
    last_progress_unix: float = 0.0
    interval_s: float = 0.0  # the rank's beat period, as its heartbeats state it
    sent_unix: float = 0.0  # the newest RankHeartbeat.unix_time taken (a datagram's older one is not)
    stepping: bool = False
    phase: int = 0  # RankPhase of its last beat (PHASE_UNSPECIFIED: it does not say)
    phase_progress: int = 0  # units of the phase done, as its last beat said
    phase_total: int = 0
    # In a collective past its deadline while a peer still worked: no deadline of its own
    # until it moves on; that peer's stall reports it as a consequence.
    waiting: bool = False
    silence: Deadline | None = None
    silence_due: float = 0.0  # time.monotonic() when `silence` fires
    stall: Deadline | None = None
    stalled: bool = False  # declared stalled at ``step``; the next progress re-arms the deadline
    # Its stall deadline passed while it was quiet: its silence deadline decides; a beat without
    # progress re-arms the stall deadline (still counted from its last progress in the report).
    deferred: bool = False
    # Restored after a control restart and nothing of it arrived since (no beat, resent or
    # new): its node agent has not re-attached.
    unheard: bool = False
    # Its data relay reconnects to an unreachable data service (DataServiceUnreachable, until
    # the one with ``back``): a data wait has the job's data_outage_seconds on top of its budget.
    data_outage: bool = False

    def cancel(self) -> None:
        for timer in (self.silence, self.stall):
            if timer is not None:
                timer.cancel()
        self.silence = self.stall = None


@dataclass(eq=False)
class _Job:
    heartbeat_timeout_s: float
    stall_min_s: float
    stall_step_factor: float
    attribution_s: float
    eval_s: float = 0.0
    eval_batches: int = 0
    staging_s: float = DEFAULT_CHECKPOINT_STAGING_S
    compile_s: float = DEFAULT_COMPILE_S
    profile_export_s: float = DEFAULT_PROFILE_EXPORT_S
    data_outage_s: float = 0.0  # fault_policy.data_outage_seconds (StartFaultMonitoring)
    running_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S
    ranks: dict[int, _RankWatch] = field(default_factory=dict)
    step_times: deque = field(default_factory=lambda: deque(maxlen=_STEP_TIMES_KEPT))
    eval_batch_times: deque = field(default_factory=lambda: deque(maxlen=_STEP_TIMES_KEPT))
    held: list[control_pb2.FaultReport] = field(default_factory=list)  # symptoms awaiting their cause
    held_timer: Deadline | None = None
    # The quiet ranks whose silence deadline the held stalls wait for: rank -> its last beat's
    # receipt then (waited for again only while no beat came since: see _release_held).
    held_waited: dict[int, float] = field(default_factory=dict)
    # Restored after a control restart: ranks not heard from since (no beat, no exit). Their
    # node agents resend what happened meanwhile, one agent after another, so a symptom
    # waits for all of them (at most reattach_s) before it may be taken for a cause.
    reattaching: set[int] = field(default_factory=set)
    reattach_s: float = 0.0
    back: set[str] = field(default_factory=set)  # workers heard from since the restart (any rank's event)
    # The workers its restored ranks ran on, not yet registered again, and when the re-attach
    # window ends (monotonic): each of them registering pushes the end out (liveness.py).
    reattach_awaited: set[str] = field(default_factory=set)
    reattach_until: float = 0.0
    reattach_pushed: float = float("-inf")  # when (monotonic) a registration last pushed it out
    restored_unix: float = 0.0  # a beat the rank sent before this is a resent one (stale)
    restored_step: int = 0  # the job's step as journaled: a rank unheard since the restart is at it
    # Restored: rank -> the newest generation launched of it, as journaled (StartFaultMonitoring
    # rank_generations): an exit of an older one is a replaced incarnation's.
    generations: dict[int, int] = field(default_factory=dict)
    round_faults: int = 0  # faults of the current incident (本轮), cleared by ResetFaultLedger
    round: int = 0  # which incident round of the job (ResetFaultLedger counts them): sick_nodes.py
    slow: SlowRanks = field(default_factory=SlowRanks)  # compute per step compared (slow_ranks.py)

    def stall_deadline_s(self) -> float:
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.stall_min_s, self.stall_step_factor * median)

    def profile_export_budget_s(self, steps: int) -> float:
        """A profile's export of ``steps`` profiled steps: its events grow with the steps and
        their length, so the budget does too (the rank measures its export against the same
        formula: services/common/phase.py)."""
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return profile_export_budget_s(self.profile_export_s, self.stall_step_factor, median * max(steps, 1))

    def profile_export_allowance_s(self, steps: int) -> float:
        """How long a rank may stay in a profile's export, beating or not: its budget, then
        the running heartbeat timeout, so that a rank whose export overran reports that itself
        (a profile that failed) before any deadline here passes; past it, the rank is stuck."""
        return self.profile_export_budget_s(steps) + self.running_timeout_s

    def phase_deadline_s(self, phase: int, total: int = 0, data_outage: bool = False) -> float:
        """The progress budget of a rank in ``phase`` (of ``total`` units, when known);
        ``data_outage``: its data relay reconnects to an unreachable data service (a phase
        that waits for batches then has as long as L1-1 waits for the service on top)."""
        budget = self._phase_budget_s(phase, total)
        return budget + self.data_outage_s if data_outage and phase in _DATA_PHASES else budget

    def _phase_budget_s(self, phase: int, total: int) -> float:
        if phase == worker_pb2.PHASE_EVALUATION:
            # Scales with the batch count; before an evaluation was seen, a training step
            # (forward, backward and update) stands in for an evaluation batch (forward only).
            times = self.eval_batch_times or self.step_times
            median = statistics.median(times) if times else 0.0
            batches = total or self.eval_batches or 1
            return (self.eval_s or self.stall_min_s) + self.stall_step_factor * median * batches
        if phase == worker_pb2.PHASE_CHECKPOINT_STAGING:
            return max(self.stall_min_s, self.staging_s)
        if phase == worker_pb2.PHASE_COMPILE:
            return max(self.stall_min_s, self.compile_s)
        if phase == worker_pb2.PHASE_PROFILE_EXPORT:
            return self.profile_export_allowance_s(total)
        return self.stall_deadline_s()
