"""Failures are data (issue 13 part 3), in one process: a failure injected in a handler of
each of the seed's 20 modules becomes that module's typed failure event, reaches the real
fault detector (L1-3), is graded by (event, cause), and is decided by L1-1's fault decision
(``fault_decision.decide``, the orchestrator's own) per the job's policy.

The injection is the bus's (``SURGE_FAULT_INJECT_HANDLER`` syntax, ``injection.configure``): it
raises in place of the handler, so any routed message the module receives will do. The
cross-process legs (a rank's, the data service's and the store's modules reaching control's
L1-3) are tests/faults/test_module_failures_live.py."""

from __future__ import annotations

import threading

import pytest

from services.contract import Module, control_pb2, engine_pb2, injection, route_pb2
from services.contract import failures as fl
from services.contract.bus import Bus
from services.contract.route_table import SEED_MODULES, default_table
from services.control.fault_decision import JobView, decide
from services.control.fault_detector import FaultDetector
from services.jobspec import FaultPolicySpec

FaultGrade, FailureCause = control_pb2.FaultGrade, route_pb2.FailureCause
pytestmark = pytest.mark.timeout(30)
JOB = "j"
# Most failures are graded by their cause (INTERNAL: FATAL -> stop); a few get a cause to
# show the (event, cause) table at work: a reduction's communication failure is held for
# attribution and relaunches the ranks; a snapshot or log-write failure is recorded and
# ignored (L1-1 decides on SnapshotFailed itself; metrics are not worth a relaunch); a
# prefetcher that cannot read its files is a data I/O error (SEVERE -> restart_ranks).
CASES: dict[int, tuple[int, str, int, str]] = {  # module -> (cause, class, grade, action)
    Module.L3_GRADIENT_REDUCTION: (
        FailureCause.FAILURE_COMMUNICATION,
        "comm_error",
        FaultGrade.SEVERE,
        "restart_ranks",
    ),
    Module.L5_CHECKPOINT_MANAGER: (FailureCause.FAILURE_IO, "snapshot_failed", FaultGrade.MINOR, "ignore"),
    Module.L4_PREFETCHER: (FailureCause.FAILURE_IO, "data_io_error", FaultGrade.SEVERE, "restart_ranks"),
    Module.L2_OPTIMIZER: (FailureCause.FAILURE_OUT_OF_MEMORY, "out_of_memory", FaultGrade.FATAL, "stop"),
    Module.L1_RECOVERY_CONTROLLER: (FailureCause.FAILURE_TIMEOUT, "recovery_failed", FaultGrade.MINOR, "ignore"),
    Module.L5_METRICS_LOGGER: (FailureCause.FAILURE_INTERNAL, "log_write_failed", FaultGrade.MINOR, "ignore"),
    # The data pipeline's failures, of no more specific cause: the data is unavailable.
    **{
        m: (FailureCause.FAILURE_INTERNAL, "data_unavailable", FaultGrade.FATAL, "stop")
        for m in (Module.L4_DATASET_VERSIONS, Module.L4_SHUFFLER, Module.L4_FILTER, Module.L4_BATCH_PACKER)
    },
}
DEFAULT = (FailureCause.FAILURE_INTERNAL, "internal_error", FaultGrade.FATAL, "stop")


def a_message_to(module: int):
    """A routed message ``module`` receives, and a module allowed to send it (first by name)."""
    table = default_table()
    for route in table.routes():
        if module in route.receivers and not route.failure:
            sender = min(route.senders)
            return fl.message_class(route.message), sender, route.kind
    raise AssertionError(f"nothing is routed to {Module.Name(module)}")


class Decisions(list):
    """L1-1's side: every FaultReport decided by the orchestrator's own pure decision."""

    def __init__(self, policy: FaultPolicySpec):
        super().__init__()
        self._policy, self._cond = policy, threading.Condition()

    def on_fault_report(self, report: control_pb2.FaultReport, payload=None) -> None:
        decision = decide(self._policy, JobView(restarts={}, ignored={}), report)
        with self._cond:
            self.append((report, decision))
            self._cond.notify_all()

    def wait(self, timeout: float = 5.0):
        with self._cond:
            assert self._cond.wait_for(lambda: self, timeout), "no FaultReport reached L1-1"
            return self[0]


@pytest.fixture
def injected():
    yield injection.configure
    injection.configure("")
    fl.set_origin()


@pytest.mark.parametrize("module", sorted(SEED_MODULES), ids=[Module.Name(m) for m in sorted(SEED_MODULES)])
def test_a_handler_failure_in_each_module_is_a_typed_event_graded_by_l1_3_and_decided_by_l1_1(module, injected):
    cause, fault_class, grade, action = CASES.get(module, DEFAULT)
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR))
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    for failure_type in fl.failure_events_to(bus.table, Module.L1_FAULT_DETECTOR):
        handler = (
            detector.on_training_loop_failed if failure_type is engine_pb2.TrainingLoopFailed else detector.on_failure
        )
        bus.subscribe(Module.L1_FAULT_DETECTOR, failure_type, handler)
    decisions = Decisions(FaultPolicySpec())
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, decisions.on_fault_report)
    bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id=JOB))

    msg_type, sender, kind = a_message_to(module)
    handled = []
    if (msg_type.DESCRIPTOR.full_name, module) not in bus.subscriptions():
        bus.subscribe(module, msg_type, lambda m, p=None: handled.append(m))
    fl.set_origin(JOB, 1)  # the process works for job j, rank 1 (what a rank's root sets)
    injected(f"handler:{Module.Name(module)}:{msg_type.DESCRIPTOR.name}:cause={FailureCause.Name(cause)}")

    if kind in (route_pb2.COMMAND, route_pb2.DATA):
        # A stream's stage (DATA) unwinds to its publisher like a command to its commander (53887a4).
        with pytest.raises(fl.ModuleFailed) as failed:
            if kind == route_pb2.COMMAND:
                bus.command(sender, module, msg_type())
            else:
                bus.publish(sender, msg_type())
        event = failed.value.event  # the commander gets the typed event, not the raw error
        assert failed.value.failure.cause == cause
    else:
        bus.publish(sender, msg_type())  # an event's sender commands nobody: nothing raised
        event = None
    assert handled == []  # the injection ran in place of the handler

    report, decision = decisions.wait()
    expected_event = default_table().route(fl.failure_route(default_table(), module).message)
    assert report.event == expected_event.message.removeprefix("surge.v1.")
    if event is not None:
        assert report.event == event.DESCRIPTOR.name
    assert (report.job_id, report.source, report.cause) == (JOB, module, cause)
    assert (report.fault_class, report.grade) == (fault_class, grade), report
    assert decision.action == action, decision
