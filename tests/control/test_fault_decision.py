"""The orchestrator's fault decision as a table: (policy, job view, report) -> decision, no bus,
no clock (services/control/fault_decision.py)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2, route_pb2
from services.control.fault_decision import (
    JobView,
    action_of,
    decide,
    give_up,
    launch_policy,
    no_checkpoint,
    standing_orders,
    wait_seconds,
)
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
    # a slow rank (issue 29 item 2): ignored by default (reported only), even where MINOR is
    # not; replace = a rebuild in place off its node; shrink the same; without a rebuild now,
    # every rank is relaunched from the checkpoint, still off that node
    (
        {"MINOR": "stop"},
        FRESH,
        report("slow_rank", FaultGrade.MINOR),
        ("ignore", engine_pb2.STEP_APPLY, "ignore", 0, 0, None, ()),
    ),
    (
        {"slow_rank": "replace"},
        FRESH,
        report("slow_rank", FaultGrade.MINOR),
        ("rebuild", engine_pb2.STEP_RELAUNCH, "rebuild", 0, 1, None, ("wb",)),
    ),
    (
        {"slow_rank": "shrink"},
        FRESH,
        report("slow_rank", FaultGrade.MINOR),
        ("shrink", engine_pb2.STEP_RELAUNCH, "shrink", 0, 1, None, ("wb",)),
    ),
    (
        {"slow_rank": "replace"},
        JobView(restarts={}, ignored={}, no_rebuild="a pause is in flight"),
        report("slow_rank", FaultGrade.MINOR),
        ("restart_ranks", engine_pb2.STEP_RELAUNCH, "restart_ranks", 0, 1, None, ("wb",)),
    ),
    (
        {"slow_rank": "replace"},
        JobView(restarts={"slow_rank": 3}, ignored={}),
        report("slow_rank", FaultGrade.MINOR),
        ("stop", engine_pb2.STEP_STOP, "budget_exhausted", JobOutcome.FAILED, 0, None, ()),
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
    # a save a destination refused (issue 29 item 8): skipped by default, the ranks train on
    (
        {},
        FRESH,
        report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0),
        ("skip_save", engine_pb2.STEP_APPLY, "skip_save", 0, 0, None, ()),
    ),
    (
        {"MEDIUM": "stop"},  # (a grade entry of the job's policy wins over the class's default)
        FRESH,
        report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0),
        ("stop", engine_pb2.STEP_STOP, "stop", JobOutcome.FAILED, 0, None, ()),
    ),
    (
        {"checkpoint_write_failed": "stop"},
        FRESH,
        report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0),
        ("stop", engine_pb2.STEP_STOP, "stop", JobOutcome.FAILED, 0, None, ()),
    ),
    (
        {},
        JobView(restarts={}, ignored={}, stop_requested=True),
        report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0),
        ("skip_save", engine_pb2.STEP_APPLY, "skip_save", 0, 0, None, ()),
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


@pytest.mark.parametrize("cause", [route_pb2.FAILURE_UNAVAILABLE, route_pb2.FAILURE_TIMEOUT])
def test_a_load_the_store_did_not_answer_relaunches_every_rank_and_spends_no_restart(cause):
    # (a fresh user's `resume`, `up` and `rollback` with the store killed under the load: decided
    # as the policy's checkpoint_error, a rollback counted against its budget; with budget 0, FAILED)
    outage = report("checkpoint_error", FaultGrade.SEVERE)
    outage.cause = cause
    spent = JobView(restarts={"checkpoint_error": 3}, ignored={})
    d = decide(FaultPolicySpec(restarts={"checkpoint_error": 0}), spent, outage)
    assert (d.action, d.spends, d.strike, d.bound) == ("restart_ranks", False, "", None)
    assert d.text.startswith("restart_ranks after checkpoint_error of rank 1 on wb: the store did not answer")
    assert d.text.endswith("; no restart spent")
    # An operator's stop in flight still wins; a load that read bad bytes is the policy's.
    stopping = JobView(restarts={}, ignored={}, stop_requested=True)
    assert decide(FaultPolicySpec(), stopping, outage).action == "stop"
    corrupt = report("checkpoint_error", FaultGrade.SEVERE, subclass="checkpoint_integrity")
    corrupt.cause = route_pb2.FAILURE_DATA_CORRUPT
    assert (decide(FaultPolicySpec(), FRESH, corrupt).action, decide(FaultPolicySpec(), FRESH, corrupt).spends) == (
        "rollback",
        True,
    )


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


def test_a_skipped_save_says_training_continues_or_that_the_stop_goes_on_without_it():
    fault = report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0, step=40, worker="w0")
    running = decide(FaultPolicySpec(), FRESH, fault)
    assert running.text == (
        "skip the save of step 40 after checkpoint_write_failed of rank 0 on w0: fault policy; "
        "training continues, the next interval tries again"
    )
    stopping = decide(FaultPolicySpec(), JobView(restarts={}, ignored={}, stop_requested=True), fault)
    assert stopping.text.endswith("fault policy; the stop goes on without it"), stopping.text


@pytest.mark.parametrize(
    "pausing, then",
    [
        ("pause", "the pause goes on without it (the ranks pause at step 40 with no checkpoint of it)"),
        ("drain", "the drain's pause goes on without it: not drained, the ranks stay paused at step 40"),
        ("paused", "the job stays paused at step 40 with no checkpoint of it"),
    ],
)
def test_a_skipped_save_of_the_step_a_job_pauses_at_does_not_say_training_continues(pausing, then):
    """Was "training continues" for a drain's save of its paused step (a fresh SRE's trial)."""
    fault = report("checkpoint_write_failed", FaultGrade.MEDIUM, rank=0, step=40, worker="w0")
    decision = decide(FaultPolicySpec(), JobView(restarts={}, ignored={}, pausing=pausing), fault)
    assert decision.action == "skip_save" and decision.text.endswith(f"fault policy; {then}"), decision.text


def test_skip_save_for_a_class_that_is_not_a_save_fault_is_refused_naming_it():
    with pytest.raises(ValueError, match="actions.rank_exit: skip_save applies only to checkpoint_write_failed"):
        FaultPolicySpec(actions={"rank_exit": "skip_save"})


def test_skip_step_for_a_class_that_is_not_a_step_fault_is_refused_naming_it():
    with pytest.raises(ValueError, match="actions.rank_exit: skip_step applies only to non_finite_loss"):
        FaultPolicySpec(actions={"rank_exit": "skip_step"})


@pytest.mark.parametrize(
    ("value", "versions", "action", "verdict", "outcome", "text"),
    [
        (
            "restart_from_scratch",
            0,
            "restart_from_scratch",
            engine_pb2.STEP_RELAUNCH,
            JobOutcome.OUTCOME_UNSPECIFIED,
            "restart from scratch after rank_exit of rank 1: no checkpoint was committed yet "
            "(fault policy no_checkpoint: restart_from_scratch)",
        ),
        (
            "stop",
            3,
            "stop",
            engine_pb2.STEP_STOP,
            JobOutcome.FAILED,
            "stop after rank_exit of rank 1: none of its 3 committed checkpoints verifies (fault policy no_checkpoint: stop)",
        ),
    ],
)
def test_a_relaunch_with_no_usable_checkpoint_is_the_policy_s_decision(value, versions, action, verdict, outcome, text):
    d = no_checkpoint(FaultPolicySpec(no_checkpoint=value), "rank_exit", 1, versions)
    assert (d.action, d.counted, d.verdict, d.outcome, d.text) == (action, action, verdict, outcome, text)
    if value == "stop":
        assert d.final == (
            "none of its 3 committed checkpoints verifies; not restarted from scratch (no_checkpoint: stop); "
            "every checkpoint is kept"
        )


def test_a_stop_for_want_of_a_checkpoint_keeps_none_when_none_was_committed():
    # (a fresh user read "every checkpoint is kept" of a job that had committed none)
    d = no_checkpoint(FaultPolicySpec(no_checkpoint="stop"), "rank_exit", 1, 0)
    assert d.final == "no checkpoint was committed yet; not restarted from scratch (no_checkpoint: stop)"


def test_the_default_no_checkpoint_policy_restarts_from_scratch_and_a_typo_is_refused():
    assert FaultPolicySpec().no_checkpoint == "restart_from_scratch"  # (the behaviour before the entry)
    with pytest.raises(ValueError, match="no_checkpoint"):
        FaultPolicySpec(no_checkpoint="restart")


@pytest.mark.parametrize(
    ("actions", "action", "verdict", "outcome"),
    [
        ({}, "stop", engine_pb2.STEP_STOP, JobOutcome.FAILED),  # the default: resumed by the operator later
        ({"no_capacity": "restart_ranks"}, "restart_ranks", engine_pb2.STEP_RELAUNCH, 0),  # wait another period
        ({"no_capacity": "ignore"}, "ignore", engine_pb2.STEP_APPLY, 0),
    ],
)
def test_a_recovery_step_that_waited_too_long_is_the_policy_s_decision(actions, action, verdict, outcome):
    d = give_up(FaultPolicySpec(actions=actions), "no_capacity", "no free slot: gave up after 600 s")
    assert (d.fault_class, d.action, d.counted, d.verdict, d.outcome) == (
        "no_capacity",
        action,
        action,
        verdict,
        outcome,
    )
    assert d.text == f"{action} after no_capacity: no free slot: gave up after 600 s (fault policy)"
    assert d.final == ("no free slot: gave up after 600 s; every checkpoint is kept" if action == "stop" else "")


def test_the_action_looked_up_is_the_one_decide_starts_from():
    policy = FaultPolicySpec(actions={"rank_exit": "rollback", "MINOR": "stop", "non_finite_loss": "skip_step"})
    assert action_of(policy, report("rank_exit_clean", FaultGrade.MEDIUM)) == "rollback"  # (a clean exit: a lost rank)
    assert action_of(policy, report("checkpoint_save", FaultGrade.MINOR)) == "stop"  # by grade
    assert action_of(policy, report("non_finite_loss")) == "skip_step"  # a step fault, ungraded: by class
    assert action_of(FaultPolicySpec(), report("checkpoint_save", FaultGrade.MINOR)) == "ignore"
    for fault in (report("rank_exit", FaultGrade.SEVERE), report("non_finite_loss")):
        assert decide(policy, FRESH, fault).action == action_of(policy, fault)


def test_each_recovery_wait_is_bounded_by_the_policy_entry_of_the_class_it_gives_up_as():
    policy = FaultPolicySpec(store_wait_seconds=7, capacity_wait_seconds=8, restore_seconds=9, rebuild_seconds=10)
    assert wait_seconds(policy, "store_unreachable") == 7
    assert wait_seconds(policy, "no_capacity") == 8
    assert wait_seconds(policy, "recovery_timeout") == 9
    assert wait_seconds(policy, "recovery_timeout", in_place=True) == 10


@pytest.mark.parametrize("fault_class", ["rank_oom", "rank_memory_error"])
def test_running_out_of_memory_is_relaunched_once_as_it_was_then_pauses_the_job_with_a_hint(fault_class):
    policy = FaultPolicySpec()
    assert policy.budget_for(fault_class) == 1 and policy.budget_for("rank_exit") == 3  # (documented defaults)
    first = decide(policy, FRESH, report(fault_class, FaultGrade.SEVERE))
    assert (first.action, first.restart, first.budget) == ("restart_ranks", 1, 1)
    again = decide(policy, JobView(restarts={fault_class: 1}, ignored={}), report(fault_class, FaultGrade.SEVERE))
    assert again.action == "pause" and again.outcome == JobOutcome.OUTCOME_UNSPECIFIED  # PAUSED, never FAILED
    assert again.text == (
        f"pause after {fault_class} of rank 1 on wb: out of memory again with the same configuration "
        "(1 of 1 relaunches used); lower data.micro_batch_size, or enable parallel.activation_checkpointing "
        "or parallel.data_parallel: fsdp2"
    )
    assert again.final.startswith(
        f"paused: {fault_class} again with the same configuration; lower data.micro_batch_size"
    )
    # A job's own budget for the class wins; any other class still fails when its budget is spent.
    roomy = FaultPolicySpec(restarts={fault_class: 3})
    assert decide(
        roomy, JobView(restarts={fault_class: 1}, ignored={}), report(fault_class, FaultGrade.SEVERE)
    ).action == ("restart_ranks")
    spent = decide(policy, JobView(restarts={"rank_exit": 3}, ignored={}), report("rank_exit", FaultGrade.SEVERE))
    assert (spent.action, spent.outcome) == ("stop", JobOutcome.FAILED)


@pytest.mark.parametrize(
    ("step", "every", "recovered", "bound", "strike"),
    [
        # found at step 30 by checks every 10: the check at 20 agreed; back to a version <= 20
        (30, 10, ("", "", 0), 20, ""),
        # found at the first check: nothing agreed since the initial state
        (10, 10, ("", "", 0), 0, ""),
        # found at the last step (25, checked too) or an operator's stop there: the check at 20 agreed
        (25, 10, ("", "", 0), 20, ""),
        # the last recovery loaded j:20 for a divergence and the first check after it failed
        # again: j:20 reproduces it, struck (the rollback goes older)
        (30, 10, ("replica_divergence", "j:20", 20), 20, "j:20"),
        # ... but a check after it agreed (at 30): j:20 is fine, the bound moved on
        (40, 10, ("replica_divergence", "j:20", 20), 30, ""),
        # the last recovery was for another fault: nothing struck
        (30, 10, ("rank_exit", "j:20", 20), 20, ""),
    ],
)
def test_a_replica_divergence_rolls_back_to_the_last_agreeing_check_and_strikes_a_version_that_reproduces_it(
    step, every, recovered, bound, strike
):
    recovered_class, version, at = recovered
    job = JobView(
        restarts={}, ignored={}, replica_check_every_steps=every,
        recovered_class=recovered_class, recovered_version=version, recovered_step=at,
    )  # fmt: skip
    d = decide(FaultPolicySpec(), job, report("replica_divergence", FaultGrade.SEVERE, step=step))
    assert (d.action, d.verdict, d.bound, d.strike) == ("rollback", engine_pb2.STEP_RELAUNCH, bound, strike)
    assert f"back to a version at or before step {bound}, the last replica check that agreed" in d.text
    assert ("reproduced the divergence" in d.text) == bool(strike)


def test_a_slow_rank_replaced_says_so_and_names_the_node_left_out():
    d = decide(FaultPolicySpec(actions={"slow_rank": "replace"}), FRESH, report("slow_rank", FaultGrade.MINOR))
    assert d.text.startswith("replace after slow_rank of rank 1 on wb (restart 1 of 3 for slow_rank)")
    assert "excluding wb" in d.text


@pytest.mark.parametrize(
    "actions, message",
    [
        (
            {"slow_rank": "restart_ranks"},
            "actions.slow_rank: must be one of ignore, replace, shrink, got restart_ranks",
        ),
        ({"rank_exit": "replace"}, "actions.rank_exit: replace applies only to slow_rank"),
    ],
)
def test_slow_rank_policy_takes_ignore_replace_or_shrink_only(actions, message):
    with pytest.raises(ValueError, match=message):
        FaultPolicySpec(actions=actions)


def test_a_dataset_shard_changed_under_the_job_pauses_it_naming_the_shard_and_spends_no_restart():
    # Issue 29 item 7: data_corrupt's default is pause (a relaunch would read the same bytes).
    changed = control_pb2.FaultReport(
        fault_class="data_corrupt", grade=FaultGrade.FATAL, rank=0, worker_id="wa",
        detail="dataset tiny@v1: shard train.bin changed since it was prepared (sha256 9f3c0a1b2c3d…, manifest ab12cd34ef56…)",
    )  # fmt: skip
    decision = decide(FaultPolicySpec(), FRESH, changed)
    assert (decision.action, decision.verdict, decision.restart) == ("pause", engine_pb2.STEP_STOP, 0)
    assert decision.outcome == JobOutcome.OUTCOME_UNSPECIFIED  # PAUSED, never FAILED
    assert decision.final == (
        "paused: data_corrupt: dataset tiny@v1: shard train.bin changed since it was prepared "
        "(sha256 9f3c0a1b2c3d…, manifest ab12cd34ef56…); put the version's files back as prepared "
        "(or prepare a new version), then `surgectl resume JOB` continues it from its newest checkpoint"
    )
    assert "\n" not in decision.final
    # Stop stays available for data_corrupt (pause is for PAUSE_CLASSES: tests/control/test_data_outage.py).
    assert decide(FaultPolicySpec(actions={"data_corrupt": "stop"}), FRESH, changed).action == "stop"


@pytest.mark.parametrize(
    ("policy", "rebuild_in_place", "hold_on_fault"),
    [
        (FaultPolicySpec(), False, False),
        (FaultPolicySpec(actions={"rank_exit": "rebuild"}), True, False),
        (FaultPolicySpec(freeze_seconds=30), False, True),
    ],
)
def test_what_the_ranks_are_told_of_the_policy_at_launch(policy, rebuild_in_place, hold_on_fault):
    told = launch_policy(policy)
    assert (told["rebuild_in_place"], told["hold_on_fault"]) == (rebuild_in_place, hold_on_fault)
    assert told["standing_orders"] == standing_orders(policy)
    assert set(told) <= {f.name for f in engine_pb2.InitJob.DESCRIPTOR.fields}  # (InitJob's fields)
