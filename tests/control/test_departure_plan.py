"""The departure's decision for one job (services/control/orchestrator/departure_plan.py): the
deadline against the job's last measured save, with its margin; and how a save is measured."""

from __future__ import annotations

import pytest

from services.contract import store_pb2
from services.control.orchestrator.departure_plan import (
    CHECKPOINT,
    DEFAULT_SAVE_SECONDS,
    FALLBACK,
    FROM_NEWEST,
    needed_seconds,
    plan_departure,
    save_seconds,
)


@pytest.mark.parametrize(
    ("deadline", "save", "step", "has_checkpoint", "action"),
    [
        (30.0, 2.0, 0.4, True, CHECKPOINT),  # 3 x 0.4 + 1.5 x 2 + 2 = 6.2 s needed
        (6.2, 2.0, 0.4, False, CHECKPOINT),  # exactly enough; no checkpoint needed before
        (6.1, 2.0, 0.4, True, FROM_NEWEST),  # a little short: the newest checkpoint, steps lost
        (6.1, 2.0, 0.4, False, FALLBACK),  # short and nothing to resume from
        (16.9, 0.0, 0.0, True, FROM_NEWEST),  # no save measured: 1.5 x 10 + 2 = 17 s
        (17.0, 0.0, 0.0, True, CHECKPOINT),
        (120.0, 60.0, 5.0, True, CHECKPOINT),  # 15 + 90 + 2 = 107
        (100.0, 60.0, 5.0, True, FROM_NEWEST),
        (0.0, 0.1, 0.01, True, FROM_NEWEST),  # the deadline passed already
        (-3.0, 0.1, 0.01, False, FALLBACK),
    ],
)
def test_the_deadline_against_the_last_save_with_its_margin(deadline, save, step, has_checkpoint, action):
    plan = plan_departure(deadline, save, step, has_checkpoint)
    assert plan.action == action
    assert plan.needed_seconds == pytest.approx(needed_seconds(save, step)[0])


def test_the_estimate_is_said_in_a_line():
    assert needed_seconds(2.0, 0.4)[1] == (
        "6.2 s needed: 3 steps of 0.40 s to the boundary, 1.5 x last save 2.0 s, 2 s margin"
    )
    assert needed_seconds(0.0, 0.0) == (
        1.5 * DEFAULT_SAVE_SECONDS + 2.0,
        "17.0 s needed: 3 steps of 0.00 s to the boundary, 1.5 x no save measured yet, taken as 10.0 s, 2 s margin",
    )


@pytest.mark.parametrize(
    ("last_step", "saved_step", "manager_s", "now", "expected"),
    [
        ((20, 100.0), 20, 0.3, 102.5, 2.5),  # from step 20's report to its commit
        ((20, 100.0), 20, 3.0, 102.5, 3.0),  # the manager's own time when longer
        ((22, 100.0), 20, 0.3, 102.5, 0.3),  # a save of an earlier step: the manager's time
        ((20, 0.0), 20, 0.3, 102.5, 0.3),  # no time stated for the step
        ((20, 103.0), 20, 0.3, 102.5, 0.3),  # clocks apart: never negative
    ],
)
def test_a_save_is_measured_from_its_step_s_report_to_its_commit(last_step, saved_step, manager_s, now, expected):
    msg = store_pb2.SaveCompleted(step=saved_step, seconds=manager_s)
    assert save_seconds(last_step, msg, now) == pytest.approx(expected)
