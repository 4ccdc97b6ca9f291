"""Operator actions keep every step (issue 12, part 7), in-process through the real bus:
stop and pause checkpoint their boundary step, a drain (`surgectl down`) parks the job,
and a resume relaunches a STOPPED / FAILED / drained job from the newest checkpoint the store
verifies (or the one named), refusing with one line what it cannot do."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2, route_pb2, store_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import (
    IllegalTransition,
    Orchestrator,
    UnknownVersion,
)
from services.control.store_relay import StoreRelay

from .conftest import Plane, drain, kinds, settle, to_ranks

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


class FakeStore:
    """What the store says about a job's versions: job id -> [(version, step, ok, reason)];
    ``down``: every question is answered UNREACHABLE."""

    def __init__(self):
        self.versions: dict[str, list[tuple[str, int, bool, str]]] = {}
        self.down = False
        self.asked = 0
        self.in_call = True  # also answer in the call (a synchronous relay); False: as an event only


@pytest.fixture
def store(monkeypatch):
    fake = FakeStore()

    def verify_checkpoints(relay, msg, payload=None):  # answered as the gRPC relay does: as an event
        fake.asked += 1
        if fake.down:
            reply = store_pb2.SnapshotFailed(
                job_id=msg.job_id, operation="verify", cause=store_pb2.UNREACHABLE, reason="store s:1: UNAVAILABLE"
            )
        else:
            verdicts = [
                store_pb2.CheckpointVerdict(
                    info=store_pb2.CheckpointInfo(version=v, step=st, job_id=msg.job_id), ok=ok, reason=reason
                )
                for v, st, ok, reason in fake.versions.get(msg.job_id, [])
            ]
            reply = store_pb2.CheckpointVerification(job_id=msg.job_id, versions=verdicts)
        if hasattr(relay, "_events"):  # (the asynchronous relay's emitter)
            relay._events(reply)
        return reply if fake.in_call else None

    monkeypatch.setattr(StoreRelay, "verify_checkpoints", verify_checkpoints)
    return fake


@pytest.fixture
def plane(tmp_path, store):
    journal = JobStore(tmp_path / "control.db")
    yield Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    journal.close()


def running_job(plane: Plane, steps: int = 20):
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=steps).job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b)
    return job_id, a, b


def step(plane: Plane, session, job_id: str, n: int, agreed: int = 0) -> None:
    """Rank 0's step ``n``; ``agreed``: the boundary command number every rank held in it."""
    plane.rank_event(
        session, job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64, commands_agreed=agreed)
    )


def saved(plane: Plane, session, job_id: str, version: int, at: int) -> None:
    plane.rank_event(session, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:{version}", step=at))


def stopped_job(plane: Plane, store: FakeStore, at: int = 6):
    """A job stopped at step ``at`` with its stop checkpoint committed (version 1)."""
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, at - 2)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    saved(plane, a, job_id, 1, at)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=at, stopped=True)
        )
    drain(a), drain(b)
    store.versions[job_id] = [(f"{job_id}:1", at, True, "")]
    return job_id, a, b


def test_stop_and_pause_checkpoint_their_boundary_step_unless_told_not_to(plane):
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    (cmd,) = drain(b)
    pause = to_ranks(cmd)
    assert (type(pause), pause.seq, pause.at_step, pause.checkpoint) == (engine_pb2.PauseTraining, 1, 0, True)
    assert plane.events(job_id)[-1].message == (
        "pause requested: ranks checkpoint their step and pause "
        "at the next step boundary every rank agrees on (command #1 to the ranks)"
    )
    step(plane, a, job_id, 6, agreed=1)  # (the boundary: rank 0's report of the step every rank held it in)
    assert "pause: every rank agreed on after step 6" in [e.message for e in plane.events(job_id)[-2:]]
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=6))
    assert plane.get(job_id).state == JobState.PAUSED and not plane.get(job_id).drained
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    plane.user(control_pb2.StopJobRequest(job_id=job_id, no_checkpoint=True))
    drain(a)
    resume, stop = drain(b)
    assert kinds([resume, stop]) == ["ResumeTraining", "StopTraining"]
    assert (to_ranks(stop).seq, to_ranks(stop).at_step, to_ranks(stop).checkpoint) == (2, 0, False)
    assert plane.events(job_id)[-1].message == (
        "stop requested: ranks stop (no checkpoint) at the next step boundary every rank agrees on (command #2 to the ranks)"
    )


