"""`surgectl delete job`: the orchestrator forgets an ended job (journal and memory) and
refuses a live one, changing nothing."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import IllegalTransition, JobNotFound

from .conftest import Plane, drain

pytestmark = pytest.mark.timeout(30)


def test_an_ended_job_is_forgotten_and_a_live_one_is_refused(plane, tmp_path):
    a = plane.register("wa")
    job_id = plane.submit(dp=1, steps=1).job_id
    drain(a)
    with pytest.raises(IllegalTransition, match=f"job {job_id} is WARMING_UP: only an ended job"):
        plane.user(control_pb2.DeleteJobRequest(job_id=job_id))
    assert plane.get(job_id).state == control_pb2.WARMING_UP  # nothing changed
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(step=1))
    assert plane.get(job_id).state == control_pb2.TERMINATED

    last = plane.user(control_pb2.DeleteJobRequest(job_id=job_id))
    assert (last.job_id, last.state) == (job_id, control_pb2.TERMINATED)
    assert [j.job_id for j in plane.user(control_pb2.JobQuery()).jobs] == []
    with pytest.raises(JobNotFound):
        plane.get(job_id)
    with pytest.raises(JobNotFound):
        plane.user(control_pb2.DeleteJobRequest(job_id=job_id))
    # A restarted control (the same journal) does not bring it back.
    journal = JobStore(tmp_path / "control.db")
    try:
        again = Plane(build(journal, data_address="127.0.0.1:7001", store_address="127.0.0.1:7002"))
        assert [j.job_id for j in again.user(control_pb2.JobQuery()).jobs] == []
        assert journal.events(job_id) == [] and journal.steps(job_id) == []
    finally:
        journal.close()
