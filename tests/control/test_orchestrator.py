"""The orchestrator's job state machine, driven in-process through the real bus and relays."""

from __future__ import annotations

import math
import re

import pytest

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.monitoring import start_monitoring
from services.control.orchestrator import (
    REATTACH_MESSAGE,
    REATTACHED_MESSAGE,
    IllegalTransition,
    JobNotFound,
)
from services.jobspec import JobSpecError, spec_from_json

from .conftest import Plane, drain, kinds, registration, settle, to_ranks

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def start_job(plane: Plane, steps: int = 10, extra: str = ""):
    """Two workers, a DP=2 job, both ranks started: RUNNING."""
    a, b = plane.register("wa"), plane.register("wb")
    job = plane.submit(dp=2, steps=steps, extra=extra)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job.job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b)
    return job.job_id, a, b


def step(plane: Plane, session, job_id: str, n: int, loss: float = 2.0) -> None:
    plane.rank_event(
        session, job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=loss, tokens=64, tokens_per_second=1000.0)
    )


def test_submit_journals_warming_up_and_launches_one_rank_per_worker(plane):
    a, b = plane.register("wa"), plane.register("wb")
    status = plane.submit(name="demo", dp=2, steps=7)
    assert status.job_id.startswith("demo-") and len(status.job_id) == len("demo-") + 6
    assert (status.state, status.world_size, status.total_steps) == (JobState.WARMING_UP, 2, 7)
    assert math.isnan(status.eval_loss)
    (la,), (lb,) = drain(a), drain(b)
    assert [r.rank for r in la.launch.ranks] == [0] and [r.rank for r in lb.launch.ranks] == [1]
    init = la.launch.init
    assert (init.job_id, init.data_address, init.store_address) == (status.job_id, "127.0.0.1:7001", "127.0.0.1:7002")
    assert spec_from_json(init.spec_json).steps == 7
    assert [e.type for e in plane.events(status.job_id)] == ["decision", "state"]


def test_training_starts_only_when_every_rank_reported_started(plane):
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2).job_id
    drain(a), drain(b)
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    assert plane.get(job_id).state == JobState.WARMING_UP
    assert drain(a) == [] and drain(b) == []
    plane.rank_event(b, job_id, 1, started=engine_pb2.TrainingLoopStarted(rank=1))
    assert plane.get(job_id).state == JobState.RUNNING
    for session in (a, b):
        (cmd,) = drain(session)
        assert kinds([cmd]) == ["StartTraining"] and to_ranks(cmd).job_id == job_id


def test_step_events_from_rank_0_update_progress(plane):
    job_id, a, b = start_job(plane)
    step(plane, a, job_id, 1, loss=3.0)
    step(plane, a, job_id, 2, loss=2.5)
    plane.rank_event(b, job_id, 1, step=engine_pb2.StepCompleted(rank=1, step=2, loss=99.0))  # ignored
    plane.rank_event(a, job_id, 0, eval=engine_pb2.EvalCompleted(step=2, loss=2.75))
    plane.rank_event(a, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:1", step=2))
    s = plane.get(job_id)
    assert (s.step, s.train_loss, s.eval_loss, s.tokens_seen) == (2, 2.5, 2.75, 128)
    assert s.tokens_per_second == 1000.0 and s.checkpoint_version == f"{job_id}:1"


def test_pause_names_no_step_learns_the_agreed_boundary_from_rank_0_and_pauses_when_all_ranks_paused(plane):
    job_id, a, b = start_job(plane)
    step(plane, a, job_id, 5)
    status = plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    assert status.state == JobState.RUNNING  # until every rank has paused
    for session in (a, b):
        (cmd,) = drain(session)
        assert kinds([cmd]) == ["PauseTraining"] and (to_ranks(cmd).seq, to_ranks(cmd).at_step) == (1, 0)
    # Asked again (a `surgectl pause` repeated or cut short and run again): its status, nothing sent.
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id)).state == JobState.RUNNING
    assert drain(a) == [] and drain(b) == []
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(step=6, loss=2.0, tokens=64))  # not held by all yet
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(step=7, loss=2.0, tokens=64, commands_agreed=1))
    assert "pause: every rank agreed on after step 7" in [e.message for e in plane.events(job_id)[-2:]]
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id)).state == JobState.RUNNING
    with pytest.raises(IllegalTransition, match=f"job {job_id} is already pausing \\(after step 7\\)") as refused:
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    assert refused.value.refusal == control_pb2.REFUSED_PAUSE_PENDING  # typed: what surgectl reads
    plane.rank_event(a, job_id, 0, paused=engine_pb2.TrainingLoopPaused(step=7))
    assert plane.get(job_id).state == JobState.RUNNING
    plane.rank_event(b, job_id, 1, paused=engine_pb2.TrainingLoopPaused(step=7))
    assert (plane.get(job_id).state, plane.get(job_id).step) == (JobState.PAUSED, 7)
    assert plane.user(control_pb2.PauseJobRequest(job_id=job_id)).state == JobState.PAUSED  # (paused already)
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.RUNNING
    assert kinds(drain(a)) == ["ResumeTraining"]