def test_a_job_stopped_with_no_checkpoint_says_submit_again_not_resume(plane):
    # A fresh user's trial: after `stop --no-checkpoint` its status said "`surgectl resume`
    # continues from (no checkpoint yet)", and `resume` then refused it.
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id, no_checkpoint=True))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=5, stopped=True)
        )
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert s.message == (
        "STOPPED: all ranks stopped at step 5; no checkpoint to resume from: `surgectl submit` starts it again"
    ), s.message


def test_a_stop_whose_checkpoint_failed_says_how_many_steps_are_lost(plane, store):
    # (a fresh user's `stop` with the store killed: "resume continues from J:623 (step 13820)"
    # of a job stopped at 13888, the 68 steps between said nowhere)
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, 4)
    step(plane, a, job_id, 6)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    agreed = engine_pb2.StepCompleted(step=8, loss=2.0, tokens=64, commands_agreed=1)  # (the stop's boundary)
    plane.rank_event(a, job_id, 0, step=agreed)
    failed = store_pb2.SnapshotFailed(
        job_id=job_id, operation="save", step=8, cause=store_pb2.UNREACHABLE, reason="store unreachable"
    )
    plane.rank_event(a, job_id, 0, snapshot_failed=failed)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=8, stopped=True)
        )
    s = plane.get(job_id)
    assert s.message == (
        f"STOPPED: all ranks stopped at step 8; `surgectl resume` continues from checkpoint {job_id}:1 (step 4); "
        "the 4 steps after it are lost (its stop's checkpoint could not be saved)"
    ), s.message


def test_a_stopped_job_resumes_from_its_newest_verified_checkpoint_as_a_new_generation(plane, store):
    job_id, a, b = stopped_job(plane, store, at=6)
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.checkpoint_version) == (JobState.TERMINATED, JobOutcome.STOPPED, f"{job_id}:1")
    assert (
        s.message
        == f"STOPPED: all ranks stopped at step 6; `surgectl resume` continues from checkpoint {job_id}:1 (step 6)"
    )
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.outcome, s.step, s.checkpoint_version) == (
        JobState.WARMING_UP,
        JobOutcome.OUTCOME_UNSPECIFIED,
        6,
        f"{job_id}:1",
    )
    assert store.asked == 1
    for session in (a, b):
        (cmd,) = drain(session)
        assert cmd.launch.init.resume_version == f"{job_id}:1"
    messages = [e.message for e in plane.events(job_id)]
    assert messages[-2].startswith(
        f"resume TERMINATED (STOPPED) from checkpoint {job_id}:1 (step 6) by the operator: 2 ranks allocated on wa, wb"
    )
    assert messages[-1] == f"TERMINATED -> WARMING_UP: ranks launching to resume from checkpoint {job_id}:1 at step 6"
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=6))
    assert plane.get(job_id).state == JobState.RUNNING
    # ... and it ends like any job.
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=20))
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.step) == (JobState.TERMINATED, JobOutcome.FINISHED, 20)


def test_a_clean_exit_of_an_old_rank_reported_after_the_resume_is_no_fault(plane, store):
    job_id, a, b = stopped_job(plane, store, at=6)
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    plane.rank_exited(a, job_id, 0, exit_code=0)  # the stopped generation's rank 0, reaped late
    s = plane.get(job_id)
    assert s.state == JobState.WARMING_UP and not [
        e for e in plane.events(job_id) if e.type == "decision" and e.message.startswith("restart_ranks")
    ]
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=6))
    assert plane.get(job_id).state == JobState.RUNNING


