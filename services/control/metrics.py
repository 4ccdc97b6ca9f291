"""Prometheus metrics of the control plane's fault handling (served on control's /metrics).

The orchestrator observes them as it decides (it receives every fault report); nothing here
reads another module. Names and labels:

* ``surge_faults_total{grade,class,role}``: graded fault reports; ``role`` ``cause`` for a
  fault of its own (an incident, decided by the policy), ``consequence`` for a report of an
  incident's effect (a survivor's broken collective, a dying rank's failure, recorded only:
  orchestrator/triage.py CONSEQUENCE and LATE), so that a page per incident reads the causes
  (deploy/rules SurgeFaultSevere); never a finished rank's clean exit (``rank_exit_clean``
  triaged as its normal end) nor a released rank's end (``rank_released``): not faults
  (orchestrator/faults.py);
* ``surge_module_failures_total{event,cause,class}``: the fault reports that grade a module's
  failure event (``FaultReport.event``, its typed ``FailureCause`` and the class L1-3 gave it);
* ``surge_fault_detection_latency_seconds{class}``: from when the fault happened, as far as
  the report knows it (a rank's exit reaped, its last heartbeat, its last step progress), to
  the report reaching the orchestrator;
* ``surge_recovery_seconds{class}``: from the decision to recover to the first training step
  completed after it (kill, relaunch, restore and one step);
* ``surge_fault_decisions_total{class,action}``: one per incident (ignore, restart_ranks,
  rollback, exclude_node, stop; ``budget_exhausted`` when a relaunch was refused);
* ``surge_skipped_steps_total{reason}``: training steps the loop skipped (no update), by
  reason ("overflow": a loss-scale overflow; "non_finite_loss": the policy's skip_step);
* ``surge_checkpoint_failures_total{cause}``: checkpoint saves that failed (``unreachable``,
  ``timeout``, ...: the store's typed cause; without one, the failure's typed cause, e.g.
  ``communication`` for a peer lost in the save); training goes on and the next interval retries;
* ``surge_jobs_ended_total{outcome}``: jobs that reached TERMINATED, by outcome (``FINISHED``,
  ``STOPPED``, ``FAILED``): an alert on ``increase(...{outcome="FAILED"}[5m]) > 0`` fires on
  the first failed job;
* ``surge_worker_events_total{outcome}``: sequenced node agent events received by control's
  session relay, ``applied`` or ``duplicate`` (a resent event already applied: dropped);
* ``surge_control_applier_lag_seconds{queue}``: how long node agent messages waited between
  control's gRPC handler receiving them and a pool thread of the event applier applying them
  (one observation per applied burst: its oldest message's wait), on a job's queue (``job``)
  or the node queue (``node``: the agents' own facts, sessions opening and closing, the
  store's answers; services/control/event_applier.py). Liveness deadlines do not include
  this wait: they count from the receipt (``RankHeartbeat.received_monotonic``).
* ``surge_control_apply_seconds{queue}``: how long applying one burst took (its decisions and
  journal commits);
* ``surge_control_queue_depth{queue}``: messages waiting to be applied, on the job queues
  together or on the node queue; ``surge_control_job_queues``: job queues with messages
  waiting or being applied; ``surge_control_oldest_unapplied_seconds``: how long the oldest
  message still waiting has waited (0: none waits). Control's health: a growing depth or age
  is control falling behind its node agents.
* ``surge_control_beats_stamped_total``: node agent beats taken on the gRPC loop (liveness
  only: services/control/beat_stamps.py); ``surge_control_loop_lag_seconds``: how late that
  loop runs (services/control/control_health.py); ``surge_control_silence_verdicts_waiting``
  and ``surge_control_silence_verdicts_held_total{reason}``: silence verdicts L1-3 holds while
  control is behind or most agents are quiet at once (fault_detector/disruption.py);
* ``surge_control_messages_total{direction,kind}`` and ``surge_control_bytes_total{direction,kind}``:
  the messages of the node agents' ``WorkerSession`` streams and their serialized bytes, ``in``
  (WorkerEvent) and ``out`` (WorkerCommand); ``kind`` is the message a routed envelope carries
  (``StepCompleted``), ``RankHeartbeat`` for a rank's beat, else the stream field (``register``,
  ``rank_exited``, ``ack``, ``launch``, ...). Divided by the steps trained over the same window:
  the control plane's cost per training step (bench/control_messages.py).
* ``surge_rank_slowdown_ratio{job,rank}``: a rank's compute per step over the median of
  its peers' (its own earlier pace without peers), the median of its last intervals; set by
  L1-3's slow-rank detector as beats arrive (services/control/slow_ranks.py); 1: as its peers;
* ``surge_slow_rank_findings_total``: ranks named slow (>= 1.5x, sustained) by that detector;
* ``surge_control_journal_commits_total``: SQLite transactions control's journal committed
  (services/control/job_store.py): its writes per second under load (bench/control_bench.py);
* ``surge_control_journal_group_writes``: writes committed together in one of those
  transactions (the group commit, services/control/journal_writer.py);
* ``surge_control_journal_queue_depth``: journal writes queued and not yet committed;
  ``surge_control_journal_commit_seconds``: from a write queued to its commit (the lag a
  decision's commands wait, and an event's ack);
* ``surge_control_journal_failing``: 1 while the journal's last transaction failed (a full
  disk, an I/O error), 0 once one commits; ``surge_control_journal_failures_total{error}``: the
  writes it failed, by their WriteError (services/control/journal_failure.py);
* ``surge_control_outbox_depth``: commands of decisions waiting for their journal write's
  commit (services/control/orchestrator/outbox.py): growing, the journal falls behind.

Every label combination known at start-up is created at 0 there (``initialise_series``, from
the composition root): a series born at 1 reads 0 in ``increase()`` / ``rate()``, so a rule or
a dashboard panel on them missed each class's FIRST fault, and every fault after a control
restart until the class came again (fresh36 F3; Prometheus' instrumentation guide, "avoid
missing metrics").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.contract import control_pb2, route_pb2, store_pb2
from services.jobspec import DEFAULT_CLASS_ACTIONS, DEFAULT_GRADE_ACTIONS, KNOWN_FAULT_CLASSES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)

ROLE_CAUSE, ROLE_CONSEQUENCE = "cause", "consequence"  # surge_faults_total's role label
FAULTS = Counter(
    "surge_faults_total",
    "Graded fault reports received by the orchestrator (not a finished rank's clean exit, not a release); "
    "role: cause (an incident of its own) or consequence (of another rank's incident).",
    ["grade", "class", "role"],
)
MODULE_FAILURES = Counter(
    "surge_module_failures_total",
    "Fault reports grading a module's failure event, by event, typed cause and fault class.",
    ["event", "cause", "class"],
)
DETECTION_LATENCY = Histogram(
    "surge_fault_detection_latency_seconds",
    "Seconds from a fault happening to its graded report reaching the orchestrator.",
    ["class"],
    buckets=_LATENCY_BUCKETS,
)
RECOVERY = Histogram(
    "surge_recovery_seconds",
    "Seconds from the decision to recover to the first training step completed after it.",
    ["class"],
    buckets=_RECOVERY_BUCKETS,
)
DECISIONS = Counter("surge_fault_decisions_total", "Decisions on fault incidents.", ["class", "action"])
SKIPPED_STEPS = Counter("surge_skipped_steps_total", "Training steps skipped by the loop (no update).", ["reason"])
CHECKPOINT_FAILURES = Counter(
    "surge_checkpoint_failures_total",
    "Checkpoint operations that failed (a save the store could not take: training went on), by typed cause.",
    ["cause"],
)
RANK_SLOWDOWN = Gauge(
    "surge_rank_slowdown_ratio",
    "A rank's compute seconds per step over the median of its peer ranks' (its own earlier pace without peers).",
    ["job", "rank"],  # (``job``, as every job series: deploy/prometheus.yml's honor_labels keeps it)
)


# (job, rank) -> its RANK_SLOWDOWN series: set on every stepping rank beat, where ``labels()``
# (validation, a lock, a look-up) cost more than the set; kept exactly while the series exists.
_SLOWDOWN_SERIES: dict[tuple[str, int], Any] = {}


def set_rank_slowdown(job_id: str, rank: int, ratio: float) -> None:
    """The rank's ``surge_rank_slowdown_ratio`` (L1-3, on each stepping beat it compares)."""
    series = _SLOWDOWN_SERIES.get((job_id, rank))
    if series is None:
        series = _SLOWDOWN_SERIES[(job_id, rank)] = RANK_SLOWDOWN.labels(job_id, str(rank))
    series.set(ratio)


