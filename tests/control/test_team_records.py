"""What control records of a team's job as it moves (issue 30 items 1-3), in-process on the real
bus: its borrowed slots at every placement (a resume from the queue after a preemption, a
recovery that shrank it, its growth back), not only at its first launch; its waiting time from
when it last entered the queue, not from its submit; the one-resize-per-interval mark journaled,
so that a restarted control keeps it."""

from __future__ import annotations

import time

import pytest

from services.contract import control_pb2
from services.control.job_store import JobStore
from services.control.scheduler import QuotaBook, TeamQuota

from .conftest import Plane, drain, launched, settle, spec_yaml, stop_plane, to_ranks
from .test_fault_policy import running
from .test_preemption import launched_jobs, make_plane, messages, paused, saved, started, step
from .test_resize import SHRINK, ready, routed
from .test_resize import paused as resize_paused

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def test_a_preempted_borrower_back_from_the_queue_records_its_borrowed_slots_and_waits_from_its_preemption(
    tmp_path, store_with_no_versions
):
    # Teams a and b own one slot each in one cohort; b's dp-2 job borrows a's idle slot; a's
    # job reclaims it (b's job PREEMPTED, queued again); a's job ends: b's job comes back from
    # the queue on the borrowed slot again.
    book = QuotaBook({"a": TeamQuota(nominal=1, cohort="c"), "b": TeamQuota(nominal=1, borrow_limit=1, cohort="c")})
    plane = make_plane(tmp_path / "control.db", quotas=book)
    try:
        wa, wb = plane.register("wa"), plane.register("wb")
        text = spec_yaml(name="borrower", dp=2, steps=100, extra="team: b")
        borrower = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="b.yaml", priority=5)).job_id
        submitted = plane.get(borrower)
        assert submitted.borrowed_slots == 1 and submitted.queued_unix == 0.0  # (placed at once: never queued)
        started(plane, borrower, (wa, wb))
        drain(wa), drain(wb)
        step(plane, wa, borrower, 4)
        saved(plane, wa, borrower, 1, 4)
        time.sleep(0.5)  # (its submit and its preemption apart: which one its wait counts from shows)
        text = spec_yaml(name="owner", dp=1, steps=100, extra="team: a")
        owner = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="a.yaml", priority=0)).job_id
        (cmd,) = drain(wa)
        drain(wb)
        pause = to_ranks(cmd)
        step(plane, wa, borrower, 6, agreed=pause.seq)
        saved(plane, wa, borrower, 2, 6)
        paused(plane, borrower, (wa, wb), 6)
        assert [j for _, j, _ in launched_jobs(launched({"wa": wa, "wb": wb}, 1))] == [owner]

        queued = plane.get(borrower)
        assert queued.state == JobState.STANDBY and queued.preempted_by == owner
        assert queued.borrowed_slots == 0  # (it holds no slot while it waits)
        assert queued.queued_unix >= queued.created_unix + 0.5
        (entry,) = [q for q in plane.user(control_pb2.TeamQuery()).queue if q.job_id == borrower]
        assert entry.waiting_seconds < time.time() - queued.created_unix - 0.4  # from its preemption

        plane.user(control_pb2.StopJobRequest(job_id=owner))  # a's slot idle again: b borrows it back
        got = launched({"wa": wa, "wb": wb}, 2)
        assert launched_jobs(got) == [("wa", borrower, f"{borrower}:2"), ("wb", borrower, f"{borrower}:2")]
        # (its launch is sent inside the decision; its status is published as the decision ends)
        settle(lambda: plane.get(borrower).state, JobState.WARMING_UP)
        back = plane.get(borrower)
        assert back.state == JobState.WARMING_UP and back.borrowed_slots == 1
        assert any("(1 on capacity its team borrowed)" in m for m in messages(plane, borrower) if "resume" in m)
    finally:
        stop_plane(plane.c)


def test_a_shrunk_job_records_its_borrowed_slots_after_its_recovery_and_its_growth_back_and_the_resize_is_journaled(
    tmp_path, plane: Plane
):
    # Team t's nominal is 2: its dp-3 job borrows 1 slot; a lost node shrinks it to 2 (within
    # nominal: 0 borrowed); a new worker grows it back to 3 (1 borrowed again).
    plane.user(
        control_pb2.SetTeamQuotaRequest(
            quota=control_pb2.TeamQuota(name="t", nominal=2, borrow_limit=-1, hard_limit=-1, weight=1.0)
        )
    )
    job_id, w = running(plane, "wa", "wb", "wc", dp=3, extra=SHRINK + "\nteam: t")
    assert plane.get(job_id).borrowed_slots == 1
    plane.c.sessions.close(w["wc"])  # rank 2's node agent is lost: no slot for its replacement
    settle(lambda: plane.get(job_id).world_size, 2)
    assert plane.get(job_id).borrowed_slots == 0
    drain(w["wa"]), drain(w["wb"])
    ready(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=7, generation=2)
    assert plane.get(job_id).state == JobState.RUNNING

    before = time.time()
    wd = plane.register("wd")
    deadline = time.monotonic() + 10
    while not (pauses := routed(w["wa"], "PauseTraining")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (pause,) = pauses
    drain(w["wb"])
    # The grow's start is journaled: a restarted control still waits out the interval.
    journal = JobStore(tmp_path / "control.db")
    try:
        settle(
            lambda: (
                before
                <= next(j.runtime for j in journal.load_jobs() if j.status.job_id == job_id).get("last_resize", 0.0)
            ),
            True,
        )
    finally:
        journal.close()
    resize_paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    drain(wd)
    ready(plane, job_id, {0: w["wa"], 1: w["wb"], 2: wd}, step=pause.at_step, generation=3)
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.borrowed_slots) == (JobState.RUNNING, 3, 1)
