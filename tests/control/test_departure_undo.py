"""A node's departure that moves a job (departure.py ``_move``: the ranks released and queued
to relaunch off the node) is one decision (issue 28 item 1, what session 28 left): its records
are one journal write (one_write.py), the release of the job's ranks follows that write, and a
commit that fails loses them together and is undone (undos.py ``_move_undone``): the job runs
on as the journal has it, RUNNING and not queued, its ranks not released; ranks paused at the
departure's checkpoint boundary continue; the same departure asked again moves it.

The failure is injected as test_commit_undo.py does (the writer's transaction fails with
SQLite's full-disk error, rolled back)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2

from .conftest import drain, kinds, launched
from .test_commit_undo import FAILED, LostCommits, decision, stored
from .test_departure import pause_then_paused, running_on_three, saved, step
from .test_fault_policy import plane, store  # noqa: F401 - fixtures

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def moved_records(plane, job_id: str) -> list[str]:  # noqa: F811
    """The job's journaled events that a move makes."""
    return [
        e.message
        for e in plane.events(job_id)
        if "ranks released to move off" in e.message or "continues from it off" in e.message
    ]


def as_journaled(plane, job_id: str) -> None:  # noqa: F811
    """The job as the journal has it after a lost move: RUNNING, not queued, not moving."""
    job = plane.c.orchestrator._jobs[job_id]
    assert (job.status.state, job.queued, job.relaunch, job.departure) == (JobState.RUNNING, None, None, "")
    assert (job.parked, job.status.drained) == (False, False)
    s = plane.get(job_id)
    assert (s.state, s.queue_position) == (JobState.RUNNING, 0)
    assert stored(plane.c.journal, job_id).status.state == JobState.RUNNING
    assert moved_records(plane, job_id) == []


def test_a_move_now_whose_one_write_is_lost_releases_nothing_and_the_job_runs_on(plane, monkeypatch):  # noqa: F811
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 10)
    saved(plane, a, job_id, 1, 10, seconds=8.0)
    step(plane, a, job_id, 13)
    # Only the move's middle record fails: one write, so all of them are lost (it was four
    # writes, the release behind the first: the job's ranks were killed, its queue entry lost).
    lost = LostCommits(monkeypatch, plane.c.journal, decision("resume PAUSED from checkpoint"))
    with pytest.raises(Exception, match=FAILED):
        plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=3))
    assert len(lost.failed) == 1
    assert not [e for e in plane.events(job_id) if "too short for a save" in e.message]  # (its warning: that write)
    assert "release" not in kinds(drain(a) + drain(b) + drain(c))
    as_journaled(plane, job_id)
    said = plane.events(job_id)[-1].message
    assert said.startswith("WARNING: node wa departs: the move of the job's ranks was not journaled (")
    assert "worker_departed" in said and "paused" not in said
    monkeypatch.undo()
    plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=3))  # asked again: it moves
    sent = launched({"wb": b, "wc": c}, 2)
    launches = [x.launch for cmds in sent.values() for x in cmds if x.WhichOneof("command") == "launch"]
    assert sorted(la.init.resume_version for la in launches) == [f"{job_id}:1"] * 2
    assert len(moved_records(plane, job_id)) == 2


def test_a_move_after_the_checkpoint_whose_write_is_lost_resumes_the_paused_ranks(plane, monkeypatch):  # noqa: F811
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 14)
    plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=60))
    drain(a)
    LostCommits(monkeypatch, plane.c.journal, lambda e: "continues from it off wa" in e.message)
    pause_then_paused(plane, job_id, a, b, 16, 1)  # (the last rank's pause decides the move; L1-1 fails on it)
    sent = drain(a) + drain(b)
    assert "release" not in kinds(sent)
    assert kinds(sent).count("ResumeTraining") == 2  # every rank waited at the boundary: they continue
    as_journaled(plane, job_id)
    assert plane.get(job_id).step == 16
    said = plane.events(job_id)[-1].message
    assert "not journaled" in said and "the ranks paused for it continue" in said
    assert not [e for e in plane.events(job_id) if e.type == "fault"]