def test_resume_of_a_running_job_is_refused_naming_its_state(plane):
    job_id, _, _ = start_job(plane)
    with pytest.raises(
        IllegalTransition, match=f"^job {job_id} is RUNNING, not PAUSED: resume continues a PAUSED job, or relaunches"
    ) as e:
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    # Typed "done already" (surgectl: exit 0, as a stop asked again); a resume asking for a
    # version or a layout of it is not done already.
    assert e.value.refusal == control_pb2.REFUSED_ALREADY_RUNNING
    for asked in (
        control_pb2.ResumeJobRequest(job_id=job_id, from_version=f"{job_id}:1"),
        control_pb2.ResumeJobRequest(job_id=job_id, dp=1),
    ):
        with pytest.raises(IllegalTransition) as e:
            plane.user(asked)
        assert e.value.refusal == control_pb2.REFUSAL_UNSPECIFIED


def test_pause_of_a_warming_up_job_is_refused(plane):
    plane.register("wa")
    job_id = plane.submit(dp=1).job_id
    with pytest.raises(IllegalTransition, match="is WARMING_UP, not RUNNING"):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id))


def test_all_ranks_finished_terminates_finished_and_releases_slots(plane):
    job_id, a, b = start_job(plane, steps=3)
    for n, loss in ((1, 3.0), (2, 2.0), (3, 1.5)):
        step(plane, a, job_id, n, loss)
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(step=3))
    assert plane.get(job_id).state == JobState.RUNNING
    plane.rank_event(b, job_id, 1, finished=engine_pb2.TrainingLoopFinished(rank=1, step=3))
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.step, s.train_loss, s.tokens_seen) == (
        JobState.TERMINATED,
        JobOutcome.FINISHED,
        3,
        1.5,
        192,
    )
    for session in (a, b):
        (cmd,) = drain(session)
        assert (cmd.release.job_id, cmd.release.kill) == (job_id, False)
    assert plane.submit(dp=2).state == JobState.WARMING_UP  # the slots are free again
    with pytest.raises(IllegalTransition, match=f"job {job_id} is already TERMINATED \\(FINISHED\\)"):
        plane.user(control_pb2.StopJobRequest(job_id=job_id))


def test_stop_of_a_running_job_stops_at_the_boundary_the_ranks_agree_on_and_ends_stopped(plane):
    job_id, a, b = start_job(plane)
    step(plane, a, job_id, 4)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    (stop,) = drain(b)
    assert kinds([stop]) == ["StopTraining"] and (to_ranks(stop).seq, to_ranks(stop).at_step) == (1, 0)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(step=6, stopped=True))
    s = plane.get(job_id)
    assert (s.state, s.outcome, s.step) == (JobState.TERMINATED, JobOutcome.STOPPED, 6)