def test_resume_takes_the_newest_version_that_verifies_or_the_one_named(plane, store):
    job_id, a, _b = stopped_job(plane, store, at=6)
    store.versions[job_id] = [
        (f"{job_id}:1", 2, True, ""),
        (f"{job_id}:2", 4, True, ""),
        (f"{job_id}:3", 6, False, "__0_0.distcp: sha256 mismatch"),
    ]
    with pytest.raises(
        IllegalTransition, match=f"^--from {job_id}:3: fails verification \\(__0_0.distcp: sha256 mismatch\\)"
    ):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:3"))
    # (another job's version, a typo: the operator's input, INVALID_ARGUMENT -- surgectl exits 2)
    with pytest.raises(UnknownVersion, match=f"^--from other:1: not a committed checkpoint of {job_id} "):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version="other:1"))
    assert plane.get(job_id).state == JobState.TERMINATED and drain(a) == []
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.step, s.checkpoint_version) == (JobState.WARMING_UP, 4, f"{job_id}:2")
    assert drain(a)[0].launch.init.resume_version == f"{job_id}:2"


def test_resume_from_a_named_older_version(plane, store):
    job_id, _a, b = stopped_job(plane, store, at=6)
    store.versions[job_id] = [(f"{job_id}:1", 3, True, ""), (f"{job_id}:2", 6, True, "")]
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:1"))
    assert (s.state, s.step) == (JobState.WARMING_UP, 3)
    assert drain(b)[0].launch.init.resume_version == f"{job_id}:1"


def test_resume_refusals_are_one_line_and_change_nothing(plane, store):
    job_id, _a, _b = stopped_job(plane, store, at=6)
    store.versions[job_id] = []
    with pytest.raises(IllegalTransition, match=f"^job {job_id} has no checkpoint to resume from; submit again$"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    store.versions[job_id] = [(f"{job_id}:1", 6, False, "manifest missing")]
    with pytest.raises(
        IllegalTransition,
        match=f"^job {job_id}: no checkpoint verifies \\({job_id}:1: manifest missing\\); submit again$",
    ):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    store.versions[job_id] = [(f"{job_id}:1", 6, True, "")]
    store.down = True
    with pytest.raises(
        IllegalTransition, match=f"^cannot resume {job_id}: the store could not verify its checkpoints \\(unreachable"
    ):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)


def test_a_resume_that_does_not_fit_waits_in_the_queue_and_relaunches_from_its_checkpoint_once_it_fits(plane, store):
    # Was: refused ("cannot resume J now: it needs 2 ranks ... but 1 is free"), the operator
    # left to try again. Now it waits like a submit: STANDBY, queued with its reason.
    job_id, a, b = stopped_job(plane, store, at=6)
    c = plane.register("wc")
    blocker = plane.submit(name="blocker", dp=1)  # takes one of the three slots... and wc takes the rest
    plane.submit(name="blocker", dp=1)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.queue_position) == (JobState.STANDBY, 1)
    assert s.message == (
        "queued: needs 2 ranks (parallel.dp=2); 1 is free on 3 registered workers: waits for ranks to free up"
    )
    decision = [e.message for e in plane.events(job_id) if e.type == "decision"][-1]
    assert decision.startswith(
        f"resume TERMINATED (STOPPED) from checkpoint {job_id}:1 (step 6) by the operator: queued"
    )
    again = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))  # asked again: it waits where it is
    assert (again.state, again.queue_position) == (JobState.STANDBY, 1)
    assert len(plane.events(job_id)) == len(plane.events(job_id)) and store.asked == 1
    plane.user(control_pb2.StopJobRequest(job_id=blocker.job_id))
    s = settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
    launched = [cmd for session in (a, b, c) for cmd in drain(session) if cmd.WhichOneof("command") == "launch"]
    assert {cmd.launch.init.resume_version for cmd in launched if cmd.launch.init.job_id == job_id} == {f"{job_id}:1"}
    s = plane.get(job_id)
    assert (s.step, s.queue_position, s.outcome) == (6, 0, JobOutcome.OUTCOME_UNSPECIFIED)


