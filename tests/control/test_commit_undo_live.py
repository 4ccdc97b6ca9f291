"""The operator's decisions on a live job whose journal record fails at its commit are undone
(issue 28 item 2; the others: test_commit_undo.py): pause, drain (of a pause in flight, of a
PAUSED job), forced down, scale, rollback and revoke. Each leaves nothing in memory that the
journal lacks: its command to the ranks (dropped with the record) is not in flight, the job's
bookkeeping is as before, journaled so, and the same command asked again is decided afresh.
Through the bus, as the operator asks: the reply is the write's error, typed (L1-3 grades it
journal_write_failed, which the job's policy ignores: test_journal_failure.py).

The failure is injected as test_commit_undo.py does (the writer's transaction fails with
SQLite's full-disk error, rolled back)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2

from .conftest import drain, to_ranks
from .test_commit_undo import FAILED, LostCommits, decision, stored
from .test_fault_policy import plane, running, saved, store  # noqa: F401 - fixtures

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def routed(session) -> list:
    return [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed"]


def idle(plane, job_id: str) -> tuple:  # noqa: F811
    """What a decision in flight leaves on the job: its boundary, its commands, its activity."""
    job = plane.c.orchestrator._jobs[job_id]
    return job.pending, job.pending_seq, dict(job.in_flight), job.activity


def kept(plane, job_id: str) -> dict:  # noqa: F811
    return stored(plane.c.journal, job_id).runtime


def test_a_pause_whose_record_is_lost_is_not_in_flight(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    lost = LostCommits(monkeypatch, plane.c.journal, decision("pause requested"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    assert len(lost.failed) == 1
    assert routed(w["wa"]) == [] and routed(w["wb"]) == []  # its PauseTraining never went
    assert idle(plane, job_id) == ("", 0, {}, None)
    assert plane.get(job_id).state == JobState.RUNNING
    assert (kept(plane, job_id)["pending"], kept(plane, job_id)["in_flight"]) == ("", [])
    monkeypatch.undo()
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))  # asked again: decided and sent (was: "already pausing")
    assert [type(m).__name__ for m in routed(w["wb"])] == ["PauseTraining"]


def test_a_drain_whose_record_is_lost_leaves_the_pause_in_flight_a_pause(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    LostCommits(monkeypatch, plane.c.journal, decision("drain: the pause in flight"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.pending, job.draining, job.status.drained) == ("pause", False, False)
    assert plane.get(job_id).drained is False
    assert kept(plane, job_id)["draining"] is False
    monkeypatch.undo()
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True)).drained  # asked again: a drain


def test_a_drain_of_a_paused_job_whose_record_is_lost_leaves_it_unparked(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=3, loss=2.0, tokens=64, commands_agreed=1))
    saved(plane, w["wa"], job_id, 1, step=3)
    for rank, name in enumerate(w):
        plane.rank_event(w[name], job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=3))
    assert plane.get(job_id).state == JobState.PAUSED
    LostCommits(monkeypatch, plane.c.journal, decision("drain: PAUSED"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.parked, job.parked_live) == (False, False)  # (`up` would have resumed it)
    assert kept(plane, job_id)["parked"] is False


def test_a_drain_of_a_job_paused_without_its_checkpoint_whose_record_is_lost_leaves_it_paused(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=3, loss=2.0, tokens=64, commands_agreed=1))
    for rank, name in enumerate(w):
        plane.rank_event(w[name], job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=3))
    for session in w.values():
        drain(session)
    LostCommits(monkeypatch, plane.c.journal, decision("drain requested"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.status.state, job.draining, job.pending) == (JobState.PAUSED, False, "")
    assert [drain(session) for session in w.values()] == [[], []]  # its resume and pause went with the record


def test_a_forced_down_whose_record_is_lost_leaves_the_job_running_as_journaled(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))  # (a pause in flight, which the forced down ends)
    in_flight = idle(plane, job_id)
    LostCommits(monkeypatch, plane.c.journal, lambda e: "forced down by the operator" in e.message)
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True))
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.RUNNING, False)
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.parked, job.parked_live) == (False, False)
    assert idle(plane, job_id) == in_flight  # the pause it had in flight, still
    assert stored(plane.c.journal, job_id).status.state == JobState.RUNNING
    monkeypatch.undo()
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True)).state == JobState.PAUSED


def test_a_scale_whose_record_is_lost_is_not_in_flight(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", extra="")
    LostCommits(monkeypatch, plane.c.journal, lambda e: e.type == "decision" and "scale by the operator" in e.message)
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    assert routed(w["wa"]) == [] and routed(w["wb"]) == []
    assert idle(plane, job_id) == ("", 0, {}, None)
    assert kept(plane, job_id)["scale"] is None and kept(plane, job_id)["in_flight"] == []
    monkeypatch.undo()
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))  # asked again: decided and sent
    assert [type(m).__name__ for m in routed(w["wb"])] == ["PauseTraining"]


def test_a_rollback_whose_record_is_lost_is_not_in_flight(plane, store, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    saved(plane, w["wa"], job_id, 2, step=8)
    LostCommits(monkeypatch, plane.c.journal, decision("rollback in place"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=v1, rollback_in_place=True))
    assert routed(w["wa"]) == [] and routed(w["wb"]) == []
    assert idle(plane, job_id) == ("", 0, {}, None)
    assert kept(plane, job_id)["reload"] is None
    monkeypatch.undo()
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=v1, rollback_in_place=True))
    assert [type(m).__name__ for m in routed(w["wb"])] == ["PauseTraining"]


def test_a_revoke_whose_record_is_lost_leaves_the_order_held(plane, monkeypatch):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    orch = plane.c.orchestrator
    LostCommits(monkeypatch, plane.c.journal, decision("standing order 1 (skip_step for gradient_overflow) revoked"))
    with pytest.raises(Exception, match=FAILED):  # (called as revoke_order_request calls it)
        orch._withdraw_standing_order(job_id, 1)
    assert routed(w["wa"]) == [] and routed(w["wb"]) == []
    job = orch._jobs[job_id]
    assert (job.revoked, job.in_flight) == ({}, {})
    assert kept(plane, job_id)["revoked"] == {}
    monkeypatch.undo()
    seq = orch._withdraw_standing_order(job_id, 1)  # asked again: revoked afresh (was: "these ranks have it")
    assert routed(w["wb"]) == [engine_pb2.RevokeStandingOrder(job_id=job_id, order=1, seq=seq)]


def test_a_departure_whose_record_is_lost_moves_nothing(plane, monkeypatch):  # noqa: F811
    from .test_departure import running_on_three
    from .test_departure import step as rank0_step

    job_id, a, b, c = running_on_three(plane)
    rank0_step(plane, a, job_id, 14)
    LostCommits(monkeypatch, plane.c.journal, lambda e: e.type == "departure" and "checkpoint at the next" in e.message)
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=60))
    assert routed(a) == [] and routed(b) == []  # its checkpoint's PauseTraining never went
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.departure, idle(plane, job_id)) == ("", ("", 0, {}, None))
    assert kept(plane, job_id)["in_flight"] == []
    monkeypatch.undo()
    plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=60))  # asked again: the move starts
    assert [type(m).__name__ for m in routed(b)] == ["PauseTraining"] and job.departure == "wa"


def test_a_paused_jobs_release_on_departure_whose_record_is_lost_leaves_it_unparked(plane, monkeypatch):  # noqa: F811
    from .test_departure import running_on_three
    from .test_departure import saved as saved_at
    from .test_departure import step as rank0_step

    job_id, a, b, c = running_on_three(plane)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    (pause,) = routed(b)
    routed(a)
    rank0_step(plane, a, job_id, 8, agreed=pause.seq)
    saved_at(plane, a, job_id, 1, 8)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=8))
    assert plane.get(job_id).state == JobState.PAUSED
    LostCommits(monkeypatch, plane.c.journal, lambda e: e.type == "departure" and "released now" in e.message)
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=60))
    assert [c.WhichOneof("command") for c in drain(a) + drain(b)] == []  # its release never went
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.parked, job.parked_live) == (False, False)
    assert kept(plane, job_id)["parked"] is False