def test_stop_of_a_warming_up_job_kills_its_starting_ranks_at_once(plane):
    # A rank reads StopTraining only once its set-up is done (a model too large for its host
    # never is); nothing was trained since the launch, so there is no step to checkpoint.
    a = plane.register("wa")
    job_id = plane.submit(dp=1).job_id
    drain(a)
    s = plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert s.message == (
        "STOPPED: stopped by the operator; its ranks were still starting (killed; nothing trained since they launched)"
    )
    assert [(c.release.job_id, c.release.kill) for c in drain(a)] == [(job_id, True)]
    # A rank that comes up after the stop is not started, and its killed exit decides nothing.
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted())
    plane.rank_exited(a, job_id, 0, exit_code=-9)
    assert drain(a) == [] and plane.get(job_id).outcome == JobOutcome.STOPPED


def test_a_killed_rank_under_a_stop_policy_fails_the_job_and_kills_the_others(plane):
    # (Recovery, the default for a killed rank, is tested in test_fault_policy.py.)
    job_id, a, b = start_job(plane, extra="fault_policy: {actions: {rank_exit: stop}}")
    plane.rank_exited(b, job_id, 1, exit_code=-9)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert s.message.startswith("FAILED: SEVERE rank_exit: rank 1 on worker wb ended (signal 9)")
    assert [(c.release.job_id, c.release.kill) for c in drain(a)] == [(job_id, True)]


def test_a_fatal_loop_failure_stops_the_job_and_is_recorded_before_the_decision(plane):
    job_id, a, _ = start_job(plane)
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="model_error", detail="RuntimeError: shapes")
    plane.rank_event(a, job_id, 0, failed=failed)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert "FATAL model_error" in s.message
    assert [e.type for e in plane.events(job_id)][-4:] == ["rank", "fault", "decision", "state"]


def test_clean_rank_exits_after_the_job_finished_change_nothing(plane):
    a = plane.register("wa")
    job_id = plane.submit(dp=1).job_id
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted())
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(step=3))
    plane.rank_exited(a, job_id, 0, exit_code=0)
    assert plane.get(job_id).outcome == JobOutcome.FINISHED


def test_a_rank_that_finished_and_exits_before_the_others_finish_is_no_fault(plane):
    """A pipeline's last stage can finish and exit before stage 0 reports its end: that
    clean exit is neither a fault event nor a decision. A clean exit of a rank that had
    not finished still is (an early exit)."""
    job_id, a, b = start_job(plane, steps=3)
    plane.rank_event(b, job_id, 1, finished=engine_pb2.TrainingLoopFinished(rank=1, step=3))
    plane.rank_exited(b, job_id, 1, exit_code=0)
    assert "fault" not in [e.type for e in plane.events(job_id)]
    assert plane.get(job_id).state == JobState.RUNNING
    plane.rank_exited(a, job_id, 0, exit_code=0)
    assert [e.message for e in plane.events(job_id) if e.type == "fault"] == [
        "MEDIUM rank_exit_clean: rank 0 on worker wa ended (exit code 0)"
    ]


def test_a_lost_node_agent_freezes_its_job_waiting_for_capacity_and_its_slots_vanish(plane):
    job_id, a, b = start_job(plane)
    plane.c.sessions.close(b)
    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN  # waits for a worker to relaunch rank 1 on; nothing lost yet
    assert s.message.startswith("waiting for capacity to resume from scratch: needs 2 ranks, 1 free")
    assert any(e.message.startswith("SEVERE worker_lost") for e in plane.events(job_id))
    queued = plane.submit(dp=2)  # live jobs first: the queue waits for the recovery
    assert (queued.state, queued.queue_position) == (JobState.STANDBY, 1)
    assert queued.message == f"queued: waits while job {job_id} recovers (live jobs first)"
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert plane.get(job_id).outcome == JobOutcome.STOPPED
    settle(
        lambda: plane.get(queued.job_id).message,
        "queued: needs 2 ranks (parallel.dp=2), more than the 1 registered: can never run as things stand; waits for workers to join",
    )