def test_a_queued_resume_taken_out_of_the_queue_is_stopped_again_with_its_checkpoints(plane, store):
    job_id, _a, _b = stopped_job(plane, store, at=6)
    plane.submit(name="blocker", dp=1)
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.STANDBY
    s = plane.user(control_pb2.StopJobRequest(job_id=job_id, queued_only=True))
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert s.message.startswith("STOPPED: its resume taken out of the queue (position 1)")


@pytest.mark.skipif(
    not hasattr(Orchestrator, "on_checkpoint_verification"),
    reason="the store's answers reach the orchestrator as events only with the asynchronous StoreRelay",
)
def test_the_store_answer_arriving_as_an_event_reaches_the_waiting_resume(plane, store):
    job_id, _a, _b = stopped_job(plane, store, at=6)
    store.in_call, store.down = False, True
    with pytest.raises(IllegalTransition, match="the store could not verify its checkpoints"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    store.down = False
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.WARMING_UP


def test_a_finished_or_running_job_is_not_resumed(plane, store):
    job_id, a, b = running_job(plane, steps=3)
    with pytest.raises(
        IllegalTransition, match=f"^job {job_id} is RUNNING, not PAUSED: resume continues a PAUSED job, or relaunches"
    ):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=3))
    with pytest.raises(IllegalTransition, match=f"^job {job_id} is TERMINATED \\(FINISHED\\): all 3 steps done"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))


def test_a_drain_pauses_with_a_checkpoint_parks_the_job_across_a_control_restart_and_resume_relaunches_it(
    tmp_path, store
):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 7)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, no_checkpoint=True))  # a drain always saves
    (cmd,) = drain(a)
    pause = to_ranks(cmd)
    assert (type(pause), pause.seq, pause.checkpoint) == (engine_pb2.PauseTraining, 1, True)
    step(plane, a, job_id, 9, agreed=1)
    saved(plane, a, job_id, 1, 9)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.PAUSED, True)
    assert s.message.endswith(f"drained: `surgectl up` resumes it from checkpoint {job_id}:1 (step 9)")
    journal.close()

    journal = JobStore(db)  # control restarted: nothing to re-attach, nothing monitored
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.PAUSED, True)
    assert s.message.startswith("drained by `surgectl down` at step 9; `surgectl up`")
    a, b = plane.register("wa"), plane.register("wb")
    store.versions[job_id] = [(f"{job_id}:1", 9, True, "")]
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.drained, s.step) == (JobState.WARMING_UP, False, 9)
    assert drain(a)[0].launch.init.resume_version == f"{job_id}:1"
    assert "PAUSED -> WARMING_UP" in plane.events(job_id)[-1].message
    journal.close()


def test_a_drain_of_a_paused_job_parks_it_without_marking_it_drained_and_stop_ends_it_at_once(plane, store):
    job_id, a, b = running_job(plane)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    saved(plane, a, job_id, 1, 2)  # (its pause's checkpoint)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=2))
    drain(a), drain(b)
    s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    assert (s.state, s.drained) == (JobState.PAUSED, False)
    assert drain(a) == []  # nothing to tell its ranks
    s = plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert s.message.endswith("its paused ranks were killed (parked by `surgectl down`, which did not stop the stack)")


def test_a_drain_during_a_pause_in_flight_turns_it_into_a_drain(plane, store):
    job_id, a, b = running_job(plane)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=2))
    assert plane.get(job_id).drained


