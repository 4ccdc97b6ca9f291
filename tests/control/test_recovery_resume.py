"""A recovery interrupted by a control restart is resumed, and exclusions survive (issue 4,
control plane restart). In-process: the real composition root on a SQLite journal; "control
is killed" = the journal is closed mid-flight (nothing more is written) and a new control is
built on the same file, as `kill -9` and a restart would leave it. The test stands in for
the node agents (re-registering with the ranks they still run) and for the store."""

from __future__ import annotations

import time

import pytest

from services.contract import control_pb2, engine_pb2, worker_pb2
from services.control import monitoring
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import Orchestrator

from .conftest import Plane, drain, registration
from .test_fault_policy import running, saved, store  # noqa: F401  (store: fixture)

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)
# Budget 2 for rank_exit: a second fault after the resumed recovery must read "restart 2 of 2".
POLICY = (
    "liveness: {attribution_seconds: 0, heartbeat_interval_seconds: 0.25, heartbeat_timeout_seconds: 1.0}\n"
    "fault_policy: {restarts: {rank_exit: 2, worker_lost: 2}}"
)


class Killed(BaseException):
    """control dies here (not an Exception: nothing on the way may handle it)."""


def open_plane(db) -> tuple[Plane, JobStore]:
    journal = JobStore(db)
    return Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)), journal


def reattach(plane: Plane, worker_id: str, *launches: control_pb2.LaunchRanks):
    """The node agent ``worker_id`` registers with the new control, still running ``launches``."""
    reg = registration(worker_id)
    reg.running.extend(launches)
    return plane.c.sessions.open(reg)


def beat(plane: Plane, session, job_id: str, rank: int) -> None:
    hb = worker_pb2.RankHeartbeat(step=0, stepping=False, unix_time=time.time(), interval_seconds=0.5)
    plane.rank_event(session, job_id, rank, heartbeat=hb)


def launches_of(commands) -> list[control_pb2.LaunchRanks]:
    return [c.launch for c in commands if c.WhichOneof("command") == "launch"]


def stop(plane: Plane, job_id: str) -> None:
    """Stop the (frozen) job before its journal closes: the detector's deadlines still armed
    then find a terminated job and write nothing."""
    assert plane.user(control_pb2.StopJobRequest(job_id=job_id)).state == JobState.TERMINATED


def messages(plane: Plane, job_id: str, kind: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == kind]


def test_a_recovery_whose_relaunch_was_done_waits_for_the_relaunched_ranks_after_a_restart(tmp_path, store):  # noqa: F811
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, w = running(plane, "wa", "wb", extra=POLICY)
    saved(plane, w["wa"], job_id, 1, step=4)

    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # decided and relaunched
    relaunched = {wid: launches_of(drain(s)) for wid, s in w.items()}
    assert [[r.rank for r in ls[0].ranks] for ls in relaunched.values()] == [[0], [1]]
    journal.close()  # control killed before the relaunched ranks reported ready

    plane, journal = open_plane(db)
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    sessions = {wid: reattach(plane, wid, relaunched[wid][0]) for wid in ("wa", "wb")}
    for rank, wid in enumerate(("wa", "wb")):
        beat(plane, sessions[wid], job_id, rank)
        plane.rank_event(sessions[wid], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=4))
    s = plane.get(job_id)
    assert s.state == JobState.RUNNING and s.step == 4
    assert all(launches_of(drain(x)) == [] for x in sessions.values())  # not relaunched again
    assert any(
        m.startswith(
            "FAULT_FROZEN: control restarted mid-recovery; resuming it (restart_ranks after "
            "rank_exit of rank 1): its ranks were relaunched"
        )
        for m in messages(plane, job_id, "state")
    )
    # The restart was spent once, before the restart: the next fault is the second.
    plane.rank_exited(sessions["wb"], job_id, 1, exit_code=-9)
    assert (
        messages(plane, job_id, "decision")[-1]
        == "restart_ranks after rank_exit of rank 1 on wb (restart 2 of 2 for rank_exit)"
    )
    stop(plane, job_id)
    journal.close()


def test_a_recovery_waiting_for_the_store_when_control_restarts_says_its_relaunch_was_not_commanded_yet(
    tmp_path,
    store,  # noqa: F811
):
    # (a fresh user read "its relaunch was commanded but not confirmed" of a recovery that was
    # still waiting for the store when control was restarted)
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, w = running(plane, "wa", "wb", extra=POLICY)
    saved(plane, w["wa"], job_id, 1, step=4)
    store.down = True
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert plane.get(job_id).message.startswith("waiting for the store")
    journal.close()

    plane, journal = open_plane(db)
    said = [m for m in messages(plane, job_id, "state") if "control restarted mid-recovery" in m]
    assert said and said[-1].endswith(
        "its relaunch was not commanded yet (it was waiting for the store to answer); waiting for the ranks to "
        "re-attach, then it goes on (a rank missing: relaunched)"
    ), said
    stop(plane, job_id)
    journal.close()