def test_a_job_needing_more_ranks_than_registered_is_queued_saying_so_and_launches_nothing(plane):
    a, b = plane.register("wa"), plane.register("wb")
    status = plane.submit(dp=3)
    assert (status.state, status.queue_position) == (JobState.STANDBY, 1)
    assert (
        status.message
        == "queued: needs 3 ranks (parallel.dp=3), more than the 2 registered: can never run as things stand; waits for workers to join"
    )
    assert drain(a) == drain(b) == []
    (stored,) = plane.c.journal.load_jobs()
    assert stored.runtime["queued"] == {"priority": 0, "seq": 1, "submitted": status.created_unix}


def test_an_invalid_spec_is_refused_with_its_one_line_error(plane):
    with pytest.raises(JobSpecError, match="^bad.yaml: steps: Input should be greater than 0, got -1$"):
        plane.user(
            control_pb2.SubmitJobRequest(spec_yaml="name: x\nsteps: -1\ndata: {dataset: x@v1}\n", spec_path="bad.yaml")
        )


def test_a_freeze_that_leaves_nothing_to_train_is_refused_before_anything_is_allocated(plane):
    # The backstop behind surgectl's own check: a spec that reached control another way.
    plane.register("wa")
    for freeze, words in (("['blocks.*.atn.*']", "model.freeze[0]: 'blocks.*.atn.*' matches no parameter"),
                          ("['*']", "model.freeze: ['*'] freezes all ")):  # fmt: skip
        text = f"name: x\nsteps: 4\ndata: {{dataset: x@v1}}\nmodel: {{n_layers: 1, freeze: {freeze}}}\n"
        with pytest.raises(JobSpecError, match=f"^ft.yaml: {re.escape(words)}"):
            plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="ft.yaml"))
    assert list(plane.user(control_pb2.JobQuery()).jobs) == []
    assert plane.c.journal.load_jobs() == []


def test_unknown_job_is_not_found(plane):
    with pytest.raises(JobNotFound, match="^job nope-000000 not found$"):
        plane.get("nope-000000")


def test_event_log_has_contiguous_seqs_and_reads_from_a_seq(plane):
    job_id, a, _ = start_job(plane)
    events = plane.events(job_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[-1].status.state == JobState.RUNNING and events[-1].type == "state"
    assert [e.seq for e in plane.events(job_id, from_seq=3)] == [e.seq for e in events[2:]]


def test_step_progress_is_journaled_at_most_once_per_interval(tmp_path):
    journal = JobStore(tmp_path / "c.db")
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=3600.0))
    job_id, a, _ = start_job(plane)
    n_before = len(plane.events(job_id))
    for n in range(1, 50):
        step(plane, a, job_id, n)
    assert plane.get(job_id).step == 49  # the status is current...
    assert len(plane.events(job_id)) == n_before  # ...but no step was journaled yet
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    journal.close()


def test_restart_keeps_live_jobs_running_for_their_ranks_to_reattach_and_their_log_continues(tmp_path):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    running, a, b = start_job(plane)
    step(plane, a, running, 4, loss=1.25)
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1"))
    s = plane.get(running)
    assert (s.state, s.step, s.train_loss, s.message) == (JobState.RUNNING, 4, 1.25, REATTACH_MESSAGE)
    # The node agents re-attach their ranks; the job goes on where it was.
    a, b = (plane.register(w) for w in ("wa", "wb"))
    step(plane, a, running, 5, loss=1.0)
    assert (plane.get(running).step, plane.get(running).train_loss) == (5, 1.0)
    stopped = plane.user(control_pb2.StopJobRequest(job_id=running))
    assert stopped.state == JobState.RUNNING  # stopping at a step boundary
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, running, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=7, stopped=True)
        )
    s = plane.get(running)
    assert (s.state, s.outcome, s.step) == (JobState.TERMINATED, JobOutcome.STOPPED, 7)
    seqs = [e.seq for e in plane.events(running)]
    assert seqs == list(range(1, len(seqs) + 1))  # the log continues across the restart
    assert [st for st, _ in journal.steps(running)] == [4, 5]  # every applied step, once
    journal.close()