def test_after_resume_from_an_older_version_a_fault_never_goes_back_to_the_branch_left(plane, store):
    job_id, a, b = stopped_job(plane, store, at=6)
    store.versions[job_id] = [(f"{job_id}:1", 3, True, ""), (f"{job_id}:2", 6, True, "")]
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:1"))
    drain(a), drain(b)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=3))
    drain(a), drain(b)
    plane.rank_exited(b, job_id, 1, exit_code=-9)  # before any save of the new branch
    relaunch = [c.launch.init.resume_version for c in drain(a) if c.WhichOneof("command") == "launch"]
    assert relaunch == [f"{job_id}:1"]  # not :2, committed on the branch the operator left
    events = [e.message for e in plane.events(job_id)]
    assert not any("its completion report never arrived" in m for m in events)  # :2 is not a lost report


def test_a_drain_whose_checkpoint_could_not_be_saved_is_not_parked_and_says_its_newest_checkpoint(plane, store):
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, 4)
    step(plane, a, job_id, 7)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    drain(a), drain(b)
    step(plane, a, job_id, 9, agreed=1)  # every rank held the pause in step 9: its boundary
    failed = store_pb2.SnapshotFailed(
        job_id=job_id, operation="save", step=9, cause=store_pb2.TIMEOUT, reason="BeginSave: DEADLINE_EXCEEDED"
    )
    plane.rank_event(a, job_id, 0, snapshot_failed=failed)  # the store is away: the boundary save is skipped
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.PAUSED, False)  # not parked: its ranks stay, nothing lost
    assert (s.step, s.checkpoint_version, s.checkpoint_step) == (9, f"{job_id}:1", 4)  # what `down` checks
    assert "not drained: its checkpoint of step 9 could not be saved" in s.message
    events = [e.message for e in plane.events(job_id)]
    assert any("the drain after step 9 has no checkpoint of it; the newest is" in m for m in events)
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))  # a plain resume: its ranks are there
    assert plane.get(job_id).state == JobState.RUNNING


@pytest.mark.parametrize("first", ["drain", "operator pause"])
def test_a_drain_of_a_job_paused_without_a_checkpoint_of_its_step_checkpoints_it_again(plane, store, first):
    """A job PAUSED with no checkpoint of its step (its pause's save failed: the store was
    away) is drained by its paused ranks checkpointing that step in place (it was parked as it
    stood, and `surgectl down` refused it again and again: a fresh user's trial; then its ranks
    resumed and saved the next boundary, one step more trained: a fresh operator's trial). An
    operator's pause stays the operator's: `up` leaves it PAUSED; a drain's pause is that
    drain's, finished now: `up` resumes it (was: the operator's pause, a second fresh
    operator's trial)."""
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, 4)
    step(plane, a, job_id, 7)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=first == "drain"))
    drain(a), drain(b)
    step(plane, a, job_id, 9, agreed=1)
    failed = store_pb2.SnapshotFailed(job_id=job_id, operation="save", step=9, cause=store_pb2.TIMEOUT)
    plane.rank_event(a, job_id, 0, snapshot_failed=failed)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    assert (plane.get(job_id).state, plane.get(job_id).checkpoint_step) == (JobState.PAUSED, 4)

    s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))  # `surgectl down`, the store back
    assert s.state == JobState.RUNNING and s.drained == (first == "drain")
    # `status` says the drain, not a job that trains (was: "RUNNING" for an operator's pause)
    # (tests/cli/test_state_text.py: "RUNNING (draining: saving step 9)")
    assert [(x.draining, x.draining_step) for x in (s, plane.get(job_id))] == [(True, 9), (True, 9)]
    for session in (a, b):
        sent = [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed"]
        kinds = [type(m).__name__ for m in sent]
        assert kinds == ["PauseTraining"] and sent[0].checkpoint, kinds  # (no ResumeTraining: no step trained)
    assert "the paused ranks checkpoint step 9 and pause again there" in plane.events(job_id)[-1].message
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True)).state == JobState.RUNNING  # again: same
    assert [c for c in drain(a) if c.WhichOneof("command") == "routed"] == []
    saved(plane, a, job_id, 2, 9)  # (the paused step, saved in place)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    s = plane.get(job_id)
    assert (s.state, s.step, s.checkpoint_step, s.checkpoint_version) == (JobState.PAUSED, 9, 9, f"{job_id}:2")
    assert (s.draining, s.draining_step) == (False, 0)  # (the drain is over)
    assert plane.c.orchestrator._jobs[job_id].parked  # the stack may stop
    if first == "drain":  # `up` resumes it
        assert s.drained and s.message.endswith(
            f"drained: `surgectl up` resumes it from checkpoint {job_id}:2 (step 9)"
        )
    else:  # `up` keeps it PAUSED
        assert not s.drained and "parked: its ranks stop with the stack" in s.message
        # `down --force` keeps the operator's pause (what the CLI says of it: PAUSED with a
        # checkpoint, not drained: `up` leaves it PAUSED)
        s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True))
        assert (s.state, s.drained, s.checkpoint_version) == (JobState.PAUSED, False, f"{job_id}:2")