def forget_rank_slowdown(job_id: str, rank: int) -> None:
    """The rank's process ended: its ``surge_rank_slowdown_ratio`` series goes (none: it was
    never compared, a job of one rank)."""
    _SLOWDOWN_SERIES.pop((job_id, rank), None)
    try:
        RANK_SLOWDOWN.remove(job_id, str(rank))
    except KeyError:
        pass


SLOW_RANK_FINDINGS = Counter(
    "surge_slow_rank_findings_total", "Ranks named slow (>= 1.5x the job's median compute per step, sustained)."
)
APPLIER_LAG = Histogram(
    "surge_control_applier_lag_seconds",
    "Seconds node agent messages waited from control's gRPC handler receiving them to the event applier "
    "applying them (per burst, its oldest message), by queue (job, node; job_call, node_call: a call posted "
    "on it, run alone).",
    ["queue"],
    buckets=_LAG_BUCKETS,
)
APPLY_SECONDS = Histogram(
    "surge_control_apply_seconds",
    "Seconds the event applier took to apply one burst of a queue (job, node; job_call, node_call: a posted call).",
    ["queue"],
    buckets=_LAG_BUCKETS,
)
# Read when scraped (set_function): the event applier registers what they read.
QUEUE_DEPTH = Gauge(
    "surge_control_queue_depth", "Node agent messages waiting to be applied, by queue (job, node).", ["queue"]
)
JOB_QUEUES = Gauge("surge_control_job_queues", "Job queues of the event applier with messages waiting or applied.")
OLDEST_UNAPPLIED = Gauge(
    "surge_control_oldest_unapplied_seconds", "Seconds the oldest node agent message still waiting has waited."
)
BEATS_COALESCED = Counter(
    "surge_control_beats_coalesced_total",
    "Node agent beats folded into the same session's beat still waiting to be applied (the newer wins).",
)
LIVENESS_READ = Counter(
    "surge_liveness_datagrams_read_total",
    "Node agent liveness datagrams (AgentLiveness over UDP) read and taken as the agent's beat "
    "(services/control/liveness_datagrams.py).",
)
LIVENESS_DROPPED = Counter(
    "surge_liveness_datagrams_dropped_total",
    "Liveness datagrams dropped: malformed, unknown_slot (no session holds it), stale_session (an "
    "older session's), bad_mac (not its session's key), stale_seq (a replay, or behind a later one).",
    ["reason"],
)
LIVENESS_FALLBACKS = Counter(
    "surge_liveness_fallbacks_total",
    "Node agent sessions told to beat on their gRPC stream too: none of their datagrams heard for 2 beat periods.",
)
LIVENESS_RESUMED = Counter(
    "surge_liveness_resumed_total",
    "Node agent sessions told to beat as datagrams alone again: their datagrams heard after a fallback.",
)
LIVENESS_RANK_BEATS = Counter(
    "surge_liveness_rank_beats_total",
    "Ranks' beats that rode in their node agents' liveness datagrams (LivenessProgress), each applied "
    "as if read off the agent's session.",
)
LIVENESS_HELD_FLIPS = Counter(
    "surge_liveness_flips_deferred_total",
    "Liveness fallbacks or resumes deferred by control's bound on them per second (each session's is "
    "told at a later sweep or datagram).",
)
LIVENESS_DELAY = Histogram(
    "surge_liveness_datagram_delay_seconds",
    "A liveness datagram's AgentLiveness.unix_time (the agent's send) -> taken at control (its stamp, "
    "or queued for the applier): the socket's queue and the reader's wait. Across hosts it includes "
    "their clocks' skew.",
    buckets=_LAG_BUCKETS,
)
BEATS_STAMPED = Counter(
    "surge_control_beats_stamped_total",
    "Node agent beats that changed nothing but a time, taken on the gRPC loop that read them (their "
    "receipt stamped, the agent's silence deadline moved), never queued for the event applier.",
)
LOOP_LAG = Gauge(
    "surge_control_loop_lag_seconds",
    "How late control's gRPC loop ran its last probe (every 0.25 s): the loop's own lag in reading messages.",
)
SILENCE_VERDICTS_WAITING = Gauge(
    "surge_control_silence_verdicts_waiting",
    "Node agents and ranks whose silence deadline passed and whose verdict (agent_silent, a rank's silence) "
    "L1-3 holds now, because control itself is behind or most agents went quiet at once.",
)
SILENCE_VERDICTS_HELD = Counter(
    "surge_control_silence_verdicts_held_total",
    "Silence verdicts held, by why: loop (control's gRPC loop behind), applier (its event applier behind), "
    "disruption (most agents quiet at once), heard (a beat read as the deadline ran).",
    ["reason"],
)
JOBS_ENDED = Counter(
    "surge_jobs_ended_total", "Jobs that reached TERMINATED, by outcome (FINISHED, STOPPED, FAILED).", ["outcome"]
)
WORKER_EVENTS = Counter(
    "surge_worker_events_total",
    "Sequenced node agent events received by control, applied or dropped as duplicates.",
    ["outcome"],
)