def test_after_a_restart_the_status_says_every_rank_re_attached_once_an_event_of_each_arrived(tmp_path):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = start_job(plane)
    step(plane, a, job_id, 4)
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1"))
    a, b = (plane.register(w) for w in ("wa", "wb"))
    step(plane, a, job_id, 5)
    assert plane.get(job_id).message == REATTACH_MESSAGE  # rank 1's agent has sent nothing yet
    plane.rank_event(b, job_id, 1, step=engine_pb2.StepCompleted(rank=1, step=5, loss=2.0))
    s = plane.get(job_id)
    assert (s.state, s.message) == (JobState.RUNNING, REATTACHED_MESSAGE)
    assert plane.events(job_id)[-1].message == f"RUNNING: {REATTACHED_MESSAGE}"
    n = len(plane.events(job_id))
    step(plane, a, job_id, 6)
    plane.rank_event(b, job_id, 1, step=engine_pb2.StepCompleted(rank=1, step=6, loss=2.0))
    assert len(plane.events(job_id)) == n  # said once
    journal.close()


def test_a_rank_that_finished_before_a_restart_is_remembered_and_its_clean_exit_after_it_is_no_fault(tmp_path):
    """Rank 1 finishes, control restarts before rank 0 does: the restarted control must know
    rank 1 finished (it once forgot: the event changed only bookkeeping, journaled nowhere),
    so rank 1's clean exit is no fault and rank 0's end finishes the job without a relaunch."""
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1"))
    job_id, a, b = start_job(plane, steps=3)
    plane.rank_event(b, job_id, 1, finished=engine_pb2.TrainingLoopFinished(rank=1, step=3))
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1"))
    a, b = (plane.register(w) for w in ("wa", "wb"))
    plane.rank_exited(b, job_id, 1, exit_code=0)
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=3))
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED)
    events = plane.events(job_id)
    assert [e.type for e in events if e.type == "fault"] == []
    assert [e.message.split(";")[0] for e in events if e.type == "decision"] == ["2 ranks allocated on wa, wb"]
    journal.close()


def test_where_each_rank_runs_is_journaled_and_pushed_to_the_detector_after_a_restart(tmp_path):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = start_job(plane)  # the relay stamps each ready report with its session's worker
    journal.close()
    journal = JobStore(db)
    (stored,) = [j for j in journal.load_jobs() if j.status.job_id == job_id]
    journal.close()
    assert stored.runtime["placement"] == {"0": "wa", "1": "wb"}
    assert stored.runtime["launched"] == {}  # (where the launch put them: kept only until every rank is ready)
    spec = spec_from_json(stored.spec_json)
    monitor = start_monitoring(job_id, spec, restored=True, placement={0: "wa", 1: "wb"})
    assert (monitor.world_size, list(monitor.rank_worker_ids)) == (2, ["wa", "wb"])
    assert list(start_monitoring(job_id, spec, restored=True).rank_worker_ids) == ["", ""]
    assert start_monitoring(job_id, spec, restored=True, step=13615).step == 13615  # (what an unheard rank is at)
    # (each rank's newest launched generation: an older one's exit is a replaced incarnation's)
    assert list(start_monitoring(job_id, spec, restored=True, generations={1: 7}).rank_generations) == [0, 7]