def test_a_drain_whose_save_failed_is_remembered_across_a_control_restart_and_the_next_drain_finishes_it(
    tmp_path, store
):
    """`surgectl down` with the store away (refused: not drained), control restarted, the
    store back, `surgectl down` again: the job paused by the first drain is drained (`up`
    resumes it), not taken for the operator's pause (a fresh operator's trial: `up` left it
    PAUSED). The step of the drain's unsaved pause is journaled."""
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, 4)
    step(plane, a, job_id, 7)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    step(plane, a, job_id, 9, agreed=1)
    failed = store_pb2.SnapshotFailed(job_id=job_id, operation="save", step=9, cause=store_pb2.UNREACHABLE)
    plane.rank_event(a, job_id, 0, snapshot_failed=failed)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    s = plane.get(job_id)
    assert (s.state, s.drained, s.checkpoint_step) == (JobState.PAUSED, False, 4)  # `down` refused
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    assert plane.c.orchestrator._jobs[job_id].drain_unsaved_step == 9
    s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))  # `surgectl down` again
    assert (s.state, s.drained) == (JobState.RUNNING, True)
    assert "its pause (an earlier drain's) at step 9 has no checkpoint of it" in plane.events(job_id)[-1].message
    journal.close()


def drained_job(plane: Plane, at: int = 9):
    """A running job drained by `surgectl down` at step ``at`` (its checkpoint committed),
    the stack not stopped after it (the `down` cut short): its paused ranks still run."""
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, at - 2)
    s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    assert (s.state, s.drained) == (JobState.RUNNING, True)  # drained from the request: `up` undoes it
    assert (s.draining, s.draining_step) == (True, 0)  # (it pauses at the next agreed boundary)
    step(plane, a, job_id, at, agreed=1)
    saved(plane, a, job_id, 1, at)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=at))
    drain(a), drain(b)
    return job_id, a, b


def test_a_drained_job_whose_stack_was_not_stopped_resumes_in_place_and_a_second_drain_parks_it_again(plane, store):
    # Was: the resume relaunched it, and the allocator refused (its own paused ranks held the
    # slots): PAUSED with its resources held until another `down` + `up`.
    job_id, a, b = drained_job(plane)
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.PAUSED, True)
    with pytest.raises(IllegalTransition, match=f"^--from: job {job_id} is PAUSED with its ranks running"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:1"))  # (a relaunch: not now)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.drained, s.step) == (JobState.RUNNING, False, 9)
    assert kinds(drain(a)) == ["ResumeTraining"] and store.asked == 0  # its ranks continue: no relaunch
    assert plane.events(job_id)[-1].message.endswith(
        "the drain is undone (the stack was not stopped, its ranks were still there)"
    )
    # A `down` run again drains it again, and `up` after a down that completed relaunches it.
    drain(b)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    step(plane, a, job_id, 11, agreed=2)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=11))
    assert (plane.get(job_id).state, plane.get(job_id).drained) == (JobState.PAUSED, True)