def test_a_relaunch_that_reached_the_agents_before_the_restart_is_not_repeated(tmp_path, store, monkeypatch):  # noqa: F811
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, w = running(plane, "wa", "wb", extra=POLICY)
    saved(plane, w["wa"], job_id, 1, step=4)

    def die_after_launch(self, *a, **kw):  # LaunchRanks queued (delivered), completion never journaled
        journal.close()
        raise Killed

    original = Orchestrator._record_relaunch
    monkeypatch.setattr(Orchestrator, "_record_relaunch", die_after_launch)
    with pytest.raises(Killed):
        plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    monkeypatch.setattr(Orchestrator, "_record_relaunch", original)
    relaunched = {wid: launches_of(drain(s))[0] for wid, s in w.items()}

    plane, journal = open_plane(db)
    sessions = {wid: reattach(plane, wid, relaunched[wid]) for wid in ("wa", "wb")}
    for rank, wid in enumerate(("wa", "wb")):
        beat(plane, sessions[wid], job_id, rank)
        plane.rank_event(sessions[wid], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=4))
    assert plane.get(job_id).state == JobState.RUNNING
    assert all(launches_of(drain(x)) == [] for x in sessions.values())
    (found,) = [m for m in messages(plane, job_id, "recovery") if "not relaunched again" in m]
    assert found.startswith("the relaunch commanded before the restart happened: rank 0")
    plane.rank_exited(sessions["wa"], job_id, 0, exit_code=-9)
    assert messages(plane, job_id, "decision")[-1].endswith("(restart 2 of 2 for rank_exit)")
    stop(plane, job_id)
    journal.close()


def test_a_relaunch_that_never_reached_the_agents_is_commanded_again_once_a_rank_is_missing(
    tmp_path,
    store,  # noqa: F811  (the fixture imported above)
    monkeypatch,
):
    monkeypatch.setattr(monitoring, "REATTACH_MIN_SECONDS", 0.5)  # re-attach window: 3 x 1.0 s heartbeat deadline
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, w = running(plane, "wa", "wb", extra=POLICY)
    saved(plane, w["wa"], job_id, 1, step=4)

    def die_before_rebuild(self, *a):  # decision journaled, versions verified, nothing relaunched
        journal.close()
        raise Killed

    original = Orchestrator._place
    monkeypatch.setattr(Orchestrator, "_place", die_before_rebuild)
    with pytest.raises(Killed):
        plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    monkeypatch.setattr(Orchestrator, "_place", original)
    assert all(launches_of(drain(s)) == [] for s in w.values())

    plane, journal = open_plane(db)
    # wa still runs the survivor (rank 0, the failed generation, never killed); wb runs nothing.
    survivor = control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=0, world_size=2)])
    sessions = {"wa": reattach(plane, "wa", survivor), "wb": reattach(plane, "wb")}
    t0 = time.monotonic()
    while True:  # rank 1 is declared silent at the end of the re-attach window (3 s)
        beat(plane, sessions["wa"], job_id, 0)
        relaunched = {wid: launches_of(drain(s)) for wid, s in sessions.items()}
        if any(relaunched.values()) or time.monotonic() - t0 > 10:
            break
        time.sleep(0.2)
    assert [[r.rank for r in ls[0].ranks] for ls in relaunched.values()] == [[0], [1]]
    assert all(ls[0].init.resume_version == f"{job_id}:1" for ls in relaunched.values())
    decisions = messages(plane, job_id, "decision")
    assert decisions[-1].startswith(
        "relaunch again for the recovery from rank_exit of rank 1 interrupted by the "
        "control restart: the relaunched ranks are not all there (rank_silent of rank 1)"
    )
    time.sleep(1.5)  # rank 0's own silence, graded before the relaunch, must not decide again
    assert len(messages(plane, job_id, "decision")) == len(decisions)
    for rank, wid in enumerate(("wa", "wb")):
        plane.rank_event(sessions[wid], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank, start_step=4))
    assert plane.get(job_id).state == JobState.RUNNING
    restarts = [d for d in messages(plane, job_id, "decision") if "(restart " in d]
    assert restarts == ["restart_ranks after rank_exit of rank 1 on wb (restart 1 of 2 for rank_exit)"]
    beat(plane, sessions["wb"], job_id, 1)
    plane.rank_exited(sessions["wb"], job_id, 1, exit_code=-9)  # a new fault: the second restart
    assert messages(plane, job_id, "decision")[-1].endswith("(restart 2 of 2 for rank_exit)")
    stop(plane, job_id)
    journal.close()


def test_workers_excluded_before_a_restart_stay_excluded_after_it(tmp_path, store):  # noqa: F811
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, w = running(plane, "wa", "wb", extra=POLICY.replace("}}", "}, actions: {worker_lost: exclude_node}}"))
    spare = plane.register("wc")
    plane.c.sessions.close(w["wb"])  # worker_lost: exclude wb (the policy says so), rank 1 goes to wc
    assert messages(plane, job_id, "decision")[-1].endswith("excluding wb")
    launched = {"wa": launches_of(drain(w["wa"]))[0], "wc": launches_of(drain(spare))[0]}
    for rank, s in enumerate((w["wa"], spare)):
        plane.rank_event(s, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    assert plane.get(job_id).state == JobState.RUNNING
    journal.close()

    plane, journal = open_plane(db)
    sessions = {wid: reattach(plane, wid, launch) for wid, launch in launched.items()}
    sessions["wb"] = reattach(plane, "wb")  # the excluded node comes back, with a free slot
    for rank, wid in enumerate(("wa", "wc")):
        beat(plane, sessions[wid], job_id, rank)
    plane.rank_exited(sessions["wa"], job_id, 0, exit_code=-9)  # restart_ranks: relaunch both
    placed = {wid: [r.rank for ls in launches_of(drain(s)) for r in ls.ranks] for wid, s in sessions.items()}
    assert placed == {"wa": [0], "wc": [1], "wb": []}  # wb free, but excluded
    stop(plane, job_id)
    journal.close()