MESSAGES = Counter(
    "surge_control_messages_total",
    "Node agent WorkerSession stream messages at control, by direction (in: WorkerEvent, out: WorkerCommand) and kind.",
    ["direction", "kind"],
)
MESSAGE_BYTES = Counter(
    "surge_control_bytes_total",
    "Serialized bytes of the node agent WorkerSession stream messages at control, by direction and kind.",
    ["direction", "kind"],
)
JOURNAL_COMMITS = Counter(
    "surge_control_journal_commits_total", "SQLite transactions committed by control's journal (job_store)."
)
JOURNAL_GROUP_WRITES = Histogram(
    "surge_control_journal_group_writes",
    "Journal writes committed together in one SQLite transaction (services/control/journal_writer.py).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
)
JOURNAL_QUEUE_DEPTH = Gauge(
    "surge_control_journal_queue_depth", "Journal writes queued on the group-commit writer, not yet committed."
)
JOURNAL_COMMIT_SECONDS = Histogram(
    "surge_control_journal_commit_seconds",
    "Seconds from a journal write being queued to its commit (its group's transaction done).",
    buckets=_LAG_BUCKETS,
)
JOURNAL_FAILING = Gauge(
    "surge_control_journal_failing",
    "1 while control's journal's last transaction failed (a full disk, an I/O error: services/control/"
    "journal_failure.py), 0 once one commits again.",
)
JOURNAL_FAILURES = Counter(
    "surge_control_journal_failures_total",
    "Journal writes control's journal failed to commit, by the WriteError their type says ('not typed': another error).",
    ["error"],
)
JOURNAL_STEPS_HELD = Gauge(
    "surge_control_journal_steps_held",
    "Rank 0 steps whose journal write failed, held to be written again (services/control/orchestrator/held_steps.py).",
)
JOURNAL_STEPS_DROPPED = Counter(
    "surge_control_journal_steps_dropped_total",
    "Rank 0 steps whose journal write failed and that no longer fit the job's held steps (the oldest go).",
)
OUTBOX_DEPTH = Gauge(
    "surge_control_outbox_depth",
    "Commands of decisions waiting for their journal write's commit before they are sent "
    "(services/control/orchestrator/outbox.py).",
)
# (direction, kind) -> (messages child, bytes child): `labels()` takes the metric's lock and
# builds a key per call; this runs once per message on the server's loop.
_children: dict[tuple[str, str], tuple] = {}