def test_a_stack_crash_while_warming_up_blames_the_lost_worker_each_rank_was_launched_on(tmp_path, monkeypatch):
    """Session 34's trial: every process of the stack killed while the job warmed up (no rank
    ready yet), then the stack brought up again. The restored job's ranks re-attach nowhere:
    the fault names the worker rank 0 was launched on (worker_lost, as when it RUNS), never a
    rank silent on a blank worker. Control journaled only where ranks reported ready."""
    monkeypatch.setattr("services.control.monitoring.REATTACH_MIN_SECONDS", 0.5)
    liveness = "liveness: {attribution_seconds: 0, heartbeat_interval_seconds: 0.1, heartbeat_timeout_seconds: 0.3}"
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, extra=liveness).job_id
    assert plane.get(job_id).state == JobState.WARMING_UP
    journal.close()  # (control killed: nothing more of it; its node agents were killed too)

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1"))
    plane.register("wa"), plane.register("wb")  # (the node agents started afresh: no rank to re-attach)
    faults = settle(lambda: len([e for e in plane.events(job_id) if e.type == "fault"][:1]), 1)
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[0].startswith("SEVERE worker_lost: rank 0 lost with worker wa: no node agent re-attached it"), faults
    journal.close()


def test_a_reconnecting_worker_replaces_its_session_and_its_lost_ranks_are_relaunched_there(plane):
    old = plane.register("wa")
    job_id = plane.submit(dp=1).job_id
    new = plane.register("wa")
    assert drain(old)[-1] is None  # the old session's command stream ended
    assert any(e.message.startswith("SEVERE worker_lost") for e in plane.events(job_id))
    # The releases reach the live session, and the lost rank is relaunched there: the
    # worker is back under the same id.
    commands = drain(new)
    assert [c.WhichOneof("command") for c in commands] == ["release", "launch"]
    assert {c.release.job_id for c in commands[:1]} == {commands[1].launch.job_id} == {job_id}
    assert plane.get(job_id).state == JobState.FAULT_FROZEN  # until the relaunched rank reports ready


def test_memory_pressure_is_recorded_on_the_jobs_with_ranks_on_that_worker_and_nothing_else_happens(plane):
    job_id, a, b = start_job(plane)  # wa: rank 0, wb: rank 1
    c = plane.register("wc")
    other = plane.submit(dp=1).job_id  # the only free slot: wc
    drain(c)
    seen = {j: plane.events(j)[-1].seq for j in (job_id, other)}

    def pressure(session, under: bool, available: int) -> None:
        # worker_id left empty: the relay stamps the session's identity.
        msg = control_pb2.MemoryPressure(available_bytes=available, total_bytes=24 << 30, under_pressure=under)
        plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(memory_pressure=msg))

    pressure(b, True, int(1.2 * (1 << 30)))
    pressure(b, False, 12 << 30)
    new = plane.events(job_id, seen[job_id] + 1)
    assert [(e.type, e.source, e.message) for e in new] == [
        ("resource", Module.L1_RESOURCE_ALLOCATOR, "memory pressure on wb: 1.2 GiB of 24.0 GiB available"),
        ("resource", Module.L1_RESOURCE_ALLOCATOR, "memory pressure relieved on wb: 12.0 GiB of 24.0 GiB available"),
    ]
    assert plane.events(other, seen[other] + 1) == ()  # no rank of it on wb
    assert plane.get(job_id).state == JobState.RUNNING  # recorded only: no decision taken
    assert drain(a) == [] and drain(b) == [] and drain(c) == []  # no command to any node


def test_boundary_commands_are_numbered_without_a_gap_and_a_relaunched_group_starts_from_the_last(plane):
    job_id, a, b = start_job(plane, steps=100000)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=3))
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    assert [to_ranks(c).seq for c in drain(a) if kinds([c]) == ["PauseTraining"]] == [1, 2]
    plane.rank_exited(b, job_id, 1, exit_code=-9)  # a relaunch: a new group
    drain(a), drain(b)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    assert plane.get(job_id).state == JobState.PAUSED  # (recovered paused: the pause was in flight)
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    (start,) = [to_ranks(c) for c in drain(a) if kinds([c]) == ["StartTraining"]]
    assert start.command_seq == 2  # the new group's agreement starts after the pause in flight (void now)