def test_a_resume_while_a_drain_pauses_undoes_the_drain_and_the_ranks_continue_once_paused(plane, store):
    # `surgectl down` cut short while its drain's pause is in flight, then `surgectl up`.
    job_id, a, b = running_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
    drain(a), drain(b)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.drained) == (JobState.RUNNING, False)
    again = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))  # asked twice: one decision
    assert again.state == JobState.RUNNING
    decisions = [e.message for e in plane.events(job_id) if e.message.startswith("resume requested while")]
    assert len(decisions) == 1 and decisions[0].endswith("has paused; the drain is undone"), decisions
    step(plane, a, job_id, 6, agreed=1)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=6))
    s = plane.get(job_id)
    assert (s.state, s.drained) == (JobState.RUNNING, False)
    assert kinds(drain(a)) == ["ResumeTraining"]
    assert plane.events(job_id)[-1].message.endswith("resumed at step 6 (asked while the ranks paused)")


def test_a_forced_down_parks_the_job_at_once_and_after_a_control_restart_resume_relaunches_it_with_no_fault(
    tmp_path, store
):
    # Was: nothing told control; after `up` the restored job's ranks were declared lost and a
    # restart was spent on worker_lost.
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = running_job(plane)
    no_checkpoint = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True))
    assert (no_checkpoint.state, no_checkpoint.drained) == (JobState.RUNNING, False)  # nothing to resume from
    saved(plane, a, job_id, 1, 5)
    step(plane, a, job_id, 8)
    s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True))
    assert (s.state, s.drained, s.step) == (JobState.PAUSED, True, 8)
    assert s.message == (
        f"forced down by the operator at step 8: its ranks are killed with the stack; its steps after checkpoint "
        f"{job_id}:1 (step 5) are lost; `surgectl up` resumes it from checkpoint {job_id}:1 (step 5) "
        "(no fault, no restart spent)"
    )
    assert drain(a) == [] and drain(b) == []  # its ranks are not asked anything
    again = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True, force=True))
    assert again.state == JobState.PAUSED and len([e for e in plane.events(job_id) if "forced" in e.message]) == 1
    journal.close()

    journal = JobStore(db)  # control restarted by `up`: nothing to re-attach, nothing monitored
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    a, b = plane.register("wa"), plane.register("wb")
    store.versions[job_id] = [(f"{job_id}:1", 5, True, "")]
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert (s.state, s.step) == (JobState.WARMING_UP, 5)
    assert drain(a)[0].launch.init.resume_version == f"{job_id}:1"
    assert not [e for e in plane.events(job_id) if e.type == "fault"]
    journal.close()


def test_a_queued_resume_survives_a_control_restart_and_relaunches_from_its_version_once_placed(tmp_path, store):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, _a, _b = stopped_job(plane, store, at=6)
    plane.submit(name="blocker", dp=1)
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.STANDBY
    journal.close()

    journal = JobStore(db)  # restarted: the queued resume is where it was; no worker yet
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    s = plane.get(job_id)
    assert (s.state, s.queue_position) == (JobState.STANDBY, 1)
    sessions = [plane.register(w) for w in ("wa", "wb", "wc")]  # room for it (the blocker is not re-attached)
    settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
    launches = [c for session in sessions for c in drain(session) if c.WhichOneof("command") == "launch"]
    assert {c.launch.init.resume_version for c in launches if c.launch.init.job_id == job_id} == {f"{job_id}:1"}
    journal.close()