def _routed_kind(routed) -> str:
    return routed.type.rsplit(".", 1)[-1]  # "surge.v1.StepCompleted" -> "StepCompleted"


def event_kind(ev: control_pb2.WorkerEvent) -> str:
    """What a node agent's stream message is, for the message counters."""
    kind = ev.WhichOneof("event") or "empty"
    if kind == "routed":
        return _routed_kind(ev.routed)
    if kind == "rank_event":
        inner = ev.rank_event.WhichOneof("event") or "empty"
        if inner == "routed":
            return _routed_kind(ev.rank_event.routed)
        return "RankHeartbeat" if inner == "heartbeat" else inner
    return "RankBeats" if kind == "rank_beats" else kind


def command_kind(cmd: control_pb2.WorkerCommand) -> str:
    """What a command down a node agent's stream is, for the message counters."""
    kind = cmd.WhichOneof("command") or "empty"
    return _routed_kind(cmd.routed) if kind == "routed" else kind


def count_message(direction: str, kind: str, size: int) -> None:
    """One message of ``size`` serialized bytes crossed a WorkerSession stream."""
    pair = _children.get((direction, kind))
    if pair is None:
        pair = _children[(direction, kind)] = (
            MESSAGES.labels(direction, kind),
            MESSAGE_BYTES.labels(direction, kind),
        )
    pair[0].inc()
    pair[1].inc(size)


