"""L1-3 fault detector: grades fault events, keeps each rank's liveness deadlines, reports.

Seed 000 L1-3: it only listens, grades (minor / medium / severe / fatal) and reports; it
never decides whether to stop or recover, never retries, never touches another module.
Its grading table is pushed once at construction (the seed's 故障分级规则台账) and frozen.

Inputs: ``StartFaultMonitoring`` and ``ResetFaultLedger`` (from L1-1), ``RankHeartbeat``,
``AgentHeartbeat``, ``WorkerRegistration``,
``RankExited`` and ``HardwareError`` (from the node agent, via the session relay: a device's
error graded by ``device_fault_class``), ``BoundaryViolationReported``
(from the contract layer of any process), and every module's failure event routed here
(``TrainingLoopFailed``, ``ForwardFailed``, ``DatasetUnavailable``, ``SnapshotFailed``, ...:
the routes flagged ``failure``; the bus builds one when a module's handler raises, relays
carry them from the ranks, the data and the store services). Outputs (to L1-1):
``FaultReport``, and ``FaultBacklogAlert`` for a node whose rank faults pile up across jobs
and incidents (a sick node, services/control/sick_nodes.py: L1-1 quarantines it).

Failure events are graded by their type and typed cause (``Failure.cause``, taken from the
exception's type by services/contract/failures.py) through ``FAILURE_CLASSES``: (event,
cause) -> fault class, whose grade is the class's rule. No class is ever read from text. A
loop that failed because a module it commanded failed repeats that module's failure: it is
reported once, under the module's event.

What it knows arrives as events; the one clock it keeps is a deadline per rank (DESIGN.md
law 4: a layer silent past its deadline is judged faulty by the layer above):

* silence: a rank's heartbeat re-arms a one-shot timer of ``heartbeat_timeout_seconds``;
  if it fires, the rank is ``rank_silent`` (e.g. SIGSTOP, a hung host). What its node agent
  states of its process changes the length, never below the job's timeout: running,
  ``heartbeat_timeout_running_seconds`` (late beats, not a dead rank); stopped by a signal,
  ``heartbeat_timeout_seconds`` counted from the stop (a stop explains a silence, it never
  shortens it: a stop shorter than the timeout is no fault), so a rank stopped for good is
  named within the timeout plus one beat period (the most by which its last beat can
  precede the stop) after its last beat;
* progress: while the rank says it is stepping, a heartbeat that shows progress (a new
  step, a new phase, or more of its phase done: ``RankHeartbeat.phase`` /
  ``phase_progress``) re-arms a timer of its phase's budget: a training step's phases
  max(``stall_min_seconds``, ``stall_step_factor`` x the job's median step time); an
  evaluation ``eval_seconds`` (else ``stall_min_seconds``) + ``stall_step_factor`` x the
  median evaluation-batch time x its batches; checkpoint staging and compile their own
  (``StartFaultMonitoring``). If it fires, the rank is ``rank_stalled`` (alive, beating, no
  progress), or ``rank_stalled_in_collective`` when its beats say it waits in a collective.

* a node agent's own silence: each ``AgentHeartbeat`` re-arms a deadline of
  ``AGENT_MISSED_BEATS`` of its beat periods (at least ``AGENT_SILENT_MIN_SECONDS``); if it
  fires, the node is reported ``agent_silent`` (no job: L1-1 holds the worker out of placement,
  so no replacement waits on a frozen agent), and its next beat reports that ``cleared``.
  The deadline is that agent session's: the worker's ``WorkerRegistration`` (heard here
  before L1-2) ends it, a withdrawal (its stream closed) as a new registration (a restarted
  agent is heard from before its first beat; a silent report is ``cleared``).

Both count from when control received the beat (``RankHeartbeat.received_monotonic``,
stamped by the session relay before the event applier's queue), not from when this handler
runs. Both are armed only inside the heartbeat's handler and cancelled by the rank's exit;
the timer thread sleeps until its deadline, nothing wakes to look (no polling).

Blame by phase: a rank stalled outside a collective (forward, backward, optimizer, data
wait, ...) is the incident's likely cause; the ranks waiting in a collective since are its
consequences, reported right after it (``rank_stalled_in_collective``). A rank whose
deadline passes in a collective while a peer still works (progressing outside one: a longer
evaluation, a slow checkpoint staging) is no fault: it waits, with no deadline of its own,
until it moves on or that peer stalls or goes silent (then it follows that peer's report).
Ranks that all wait in a collective with nobody working are reported stalled in it.

Attribution ("the survivor is not blamed"): when a rank dies, its peers fail soon after in
the collective they shared (``comm_error``), and either report may reach control first. A
``comm_error`` is therefore held for ``attribution_seconds``: a fault of another rank that
arrives meanwhile is reported first, as the incident's cause, and the held reports follow
it. Which reports are consequences of the incident, and what to do, is the orchestrator's.
A ``rank_stalled`` is a symptom too: the stalled rank may be waiting in a collective for a
peer that stopped (SIGSTOP, a hung host), whose silence deadline fires at most
``heartbeat_timeout_seconds`` after its last beat, or after the stop its agent stated (of a
rank that beat until it stopped, before a stall can find it quiet: so at most that long after
the stall too). A stall is held for 1.5 beat periods (at least ``attribution_seconds``), long
enough to see whether a peer has gone quiet (no beat for 1.5 of its periods); if one has, it
is held until that peer's silence deadline can have fired. This holds for a stall in a
collective as for one outside it, and for a rank that goes quiet while the stall is held, the
stalled rank itself included: a rank's last state ("in a collective") says nothing once its
reports stop (its host hung; its newer beats died with its node agent), so a stall judged
from it waits for its silence verdict. A silence is always a cause, never a consequence (a
rank's beats come from a side thread that a peer's death does not block), so it is reported
first and the held stalls follow it. A rank whose own beats stopped is not reported stalled:
its silence is (its own held stalls are dropped); if it beats again without progress (a
pause, not a death), its stall deadline is re-armed from that beat.

After a control restart the orchestrator pushes ``StartFaultMonitoring`` again with the
job's ``world_size``, a ``reattach_seconds`` and the worker each rank ran on: every rank gets
one deadline of that length, re-armed as usual by its first heartbeat after its node agent
re-attached, so no rank is judged silent for the time control was down. A rank of which
nothing at all arrives by then (no beat, not even one its agent resent), nor of another rank
of the worker it ran on (when that is known), lost its node agent with it (SIGKILLed, the host gone: a rank exits when its
agent's session ends, and nobody is left to say so): ``worker_lost``, on the worker it ran
on, as when control sees an agent's session close. One whose agent resent its old beats but
that sends no new one is silent. (The detector does not see registrations: an agent back
with nothing at all of the rank to resend, e.g. its exit applied just before control died
while its report was held, reads as lost too.)
While agents re-attach, a rank's own exit after its symptom (the survivor of a collective
exits on its ``comm_error``) follows that symptom, as it does without a restart: it is never
taken for the cause that happened first.

Slow ranks (issue 29 item 2): each beat carries the rank's compute seconds (forward,
backward, optimizer, without its waits in collectives); ``slow_ranks.py`` compares each
rank's compute per step with the median of its peers' and with its own earlier pace, and a
rank >= 1.5x slower for a majority of its last intervals is reported ``slow_rank`` (MINOR:
by default the policy ignores it; ``replace`` or ``shrink`` are L1-1's to choose), and
``slow_rank_cleared`` once a majority of them are below that again (or its process ended).
The ratio of every compared rank is the ``surge_rank_slowdown_ratio`` gauge.

Aliases: a rank's ``checkpoint_integrity`` failure (a version that fails its SHA-256 check
when loaded) is graded and reported as ``checkpoint_error``, the class the fault policy
table names.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import structlog

from services.contract import (
    Module,
    audit_pb2,
    control_pb2,
    data_pb2,
    engine_pb2,
    route_pb2,
    store_pb2,
    worker_pb2,
)
from services.contract.bus import Emitter
from services.contract.route_table import default_table
from services.control import metrics
from services.control.deadlines import Deadline, Deadlines
from services.control.sick_nodes import NODE_FAULT_CLASSES, NodeFault, SickNode, SickNodePolicy, SickNodes
from services.control.slow_ranks import Finding, SlowRanks

FaultGrade = control_pb2.FaultGrade
_log = structlog.get_logger("fault_detector")

# Fault classes this detector names itself (TrainingLoopFailed brings its own class).
RANK_EXIT = "rank_exit"  # a rank process ended with a non-zero code or a signal
# A rank's exit by the cause its node agent tells from evidence (RankExited.cause): the OOM
# killer (its cgroup's oom_kill count rose), or Python's MemoryError (its exit code 75).
# Any other exit (an error code, a signal that was no OOM kill) is rank_exit; the cause (the
# signal, its sender where known) is in the detail.
RANK_OOM = "rank_oom"
RANK_MEMORY_ERROR = "rank_memory_error"
EXIT_CAUSE_CLASSES = {
    control_pb2.EXIT_OOM_KILLED: RANK_OOM,
    control_pb2.EXIT_MEMORY_ERROR: RANK_MEMORY_ERROR,
}
RANK_EXIT_CLEAN = "rank_exit_clean"  # exit code 0: normal after the loop finished, early otherwise
RANK_RELEASED = "rank_released"  # ended after control released it: an exit control asked for
RANK_SILENT = "rank_silent"  # no heartbeat within the deadline
RANK_STALLED = "rank_stalled"  # heartbeats, but no progress within its phase's deadline (not in a collective)
# heartbeats, waiting in a collective with no progress: a consequence of the peer it waits for
RANK_STALLED_IN_COLLECTIVE = "rank_stalled_in_collective"
WORKER_LOST = "worker_lost"  # the node agent's session closed under the rank
AGENT_SILENT = "agent_silent"  # a node agent missed its own beats (AgentHeartbeat): a report of the node
# A node agent silent for this many of its beat periods (at least AGENT_SILENT_MIN_SECONDS) is
# reported agent_silent: a frozen or cut-off agent would hold a rank placed there until it woke.
AGENT_MISSED_BEATS = 5
AGENT_SILENT_MIN_SECONDS = 3.0
SLOW_RANK = "slow_rank"  # computes >= 1.5x its peers' median per step, sustained (slow_ranks.py)
SLOW_RANK_CLEARED = "slow_rank_cleared"  # a rank named slow is not any more (or ended)
# Footprint (issue 29 item 8): a rank whose output outran the agent's bound (its log file is
# rotated: nothing grows without bound), and an in-memory copy skipped for want of space.
RANK_LOG_FLOOD = "rank_log_flood"
MEMORY_COPY_SKIPPED = "memory_copy_skipped"
LOOP_FAILURE = "loop_failure"  # default for a fault class not in the table
INTERNAL_ERROR = "internal_error"  # a module's failure of no more specific cause
BOUNDARY_VIOLATION = "boundary_violation"  # a send the route table refused (a module or wiring bug)
COMM_ERROR = "comm_error"  # a collective failed: usually a peer's fault, see attribution
PORT_IN_USE = "port_in_use"  # the rendezvous port was taken: a fresh port fixes it
CHECKPOINT_ERROR = "checkpoint_error"  # a checkpoint could not be saved or loaded (or failed its check)
# The data service cannot be reached: while a rank's relay reconnects (DataServiceUnreachable,
# ``cleared`` once it is back) L1-1 waits for it; a relay whose reconnection is spent, or a data
# module's failure typed unavailable, is the same class, decided by the policy (pause).
DATA_OUTAGE = "data_outage"
# Classes reported under the class the policy table uses (the detail keeps the original).
ALIASES = {"checkpoint_integrity": CHECKPOINT_ERROR}
# Reports that are usually another rank's doing (held for their cause).
_SYMPTOMS = frozenset({COMM_ERROR, RANK_STALLED, RANK_STALLED_IN_COLLECTIVE})
_STALLS = frozenset({RANK_STALLED, RANK_STALLED_IN_COLLECTIVE})
# A peer silent for more than this many of its beat periods makes a stall a symptom.
QUIET_BEATS = 1.5

# A node agent that stopped its ranks because it is leaving (SIGTERM): one departure.
WORKER_DEPARTED = "worker_departed"
# A device of the node failed (HardwareError: an uncorrectable ECC error, a fatal Xid) or runs
# degraded (corrected ECC errors, another Xid, clocks throttled by heat or power).
DEVICE_ERROR = "device_error"
DEVICE_DEGRADED = "device_degraded"
# Xids that mean the device (not the program on it) failed and its node should be left out,
# from NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, "Xid errors that are
# hardware / driver failures"): 48 double-bit ECC error, 62 internal micro-controller halt,
# 63/64 ECC page retirement or row remapping (recording / failed), 74 NVLink error, 79 fallen
# off the bus, 92 high single-bit ECC rate, 94/95 contained / uncontained ECC error, 119/120
# GSP RPC timeout / GSP error. Others (13, 31, 43: a program's own fault) are degraded only.
FATAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})

DEFAULT_RULES: dict[str, int] = {
    RANK_EXIT: FaultGrade.SEVERE,
    RANK_EXIT_CLEAN: FaultGrade.MEDIUM,  # the orchestrator knows whether the rank had finished
    RANK_OOM: FaultGrade.SEVERE,  # relaunched once as it was, then the job pauses (fault_policy)
    RANK_MEMORY_ERROR: FaultGrade.SEVERE,
    RANK_RELEASED: FaultGrade.MINOR,
    # Slower, not failing: the job trains on at the slow rank's pace (fault_policy
    # actions.slow_rank: ignore by default, or replace / shrink).
    SLOW_RANK: FaultGrade.MINOR,
    SLOW_RANK_CLEARED: FaultGrade.MINOR,  # for the record (job status), never decided on
    WORKER_DEPARTED: FaultGrade.SEVERE,  # its ranks must run elsewhere (or on it once it is back)
    DEVICE_ERROR: FaultGrade.SEVERE,  # its ranks must run elsewhere (fault_policy default: exclude_node)
    DEVICE_DEGRADED: FaultGrade.MINOR,  # a warning: recorded, nothing done by default
    # Warnings for the record (event, status): the job trains on; the log stays bounded and
    # the next save tries its memory copy again.
    RANK_LOG_FLOOD: FaultGrade.MINOR,
    MEMORY_COPY_SKIPPED: FaultGrade.MINOR,
    RANK_SILENT: FaultGrade.SEVERE,
    RANK_STALLED: FaultGrade.SEVERE,
    RANK_STALLED_IN_COLLECTIVE: FaultGrade.SEVERE,
    WORKER_LOST: FaultGrade.SEVERE,
    LOOP_FAILURE: FaultGrade.FATAL,
    # Deterministic: the same code refuses the same send after any restart.
    BOUNDARY_VIOLATION: FaultGrade.FATAL,
    PORT_IN_USE: FaultGrade.MEDIUM,
    COMM_ERROR: FaultGrade.SEVERE,
    "data_unavailable": FaultGrade.FATAL,
    DATA_OUTAGE: FaultGrade.SEVERE,  # a service that may be back: the job waits, then pauses
    "data_exhausted": FaultGrade.FATAL,
    "non_finite_loss": FaultGrade.FATAL,
    "overflow_storm": FaultGrade.FATAL,
    # A rank fails with these only when the policy does not skip the step: a recurring
    # numeric fault of the run (fp16 loss scaler), not of a process.
    "gradient_overflow": FaultGrade.MEDIUM,
    "loss_scale_at_minimum": FaultGrade.FATAL,
    # The job spec asked for an operator this device lacks: the same on every restart.
    "operator_unavailable": FaultGrade.FATAL,
    "model_error": FaultGrade.FATAL,
    "config_error": FaultGrade.FATAL,
    "checkpoint_error": FaultGrade.SEVERE,
    # Data-parallel replicas found different (the replica check, issue 29 item 3): a flipped
    # bit or a bad device, not a bug; the policy rolls back to a version that agreed.
    "replica_divergence": FaultGrade.SEVERE,
    # A save whose bytes a destination refused (full, quota, permission, read-only, I/O
    # error): the save is lost, the ranks train on, older versions are intact; the policy
    # decides (default skip_save). MEDIUM: no step is lost, but every save may be.
    "checkpoint_write_failed": FaultGrade.MEDIUM,
    "session_lost": FaultGrade.SEVERE,
    # Module failure events, by the class FAILURE_CLASSES gives them (typed cause, never text).
    INTERNAL_ERROR: FaultGrade.FATAL,  # a bug until shown otherwise: the same on a restart
    "out_of_memory": FaultGrade.FATAL,  # the same model on the same devices runs out again
    "io_error": FaultGrade.SEVERE,  # a file or disk that may be back after a restart
    "timeout": FaultGrade.SEVERE,
    "unavailable": FaultGrade.SEVERE,  # a service that may be back
    "data_corrupt": FaultGrade.FATAL,  # bytes that failed their check stay wrong
    "data_io_error": FaultGrade.SEVERE,
    # Reported for the record: the orchestrator decides on these events itself (they are
    # routed to it too), so the report asks for nothing (MINOR: ignore by default).
    "snapshot_failed": FaultGrade.MINOR,
    "log_write_failed": FaultGrade.MINOR,
    "recovery_failed": FaultGrade.MINOR,
    # A replaced incarnation refused by a fenced service (FAILURE_FENCED): for the record.
    "rank_fenced": FaultGrade.MINOR,
    # A node agent missed its beats (a report of the node, no job): L1-1 holds the worker out of
    # placement until it beats again; its ranks' own silence is judged per rank, as before.
    AGENT_SILENT: FaultGrade.MINOR,
}

# A module's failure event -> fault class, by (event name, FailureCause); "" / ANY_CAUSE match
# any. Looked up most specific first: (event, cause), (event, any), (any, cause), else
# internal_error. The grade is the class's (DEFAULT_RULES, or the control's rule overrides).
ANY_EVENT, ANY_CAUSE = "", 0
FailureCause = route_pb2.FailureCause
_DATA_EVENTS = ("DatasetUnavailable", "PrefetchFailed", "ShuffleFailed", "SampleStreamInterrupted", "PackingFailed")
FAILURE_CLASSES: dict[tuple[str, int], str] = {
    (ANY_EVENT, FailureCause.FAILURE_COMMUNICATION): COMM_ERROR,
    # Forming the group failed (its store, a peer that never came); a taken port is typed
    # where the group is formed (L2-2 probes it: RendezvousFailed, the loop's port_in_use).
    (ANY_EVENT, FailureCause.FAILURE_RENDEZVOUS): COMM_ERROR,
    (ANY_EVENT, FailureCause.FAILURE_OUT_OF_MEMORY): "out_of_memory",
    (ANY_EVENT, FailureCause.FAILURE_IO): "io_error",
    (ANY_EVENT, FailureCause.FAILURE_TIMEOUT): "timeout",
    (ANY_EVENT, FailureCause.FAILURE_UNAVAILABLE): "unavailable",
    (ANY_EVENT, FailureCause.FAILURE_INVALID_INPUT): "config_error",
    (ANY_EVENT, FailureCause.FAILURE_DATA_CORRUPT): "data_corrupt",
    (ANY_EVENT, FailureCause.FAILURE_NON_FINITE): "non_finite_loss",
    (ANY_EVENT, FailureCause.FAILURE_UNSUPPORTED): "operator_unavailable",
    (ANY_EVENT, FailureCause.FAILURE_EXHAUSTED): "data_exhausted",
    (ANY_EVENT, FailureCause.FAILURE_INTERNAL): INTERNAL_ERROR,
    (ANY_EVENT, FailureCause.FAILURE_WRITE_REFUSED): "io_error",
    (ANY_EVENT, FailureCause.FAILURE_FENCED): "rank_fenced",
    ("SnapshotFailed", ANY_CAUSE): "snapshot_failed",
    # A save's bytes refused by a destination (typed from the errno where the write failed).
    ("SnapshotFailed", FailureCause.FAILURE_WRITE_REFUSED): "checkpoint_write_failed",
    # Bytes that fail their digest as a rank reads them (a load): the version is bad, not the
    # store; reported as checkpoint_error with this subclass (ALIASES), which strikes it.
    ("SnapshotFailed", FailureCause.FAILURE_DATA_CORRUPT): "checkpoint_integrity",
    ("LogWriteFailed", ANY_CAUSE): "log_write_failed",
    ("RecoveryFailed", ANY_CAUSE): "recovery_failed",
    ("UpdateFailed", FailureCause.FAILURE_NON_FINITE): "non_finite_loss",
    **{(e, ANY_CAUSE): "data_unavailable" for e in _DATA_EVENTS},
    **{(e, FailureCause.FAILURE_UNAVAILABLE): DATA_OUTAGE for e in _DATA_EVENTS},
    **{(e, FailureCause.FAILURE_IO): "data_io_error" for e in _DATA_EVENTS},
    **{(e, FailureCause.FAILURE_DATA_CORRUPT): "data_corrupt" for e in _DATA_EVENTS},
    **{(e, FailureCause.FAILURE_INVALID_INPUT): "config_error" for e in _DATA_EVENTS},
    **{(e, FailureCause.FAILURE_EXHAUSTED): "data_exhausted" for e in _DATA_EVENTS},
}


def failure_class(event: str, cause: int) -> str:
    """The fault class of failure event ``event`` (short name) with ``cause`` (FAILURE_CLASSES)."""
    for key in ((event, cause), (event, ANY_CAUSE), (ANY_EVENT, cause)):
        if key in FAILURE_CLASSES:
            return FAILURE_CLASSES[key]
    return INTERNAL_ERROR


def device_fault_class(msg: engine_pb2.HardwareError) -> str:
    """The rule for a device's error: an uncorrectable ECC error or a fatal Xid
    (``FATAL_XIDS``) is ``device_error``; anything else the sampler states (corrected ECC
    errors, another Xid, heat, throttled clocks) is ``device_degraded``."""
    Error = engine_pb2.HardwareError.Error
    if msg.error == Error.ECC_UNCORRECTABLE or (msg.error == Error.XID and msg.xid in FATAL_XIDS):
        return DEVICE_ERROR
    return DEVICE_DEGRADED


def _sole_sender(msg: Any) -> int:
    """The one module the route table lets send ``msg`` (0 if none or several)."""
    route = default_table().route(msg)
    return next(iter(route.senders)) if route is not None and len(route.senders) == 1 else 0


# Deadlines when StartFaultMonitoring leaves one at 0 (seconds; job spec `liveness`).
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S = 15.0
DEFAULT_STALL_MIN_S = 30.0
DEFAULT_STALL_STEP_FACTOR = 5.0  # attribution_seconds 0: a comm_error is reported at once
DEFAULT_CHECKPOINT_STAGING_S = 600.0
DEFAULT_COMPILE_S = 900.0
_STEP_TIMES_KEPT = 64  # recent step durations of a job, for the median
RankPhase = worker_pb2.RankPhase
# Not working on a step (a rank says idle only while not stepping; before its first step
# after StartTraining it is judged as a training step).
_RESTING = frozenset({RankPhase.PHASE_IDLE})
# The phases that wait for batches (a training step's data wait, an evaluation's): a rank whose
# data relay reconnects (DataServiceUnreachable) has the job's data_outage_seconds on top there.
_DATA_PHASES = frozenset({RankPhase.PHASE_DATA_WAIT, RankPhase.PHASE_EVALUATION})


def phase_name(phase: int) -> str:
    """ "forward", "collective", ... ("" for a rank that does not say)."""
    if phase == RankPhase.PHASE_UNSPECIFIED or phase not in RankPhase.values():
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
    restored_unix: float = 0.0  # a beat the rank sent before this is a resent one (stale)
    round_faults: int = 0  # faults of the current incident (本轮), cleared by ResetFaultLedger
    round: int = 0  # which incident round of the job (ResetFaultLedger counts them): sick_nodes.py
    slow: SlowRanks = field(default_factory=SlowRanks)  # compute per step compared (slow_ranks.py)

    def stall_deadline_s(self) -> float:
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.stall_min_s, self.stall_step_factor * median)

    def phase_deadline_s(self, phase: int, total: int = 0, data_outage: bool = False) -> float:
        """The progress budget of a rank in ``phase`` (of ``total`` units, when known);
        ``data_outage``: its data relay reconnects to an unreachable data service (a phase
        that waits for batches then has as long as L1-1 waits for the service on top)."""
        budget = self._phase_budget_s(phase, total)
        return budget + self.data_outage_s if data_outage and phase in _DATA_PHASES else budget

    def _phase_budget_s(self, phase: int, total: int) -> float:
        if phase == RankPhase.PHASE_EVALUATION:
            # Scales with the batch count; before an evaluation was seen, a training step
            # (forward, backward and update) stands in for an evaluation batch (forward only).
            times = self.eval_batch_times or self.step_times
            median = statistics.median(times) if times else 0.0
            batches = total or self.eval_batches or 1
            return (self.eval_s or self.stall_min_s) + self.stall_step_factor * median * batches
        if phase == RankPhase.PHASE_CHECKPOINT_STAGING:
            return max(self.stall_min_s, self.staging_s)
        if phase == RankPhase.PHASE_COMPILE:
            return max(self.stall_min_s, self.compile_s)
        return self.stall_deadline_s()


class FaultDetector:
    """Grades fault events by a frozen rule table and publishes ``FaultReport``.

    Args:
        emit: publishes this module's events (FaultReport).
        rules: fault class -> ``FaultGrade`` value; merged over ``DEFAULT_RULES``.

    Raises:
        ValueError: a rule names an unknown grade (the message names the class).
    """

    def __init__(self, emit: Emitter, rules: Mapping[str, int] | None = None, sick_nodes: SickNodePolicy | None = None):
        table = dict(DEFAULT_RULES)
        for fault_class, grade in (rules or {}).items():
            if grade not in FaultGrade.values() or grade == FaultGrade.GRADE_UNSPECIFIED:
                raise ValueError(f"fault rules: {fault_class}: unknown grade {grade!r}")
            table[fault_class] = grade
        # Frozen after init: no command carries rules (the seed lists none), and the table
        # itself is read-only, so nobody may change the grading at run time.
        self._rules: Mapping[str, int] = MappingProxyType(table)
        self._emit = emit
        # Re-entrant: a report is published outside it, but timers and handlers share it.
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        # Every silence, stall and attribution deadline on one heap (not a thread each).
        self._deadlines = Deadlines("fault-detector", workers=16)
        self._counts: Counter[tuple[str, str]] = Counter()  # (job_id, class) -> faults seen (累计)
        # (job_id, rank) -> (module, operation, cause) of module failures reported: a loop
        # failure that repeats one (it commanded the failed module) is not reported twice.
        self._failures: defaultdict[tuple[str, int], deque] = defaultdict(lambda: deque(maxlen=16))
        # (job_id, rank) -> (worker_id, pid) -> (RankProcessState.State, detail, unix_time):
        # what the node agents last stated of each process of the rank, until its exit.
        self._processes: defaultdict[tuple[str, int], dict[tuple[str, int], tuple[int, str, float]]] = defaultdict(dict)
        # Rank faults by node across jobs, for a node that keeps failing (FaultBacklogAlert).
        self._sick = SickNodes(sick_nodes)
        # worker id -> its node agent's silence deadline (re-armed by each AgentHeartbeat), and
        # the workers reported agent_silent whose agent has not beaten since (with the receipt of
        # their last beat, time.monotonic()).
        self._agents: dict[str, tuple[object, Deadline]] = {}
        self._silent_agents: dict[str, float] = {}

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
        with self._lock:
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
                data_outage_s=msg.data_outage_seconds,
                slow=SlowRanks(stage_size=msg.ranks_per_stage),
            )
            job.running_timeout_s = max(
                msg.heartbeat_timeout_running_seconds or DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S, job.heartbeat_timeout_s
            )
            if msg.reattach_seconds > 0:
                job.reattaching, job.reattach_s = set(range(msg.world_size)), msg.reattach_seconds
                now = job.restored_unix = time.time()
                workers = list(msg.rank_worker_ids)
                for rank in range(msg.world_size):
                    worker_id = workers[rank] if rank < len(workers) else ""
                    watch = job.ranks[rank] = _RankWatch(worker_id=worker_id, last_beat_unix=now, unheard=True)
                    watch.silence = self._deadlines.after(
                        msg.reattach_seconds, self._silence_passed, (msg.job_id, rank, watch)
                    )

    def reset_fault_ledger(self, msg: control_pb2.ResetFaultLedger, payload: Any = None) -> None:
        """重置故障台账指令: the job's incident is over (recovered); the next fault opens a new one."""
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is not None:
                job.round_faults = 0
                job.round += 1

    # ------------------------------------------------------------ liveness (node agent relay)

    def on_agent_heartbeat(self, msg: control_pb2.AgentHeartbeat, payload: Any = None) -> None:
        """A node agent is alive: re-arm its silence deadline (``AGENT_MISSED_BEATS`` of its
        beat periods, at least ``AGENT_SILENT_MIN_SECONDS``, from the beat's receipt). If it
        fires, the node is reported ``agent_silent`` (no job: L1-1 holds the worker out of
        placement); the first beat after that reports it ``cleared``."""
        mono = time.monotonic()
        received = msg.received_monotonic or mono
        wait = max(AGENT_MISSED_BEATS * (msg.interval_seconds or 1.0), AGENT_SILENT_MIN_SECONDS)
        with self._lock:
            armed = self._agents.get(msg.worker_id)
            if armed is not None:
                armed[1].cancel()
            quiet_since = self._silent_agents.pop(msg.worker_id, None)
            token = object()  # which arming fires (a re-armed one is stale)
            args = (msg.worker_id, token, received, wait)
            self._agents[msg.worker_id] = (
                token,
                self._deadlines.after(wait - (mono - received), self._agent_silence_passed, args),
            )
        if quiet_since is not None:
            self._agent_heard_again(msg.worker_id, f"beats again after {received - quiet_since:.1f} s")

    def on_worker_registration(self, msg: control_pb2.WorkerRegistration, payload: Any = None) -> None:
        """A node agent's registration or withdrawal (heard here before L1-2 offers or
        withdraws its slots): either ends the agent silence deadline of the worker id. A
        deadline armed by the last beat of the agent whose session this one replaced (killed,
        restarted, back after its stream broke) is not this agent's: it fired, in CI, after a
        restarted agent registered and before its first beat (a period after its start), and
        held the node a grow-back had just been decided on. The agent registering is heard
        from (a report of it silent is ``cleared``); its own beats arm its deadline (an agent
        that never beats is never held, as before any beat). A withdrawal (zero slots: the
        agent's stream closed) takes the node out of placement itself: a gone agent is no
        silent one. A departing agent still beats until its stream closes."""
        if msg.departing:
            return
        mono = time.monotonic()
        with self._lock:
            armed = self._agents.pop(msg.worker_id, None)
            if armed is not None:
                armed[1].cancel()
            quiet_since = self._silent_agents.pop(msg.worker_id, None) if msg.slots > 0 else None
        if quiet_since is not None:
            self._agent_heard_again(msg.worker_id, f"registered again after {mono - quiet_since:.1f} s")

    def _agent_heard_again(self, worker_id: str, how: str) -> None:
        """A node agent reported silent spoke: its report ``cleared`` (L1-1 lifts its hold)."""
        now = time.time()
        self._emit(
            control_pb2.FaultReport(
                grade=self._grade(AGENT_SILENT),
                fault_class=AGENT_SILENT,
                source=Module.EXT_HARDWARE,
                detail=f"the node agent of {worker_id} {how}",
                detected_unix=now,
                occurred_unix=now,
                worker_id=worker_id,
                event=control_pb2.AgentHeartbeat.DESCRIPTOR.name,
                cleared=True,
            )
        )

    def _agent_silence_passed(self, worker_id: str, token: object, received: float, wait: float) -> None:
        with self._lock:
            armed = self._agents.get(worker_id)
            if armed is None or armed[0] is not token:
                return  # re-armed meanwhile
            del self._agents[worker_id]
            self._silent_agents[worker_id] = received
        now = time.time()
        self._emit(
            control_pb2.FaultReport(
                grade=self._grade(AGENT_SILENT),
                fault_class=AGENT_SILENT,
                source=Module.EXT_HARDWARE,
                detail=f"the node agent of {worker_id} sent no AgentHeartbeat for {time.monotonic() - received:.1f} s "
                f"(its deadline {wait:.1f} s)",
                detected_unix=now,
                occurred_unix=now - (time.monotonic() - received),
                worker_id=worker_id,
                event=control_pb2.AgentHeartbeat.DESCRIPTOR.name,
            )
        )

    def on_rank_heartbeat(self, msg: worker_pb2.RankHeartbeat, payload: Any = None) -> None:
        """A rank is alive (at step ``msg.step``, in ``msg.phase``): re-arm its silence
        deadline, and its progress deadline when it moved on (a new step, a new phase, or
        more of its phase done) or just started stepping.

        Deadlines count from when control received the beat (``received_monotonic``, stamped
        by the session relay before the event applier's queue), not from now: a beat that
        waited in that queue does not extend the rank's life."""
        mono = time.monotonic()
        lag = max(0.0, mono - msg.received_monotonic) if msg.received_monotonic else 0.0
        now = time.time() - lag  # the receipt, on the wall clock the reports use
        # Re-attached: a beat the rank sent after the restart (a resent older one says
        # nothing about what its agent has still to resend).
        with self._lock:
            job = self._jobs.get(msg.job_id)
            fresh = job is not None and (not msg.unix_time or msg.unix_time >= job.restored_unix)
        if fresh and self._reattached(msg.job_id, msg.rank):
            self._release_held(msg.job_id)
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None:
                return
            watch = job.ranks.get(msg.rank)
            if watch is None:
                watch = job.ranks[msg.rank] = _RankWatch()
                _log.info(
                    "watching rank",
                    job_id=msg.job_id,
                    rank=msg.rank,
                    worker_id=msg.worker_id,
                    heartbeat_timeout_s=job.heartbeat_timeout_s,
                    stepping=msg.stepping,
                    step=msg.step,
                )
            watch.worker_id = msg.worker_id or watch.worker_id
            watch.last_beat_unix, watch.unheard = now, False
            job.back.add(watch.worker_id)
            watch.interval_s = msg.interval_seconds or watch.interval_s
            if watch.silence is not None:
                watch.silence.cancel()
            # Longer while its node agent states its process running: late beats are not a
            # dead rank (a stop the agent states brings it back to the job's heartbeat
            # timeout, counted from the stop: on_rank_process_state).
            wait = self._silence_timeout(msg.job_id, job, msg.rank, watch) - lag
            watch.silence_due = time.monotonic() + wait
            watch.silence = self._deadlines.after(wait, self._silence_passed, (msg.job_id, msg.rank, watch))
            progressed = msg.step != watch.step
            # Progress within a step or a long phase: a new phase, or more of it done.
            moved = progressed or msg.phase != watch.phase or msg.phase_progress != watch.phase_progress
            if moved and any(r.rank == msg.rank and r.fault_class in _STALLS for r in job.held):
                # A stall held for attribution that moved on was transient: not reported.
                job.held = [r for r in job.held if not (r.rank == msg.rank and r.fault_class in _STALLS)]
                if not job.held and job.held_timer is not None:
                    job.held_timer.cancel()
                    job.held_timer = None
            if progressed and watch.step >= 0 and msg.step_seconds > 0:
                job.step_times.append(msg.step_seconds)
            if (
                moved
                and msg.phase == RankPhase.PHASE_EVALUATION
                and msg.phase_progress > 0
                and msg.phase_progress != watch.phase_progress
            ):
                job.eval_batch_times.append(msg.phase_seconds / msg.phase_progress)
            watch.step, watch.stepping = msg.step, msg.stepping
            watch.phase, watch.phase_progress, watch.phase_total = msg.phase, msg.phase_progress, msg.phase_total
            if moved:
                watch.last_progress_unix = now
                watch.stalled = watch.waiting = watch.deferred = False
            if not msg.stepping or msg.phase == RankPhase.PHASE_FAULT_WAIT:  # (waiting for L1-1's verdict)
                if watch.stall is not None:
                    watch.stall.cancel()
                watch.stall, watch.deferred = None, False
            elif moved or (watch.stall is None and not watch.stalled and not watch.waiting):
                if watch.stall is not None:
                    watch.stall.cancel()
                elif not watch.deferred:
                    watch.last_progress_unix = now  # stepping starts now: the clock starts now
                watch.deferred = False
                budget = job.phase_deadline_s(msg.phase, msg.phase_total, watch.data_outage)
                watch.stall = self._deadlines.after(budget - lag, self._stall_passed, (msg.job_id, msg.rank, watch))
            finding = None
            if msg.stepping:  # (a paused or finished rank's beats repeat its last step)
                compute = (msg.forward_compute_seconds, msg.backward_compute_seconds, msg.optimizer_compute_seconds)
                finding = job.slow.observe(msg.rank, msg.step, compute, msg.unix_time or now)
                ratio = job.slow.ratio(msg.rank)
                if ratio is not None:
                    metrics.RANK_SLOWDOWN.labels(msg.job_id, str(msg.rank)).set(ratio)
        if finding is not None:  # (published outside the lock)
            self._report_slow(msg.job_id, finding, job.slow.settings.window)

    def _report_slow(self, job_id: str, finding: Finding, window: int) -> None:
        """Report a slow-rank finding (``slow_rank``) or its end (``slow_rank_cleared``)."""
        if finding.slow:
            metrics.SLOW_RANK_FINDINGS.inc()
        fault_class = SLOW_RANK if finding.slow else SLOW_RANK_CLEARED
        # (the rank's process, as for a stall: its beats say how it computes)
        self._report(job_id, fault_class, Module.EXT_HARDWARE, finding.rank, finding.text(window), step=finding.step)

    # ------------------------------------------------------------ fault events

    def on_rank_process_state(self, msg: control_pb2.RankProcessState, payload: Any = None) -> None:
        """A node agent states a rank process RUNNING (watched from now on, or continued) or
        STOPPED by a signal. A stop explains a silence, it never shortens it: a rank stated
        stopped that beats no more is declared silent ``heartbeat_timeout_seconds`` after
        control heard the stop, never later than the deadline it had (a running one), so a
        stop and continue within the job's timeout (^Z and fg, a py-spy dump, a debugger's
        attach) is no fault. (A cgroup freeze is no stop ``waitid`` reports: running.) A rank that beat until it was stopped stops at
        most a beat period after its last beat: it is declared at most the timeout plus one
        beat period after that beat (the slack). One stated running (continued) gets
        ``heartbeat_timeout_running_seconds`` from its last beat (see ``_silence_passed``)."""
        with self._lock:
            self._processes[(msg.job_id, msg.rank)][(msg.worker_id, msg.pid)] = (msg.state, msg.detail, msg.unix_time)
            job = self._jobs.get(msg.job_id)
            watch = job.ranks.get(msg.rank) if job is not None else None
            if watch is None or watch.silence is None or watch.unheard:
                return  # not beating yet, declared already, or on its re-attach deadline
            if watch.worker_id and watch.worker_id != msg.worker_id:
                return  # another process of the rank, elsewhere (a relaunch): not the one watched
            now = time.monotonic()
            if msg.state == control_pb2.RankProcessState.STOPPED:
                # Counted from the stop, not from the last beat (which may precede it by a beat
                # period: a 2 s stop would look like 2 s + a period); capped by the deadline
                # it had, so stops that come and go never keep a rank that beats no more alive.
                wait = min(watch.silence_due - now, job.heartbeat_timeout_s)
            else:  # running (continued): its deadline counts from its last beat again
                wait = job.running_timeout_s - (time.time() - watch.last_beat_unix)
            watch.silence.cancel()
            watch.silence_due = now + wait
            watch.silence = self._deadlines.after(wait, self._silence_passed, (msg.job_id, msg.rank, watch))

    def on_rank_exited(self, msg: control_pb2.RankExited, payload: Any = None) -> None:
        """A rank process ended: its deadlines end with it. Every exit of a monitored job is
        graded: a code-0 exit is normal once the loop finished, but only the orchestrator
        knows that; an exit after a release is one control asked for."""
        with self._lock:
            self._forget_process(msg.job_id, msg.rank, msg.worker_id, msg.pid)
            job = self._jobs.get(msg.job_id)
            watch = job.ranks.pop(msg.rank, None) if job is not None else None
            if watch is not None:
                watch.cancel()
            ended_slow = job.slow.forget(msg.rank) if job is not None else None
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
        )
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
        with self._lock:
            for job_id, job in self._jobs.items():
                for rank, watch in job.ranks.items():
                    if watch.worker_id == msg.worker_id:
                        where[job_id] = min(rank, where.get(job_id, rank))
            for (job_id, rank), processes in self._processes.items():
                if job_id in self._jobs and any(w == msg.worker_id for w, _ in processes):
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
        )
        if report is None:
            return
        self._hold_or_report(msg.job_id, msg.rank, report)

    def on_data_service_unreachable(self, msg: data_pb2.DataServiceUnreachable, payload: Any = None) -> None:
        """A rank's data relay cannot reach the data service and reconnects (or, ``back``, it
        answers again): reported as ``data_outage`` (``cleared`` when back) for L1-1, which
        waits for the service up to the job's data_outage_seconds. Meanwhile the rank's data
        wait is no stall: its budget has that wait on top (the relay gives up after it, and
        L1-1 decides before that), re-armed from the rank's last progress."""
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None:
                return
            watch = job.ranks.get(msg.rank)
            if watch is not None and watch.data_outage != (not msg.back):
                watch.data_outage = not msg.back
                if watch.stall is not None and watch.phase in _DATA_PHASES:
                    watch.stall.cancel()
                    budget = job.phase_deadline_s(watch.phase, watch.phase_total, watch.data_outage)
                    left = budget - max(0.0, time.time() - watch.last_progress_unix)
                    watch.stall = self._deadlines.after(
                        max(0.0, left), self._stall_passed, (msg.job_id, msg.rank, watch)
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
            job_id, fault_class, module, rank, detail, step=step, subclass=subclass, event=event, cause=failure.cause
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
        with self._lock:
            self._failures[(job_id, rank)].append((failure.module, failure.operation, failure.cause))
        self._hold_or_report(job_id, rank, report)

    def _seen_failure(self, job_id: str, rank: int, failure: route_pb2.Failure) -> bool:
        with self._lock:
            return (failure.module, failure.operation, failure.cause) in self._failures.get((job_id, rank), ())

    def _hold_or_report(self, job_id: str, rank: int, report: control_pb2.FaultReport) -> None:
        with self._lock:
            job = self._jobs[job_id]
            if rank in job.ranks:
                job.ranks[rank].unheard = False  # its agent is back (resending)
                job.back.add(job.ranks[rank].worker_id)
            if report.fault_class == COMM_ERROR and (job.attribution_s > 0 or job.reattaching):
                window = max(job.attribution_s, job.reattach_s if job.reattaching else 0.0)
                self._hold(job_id, report, window=window)
                return
        self._report_graded(job_id, report)

    def on_boundary_violation_reported(self, msg: audit_pb2.BoundaryViolationReported, payload: Any = None) -> None:
        """A process's contract layer refused a send. Graded for the job of the process
        that reported it; a violation outside any job (``job_id`` "") is nobody's job to
        decide on here: the contract layer has counted and logged it."""
        receiver = Module.Name(msg.receiver) if msg.receiver else "any receiver"
        detail = f"{msg.process}: {Module.Name(msg.sender)} may not send {msg.message} to {receiver}"
        if msg.detail:
            detail += f" ({msg.detail})"
        self._report(msg.job_id, BOUNDARY_VIOLATION, msg.sender, msg.rank, detail)

    # ------------------------------------------------------------ deadlines (timer threads)

    def _silence_passed(self, job_id: str, rank: int, watch: _RankWatch) -> None:
        """The rank's silence deadline passed (``heartbeat_timeout_s`` after its last beat,
        ``running_timeout_s`` while its node agent states its process running,
        ``heartbeat_timeout_s`` after control heard the agent state it stopped): it is
        declared silent, saying which."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.ranks.get(rank) is not watch:
                return  # the rank exited (or a new process of it beats) meanwhile
            state, stopped_how = self._process_state(job_id, rank, watch.worker_id)
            del job.ranks[rank]  # declared once; a new heartbeat starts a new watch
            watch.cancel()
            timeout = job.heartbeat_timeout_s
            # Nothing of it since the restart, nor of another rank of the worker it ran on (as
            # journaled): that worker is gone. Where it ran is unknown: only silent.
            lost = (
                watch.unheard and rank in job.reattaching and bool(watch.worker_id) and watch.worker_id not in job.back
            )
            # Peers that waited in a collective, without a deadline, while it still looked
            # alive and working: they waited for it. Its consequences, reported after it.
            waiting = [
                (r, w) for r, w in sorted(job.ranks.items()) if w.waiting and w.phase == RankPhase.PHASE_COLLECTIVE
            ]
            for _, w in waiting:
                w.waiting, w.stalled = False, True
            # Its own stalls held meanwhile (judged from the last state it stated, e.g. "in a
            # collective", before its reports stopped): its silence is the verdict, not them.
            job.held = [r for r in job.held if not (r.rank == rank and r.fault_class in _STALLS)]
            window = max(job.attribution_s, 0.1)
        now = time.time()
        silent_for = now - watch.last_beat_unix
        if lost:
            fault_class = WORKER_LOST
            detail = (
                f"rank {rank} lost with worker {watch.worker_id}: no node agent re-attached it "
                f"within {silent_for:.1f} s of the control restart"
            )
        elif state == control_pb2.RankProcessState.STOPPED:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s: its process "
                f"is {stopped_how or 'stopped'} (stated by its node agent) after step {max(watch.step, 0)}"
            )
        elif state == control_pb2.RankProcessState.RUNNING:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s "
                f"(deadline {job.running_timeout_s:g} s for a process its node agent states running) "
                f"after step {max(watch.step, 0)}"
            )
        else:
            fault_class = RANK_SILENT
            detail = (
                f"rank {rank} on worker {watch.worker_id} sent no heartbeat for {silent_for:.1f} s "
                f"(deadline {timeout:g} s) after step {max(watch.step, 0)}"
            )
        self._report(
            job_id,
            fault_class,
            Module.EXT_HARDWARE,
            rank,
            detail,
            occurred=watch.last_beat_unix,
            worker_id=watch.worker_id,
            step=max(watch.step, 0),
            phase=watch.phase,
        )
        followers = self._waiting_reports(job_id, waiting, rank, "silent", now)
        if followers:
            self._hold(job_id, followers[0], window=window, followers=followers[1:])
        if self._reattached(job_id, rank):
            self._release_held(job_id)

    def _stall_passed(self, job_id: str, rank: int, watch: _RankWatch) -> None:
        """The rank made no progress for its phase's budget. Outside a collective it is an
        incident's likely cause (``rank_stalled``), reported with the peers that wait for
        it in a collective as its consequences (``rank_stalled_in_collective``, after it).
        In a collective it waits for someone: while a peer still works (progressing outside
        a collective) that is no fault, and the rank waits without a deadline of its own
        until it moves on (that peer's own deadline reports it, if that peer stalls);
        otherwise it is reported as a symptom, held for its cause, with the ranks waiting
        in a collective that way."""
        now = time.time()
        consequences: list[tuple[int, _RankWatch]] = []
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.ranks.get(rank) is not watch or watch.stall is None:
                return
            watch.stall = None
            quiet = self._quiet(job, now)
            if (
                watch.phase == RankPhase.PHASE_COLLECTIVE
                and rank not in quiet
                and any(
                    r != rank and (r not in quiet and self._working(w) or self._waits_for_data(w))
                    for r, w in job.ranks.items()
                )
            ):
                # Waiting for a peer that still works (e.g. a longer evaluation on it), or that
                # waits for the data service (L1-1 waits for it too; a late beat of that peer
                # changes nothing: were it gone, its silence deadline reports it): no fault
                # (see the docstring).
                watch.waiting = True
                return
            if rank in quiet:
                # It stopped beating too: its silence deadline reports it (as silent). Should it
                # beat again without progress (a pause, not a death), that beat re-arms this one.
                watch.deferred = True
                return
            watch.stalled = True  # declared once; the next progress re-arms the deadline
            deadline = job.phase_deadline_s(watch.phase, watch.phase_total, watch.data_outage)
            in_collective = watch.phase == RankPhase.PHASE_COLLECTIVE
            for r, w in sorted(job.ranks.items()):
                # Outside a collective: its peers waiting in one since (at least 1.5 of their
                # beats without progress) wait for it. In one: the peers that waited without
                # a deadline for a peer that worked then. Consequences, reported after it.
                if r == rank or r in quiet or w.phase != RankPhase.PHASE_COLLECTIVE or not w.stepping or w.stalled:
                    continue
                if w.waiting or (
                    not in_collective and now - w.last_progress_unix > QUIET_BEATS * (w.interval_s or 1.0)
                ):
                    if w.stall is not None:
                        w.stall.cancel()
                    w.stall, w.stalled, w.waiting = None, True, False
                    consequences.append((r, w))
        stalled_for = now - watch.last_progress_unix
        where = phase_name(watch.phase)
        fault_class = RANK_STALLED_IN_COLLECTIVE if in_collective else RANK_STALLED
        if in_collective:
            text = (
                f"rank {rank} on worker {watch.worker_id} waits in a collective: no step progress for "
                f"{stalled_for:.1f} s (deadline {deadline:.1f} s) after step {max(watch.step, 0)}"
            )
        else:
            text = (
                f"rank {rank} on worker {watch.worker_id} is alive but made no step progress for {stalled_for:.1f} s "
                f"(deadline {deadline:.1f} s) after step {max(watch.step, 0)}"
            )
            if where:
                text += f", in its {where} phase" + (
                    f" ({watch.phase_progress} of {watch.phase_total} done)" if watch.phase_total else ""
                )
        report = self._graded(
            job_id,
            fault_class,
            Module.EXT_HARDWARE,
            rank,
            text,
            occurred=watch.last_progress_unix,
            worker_id=watch.worker_id,
            step=max(watch.step, 0),
            phase=watch.phase,
        )
        if report is None:
            return
        followers = self._waiting_reports(job_id, consequences, rank, f"stalled in its {where or 'step'}", now)
        # Held: until a quiet peer's silence deadline can have fired, or long enough to
        # tell whether a peer goes quiet (then extended, see _release_held).
        _log.info(
            "stall held for attribution",
            job_id=job_id,
            rank=rank,
            quiet=quiet,
            phase=where,
            waiting_in_collective=[r for r, _ in consequences],
        )
        if quiet:
            self._hold(
                job_id,
                report,
                window=max(job.attribution_s, job.heartbeat_timeout_s + 0.5),
                waited=quiet,
                followers=followers,
            )
        else:
            self._hold(job_id, report, window=max(job.attribution_s, self._beat_window(job)), followers=followers)

    def _waiting_reports(
        self,
        job_id: str,
        waiting: list[tuple[int, _RankWatch]],
        cause_rank: int,
        how: str,
        now: float,
    ) -> list[control_pb2.FaultReport]:
        """``rank_stalled_in_collective`` reports of the ranks that wait for ``cause_rank``."""
        reports = []
        for r, w in waiting:
            waited = now - w.last_progress_unix
            report = self._graded(
                job_id,
                RANK_STALLED_IN_COLLECTIVE,
                Module.EXT_HARDWARE,
                r,
                f"rank {r} on worker {w.worker_id} waits in a collective: no step progress for {waited:.1f} s "
                f"after step {max(w.step, 0)}, waiting for rank {cause_rank} ({how})",
                occurred=w.last_progress_unix,
                worker_id=w.worker_id,
                step=max(w.step, 0),
                phase=w.phase,
            )
            if report is not None:
                reports.append(report)
        return reports

    @staticmethod
    def _working(w: _RankWatch) -> bool:
        """Progressing outside a collective: stepping, its progress deadline armed, not
        declared stalled, in a phase that is not a collective wait."""
        return (
            w.stepping
            and w.stall is not None
            and not w.stalled
            and w.phase not in _RESTING
            and w.phase != RankPhase.PHASE_COLLECTIVE
        )

    @staticmethod
    def _waits_for_data(w: _RankWatch) -> bool:
        """Stepping, waiting for batches while its data relay reconnects to an unreachable
        data service (DataServiceUnreachable), not declared stalled."""
        return w.stepping and w.data_outage and not w.stalled and w.phase in _DATA_PHASES

    def _release_held(self, job_id: str) -> None:
        """The attribution window closed with no cause from another rank: the first held
        symptom is the cause after all, and the rest follow it. Unless a stall (of either
        kind: outside or in a collective) is held and some rank has gone quiet: the stalled
        rank itself (its last state, e.g. "in a collective", is then stale: its silence is the
        verdict) or the peer it waits for. Then the window is extended until that rank's
        silence deadline can have fired, and again while it has not (its agent stated a stop
        or a run since) as long as it sent no beat: a rank that beats again, and goes quiet
        once more, is not waited for twice (a slow beater does not hold a stall forever)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            if any(r.fault_class in _STALLS for r in job.held):
                pending = [
                    (r, w)
                    for r in self._quiet(job, time.time())
                    if (w := job.ranks[r]).silence is not None
                    and job.held_waited.get(r, w.last_beat_unix) == w.last_beat_unix
                ]
                if pending:
                    job.held_waited.update((r, w.last_beat_unix) for r, w in pending)
                    wait = max(w.silence_due for _, w in pending) - time.monotonic()
                    job.held_timer = self._deadlines.after(max(0.0, wait) + 0.5, self._release_held, (job_id,))
                    return
            if job.held_timer is not None:
                job.held_timer.cancel()  # (released early: every rank re-attached)
            held, job.held, job.held_timer = job.held, [], None
            job.held_waited = {}
            restored = job.reattach_s > 0
        causes = self._causes(held)
        if restored and causes:
            # Reports held while the node agents re-attached after a control restart: the
            # cause that happened first (long before it arrived) goes first; the rest keep
            # their order (a rank's exit stays after its own symptom).
            first = min(causes, key=lambda r: r.occurred_unix)
            held = [first] + [r for r in held if r is not first]
        elif not causes:
            # Symptoms only: a rank stalled outside a collective is what the ranks stalled
            # in one wait for, whichever deadline fired first: it goes first (the rest keep
            # their order).
            held = sorted(held, key=lambda r: r.fault_class != RANK_STALLED)
        for report in held:
            self._emit(report)

    # ------------------------------------------------------------ private

    def _process_state(self, job_id: str, rank: int, worker_id: str) -> tuple[int, str]:
        """What the node agent of ``worker_id`` last stated of the rank's process there:
        (RankProcessState.State, its detail); (STATE_UNSPECIFIED, "") where it stated nothing
        (a rank not launched by a node agent, a worker unknown). Of two processes of the rank
        there (one released, not yet reaped), the newest: the one that beats. Lock held."""
        states = [v for (w, _), v in self._processes.get((job_id, rank), {}).items() if w == worker_id]
        if not worker_id or not states:
            return control_pb2.RankProcessState.STATE_UNSPECIFIED, ""
        state, detail, _ = states[-1]  # (keys keep the order in which each process was first stated)
        return state, detail

    def _forget_process(self, job_id: str, rank: int, worker_id: str, pid: int) -> None:
        """The process ended (pid 0: every process of the rank on that worker). Lock held."""
        known = self._processes.get((job_id, rank))
        if known is None:
            return
        for key in [k for k in known if k[0] == worker_id and (not pid or k[1] == pid)]:
            del known[key]
        if not known:
            del self._processes[(job_id, rank)]

    def _silence_timeout(self, job_id: str, job: _Job, rank: int, watch: _RankWatch) -> float:
        """How long the rank may stay without a beat: longer while its node agent states its
        process runs, the job's heartbeat timeout otherwise (nothing stated, or stopped: a
        beat from a process still stated stopped came before the agent's word that it
        continued) (lock held)."""
        state, _ = self._process_state(job_id, rank, watch.worker_id)
        if state == control_pb2.RankProcessState.RUNNING:
            return job.running_timeout_s
        return job.heartbeat_timeout_s

    def _reattached(self, job_id: str, rank: int) -> bool:
        """The rank was heard from after a control restart; True when it was the last one
        the job waited for and symptoms are held (they may go now)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or rank not in job.reattaching:
                return False
            job.reattaching.discard(rank)
            return not job.reattaching and bool(job.held)

    @staticmethod
    def _causes(held: list[control_pb2.FaultReport]) -> list[control_pb2.FaultReport]:
        """The held reports that may be an incident's cause: not a symptom, and not a report
        of a rank after its own symptom (a survivor's exit after its failed collective
        follows that failure, as ``_report_graded`` orders it live). A silence always may."""
        symptomatic: set[int] = set()
        causes = []
        for r in held:
            if r.fault_class in _SYMPTOMS:
                symptomatic.add(r.rank)
            elif r.rank not in symptomatic or r.fault_class == RANK_SILENT:
                causes.append(r)
        return causes

    @staticmethod
    def _quiet(job: _Job, now: float) -> list[int]:
        """Ranks with no beat for more than QUIET_BEATS of their beat periods."""
        return [
            r
            for r, w in job.ranks.items()
            if now - w.last_beat_unix > QUIET_BEATS * (w.interval_s or job.heartbeat_timeout_s)
        ]

    @staticmethod
    def _beat_window(job: _Job) -> float:
        """QUIET_BEATS of the longest beat period the job's ranks stated (seconds; 0 when
        none did: then nothing tells a quiet peer before its deadline)."""
        return QUIET_BEATS * max((w.interval_s for w in job.ranks.values()), default=0.0)

    @staticmethod
    def _held_rank(job: _Job, rank: int) -> bool:
        return any(r.rank == rank for r in job.held)

    def _grade(self, fault_class: str) -> int:
        return self._rules.get(fault_class, self._rules[LOOP_FAILURE])

    def _graded(
        self,
        job_id: str,
        fault_class: str,
        source: int,
        rank: int,
        detail: str,
        *,
        occurred: float = 0.0,
        worker_id: str = "",
        step: int = 0,
        phase: int = 0,
        subclass: str = "",
        event: str = "",
        cause: int = 0,
        exit_cause: int = 0,
    ) -> control_pb2.FaultReport | None:
        now = time.time()
        sick = None
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None  # not a job this control started (e.g. ranks from a previous run)
            self._counts[(job_id, fault_class)] += 1
            job.round_faults += 1
            if not worker_id and rank in job.ranks:
                worker_id = job.ranks[rank].worker_id
            if worker_id and fault_class in NODE_FAULT_CLASSES:
                kind = fault_class + (f"/{control_pb2.ExitCause.Name(exit_cause)}" if exit_cause else "")
                sick = self._sick.record(NodeFault(worker_id, job_id, job.round, kind, now))
        if sick is not None:
            self._alert_sick(sick)
        return control_pb2.FaultReport(
            job_id=job_id,
            grade=self._grade(fault_class),
            fault_class=fault_class,
            source=source,
            rank=rank,
            detail=detail,
            detected_unix=now,
            occurred_unix=occurred or now,
            worker_id=worker_id,
            step=step,
            phase=phase,
            subclass=subclass,
            event=event,
            cause=cause,
        )

    def _alert_sick(self, sick: SickNode) -> None:
        """A node's rank faults piled up across jobs and incidents (sick_nodes.py): L1-1 is
        told (it quarantines the node), before the report that made it sick, so the cordon is
        in force before that job decides where to relaunch. Outside the lock."""
        _log.warning("sick node", worker_id=sick.worker_id, faults=sick.faults, incidents=sick.incidents)
        self._emit(
            control_pb2.FaultBacklogAlert(
                worker_id=sick.worker_id,
                reports=sick.faults,
                incidents=sick.incidents,
                window_seconds=sick.window_seconds,
                detail=sick.detail,
            )
        )

    def _hold(
        self,
        job_id: str,
        report: control_pb2.FaultReport,
        window: float,
        waited: list[int] = (),
        followers: list[control_pb2.FaultReport] = (),
    ) -> None:
        """Hold a symptom until its cause arrives or ``window`` seconds pass. The window
        opens with the first symptom held and does not move (``waited``: the quiet ranks
        whose silence deadline it covers, see _release_held). ``followers`` are held with
        it, after it."""
        with self._lock:
            job = self._jobs[job_id]
            if not job.held:
                job.held_waited = {r: job.ranks[r].last_beat_unix for r in waited if r in job.ranks}
                if job.held_timer is not None:
                    job.held_timer.cancel()
                job.held_timer = self._deadlines.after(window, self._release_held, (job_id,))
            job.held.append(report)
            job.held.extend(followers)

    def _report(self, job_id: str, fault_class: str, source: int, rank: int, detail: str, **known: Any) -> None:
        report = self._graded(job_id, fault_class, source, rank, detail, **known)
        if report is None:
            return
        self._report_graded(job_id, report)

    def _report_graded(self, job_id: str, report: control_pb2.FaultReport) -> None:
        """Publish a graded report as a cause, unless its rank has a symptom held: then it
        follows that symptom (e.g. the held rank's own exit)."""
        rank = report.rank
        with self._lock:
            job = self._jobs[job_id]
            if job.reattaching:
                # Restored after a control restart: the node agents resend what happened
                # while control was down one after another; the whole story is ordered
                # once every rank was heard from (see _release_held).
                self._hold(job_id, report, window=job.reattach_s)
                return
            # A silence is never a consequence: it is published as a cause at once.
            if job.held and report.fault_class != RANK_SILENT and self._held_rank(job, rank):
                job.held.append(report)  # the held rank's own exit follows its symptom
                return
        self._publish_cause(job_id, report)

    def _publish_cause(self, job_id: str, report: control_pb2.FaultReport) -> None:
        """Publish ``report``, then whatever symptoms were waiting for a cause: it is theirs.
        Published outside the lock: the orchestrator may command this module back."""
        with self._lock:
            job = self._jobs[job_id]
            held, job.held, job.held_waited = job.held, [], {}
            if job.held_timer is not None:
                job.held_timer.cancel()
                job.held_timer = None
        self._emit(report)
        for symptom in held:
            self._emit(symptom)