# The ways a drain's save in place of a paused step fails (the rank's SnapshotFailed, typed):
# the disk full (the store answers, the write refused), a quota, the store stopped, its timeout.
_NO_SPACE = dict(
    cause=store_pb2.WRITE_REFUSED,
    write_error=route_pb2.WRITE_NO_SPACE,
    path="/s/checkpoints/j/staging",
    reason="No space left on device",
    failure=route_pb2.Failure(cause=route_pb2.FailureCause.FAILURE_WRITE_REFUSED),
)
_SAVE_FAILURES = {
    "no space": (
        _NO_SPACE,
        "the store answered but refused the write: no space at /s/checkpoints/j/staging",
        "once you free space at /s/checkpoints/j/staging",
    ),
    "quota": (
        {**_NO_SPACE, "write_error": route_pb2.WRITE_QUOTA},
        "the store answered but refused the write: quota at /s/checkpoints/j/staging",
        "once you raise the disk quota of /s/checkpoints/j/staging",
    ),
    "store stopped": (
        dict(cause=store_pb2.UNREACHABLE, reason="BeginSave: UNAVAILABLE"),
        "the store did not answer (unreachable)",
        "once the store answers",
    ),
    "store timeout": (
        dict(cause=store_pb2.TIMEOUT, reason="BeginSave: DEADLINE_EXCEEDED"),
        "the store did not answer in time",
        "once the store answers",
    ),
}


@pytest.mark.parametrize("how", list(_SAVE_FAILURES))
def test_a_second_drain_whose_save_in_place_fails_again_is_not_drained_and_says_why(plane, store, how):
    """`surgectl down` refused (its drain's save failed), then `down` again with the save
    failing again (the disk still full, the store still away): the paused ranks' save in place
    fails, so the job is not drained (its ranks stay, `down` refuses again, nothing lost) and
    control says why in the state the stack is in (the store refusing the write is not "once
    the store answers"); the skipped save is not "training continues". Was: the save's failure
    was taken for a periodic one, the job marked drained, `down` stopped the stack and `up`
    resumed 150 steps back (a fresh SRE's trial, F1). A third `down` asks the save again."""
    fields, why, until = _SAVE_FAILURES[how]
    job_id, a, b = running_job(plane)
    saved(plane, a, job_id, 1, 4)
    step(plane, a, job_id, 7)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))  # the first `down`
    drain(a), drain(b)
    step(plane, a, job_id, 9, agreed=1)
    plane.rank_event(
        a, job_id, 0, snapshot_failed=store_pb2.SnapshotFailed(**fields, job_id=job_id, operation="save", step=9)
    )
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
    s = plane.get(job_id)
    assert (s.state, s.drained, s.checkpoint_step) == (JobState.PAUSED, False, 4)  # the first `down` refused
    assert f"could not be saved ({why}), the ranks stay paused (resume, or `surgectl down` again {until})" in s.message
    assert (s.save_failing.failed, s.save_failing.step) == (1, 9)

    for attempt in (2, 3):  # `down` again, the save failing again, and again
        s = plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=True))
        assert (s.state, s.drained) == (JobState.RUNNING, True)  # (the earlier drain's pause, checkpointing)
        for session in (a, b):
            sent = [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed"]
            assert [type(m).__name__ for m in sent] == ["PauseTraining"] and sent[0].checkpoint
        failed = store_pb2.SnapshotFailed(**fields, job_id=job_id, operation="save", step=9)
        plane.rank_event(a, job_id, 0, snapshot_failed=failed)
        for rank, session in ((0, a), (1, b)):
            plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=9))
        s = plane.get(job_id)
        assert (s.state, s.drained, s.step, s.checkpoint_step) == (JobState.PAUSED, False, 9, 4), attempt
        assert not plane.c.orchestrator._jobs[job_id].parked  # its ranks stay: the stack must not stop
        assert plane.c.orchestrator._jobs[job_id].drain_unsaved_step == 9  # the next `down` is this drain's
        assert f"could not be saved ({why})" in s.message and until in s.message
        assert "drained: `surgectl up` resumes it" not in s.message
        events = [e.message for e in plane.events(job_id)]
        assert f"the drain after step 9 has no checkpoint of it; the newest is checkpoint {job_id}:1" in " ".join(
            events
        )
        assert not any("training continues" in m for m in events), [m for m in events if "training continues" in m]

    saved(plane, a, job_id, 2, 9)  # the space freed, the store back: the next `down` saves step 9
    assert not plane.get(job_id).HasField("save_failing")  # (a commit clears it)