class ControlMetrics:
    """What the orchestrator records; a composition root may pass a stand-in in tests."""

    def fault_reported(self, report: control_pb2.FaultReport, received_unix: float, consequence: bool = False) -> None:
        """``consequence``: the report is an incident's effect (triage's CONSEQUENCE or LATE),
        counted with ``role="consequence"``; else ``role="cause"``."""
        role = ROLE_CONSEQUENCE if consequence else ROLE_CAUSE
        FAULTS.labels(control_pb2.FaultGrade.Name(report.grade), report.fault_class, role).inc()
        if report.event:
            MODULE_FAILURES.labels(report.event, route_pb2.FailureCause.Name(report.cause), report.fault_class).inc()
        if report.occurred_unix > 0:
            DETECTION_LATENCY.labels(report.fault_class).observe(max(0.0, received_unix - report.occurred_unix))

    def decided(self, fault_class: str, action: str) -> None:
        DECISIONS.labels(fault_class, action).inc()

    def recovered(self, fault_class: str, seconds: float) -> None:
        RECOVERY.labels(fault_class).observe(seconds)

    def checkpoint_failed(self, cause: str) -> None:
        CHECKPOINT_FAILURES.labels(cause).inc()

    def step_skipped(self, reason: str) -> None:
        SKIPPED_STEPS.labels(reason or "unknown").inc()

    def job_ended(self, outcome: str) -> None:
        JOBS_ENDED.labels(outcome).inc()


# Not faults: never counted in surge_faults_total (orchestrator/faults.py).
_NOT_FAULTS = frozenset({"rank_exit_clean", "rank_released"})
# Decisions that relaunch ranks: their incidents are timed (surge_recovery_seconds) and spend
# a restart budget (``budget_exhausted`` once it is spent).
_RELAUNCHES = frozenset({"restart_ranks", "rollback", "exclude_node"})
_SILENCE_HELD_REASONS = ("loop", "applier", "disruption", "heard")
_SKIP_REASONS = ("overflow", "non_finite_loss")


def initialise_series(grades: Mapping[str, int]) -> None:
    """Create every label combination known at start-up at 0 (``labels()`` makes the child: a
    counter at 0, a histogram with empty buckets), so that the first fault of a class, the
    first failed job, the first failed save of a cause is an increase of 1 to every rule.

    ``grades``: the fault detector's table (class -> FaultGrade value, control's overrides
    included): each class's faults are counted with that grade. Decisions: each class's
    default action (by class, else by its grade), and ``budget_exhausted`` where it relaunches;
    a job whose policy names another action starts that series at 1 (jobs' policies are not
    known at start-up). A class without a grade (the orchestrator's recovery waits:
    ``store_unreachable``...) has its decision's series only."""
    actions: dict[str, str] = {}
    for fault_class in sorted(KNOWN_FAULT_CLASSES - _NOT_FAULTS):
        grade = grades.get(fault_class)
        if grade is not None:
            for role in (ROLE_CAUSE, ROLE_CONSEQUENCE):
                FAULTS.labels(control_pb2.FaultGrade.Name(grade), fault_class, role)
        action = DEFAULT_CLASS_ACTIONS.get(fault_class)
        if action is None and grade is not None:
            action = DEFAULT_GRADE_ACTIONS.get(control_pb2.FaultGrade.Name(grade), "stop")
        if action is not None:
            actions[fault_class] = action
    for fault_class, action in actions.items():
        DECISIONS.labels(fault_class, action)
        if action in _RELAUNCHES:
            DECISIONS.labels(fault_class, "budget_exhausted")
            RECOVERY.labels(fault_class)
            DETECTION_LATENCY.labels(fault_class)
    # A failed save's cause: the store's typed cause, else the failure's (orchestrator/texts.py).
    for name, number in store_pb2.StoreFailureCause.items():
        if number:
            CHECKPOINT_FAILURES.labels(name.lower())
    for name, number in route_pb2.FailureCause.items():
        if number:
            CHECKPOINT_FAILURES.labels(name.removeprefix("FAILURE_").lower())
    for name, number in control_pb2.JobOutcome.items():
        if number:
            JOBS_ENDED.labels(name)
    for reason in _SKIP_REASONS:
        SKIPPED_STEPS.labels(reason)
    for reason in _SILENCE_HELD_REASONS:
        SILENCE_VERDICTS_HELD.labels(reason)
    for outcome in ("applied", "duplicate"):
        WORKER_EVENTS.labels(outcome)
