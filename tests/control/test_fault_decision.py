"""The orchestrator's fault decision as a table: (policy, job view, report) -> decision, no bus,
no clock (services/control/fault_decision.py)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.fault_decision import JobView, decide, standing_orders
from services.jobspec import STEP_FAULT_CLASSES, FaultPolicySpec

FaultGrade, JobOutcome = control_pb2.FaultGrade, control_pb2.JobOutcome
FRESH = JobView(restarts={}, ignored={})


def report(
    fault_class: str,
    grade: int = FaultGrade.GRADE_UNSPECIFIED,
    *,
    rank: int = 1,
    step: int = 12,
    worker: str = "wb",
    subclass: str = "",
) -> control_pb2.FaultReport:
    """A graded report (grade given), or a step fault as the orchestrator builds it from the
    loop's StepFaultReported (ungraded)."""
    return control_pb2.FaultReport(
        fault_class=fault_class,
        grade=grade,
        rank=rank,
        step=step,
        worker_id=worker,
        detail="what happened",
        subclass=subclass,
    )


# (actions, job view, report) -> (action, verdict, counted, outcome, restart, bound, exclude)
TABLE = [
    # step faults: the defaults, by class (never by grade)
    ({}, FRESH, report("non_finite_loss"), ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, 12, ())),
    ({}, FRESH, report("gradient_overflow"), ("skip_step", engine_pb2.STEP_SKIP, "skip_step", 0, 0, None, ())),
    ({}, FRESH, report("overflow_storm"), ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, 12, ())),
    ({}, FRESH, report("loss_scale_at_minimum"), ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, 12, ())),
    (
        {"FATAL": "ignore"},
        FRESH,
        report("non_finite_loss"),
        ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, 12, ()),
    ),
    # every action for a step fault
    (
        {"non_finite_loss": "ignore"},
        FRESH,
        report("non_finite_loss"),
        ("ignore", engine_pb2.STEP_APPLY, "ignore", 0, 0, None, ()),
    ),
    (
        {"non_finite_loss": "skip_step"},
        FRESH,
        report("non_finite_loss"),
        ("skip_step", engine_pb2.STEP_SKIP, "skip_step", 0, 0, None, ()),
    ),
    (
        {"overflow_storm": "restart_ranks"},
        FRESH,
        report("overflow_storm"),
        ("restart_ranks", engine_pb2.STEP_RELAUNCH, "restart_ranks", 0, 1, None, ()),
    ),
    (
        {"loss_scale_at_minimum": "exclude_node"},
        FRESH,
        report("loss_scale_at_minimum"),
        ("exclude_node", engine_pb2.STEP_RELAUNCH, "exclude_node", 0, 1, None, ("wb",)),
    ),
    (
        {"gradient_overflow": "stop"},
        FRESH,
        report("gradient_overflow"),
        ("stop", engine_pb2.STEP_STOP, "stop", JobOutcome.FAILED, 0, None, ()),
    ),
    # budgets: the class's own, else max_restarts; spent -> stop FAILED
    (
        {},
        JobView(restarts={"non_finite_loss": 3}, ignored={}),
        report("non_finite_loss"),
        ("stop", engine_pb2.STEP_STOP, "budget_exhausted", JobOutcome.FAILED, 0, None, ()),
    ),
    (
        {},
        JobView(restarts={"non_finite_loss": 2}, ignored={}),
        report("non_finite_loss"),
        ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 3, 12, ()),
    ),
    # an operator's stop in flight turns a relaunch or a stop into that stop; not a skip
    (
        {},
        JobView(restarts={}, ignored={}, stop_requested=True),
        report("non_finite_loss"),
        ("stop", engine_pb2.STEP_STOP, "stop", JobOutcome.STOPPED, 0, None, ()),
    ),
    (
        {},
        JobView(restarts={}, ignored={}, stop_requested=True),
        report("gradient_overflow"),
        ("skip_step", engine_pb2.STEP_SKIP, "skip_step", 0, 0, None, ()),
    ),
    # graded faults: class, then grade, then the defaults, then the grade defaults
    (
        {},
        FRESH,
        report("rank_exit", FaultGrade.SEVERE),
        ("restart_ranks", engine_pb2.STEP_RELAUNCH, "restart_ranks", 0, 1, None, ()),
    ),
    (
        {},
        FRESH,
        report("rank_exit_clean", FaultGrade.MEDIUM),
        ("restart_ranks", engine_pb2.STEP_RELAUNCH, "restart_ranks", 0, 1, None, ()),
    ),
    (
        {"SEVERE": "stop"},
        FRESH,
        report("rank_silent", FaultGrade.SEVERE),
        ("stop", engine_pb2.STEP_STOP, "stop", JobOutcome.FAILED, 0, None, ()),
    ),
    (
        {"SEVERE": "stop", "rank_silent": "rollback"},
        FRESH,
        report("rank_silent", FaultGrade.SEVERE),
        ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, 12, ()),
    ),
    (
        {},
        FRESH,
        report("something_new", FaultGrade.SEVERE),
        ("restart_ranks", engine_pb2.STEP_RELAUNCH, "restart_ranks", 0, 1, None, ()),
    ),
    ({}, FRESH, report("something_new", FaultGrade.MINOR), ("ignore", engine_pb2.STEP_APPLY, "ignore", 0, 0, None, ())),
    (
        {"rank_exit": "exclude_node"},
        FRESH,
        report("rank_exit", FaultGrade.SEVERE, worker=""),
        ("exclude_node", engine_pb2.STEP_RELAUNCH, "exclude_node", 0, 1, None, ()),
    ),
    (
        {},
        FRESH,
        report("checkpoint_error", FaultGrade.SEVERE, step=0),
        ("rollback", engine_pb2.STEP_RELAUNCH, "rollback", 0, 1, None, ()),
    ),
]


