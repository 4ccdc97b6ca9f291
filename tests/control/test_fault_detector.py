"""The fault detector grades by its frozen rule table and only reports."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.contract.bus import Bus
from services.control.fault_detector import DEFAULT_RULES, WORKER_LOST_MARKER, FaultDetector

M, G = Module, control_pb2.FaultGrade
pytestmark = pytest.mark.timeout(30)


def wired(rules=None) -> tuple[Bus, list[control_pb2.FaultReport]]:
    """A bus with the detector and the test standing in for the orchestrator."""
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(M.L1_FAULT_DETECTOR), rules=rules)
    bus.subscribe(M.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    bus.subscribe(M.L1_FAULT_DETECTOR, control_pb2.RankExited, detector.on_rank_exited)
    bus.subscribe(M.L1_FAULT_DETECTOR, engine_pb2.TrainingLoopFailed, detector.on_training_loop_failed)
    reports: list[control_pb2.FaultReport] = []
    bus.subscribe(M.L1_ORCHESTRATOR, control_pb2.FaultReport, lambda m, p: reports.append(m))
    bus.command(M.L1_ORCHESTRATOR, M.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j"))
    return bus, reports


def exited(bus: Bus, exit_code: int, detail: str = "") -> None:
    msg = control_pb2.RankExited(job_id="j", rank=1, exit_code=exit_code, worker_id="w", detail=detail)
    bus.publish(M.EXT_HARDWARE, msg)


def test_default_grades_of_rank_exits():
    bus, reports = wired()
    exited(bus, 1)
    exited(bus, -9)
    exited(bus, 0)
    exited(bus, 0, f"{WORKER_LOST_MARKER} session closed")
    got = [(r.fault_class, r.grade, r.source, r.rank) for r in reports]
    assert got == [
        ("rank_exit", G.SEVERE, M.EXT_HARDWARE, 1),
        ("rank_exit", G.SEVERE, M.EXT_HARDWARE, 1),
        ("rank_exit_clean", G.MEDIUM, M.EXT_HARDWARE, 1),
        ("worker_lost", G.SEVERE, M.EXT_HARDWARE, 1),
    ]
    assert reports[1].detail == "rank 1 on worker w ended (signal 9)"
    assert reports[3].detail == "rank 1 lost with worker w: session closed"


def test_loop_failures_are_graded_by_class_with_fatal_as_default():
    bus, reports = wired()
    for fault_class in ("comm_error", "non_finite_loss", "something_new", ""):
        bus.publish(M.L2_TRAINING_LOOP, engine_pb2.TrainingLoopFailed(job_id="j", step=3, fault_class=fault_class))
    assert [(r.fault_class, r.grade) for r in reports] == [
        ("comm_error", G.SEVERE),
        ("non_finite_loss", G.FATAL),
        ("something_new", G.FATAL),
        ("loop_failure", G.FATAL),
    ]
    assert all(r.source == M.L2_TRAINING_LOOP for r in reports)


def test_rules_pushed_at_init_override_the_defaults():
    bus, reports = wired({"rank_exit": G.MINOR, "data_unavailable": G.MEDIUM})
    exited(bus, 3)
    bus.publish(M.L2_TRAINING_LOOP, engine_pb2.TrainingLoopFailed(job_id="j", fault_class="data_unavailable"))
    assert [r.grade for r in reports] == [G.MINOR, G.MEDIUM]
    assert DEFAULT_RULES["rank_exit"] == G.SEVERE  # the defaults are not modified


def test_faults_of_jobs_not_monitored_are_not_reported():
    bus, reports = wired()
    bus.publish(M.EXT_HARDWARE, control_pb2.RankExited(job_id="other", exit_code=1))
    assert reports == []


def test_a_rule_with_an_unknown_grade_is_refused():
    with pytest.raises(ValueError, match="^fault rules: rank_exit: unknown grade 9$"):
        FaultDetector(emit=Bus().emitter(M.L1_FAULT_DETECTOR), rules={"rank_exit": 9})