def test_a_boundary_command_in_flight_when_control_restarts_goes_again_once_with_its_number(tmp_path):
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, a, b = start_job(plane)
    step(plane, a, job_id, 4)
    plane.c.orchestrator._withdraw_standing_order(job_id, 1)  # (3 boundary commands in flight; say
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))  # none left the sessions' queues before
    plane.user(control_pb2.StopJobRequest(job_id=job_id))  # control died)
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    w = {}
    for rank, name in enumerate(("wa", "wb")):  # the node agents re-attach the ranks they still run
        reg = registration(name)
        reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=rank)]))
        w[name] = plane.c.sessions.open(reg)
    step(plane, w["wa"], job_id, 5)
    assert [kinds(drain(s)) for s in w.values()] == [[], []]  # not every rank re-attached yet
    plane.rank_event(w["wb"], job_id, 1, step=engine_pb2.StepCompleted(rank=1, step=5, loss=2.0))
    for session in w.values():  # every one again, in order, with its number
        revoke, pause, stop = [to_ranks(c) for c in drain(session)]
        assert (type(revoke), revoke.order, revoke.seq) == (engine_pb2.RevokeStandingOrder, 1, 1)
        assert (type(pause), pause.seq, pause.checkpoint) == (engine_pb2.PauseTraining, 2, True)
        assert (type(stop), stop.seq, stop.checkpoint) == (engine_pb2.StopTraining, 3, True)
    step(plane, w["wa"], job_id, 6)
    plane.rank_event(w["wb"], job_id, 1, step=engine_pb2.StepCompleted(rank=1, step=6, loss=2.0))
    assert [kinds(drain(s)) for s in w.values()] == [[], []]  # once
    for rank, name in enumerate(("wa", "wb")):
        plane.rank_event(
            w[name], job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=7, stopped=True)
        )
    assert (plane.get(job_id).state, plane.get(job_id).outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    journal.close()


@pytest.mark.parametrize("policy", ["restart_from_scratch", "stop"])
def test_a_recovery_with_no_checkpoint_to_load_is_decided_by_the_no_checkpoint_policy(plane, policy):
    """No checkpoint committed yet when a rank dies: the relaunch restarts the ranks from
    step 0 (the default) or stops the job FAILED (``no_checkpoint: stop``), said either way."""
    job_id, a, b = start_job(plane, extra=f"fault_policy: {{no_checkpoint: {policy}}}")
    plane.rank_exited(b, job_id, 1, exit_code=-9)
    decisions = [e.message for e in plane.events(job_id) if e.type in ("decision", "recovery")]
    s = plane.get(job_id)
    if policy == "stop":
        assert decisions[-1] == (
            "stop after rank_exit of rank 1: no checkpoint was committed yet (fault policy no_checkpoint: stop)"
        )
        assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
        assert s.message.startswith("FAILED: no checkpoint was committed yet; not restarted from scratch")
        assert not [c for c in drain(a) + drain(b) if c is not None and c.WhichOneof("command") == "launch"]
    else:
        assert (
            "restart from scratch after rank_exit of rank 1: no checkpoint was committed yet "
            "(fault policy no_checkpoint: restart_from_scratch)"
        ) in decisions
        assert s.state == JobState.FAULT_FROZEN
        launched = [c.launch for c in drain(a) + drain(b) if c is not None and c.WhichOneof("command") == "launch"]
        assert launched and all(not launch.init.resume_version for launch in launched)


def test_the_running_transition_counts_its_ranks_in_words_that_read_right():
    """("all 1 ranks ready" read wrong to an operator's trial)"""
    from services.control.orchestrator.training import _ready_text

    assert _ready_text(1) == "the rank is ready; training started"
    assert _ready_text(8) == "all 8 ranks ready; training started"


def test_a_one_rank_job_says_its_rank_is_ready(plane):
    a = plane.register("wa")
    job_id = plane.submit(dp=1).job_id
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)
    assert any(e.message == "WARMING_UP -> RUNNING: the rank is ready; training started" for e in plane.events(job_id))
    drain(a)
