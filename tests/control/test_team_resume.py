"""An operator resume is a start: its team's quota holds it like a submit (issue 30 item 1).
Uses test_operator_actions' stopped job and fake store."""

from __future__ import annotations

import pytest

from services.contract import control_pb2

from .test_operator_actions import plane, stopped_job, store  # noqa: F401 - fixtures

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def test_a_resume_that_would_take_its_team_beyond_its_hard_limit_waits_with_free_slots(plane, store):  # noqa: F811
    job_id, _, _ = stopped_job(plane, store, at=6)  # dp 2, team "default"; its two slots are free again
    plane.register("wc", slots=2)
    q = control_pb2.TeamQuota(name="default", nominal=-1, borrow_limit=-1, hard_limit=2, weight=1.0, cohort="default")
    plane.user(control_pb2.SetTeamQuotaRequest(quota=q))
    other = plane.submit(name="other", dp=2)
    assert other.state == JobState.WARMING_UP
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.queue_position) == (JobState.STANDBY, 1)
    assert s.message == "queued: team default at its hard limit (2 of 2 slots held, this job needs 2)"
