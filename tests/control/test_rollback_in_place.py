"""A rollback in place by the operator (issue 29 item 9, `surgectl rollback`): the live ranks
pause at an agreed boundary, load the version (ResumeTraining.reload_version), report ready at
its step and start again; nothing is relaunched. Refusals change nothing; a fault on the way
falls back to the policy's relaunch. Driven in-process through the real bus (fixtures of
test_fault_policy.py)."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, engine_pb2, route_pb2, store_pb2
from services.control.orchestrator import IllegalTransition, UnknownVersion
from services.control.orchestrator.texts import _newest

from .conftest import drain, kinds, to_ranks
from .test_fault_policy import QUICK, decisions, plane, restarted, running, saved, store  # noqa: F401 - fixtures

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def rollback(plane, job_id: str, version: str = "") -> control_pb2.JobStatus:  # noqa: F811
    return plane.user(control_pb2.ResumeJobRequest(job_id=job_id, from_version=version, rollback_in_place=True))


def paused(plane, w: dict, job_id: str, step: int) -> None:  # noqa: F811
    for rank, name in enumerate(w):
        plane.rank_event(w[name], job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=step))


def routed(session) -> list:
    return [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed"]


def test_the_live_ranks_pause_load_the_version_and_go_on_from_its_step(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    v1, v2 = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    rollback(plane, job_id, v1)
    assert decisions(plane, job_id)[0].startswith(f"rollback in place to checkpoint {v1} (step 4) by the operator")
    (pause,) = routed(w["wb"])
    assert isinstance(pause, engine_pb2.PauseTraining) and not pause.checkpoint
    paused(plane, w, job_id, step=10)
    (reload,) = routed(w["wb"])
    assert reload.reload_version == v1 and not reload.rebuild
    assert [type(m).__name__ for m in routed(w["wa"])] == ["PauseTraining", "ResumeTraining"]
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    s = plane.get(job_id)
    assert (s.state, s.step, s.message) == (
        JobState.RUNNING,
        4,
        f"rolled back in place to checkpoint {v1} at step 4",
    )
    assert kinds(drain(w["wa"])) == ["StartTraining"]  # (no release, no launch: the same processes)
    done = [e.message for e in plane.events(job_id) if e.message.startswith("rollback in place done")]
    assert done and done[0].endswith(f"; {v2} kept, never chosen by a recovery or a plain resume")
    assert v2 in plane.c.orchestrator._jobs[job_id].abandoned
    # What a resume would load is the version rolled back to, in the status and in what `down
    # --force` and a stop say (was: v2, so `up` was said to resume "from v2, no step lost", then
    # resumed from v1: a fresh user's trial).
    assert (s.checkpoint_version, s.checkpoint_step) == (v1, 4)
    assert _newest(plane.c.orchestrator._jobs[job_id]) == f"checkpoint {v1} (step 4)"


@pytest.mark.parametrize(
    ("setup", "refused"),
    [
        ("unknown", "--version {job}:9: not a usable committed checkpoint of job {job} (usable: {job}:1)"),
        ("none", "rollback: job {job} has no committed checkpoint to go back to"),
        ("fp16", "rollback: job {job} trains in fp16"),
        ("paused", "job {job} is PAUSED, not RUNNING: `surgectl resume {job}` first"),
    ],
)
def test_a_rollback_that_cannot_be_done_is_one_line_and_changes_nothing(plane, store, setup, refused):  # noqa: F811
    extra = QUICK + ("\nprecision: {dtype: fp16}" if setup == "fp16" else "")
    job_id, w = running(plane, "wa", "wb", extra=extra)
    if setup != "none":
        saved(plane, w["wa"], job_id, 1, step=4)
    if setup == "paused":
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
        paused(plane, w, job_id, step=6)
        drain(w["wa"]), drain(w["wb"])
    before = len(plane.events(job_id))
    # A version the job never had is the operator's input, as `resume --from` answers it.
    kind = UnknownVersion if setup == "unknown" else IllegalTransition
    with pytest.raises(kind, match=refused.format(job=job_id).replace("(", r"\(").replace(")", r"\)")):
        rollback(plane, job_id, f"{job_id}:9" if setup == "unknown" else "")
    assert len(plane.events(job_id)) == before and routed(w["wa"]) == []


def test_a_rank_lost_while_they_pause_gives_the_rollback_up_for_the_policys_relaunch(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(v1, 4, True)]
    rollback(plane, job_id)
    drain(w["wa"]), drain(w["wb"])
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    events = [e.message for e in plane.events(job_id)]
    assert any(m.startswith(f"rollback in place to {v1} given up: restart_ranks after rank_exit") for m in events)
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    assert plane.c.orchestrator._jobs[job_id].reload is None
    assert "launch" in kinds(drain(w["wa"]))


def test_a_version_that_cannot_be_loaded_in_place_is_decided_not_left_waiting(plane, store):  # noqa: F811
    # A fresh admin's find: the version named was deleted by keep_last; every rank's load was
    # refused (NOT_FOUND), its L5-1 reported the failure (SnapshotFailed, minor: training would
    # go on after a failed save) and its loop failed "after a reported module failure": nothing
    # was decided, the job RUNNING with its ranks waiting to be released, for minutes.
    job_id, w = running(plane, "wa", "wb")
    v1, v2 = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    store.verdicts = [(v2, 8, True)]
    rollback(plane, job_id, v1)
    paused(plane, w, job_id, step=10)
    drain(w["wa"]), drain(w["wb"])
    reason = f"store at 127.0.0.1:1: Load: NOT_FOUND: checkpoint {v1} not found"
    for rank, name in enumerate(w):
        failure = route_pb2.Failure(
            cause=route_pb2.FailureCause.FAILURE_INVALID_INPUT,
            detail=reason,
            operation="surge.v1.LoadCheckpoint",
            module=Module.L5_CHECKPOINT_MANAGER,
            job_id=job_id,
            rank=rank,
        )
        plane.rank_event(
            w[name],
            job_id,
            rank,
            snapshot_failed=store_pb2.SnapshotFailed(
                job_id=job_id, version=v1, operation="load", reason=reason, cause=store_pb2.REJECTED, rank=rank,
                failure=failure,
            ),
        )  # fmt: skip
        plane.rank_event(
            w[name],
            job_id,
            rank,
            failed=engine_pb2.TrainingLoopFailed(
                rank=rank, step=10, fault_class="checkpoint_error", detail=reason, failure=failure
            ),  # (the class a CheckpointError names: services/rank/checkpoint_errors.py)
        )
    events = [e.message for e in plane.events(job_id)]
    assert any(m.startswith(f"rollback in place to {v1} given up") for m in events), events[-8:]
    assert plane.c.orchestrator._jobs[job_id].reload is None
    assert "launch" in kinds(drain(w["wa"]))  # (relaunched from the newest usable version)


def test_a_version_its_retention_removed_is_refused_up_front(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    v2 = f"{job_id}:2"
    plane.rank_event(
        w["wa"], job_id, 0, saved=store_pb2.SaveCompleted(version=v2, step=8, removed_versions=[v1])
    )  # (keep_last 1: the commit of v2 removed v1)
    before = len(plane.events(job_id))
    with pytest.raises(
        UnknownVersion, match=rf"--version {v1}: not a usable committed checkpoint of job {job_id} \(usable: {v2}\)"
    ):
        rollback(plane, job_id, v1)
    assert len(plane.events(job_id)) == before and routed(w["wa"]) == []
    assert plane.c.orchestrator._jobs[job_id].versions == [(8, v2)]


def test_a_rollback_asked_again_while_in_flight_is_folded_and_says_so(plane, store):  # noqa: F811
    # An operator's trial: the second `surgectl rollback` printed the line of a new rollback,
    # though control folded it into the first. Its reply now names the rollback in flight.
    job_id, w = running(plane, "wa", "wb")
    v1, _ = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    first = rollback(plane, job_id, v1)
    assert (first.rollback_in_flight, first.rollback_asked_unix) == ("", 0.0)  # (a new one: nothing folded)
    asked = plane.c.orchestrator._jobs[job_id].reload.asked_unix
    assert asked > 0
    for again in (v1, ""):  # the same version, or none named (the newest usable: the one in flight)
        folded = rollback(plane, job_id, again)
        assert (folded.rollback_in_flight, folded.rollback_asked_unix) == (v1, asked)
    assert [type(m).__name__ for m in routed(w["wb"])] == ["PauseTraining"]  # one rollback asked of the ranks
    assert plane.get(job_id).rollback_in_flight == ""  # (a query is no answer to an ask)
