"""Prometheus metrics of the control plane's fault handling (served on control's /metrics).

The orchestrator observes them as it decides (it receives every fault report); nothing here
reads another module. Names and labels:

* ``surge_faults_total{grade,class}``: graded fault reports, consequences of an incident
  included;
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
* ``surge_worker_events_total{outcome}``: sequenced node agent events received by control's
  session relay, ``applied`` or ``duplicate`` (a resent event already applied: dropped);
* ``surge_control_applier_lag_seconds``: how long node agent messages waited between
  control's gRPC handler receiving them and the event-applier thread applying them (one
  observation per applied burst: its oldest message's wait). Liveness deadlines do not
  include this wait: they count from the receipt (``RankHeartbeat.received_monotonic``).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.contract import control_pb2, route_pb2

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)

FAULTS = Counter("surge_faults_total", "Graded fault reports received by the orchestrator.", ["grade", "class"])
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
APPLIER_LAG = Histogram(
    "surge_control_applier_lag_seconds",
    "Seconds node agent messages waited from control's gRPC handler receiving them to the event applier "
    "applying them (per burst, its oldest message).",
    buckets=_LAG_BUCKETS,
)
WORKER_EVENTS = Counter(
    "surge_worker_events_total",
    "Sequenced node agent events received by control, applied or dropped as duplicates.",
    ["outcome"],
)


class ControlMetrics:
    """What the orchestrator records; a composition root may pass a stand-in in tests."""

    def fault_reported(self, report: control_pb2.FaultReport, received_unix: float) -> None:
        FAULTS.labels(control_pb2.FaultGrade.Name(report.grade), report.fault_class).inc()
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
