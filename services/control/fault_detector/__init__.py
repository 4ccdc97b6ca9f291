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
  precede the stop) after its last beat. The report says whether the rank's node agent was
  heard from since the rank's last beat (``agent_unheard``: no beat since, or quiet now): a
  node frozen with its agent, or the agent alone hung (it relays the rank's beats); that
  agent is then reported ``agent_silent`` at once if its own deadline has not fired yet,
  before the rank (its next beat ``cleared``), so L1-1's relaunch of every rank (the rank
  cannot be ended) finds the node held. The party at fault is then the agent, not the rank
  (which may be training): the job's report is ``worker_lost`` with subclass
  ``agent_silent``, naming the agent (unless the agent stated the rank's process stopped:
  then the rank is ``rank_silent``). A rank restored after a control restart that nothing
  of was heard since is lost with the worker L1-1 journaled for it (where it reported ready,
  or where it was launched: a restart during WARMING_UP), at the journaled step;
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
  agent is heard from before its first beat; a silent report is ``cleared``). Once armed, the
  agent's beats that change nothing (same period, no quiet spell) move it on control's gRPC
  loop as they are read, never queued (services/control/beat_stamps.py).

* held verdicts (disruption.py): while control itself is behind (its loop, or its event
  applier, by more than a second: services/control/control_health.py) or most agents are
  quiet at once (a full disruption, as Kubernetes' node lifecycle controller sees one), an
  agent's or a rank's silence verdict is held, not issued, and decided again once control
  keeps up: slowness is never death.

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

Cut links (issue 29 item 5, links.py): the node agents probe the data-plane links between
a job's nodes and state each change (``LinkStateChanged``). A link both ends say is down,
while the ranks of both nodes still beat, grades a rank's collective stall or communication
error as ``link_down`` (SEVERE, naming both nodes in ``link_ends``; L1-1 relaunches without
one of them, like a lost node), not as a stall of whichever rank's deadline fired first; a
link losing probes one way or heavily is ``link_degraded`` (MINOR, a warning).

Aliases: a rank's ``checkpoint_integrity`` failure (a version that fails its SHA-256 check
when loaded) is graded and reported as ``checkpoint_error``, the class the fault policy
table names.

Layout (one concern a file): detector.py, ``FaultDetector`` itself (its state, the commands
from L1-1, the fault events it grades) joining the mixins liveness.py (each rank's silence
deadline and each node agent's), stalls.py (progress deadlines, blame by phase),
attribution.py (held symptoms and their causes), links.py (link views, link_down / link_degraded) and grading.py (grade, report, sick-node
alert); and plain records and tables: rules.py (the fault classes, ``DEFAULT_RULES``,
``FAILURE_CLASSES``), watch.py (``_RankWatch``, ``_Job``, the deadlines' defaults).
"""

from services.control.fault_detector.detector import FaultDetector
from services.control.fault_detector.rules import (
    AGENT_MISSED_BEATS,
    AGENT_SILENT,
    AGENT_SILENT_MIN_SECONDS,
    ALIASES,
    ANY_CAUSE,
    ANY_EVENT,
    BOUNDARY_VIOLATION,
    CHECKPOINT_ERROR,
    COMM_ERROR,
    DATA_OUTAGE,
    DEFAULT_RULES,
    DEVICE_DEGRADED,
    DEVICE_ERROR,
    EXIT_CAUSE_CLASSES,
    FAILURE_CLASSES,
    FATAL_XIDS,
    INTERNAL_ERROR,
    LINK_DEGRADED,
    LINK_DOWN,
    LOOP_FAILURE,
    MEMORY_COPY_SKIPPED,
    PORT_IN_USE,
    QUIET_BEATS,
    RANK_EXIT,
    RANK_EXIT_CLEAN,
    RANK_LOG_FLOOD,
    RANK_MEMORY_ERROR,
    RANK_NOT_STARTED,
    RANK_OOM,
    RANK_RELEASED,
    RANK_SILENT,
    RANK_STALLED,
    RANK_STALLED_IN_COLLECTIVE,
    SLOW_RANK,
    SLOW_RANK_CLEARED,
    WORKER_DEPARTED,
    WORKER_LOST,
    FailureCause,
    FaultGrade,
    device_fault_class,
    failure_class,
)
from services.control.fault_detector.watch import (
    DEFAULT_CHECKPOINT_STAGING_S,
    DEFAULT_COMPILE_S,
    DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_PROFILE_EXPORT_S,
    DEFAULT_STALL_MIN_S,
    DEFAULT_STALL_STEP_FACTOR,
    RankPhase,
    _Job,
    _RankWatch,
    phase_name,
)

__all__ = [
    "AGENT_MISSED_BEATS",
    "AGENT_SILENT",
    "AGENT_SILENT_MIN_SECONDS",
    "ALIASES",
    "ANY_CAUSE",
    "ANY_EVENT",
    "BOUNDARY_VIOLATION",
    "CHECKPOINT_ERROR",
    "COMM_ERROR",
    "DATA_OUTAGE",
    "DEFAULT_CHECKPOINT_STAGING_S",
    "DEFAULT_COMPILE_S",
    "DEFAULT_PROFILE_EXPORT_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_RUNNING_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_RULES",
    "DEFAULT_STALL_MIN_S",
    "DEFAULT_STALL_STEP_FACTOR",
    "DEVICE_DEGRADED",
    "DEVICE_ERROR",
    "EXIT_CAUSE_CLASSES",
    "FAILURE_CLASSES",
    "FATAL_XIDS",
    "FailureCause",
    "FaultDetector",
    "FaultGrade",
    "INTERNAL_ERROR",
    "LINK_DEGRADED",
    "LINK_DOWN",
    "LOOP_FAILURE",
    "MEMORY_COPY_SKIPPED",
    "PORT_IN_USE",
    "QUIET_BEATS",
    "RANK_EXIT",
    "RANK_EXIT_CLEAN",
    "RANK_LOG_FLOOD",
    "RANK_MEMORY_ERROR",
    "RANK_NOT_STARTED",
    "RANK_OOM",
    "RANK_RELEASED",
    "RANK_SILENT",
    "RANK_STALLED",
    "RANK_STALLED_IN_COLLECTIVE",
    "RankPhase",
    "SLOW_RANK",
    "SLOW_RANK_CLEARED",
    "WORKER_DEPARTED",
    "WORKER_LOST",
    "_Job",
    "_RankWatch",
    "device_fault_class",
    "failure_class",
    "phase_name",
]
