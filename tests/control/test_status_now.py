"""The status of a job that runs again after a fault says what is true now (fresh36 F7): the
recovery's own words, and the loss of a step the job went back from, stayed for as long as
it ran on. Driven in-process through the real bus and relays (test_fault_policy's plane)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2

from .conftest import drain
from .test_fault_policy import plane, restarted, running, saved, store  # noqa: F401 - fixtures

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def test_a_job_running_again_after_a_recovery_shows_its_training_and_no_loss_of_a_step_it_went_back_from(plane):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=6, loss=1.5, tokens=64))
    assert plane.get(job_id).train_loss == 1.5
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    for session in w.values():
        drain(session)
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    s = plane.get(job_id)
    assert (s.state, s.step, s.train_loss) == (JobState.RUNNING, 4, 0.0)  # (was 1.5: step 6's, shown at 4)
    assert s.message.startswith("recovered from rank_exit of rank 1: "), s.message  # (the recovery, until it steps)
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=5, loss=1.7, tokens=64))
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=6, loss=1.6, tokens=64))
    s = plane.get(job_id)
    assert (s.step, s.train_loss) == (6, pytest.approx(1.6))
    assert s.message == "all 2 ranks training since step 5, after the recovery from rank_exit of rank 1"
    events = [e.message for e in plane.events(job_id)]
    assert any("recovered from rank_exit of rank 1: all 2 ranks restored" in m for m in events), events
