"""A stop has a deadline of its own (stop_deadline.py): ranks that never reach the stop's
boundary (a rank hung outside a collective, a frozen node agent) no longer leave the job
stopping for good. Past it the ranks are killed and the job ends STOPPED, its message saying
the stop did not finish cleanly and which ranks had not stopped; no checkpoint is claimed."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import stop_deadline

from .conftest import Plane, drain, settle, stop_plane
from .test_operator_actions import running_job, saved, step

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def plane(tmp_path, store_with_no_versions):
    control = build(JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    yield Plane(control)
    stop_plane(control)


def overdue(plane: Plane, job_id: str) -> None:
    """The stop's deadline, run now (as its timer would run it; the timer stays armed)."""
    timer = plane.c.orchestrator._policy_timers[f"stop:{job_id}"].timer
    assert timer is not None and not timer.cancelled
    timer.fn(*timer.args)


def test_a_stop_no_rank_reaches_ends_the_job_at_its_deadline_killing_the_ranks(plane, monkeypatch):
    """Both ranks hung: the stop's StopTraining is never acted on. The real timer fires."""
    monkeypatch.setattr(stop_deadline, "STOP_DEADLINE_S", 0.5)
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert plane.get(job_id).state == JobState.RUNNING  # (stopping: waits for its boundary)
    s = settle(lambda: plane.get(job_id).state, JobState.TERMINATED, timeout_s=30.0)
    s = plane.get(job_id)
    assert s.outcome == JobOutcome.STOPPED, s
    assert s.message == (
        "STOPPED: stopped by the operator, not cleanly: the stop did not finish within 0.5 s; 2 of 2 ranks "
        "had not stopped at a boundary (none agreed) (ranks 0, 1): every rank was killed; no checkpoint of "
        "the stop is claimed (newest committed: (no checkpoint yet))"
    ), s.message
    sent = {"wa": [], "wb": []}

    def released() -> dict:
        for name, session in (("wa", a), ("wb", b)):
            sent[name] += [c for c in drain(session) if c.WhichOneof("command") == "release"]
        return {name: [c.release.kill for c in cmds] for name, cmds in sent.items()}

    settle(released, {"wa": [True], "wb": [True]}, timeout_s=30.0)  # (each node's ranks killed, through L1-2)


def test_the_ranks_that_did_not_stop_at_the_agreed_boundary_are_named(plane):
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    step(plane, a, job_id, 6, agreed=1)  # (every rank agreed on the boundary after step 6)
    saved(plane, a, job_id, 1, 6)
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=6, stopped=True))
    assert plane.get(job_id).state == JobState.RUNNING  # (rank 1 never finishes its stop)
    overdue(plane, job_id)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED), s
    assert s.message.endswith(
        "1 of 2 ranks had not stopped at the boundary after step 6 (rank 1): every rank was killed; no checkpoint "
        f"of the stop is claimed (newest committed: checkpoint {job_id}:1 (step 6))"
    ), s.message
    (ended,) = [e for e in plane.events(job_id) if e.type == "state" and "TERMINATED" in e.message]
    assert "not cleanly" in ended.message, ended


def test_a_stop_that_finished_in_time_is_left_as_it_ended_by_its_deadline(plane):
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    step(plane, a, job_id, 6, agreed=1)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=6, stopped=True)
        )
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    n = len(plane.events(job_id))
    overdue(plane, job_id)
    assert plane.get(job_id).message == s.message and len(plane.events(job_id)) == n


def test_a_stop_in_flight_when_control_restarts_gets_its_deadline_again(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    stop_plane(plane.c)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        overdue(plane, job_id)
        s = plane.get(job_id)
        assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED), s
        assert "the stop did not finish within" in s.message and "(ranks 0, 1)" in s.message, s.message
    finally:
        stop_plane(plane.c)


def test_a_job_whose_saves_are_slow_gets_a_stop_deadline_past_its_save(monkeypatch):
    """The floor, unless the job's last measured save times SAVE_MULTIPLE is longer: a large
    model's stop is not killed mid-save for being slow."""
    monkeypatch.setattr(stop_deadline, "STOP_DEADLINE_S", 900.0)
    assert stop_deadline.stop_deadline_seconds(0.0) == 900.0  # (none measured yet)
    assert stop_deadline.stop_deadline_seconds(60.0) == 900.0
    assert stop_deadline.stop_deadline_seconds(600.0) == 600.0 * stop_deadline.SAVE_MULTIPLE
    assert stop_deadline.stop_deadline_seconds(-1.0) == 900.0
