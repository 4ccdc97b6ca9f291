"""Fair share over a window in control itself (issue 30's CI list: "fair share over a window,
within +-10 % of the weights"), in-process on the real bus and sessions: two teams of weights 1
and 2 keep the queue full of one-slot jobs on a 6-slot worker; each job runs one tick (it ends
when the test says so); the slot-ticks each team got over the window are within 10 % of its
weight's share. scheduler/fair_share.py's simulation (tests/control/test_scheduler_policy.py)
checks the policy alone; this checks the order control starts jobs in, from its own usage and
capacity."""

from __future__ import annotations

import pytest

from services.contract import control_pb2

from .conftest import Plane, settle, spec_yaml
from .test_job_queue import finish

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(120)
WEIGHTS = {"a": 1.0, "b": 2.0}
SLOTS, BACKLOG, TICKS = 6, 8, 36


def submit(plane: Plane, name: str, team: str) -> None:
    plane.user(
        control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name=name, dp=1, extra=f"team: {team}"), spec_path="j.yaml")
    )


def running(plane: Plane) -> list[control_pb2.JobStatus]:
    """The jobs holding their slot, oldest start first (the one that ends next)."""
    jobs = [s for s in plane.user(control_pb2.JobQuery()).jobs if s.state == JobState.WARMING_UP]
    return sorted(jobs, key=lambda s: (s.updated_unix, s.job_id))


def test_the_slot_ticks_each_team_gets_over_a_window_are_within_ten_percent_of_its_weight(plane):
    for team, weight in WEIGHTS.items():
        q = control_pb2.TeamQuota(name=team, nominal=-1, borrow_limit=-1, hard_limit=-1, weight=weight)
        plane.user(control_pb2.SetTeamQuotaRequest(quota=q))
    n = 0
    for team in WEIGHTS:  # (queued before any slot exists: the first placements are the fair order's too)
        for _ in range(BACKLOG):
            submit(plane, f"{team}{n}", team)
            n += 1
    w = plane.register("w", slots=SLOTS)
    settle(lambda: len(running(plane)), SLOTS)
    got = dict.fromkeys(WEIGHTS, 0)
    for _ in range(TICKS):  # one job ends per tick; its slot goes to the fair order's next job
        job = running(plane)[0]
        finish(plane, w, job.job_id)
        got[job.team] += 1
        submit(plane, f"{job.team}{n}", job.team)  # (its team's demand stays: both always have jobs waiting)
        n += 1
        settle(lambda: len(running(plane)), SLOTS)
    total, wsum = sum(got.values()), sum(WEIGHTS.values())
    for team, weight in WEIGHTS.items():
        assert abs(got[team] / total - weight / wsum) <= 0.1 * weight / wsum, got
