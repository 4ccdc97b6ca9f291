"""Who a control restart's unheard ranks are blamed on (session 34, a fresh operator's trial):
`surgectl stop J; surgectl resume J`, then every process of the stack killed (control, data,
store, node agents) while the job warmed up, then `surgectl up`. The job's event read "SEVERE
rank_silent: rank 0 on worker  sent no heartbeat for 15.0 s (deadline 3 s) after step 0" for a
job at step 13615; the same crash while RUNNING named the lost worker. Real composed control,
its journal reopened as after a crash."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2, store_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore

from . import test_operator_actions as operator_actions
from .conftest import Plane, drain, settle

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)
store = operator_actions.store  # (answers the resume's verification with the versions given)
LIVENESS = "liveness: {attribution_seconds: 0, heartbeat_interval_seconds: 0.1, heartbeat_timeout_seconds: 0.3}"


def started(db):
    """Control on the journal at ``db``, two node agents (wa, wb) and a dp 2 job whose ranks
    started: (journal, plane, wa's session, wb's session, job id)."""
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=20, extra=LIVENESS).job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    return journal, plane, a, b, job_id


def restarted(db):
    """Control started again on the journal at ``db``, as after every process was killed."""
    journal = JobStore(db)
    return journal, Plane(build(journal, data_address="d:1", store_address="s:1"))


def test_a_stack_crash_during_a_resumes_warm_up_blames_the_lost_worker_at_the_jobs_step(tmp_path, store, monkeypatch):
    monkeypatch.setattr("services.control.monitoring.REATTACH_MIN_SECONDS", 0.5)
    db = tmp_path / "control.db"
    journal, plane, a, b, job_id = started(db)
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(step=5, loss=2.0, tokens=64))
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    plane.rank_event(a, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:1", step=6))
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(
            session, job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=6, stopped=True)
        )
    store.versions[job_id] = [(f"{job_id}:1", 6, True, "")]
    assert plane.user(control_pb2.ResumeJobRequest(job_id=job_id)).state == JobState.WARMING_UP
    drain(a), drain(b)
    journal.close()  # (every process killed at once: no rank reported ready to this control)

    journal, plane = restarted(db)
    assert (plane.get(job_id).state, plane.get(job_id).step) == (JobState.WARMING_UP, 6)
    plane.register("wa"), plane.register("wb")  # (`surgectl up`: node agents afresh, no rank to re-attach)
    settle(lambda: any(e.type == "fault" for e in plane.events(job_id)), True)
    fault = next(e.message for e in plane.events(job_id) if e.type == "fault")
    # As for the same crash while RUNNING: the node agent that held the rank is gone.
    assert fault.startswith("SEVERE worker_lost: rank 0 lost with worker wa: no node agent re-attached it"), fault
    assert fault.endswith("of the control restart, after step 6"), fault  # (the journaled step, not 0)
    decision = next(e.message for e in plane.events(job_id) if e.type == "decision" and "worker_lost" in e.message)
    assert "rank_silent" not in decision, decision
    journal.close()


def test_a_stack_crash_while_a_recoverys_relaunch_warms_up_blames_the_worker_it_was_relaunched_on(
    tmp_path, store, monkeypatch
):
    """blame34's left item: rank 1 killed, its recovery relaunched both ranks (FAULT_FROZEN,
    warming up), then every process of the stack killed. Where each rank of the relaunch went
    (RecoveryCompleted.rank_worker_ids) is journaled, so the restarted control names the lost
    rank's worker (was: "not re-attached (the worker it was launched on is not known)")."""
    monkeypatch.setattr("services.control.monitoring.REATTACH_MIN_SECONDS", 0.5)
    db = tmp_path / "control.db"
    journal, plane, a, b, job_id = started(db)
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(step=6, loss=2.0, tokens=64))
    plane.rank_event(a, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:1", step=6))
    store.versions[job_id] = [(f"{job_id}:1", 6, True, "")]
    plane.rank_exited(b, job_id, 1, exit_code=-9)
    relaunched = lambda: any(e.type == "recovery" and "relaunched on" in e.message for e in plane.events(job_id))  # noqa: E731
    settle(relaunched, True)
    assert plane.get(job_id).state == JobState.FAULT_FROZEN  # (the relaunched ranks warm up)
    assert plane.c.orchestrator._jobs[job_id].launched == {0: "wa", 1: "wb"}
    drain(a), drain(b)
    before = len([e for e in plane.events(job_id) if e.type == "fault"])  # (rank 1's exit)
    journal.close()  # (every process killed at once: no relaunched rank reported ready)

    journal, plane = restarted(db)
    plane.register("wa"), plane.register("wb")  # (`surgectl up`: node agents afresh, no rank to re-attach)
    settle(lambda: len([e for e in plane.events(job_id) if e.type == "fault"]) > before, True)
    fault = [e.message for e in plane.events(job_id) if e.type == "fault"][before]
    assert "not known" not in fault, fault
    assert "rank 0 lost with worker wa: no node agent re-attached it" in fault, fault
    journal.close()
