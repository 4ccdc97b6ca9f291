"""L1-3's grading table: the fault classes it names, their grades (``DEFAULT_RULES``), a
module failure event's class by its type and typed cause (``FAILURE_CLASSES``), and a device
error's class (``device_fault_class``). Frozen into each ``FaultDetector`` at construction."""

from __future__ import annotations

from typing import Any

from services.contract import control_pb2, engine_pb2, route_pb2
from services.contract.route_table import default_table

FaultGrade = control_pb2.FaultGrade

# Fault classes this detector names itself (TrainingLoopFailed brings its own class).
RANK_EXIT = "rank_exit"  # a rank process ended with a non-zero code or a signal
# A rank's exit by the cause its node agent tells from evidence (RankExited.cause): the OOM
# killer (its cgroup's oom_kill count rose), or Python's MemoryError (its exit code 75).
# Any other exit (an error code, a signal that was no OOM kill) is rank_exit; the cause (the
# signal, its sender where known) is in the detail.
RANK_OOM = "rank_oom"
RANK_MEMORY_ERROR = "rank_memory_error"
# A rank its node agent could not start (an executable, or an evaluation job's command, that is
# missing or not executable there): no relaunch would start it either.
RANK_NOT_STARTED = "rank_not_started"
EXIT_CAUSE_CLASSES = {
    control_pb2.EXIT_OOM_KILLED: RANK_OOM,
    control_pb2.EXIT_MEMORY_ERROR: RANK_MEMORY_ERROR,
    control_pb2.EXIT_NOT_STARTED: RANK_NOT_STARTED,
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
# A node agent is quiet once it has not beaten for this many of its periods (links.py).
QUIET_PERIODS = 1.5
# A silent rank's node agent is unheard (FaultReport.agent_unheard) once it has not beaten for
# this many of its periods (or not since the rank's last beat). Longer than QUIET_PERIODS: the
# flag changes the decision (every rank relaunched, the node held), and a beat 1.5 periods late
# is seen on a loaded 2-core host; a node frozen a second after its rank is quiet for 3 or more
# periods of 1 s when the rank is declared (4 s timeout).
UNHEARD_PERIODS = 2.5
AGENT_SILENT_MIN_SECONDS = 3.0
SLOW_RANK = "slow_rank"  # computes >= 1.5x its peers' median per step, sustained (slow_ranks.py)
SLOW_RANK_CLEARED = "slow_rank_cleared"  # a rank named slow is not any more (or ended)
# Footprint (issue 29 item 8): a rank whose output outran the agent's bound (its log file is
# rotated: nothing grows without bound), and an in-memory copy skipped for want of space.
RANK_LOG_FLOOD = "rank_log_flood"
MEMORY_COPY_SKIPPED = "memory_copy_skipped"
# Data-plane links (issue 29 item 5, links.py): a collective that stalled (or failed) while its
# ranks still beat and a link between their nodes was down (both ends' node agents hear nothing
# of each other), and a link that loses probes (one way, or heavily both ways).
LINK_DOWN = "link_down"
LINK_DEGRADED = "link_degraded"
JOURNAL_WRITE_FAILED = "journal_write_failed"  # L1-1's journal refused a write (its failure event, typed)
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
    RANK_NOT_STARTED: FaultGrade.FATAL,  # the same missing executable on every relaunch
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
    # A cut link: its ranks cannot meet again across it; relaunched without one of its nodes
    # (fault_policy default exclude_node). A degraded one is a warning: the job trains on.
    LINK_DOWN: FaultGrade.SEVERE,
    LINK_DEGRADED: FaultGrade.MINOR,
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
    # Control's own journal refused a write (a full disk, an I/O error: typed by SQLite's result
    # code or the errno, services/control/journal_failure.py): control's fault, not the job's.
    # The decision it carried is undone and refused; the job's policy decides (ignore by default).
    JOURNAL_WRITE_FAILED: FaultGrade.MINOR,
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
    # L1-1 writes to one place only, its journal: a refused write there is control's store failing.
    ("OrchestratorFailed", FailureCause.FAILURE_WRITE_REFUSED): JOURNAL_WRITE_FAILED,
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