@pytest.mark.parametrize(("actions", "job", "fault", "want"), TABLE)
def test_the_decision_is_a_pure_function_of_policy_job_view_and_report(actions, job, fault, want):
    d = decide(FaultPolicySpec(actions=actions), job, fault)
    assert (d.action, d.verdict, d.counted, d.outcome, d.restart, d.bound, d.exclude) == want
    assert decide(FaultPolicySpec(actions=actions), job, fault) == d  # no hidden state


def test_the_decision_texts_name_the_fault_the_rank_and_the_budget():
    step = decide(FaultPolicySpec(), FRESH, report("non_finite_loss"))
    assert step.text == "rollback after non_finite_loss of rank 1 on wb at step 12 (restart 1 of 3 for non_finite_loss)"
    ignored = decide(
        FaultPolicySpec(actions={"non_finite_loss": "ignore"}),
        JobView(restarts={}, ignored={"non_finite_loss": 2}),
        report("non_finite_loss"),
    )
    assert ignored.text == (
        "ignore non_finite_loss of rank 1 on wb at step 12: fault policy; 3 ignored so far; "
        "the step is applied as it is"
    )
    spent = decide(
        FaultPolicySpec(restarts={"rank_exit": 1}),
        JobView(restarts={"rank_exit": 1}, ignored={}),
        report("rank_exit", FaultGrade.SEVERE),
    )
    assert spent.text == "stop after rank_exit of rank 1 on wb: restart budget for rank_exit exhausted (1 of 1 used)"
    assert (
        spent.final
        == "restart budget for rank_exit exhausted (1 of 1 used); last fault: SEVERE rank_exit: what happened"
    )
    operator = decide(
        FaultPolicySpec(), JobView(restarts={}, ignored={}, stop_requested=True), report("rank_exit", FaultGrade.SEVERE)
    )
    assert operator.final == "stopped by the operator; then SEVERE rank_exit: what happened"


def test_only_a_checkpoint_integrity_failure_strikes_the_version_being_loaded():
    loading = JobView(restarts={}, ignored={}, loading_version="j:2")
    corrupt = report("checkpoint_error", FaultGrade.SEVERE, subclass="checkpoint_integrity")
    assert decide(FaultPolicySpec(), loading, corrupt).strike == "j:2"
    assert decide(FaultPolicySpec(), loading, report("checkpoint_error", FaultGrade.SEVERE)).strike == ""
    assert decide(FaultPolicySpec(), FRESH, corrupt).strike == ""


def test_standing_orders_are_the_skip_step_classes_with_stable_ids():
    (default,) = standing_orders(FaultPolicySpec())
    assert (default.id, default.kind, default.action) == (
        1,
        engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW,
        engine_pb2.STEP_SKIP,
    )
    every = standing_orders(FaultPolicySpec(actions={c: "skip_step" for c in STEP_FAULT_CLASSES}))
    assert [(o.id, o.kind) for o in every] == [
        (1, engine_pb2.STEP_FAULT_NON_FINITE_LOSS),
        (2, engine_pb2.STEP_FAULT_GRADIENT_OVERFLOW),
        (3, engine_pb2.STEP_FAULT_OVERFLOW_STORM),
        (4, engine_pb2.STEP_FAULT_LOSS_SCALE_AT_MINIMUM),
    ]
    assert standing_orders(FaultPolicySpec(actions={"gradient_overflow": "ignore"})) == []


@pytest.mark.parametrize("action", ["ignore", "skip_step", "rollback", "restart_ranks", "exclude_node", "stop"])
@pytest.mark.parametrize("fault_class", STEP_FAULT_CLASSES)
def test_the_spec_accepts_every_action_for_every_step_fault_class_and_each_decides(fault_class, action):
    policy = FaultPolicySpec(actions={fault_class: action})
    assert decide(policy, FRESH, report(fault_class)).action == action


def test_skip_step_for_a_class_that_is_not_a_step_fault_is_refused_naming_it():
    with pytest.raises(ValueError, match="actions.rank_exit: skip_step applies only to non_finite_loss"):
        FaultPolicySpec(actions={"rank_exit": "skip_step"})
