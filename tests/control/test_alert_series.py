"""What Prometheus rules alert on, on control's /metrics (fresh36 F3, F4): every known label set
of the fault, decision, save-failure and job-outcome counters exists at 0 once control is built
(a series born at 1 reads 0 in increase(): a rule or a dashboard panel missed each class's
first fault), a job's end counts once by its outcome, and each job not ended has its state,
step, newest checkpoint's step and checkpoint interval as gauges (gone once it ends)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.fault_detector import DEFAULT_RULES
from services.jobspec import KNOWN_FAULT_CLASSES

from .test_cluster_gauges import samples
from .test_fault_policy import running, saved

pytestmark = pytest.mark.timeout(30)
FaultGrade = control_pb2.FaultGrade


def _value(got: dict, name: str, **labels) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def test_every_known_label_set_of_the_alerting_counters_exists_once_control_is_built(plane):
    got = samples()
    missing = [
        (c, FaultGrade.Name(DEFAULT_RULES[c]))
        for c in sorted(KNOWN_FAULT_CLASSES - {"rank_exit_clean", "rank_released"})
        if c in DEFAULT_RULES
        and any(
            _value(got, "surge_faults_total", **{"class": c, "grade": FaultGrade.Name(DEFAULT_RULES[c]), "role": r})
            is None
            for r in ("cause", "consequence")
        )
    ]
    assert missing == []
    for fault_class, action in (("worker_lost", "restart_ranks"), ("rank_exit", "budget_exhausted")):
        assert _value(got, "surge_fault_decisions_total", **{"class": fault_class, "action": action}) is not None
        assert _value(got, "surge_recovery_seconds_count", **{"class": fault_class}) is not None
    for cause in ("unreachable", "timeout", "write_refused", "communication"):
        assert _value(got, "surge_checkpoint_failures_total", cause=cause) is not None, cause
    for outcome in ("FINISHED", "STOPPED", "FAILED"):
        assert _value(got, "surge_jobs_ended_total", outcome=outcome) is not None, outcome
    assert _value(got, "surge_control_silence_verdicts_held_total", reason="disruption") is not None


def test_a_failed_job_counts_once_by_outcome_and_its_per_job_gauges_go_with_it(plane):
    failed_before = _value(samples(), "surge_jobs_ended_total", outcome="FAILED")
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, 5)
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=7, loss=2.0, tokens=64))
    got = samples()
    assert _value(got, "surge_job_state", job=job_id, state="RUNNING") == 1
    assert _value(got, "surge_job_step", job=job_id) == 7
    assert _value(got, "surge_job_checkpoint_step", job=job_id) == 5
    assert _value(got, "surge_job_checkpoint_every_steps", job=job_id) == 100  # (the spec default)
    # A FATAL fault (the job's model cannot be built: the same on every restart) ends it FAILED.
    failed = engine_pb2.TrainingLoopFailed(step=8, fault_class="model_error", detail="bad model")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert plane.get(job_id).outcome == control_pb2.FAILED
    got = samples()
    assert _value(got, "surge_jobs_ended_total", outcome="FAILED") == (failed_before or 0) + 1
    assert [k for k in got if k[0].startswith("surge_job_") and ("job", job_id) in k[1]] == []


def test_an_incident_s_cause_and_its_consequences_are_told_apart_by_role(plane):
    # One incident raised SurgeFaultSevere twice: the survivor's comm_error under rank 1's
    # rank_exit counted like a fault of its own. Now role="consequence"; the rule reads causes.
    def faults(fault_class: str, role: str) -> float:
        return _value(samples(), "surge_faults_total", **{"class": fault_class, "grade": "SEVERE", "role": role}) or 0

    keys = [(c, r) for c in ("rank_exit", "comm_error") for r in ("cause", "consequence")]
    before = {k: faults(*k) for k in keys}
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the cause
    broken = engine_pb2.TrainingLoopFailed(step=3, fault_class="comm_error", detail="Connection closed by peer")
    plane.rank_event(w["wa"], job_id, 0, failed=broken)  # the survivor, blocked in the all-reduce
    assert {k: faults(*k) - before[k] for k in keys} == {
        ("rank_exit", "cause"): 1,
        ("rank_exit", "consequence"): 0,
        ("comm_error", "cause"): 0,
        ("comm_error", "consequence"): 1,
    }
