"""An operator resume at another data-parallel size (issue 14 part 4: `surgectl resume JOB
--dp N`), in-process through the real bus: L1-1 validates the new layout before it asks or
changes anything (the global batch kept, the spec's rules, the allocator's free slots), then
relaunches at the new world size with the job's spec replaced and journaled. The real stack
(ranks resharding the checkpoint, losses): tests/cli/test_resume_dp.py."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2, store_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import IllegalTransition, UnknownVersion
from services.jobspec import JobSpecError, spec_from_json

from .conftest import Plane, drain, settle
from .test_operator_actions import plane, running_job, saved, step, stopped_job, store  # noqa: F401 - fixtures

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def stored_spec(tmp_path, job_id: str):
    """The job's spec as control's journal holds it (what a restarted control runs)."""
    journal = JobStore(tmp_path / "control.db")
    try:
        (row,) = [j for j in journal.load_jobs() if j.status.job_id == job_id]
        return spec_from_json(row.spec_json)
    finally:
        journal.close()


def test_a_stopped_dp2_job_resumes_at_dp1_with_the_global_batch_kept_and_its_spec_journaled(plane, store, tmp_path):  # noqa: F811
    job_id, a, b = stopped_job(plane, store, at=6)  # dp 2 x micro_batch_size 2 x grad_accum 1: 4 rows
    s = plane.get(job_id)
    assert (s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (2, 2, 2, 1)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, grad_accum=2))
    assert (s.state, s.step, s.checkpoint_version) == (JobState.WARMING_UP, 6, f"{job_id}:1")
    assert (s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (1, 1, 2, 2)
    (cmd,) = drain(a)  # one rank, on the first worker; nothing for the second
    assert drain(b) == []
    launch = cmd.launch
    assert [(r.rank, r.world_size) for r in launch.ranks] == [(0, 1)]
    assert launch.init.resume_version == f"{job_id}:1"
    sent = spec_from_json(launch.init.spec_json)
    assert (sent.parallel.dp, sent.data.micro_batch_size, sent.data.grad_accum) == (1, 2, 2)
    decision = plane.events(job_id)[-2]
    assert decision.message.startswith(
        f"resume TERMINATED (STOPPED) from checkpoint {job_id}:1 (step 6) by the operator at a new layout: "
        "parallel.dp 2 -> 1, data.grad_accum 1 -> 2, eval.batches 8 -> 16 (world size 2 -> 1; the global batch of "
        "4 rows kept): "
        "1 ranks allocated on wa"
    ), decision.message
    kept = stored_spec(tmp_path, job_id)
    assert (kept.parallel.dp, kept.data.grad_accum, kept.world_size) == (1, 2, 1)
    # `surgectl spec JOB`: GetJob with_spec answers the journaled spec; without, no spec.
    assert spec_from_json(plane.user(control_pb2.JobQuery(job_id=job_id, with_spec=True)).spec_json) == kept
    assert plane.get(job_id).spec_json == ""
    # One rank is the whole world now: its ready report starts the job.
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0, start_step=6))
    assert plane.get(job_id).state == JobState.RUNNING
    # The stopped generation's rank 1, reaped late: its clean exit is no fault; and the job
    # ends FINISHED when its one rank finishes (rank 1's old "stopped" is not this generation's).
    plane.rank_exited(b, job_id, 1, exit_code=0)
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=20))
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.step) == (JobState.TERMINATED, JobOutcome.FINISHED, 20), s.message
    assert not [e for e in plane.events(job_id) if e.type == "decision" and "rank_exit" in e.message]

    # A control restarted now knows the job at its journaled layout.
    journal = JobStore(tmp_path / "control.db")
    try:
        again = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
        s = again.get(job_id)
        assert (s.state, s.world_size, s.dp, s.grad_accum) == (JobState.TERMINATED, 1, 1, 2)
    finally:
        journal.close()


def test_a_layout_that_changes_the_global_batch_or_does_not_fit_is_refused_with_one_line_and_changes_nothing(
    plane,  # noqa: F811
    store,  # noqa: F811
    tmp_path,
):
    job_id, a, b = stopped_job(plane, store, at=6)
    before = plane.get(job_id)
    events = len(plane.events(job_id))
    asked = store.asked
    with pytest.raises(JobSpecError) as refused:
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=3))
    assert str(refused.value) == (
        "--dp 3: the global batch (data.micro_batch_size x data.grad_accum x parallel.dp) would be 2 x 1 x 3 = 6 "
        "rows, not the job's 4 (2 x 1 x 2); a resume keeps it: choose --micro-batch-size and --grad-accum so the "
        "product stays 4"
    )
    assert store.asked == asked  # refused before the store was asked
    # The global batch kept, but 4 ranks do not fit two one-slot workers: it waits in the queue
    # for workers to join, as a submit of that size does (was: refused); taken out of the
    # queue, the job is as it was, its layout unchanged.
    queued = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=4, micro_batch_size=1))
    assert (queued.state, queued.queue_position) == (JobState.STANDBY, 1)
    assert queued.message.endswith(
        "more than the 2 registered: can never run as things stand; waits for workers to join"
    ), queued.message
    plane.user(control_pb2.StopJobRequest(job_id=job_id, queued_only=True))
    events = len(plane.events(job_id))
    after = plane.get(job_id)
    assert (after.state, after.outcome, after.world_size, after.dp, after.micro_batch_size) == (
        before.state,
        before.outcome,
        2,
        2,
        2,
    )
    assert len(plane.events(job_id)) == events and drain(a) == [] and drain(b) == []
    assert stored_spec(tmp_path, job_id).parallel.dp == 2
    # Its own layout named again is a plain resume.
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=2, micro_batch_size=2, grad_accum=1))
    assert (s.state, s.world_size) == (JobState.WARMING_UP, 2)
    assert "new layout" not in plane.events(job_id)[-2].message


def test_a_paused_job_with_running_ranks_is_told_to_stop_first(plane, store):  # noqa: F811
    job_id, a, b = running_job(plane)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=2))
    drain(a), drain(b)
    with pytest.raises(IllegalTransition) as refused:
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, grad_accum=2))
    assert str(refused.value) == (
        f"--dp 1 --grad-accum 2: job {job_id} is PAUSED with its ranks running; a new layout needs new ranks: "
        f"`surgectl stop {job_id}` first (it checkpoints), then resume it with --dp 1 --grad-accum 2"
    )
    s = plane.get(job_id)
    assert (s.state, s.dp) == (JobState.PAUSED, 2) and drain(a) == [] and drain(b) == []
    # Its own layout named: a plain resume of the running ranks.
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=2, grad_accum=1))
    assert (s.state, s.world_size) == (JobState.RUNNING, 2)


def test_a_drained_job_resumes_at_a_new_dp_after_the_stack_came_back(plane, store, tmp_path):  # noqa: F811
    """Drained by `surgectl down` (PAUSED, its ranks gone with the stack), then `up`: the
    same relaunch, at dp 1."""
    job_id, a, b = running_job(plane)
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(step=7, loss=2.0, tokens=64))
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    plane.rank_event(a, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:1", step=9))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    drain(a), drain(b)
    assert plane.get(job_id).drained
    journal = JobStore(tmp_path / "control.db")  # the stack came back: a new control, new node agents
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    a, b = plane.register("wa"), plane.register("wb")
    store.versions[job_id] = [(f"{job_id}:1", 9, True, "")]
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, micro_batch_size=1, grad_accum=4))
    assert (s.state, s.drained, s.step, s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (
        JobState.WARMING_UP,
        False,
        9,
        1,
        1,
        1,
        4,
    )
    (cmd,) = drain(a)
    assert cmd.launch.init.resume_version == f"{job_id}:1" and len(cmd.launch.ranks) == 1
    assert "PAUSED -> WARMING_UP" in plane.events(job_id)[-1].message
    journal.close()


def test_a_rank_lost_after_a_resume_at_a_new_dp_is_relaunched_at_that_dp(plane, store):  # noqa: F811
    """The recovery relaunches what the allocator holds: the new world size and spec."""
    job_id, a, b = stopped_job(plane, store, at=6)
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, grad_accum=2))
    drain(a), drain(b)
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0, start_step=6))
    plane.rank_exited(a, job_id, 0, exit_code=-9)
    events = [e.message for e in plane.events(job_id)]
    assert [m for m in events if m.startswith("ranks killed and relaunched")], events[-6:]
    launches = [c.launch for s in (a, b) for c in drain(s) if c.WhichOneof("command") == "launch"]
    assert [[r.world_size for r in launch.ranks] for launch in launches] == [[1]]
    sent = spec_from_json(launches[0].init.spec_json)
    assert (sent.parallel.dp, sent.data.grad_accum, launches[0].init.resume_version) == (1, 2, f"{job_id}:1")


def test_a_new_layout_asked_of_a_queued_resume_is_applied_to_it_and_placed_when_it_fits(plane, store):  # noqa: F811
    """`resume J --dp 1 --grad-accum 2` on a job queued for resume (needing 2 ranks, 1 free):
    was exit 0 with the layout ignored, the job still waiting for 2 ranks."""
    job_id, a, b = stopped_job(plane, store, at=6)
    plane.submit(name="blocker", dp=1)  # takes one of the two slots
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.queue_position) == (JobState.STANDBY, 1)
    # A version the job does not have is bad input, said as such (was: "cancel the queued resume
    # first", advice that lost the queue's place for a resume refused next); its resume stays queued.
    with pytest.raises(
        UnknownVersion, match=rf"--from {job_id}:9: not a committed checkpoint of {job_id} \(its versions: "
    ):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:9"))
    assert plane.get(job_id).queue_position == 1
    with pytest.raises(JobSpecError, match="the global batch"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1))  # (4 rows kept: refused, nothing changed)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, grad_accum=2))
    # The reply's reason is the new layout's (it said "needs 2 ranks" though it had applied dp 1).
    assert (
        s.message
        == f"queued: resume from {job_id}:1 at the layout asked (1 rank, parallel.dp=1); the queue is tried again"
    ), s.message
    s = settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
    s = plane.get(job_id)
    assert (s.world_size, s.dp, s.micro_batch_size, s.grad_accum, s.step) == (1, 1, 2, 2, 6)
    said = [e.message for e in plane.events(job_id) if e.type == "decision"]
    assert any(
        m.startswith(
            f"the queued resume from {job_id}:1 (step 6) takes the layout asked by the operator "
            "(--dp 1 --grad-accum 2): parallel.dp 2 -> 1, data.grad_accum 1 -> 2"
        )
        for m in said
    ), said
    launched = [c.launch for session in (a, b) for c in drain(session) if c.WhichOneof("command") == "launch"]
    mine = [x for x in launched if x.init.job_id == job_id]
    assert [len(x.ranks) for x in mine] == [1] and spec_from_json(mine[0].init.spec_json).parallel.dp == 1


def test_a_queued_resume_shows_the_layout_it_waits_to_start_at(plane, store):  # noqa: F811
    """`status` and `queue` of a resume queued with a new layout said the size it last ran at
    (a fresh user's `resume --dp 4`), though admission counts the one asked."""
    job_id, a, b = stopped_job(plane, store, at=6)
    plane.submit(name="blocker", dp=2)  # takes both slots: nothing of it fits
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=1, grad_accum=2))
    assert s.state == JobState.STANDBY
    layout = lambda s: (s.world_size, s.dp, s.micro_batch_size, s.grad_accum)  # noqa: E731
    assert layout(s) == layout(plane.get(job_id)) == (1, 1, 2, 2)
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, dp=2, grad_accum=1))  # asked again: its own
    assert layout(plane.get(job_id)) == (2, 2, 2, 1)


def test_another_version_the_job_has_asked_of_its_queued_resume_says_to_cancel_first(plane, store):  # noqa: F811
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 2)
    saved(plane, a, job_id, 1, 2)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    saved(plane, a, job_id, 2, 6)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=6, stopped=True)
        )
    drain(a), drain(b)
    store.versions[job_id] = [(f"{job_id}:1", 2, True, ""), (f"{job_id}:2", 6, True, "")]
    plane.submit(name="blocker", dp=1)
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.STANDBY
    with pytest.raises(IllegalTransition, match=f"cancel the queued resume first: `surgectl cancel {job_id}`"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:1"))
