"""Teams in control (issue 30 items 1 and 4), in-process on the real bus: a hard limit holds
on an idle cluster, a team borrows its cohort's idle nominal (recorded, and named for reclaim),
a quota-held job holds back its own team only, two simultaneous submits that together do not
fit (one runs, one waits, nothing of it launched) 20 times, quotas across a control restart."""

from __future__ import annotations

import threading
import time

import pytest

from services.contract import control_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator.refusals import BeyondHardLimit
from services.control.scheduler import QuotaBook, QuotaFileError, Running, TeamQuota, reclaim_victims

from .conftest import Plane, drain, spec_yaml, stop_plane

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def set_team(plane: Plane, name: str, **fields) -> control_pb2.TeamList:
    q = {"nominal": -1, "borrow_limit": -1, "hard_limit": -1, "weight": 1.0, "cohort": "default", **fields}
    return plane.user(control_pb2.SetTeamQuotaRequest(quota=control_pb2.TeamQuota(name=name, **q)))


def submit(plane: Plane, name: str, team: str, dp: int = 1, priority: int = 0) -> control_pb2.JobStatus:
    text = spec_yaml(name=name, dp=dp, extra=f"team: {team}")
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml", priority=priority))


def launched(*sessions) -> list[str]:
    return [c.launch.job_id for s in sessions for c in drain(s) if c.WhichOneof("command") == "launch"]


def teams(plane: Plane) -> dict[str, control_pb2.TeamQuota]:
    return {t.name: t for t in plane.user(control_pb2.TeamQuery()).teams}


def test_a_hard_limit_holds_on_an_idle_cluster_and_a_job_beyond_it_alone_is_refused(plane):
    w = plane.register("w", slots=8)
    set_team(plane, "vision", hard_limit=2)
    a = submit(plane, "a", "vision", dp=2)
    b = submit(plane, "b", "vision", dp=1)
    assert a.state == JobState.WARMING_UP and b.state == JobState.STANDBY
    assert b.message == "queued: team vision at its hard limit (2 of 2 slots held, this job needs 1)"
    assert launched(w) == [a.job_id]  # 6 slots idle, still nothing for b
    with pytest.raises(
        BeyondHardLimit, match=r"^job.yaml: team: needs 3 slots; team vision may hold at most 2 \(hard_limit\)$"
    ):
        submit(plane, "c", "vision", dp=3)
    assert {j.name for j in plane.user(control_pb2.JobQuery()).jobs} == {"a", "b"}  # nothing persisted of c
    t = teams(plane)["vision"]
    assert (t.used, t.hard_limit, t.running_jobs, t.waiting_jobs) == (2, 2, 1, 1)


def test_a_job_its_quota_holds_back_holds_back_its_own_team_only(plane):
    w = plane.register("w", slots=8)
    set_team(plane, "vision", hard_limit=2)
    a = submit(plane, "a", "vision", dp=2)
    b = submit(plane, "b", "vision", dp=1)  # its hard limit
    c = submit(plane, "c", "vision", dp=1, priority=-1)  # behind b in its team
    d = submit(plane, "d", "nlp", dp=1)  # another team: not held back by b
    assert [plane.get(j).state for j in (a.job_id, b.job_id, c.job_id, d.job_id)] == [
        JobState.WARMING_UP,
        JobState.STANDBY,
        JobState.STANDBY,
        JobState.WARMING_UP,
    ]
    assert sorted(launched(w)) == sorted([a.job_id, d.job_id])
    queue = plane.user(control_pb2.TeamQuery()).queue
    assert [(q.job_id, q.position) for q in queue] == [(b.job_id, 1), (c.job_id, 2)]
    set_team(plane, "vision", hard_limit=4)  # raised: both start (the queue is tried again)
    from .conftest import settle

    settle(lambda: [plane.get(j).state for j in (b.job_id, c.job_id)], [JobState.WARMING_UP] * 2)


def test_a_team_borrows_its_cohort_s_idle_nominal_and_that_job_is_the_one_named_for_reclaim(plane):
    w = plane.register("w", slots=4)
    set_team(plane, "vision", nominal=2, borrow_limit=2, cohort="research")
    set_team(plane, "nlp", nominal=2, cohort="research")
    a = submit(plane, "a", "vision", dp=2)
    b = submit(plane, "b", "vision", dp=2)  # beyond vision's nominal: nlp's 2 idle slots
    assert (a.state, a.borrowed_slots, b.state, b.borrowed_slots) == (JobState.WARMING_UP, 0, JobState.WARMING_UP, 2)
    assert "ranks launching (2 on capacity its team borrowed)" in plane.events(b.job_id)[-1].message
    c = submit(plane, "c", "vision", dp=1)  # 5 > nominal 2 + borrow limit 2
    assert c.message == "queued: team vision beyond its nominal 2 would borrow 3 slots, over its borrow limit of 2"
    n = submit(plane, "n", "nlp", dp=2)  # within nlp's nominal, but the cluster is full
    assert n.state == JobState.STANDBY
    t = teams(plane)
    assert (t["vision"].used, t["vision"].borrowed, t["nlp"].used) == (4, 2, 0)
    running = [
        Running(s.job_id, s.team, s.world_size, s.priority, s.created_unix, s.borrowed_slots)
        for s in plane.user(control_pb2.JobQuery()).jobs
        if s.state == JobState.WARMING_UP
    ]
    book = QuotaBook(
        {
            "vision": TeamQuota(nominal=2, borrow_limit=2, cohort="research"),
            "nlp": TeamQuota(nominal=2, cohort="research"),
        }
    )
    assert reclaim_victims(book, {"vision": 4}, "nlp", 2, 0, running) == [b.job_id]
    assert launched(w) == [a.job_id, b.job_id]


def test_two_simultaneous_submits_that_together_do_not_fit_one_runs_one_waits_nothing_partially_held(plane):
    sessions = []
    for i in range(20):
        # 5 free slots each round (each earlier round's running job left 2 of its round's 5)
        sessions.append(plane.register(f"w{i}", slots=5 if i == 0 else 3))
        go = threading.Barrier(2)
        got: dict[str, control_pb2.JobStatus] = {}

        def one(name: str, i: int = i, go=go, got=got) -> None:
            go.wait()
            got[name] = submit(plane, f"{name}{i}", "vision" if name == "x" else "nlp", dp=3)

        threads = [threading.Thread(target=one, args=(n,)) for n in ("x", "y")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        states = sorted(JobState.Name(s.state) for s in got.values())
        assert states == ["STANDBY", "WARMING_UP"], (i, states)
        ran = [s.job_id for s in got.values() if s.state == JobState.WARMING_UP]
        waits = [s for s in got.values() if s.state == JobState.STANDBY][0]
        assert sorted(set(launched(*sessions))) == ran  # (one launch per worker it spans) nothing of the waiting job
        assert waits.message.startswith("queued: needs 3 ranks"), waits.message
        plane.user(control_pb2.StopJobRequest(job_id=waits.job_id, queued_only=True))  # (the next round's slots)


def test_team_set_refuses_a_bad_value_in_one_line(plane):
    with pytest.raises(QuotaFileError, match=r"^surgectl team set: hard_limit: must be >= nominal \(4\), got 2$"):
        set_team(plane, "vision", nominal=4, hard_limit=2)
    with pytest.raises(QuotaFileError, match=r"^team: must match"):
        set_team(plane, "Vision!")
    with pytest.raises(QuotaFileError, match=r"^team remove: team 'nlp' has no quota of its own"):
        plane.user(control_pb2.SetTeamQuotaRequest(quota=control_pb2.TeamQuota(name="nlp"), remove=True))
    assert "vision" not in teams(plane)


def test_quotas_survive_a_control_restart_over_the_quota_file(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    file_book = QuotaBook({"vision": TeamQuota(nominal=1), "nlp": TeamQuota(nominal=3, weight=2)})

    def start():
        return build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=file_book)

    control = start()
    try:
        plane = Plane(control)
        set_team(plane, "vision", nominal=6, hard_limit=8, weight=3, cohort="research")
        plane.user(control_pb2.SetTeamQuotaRequest(quota=control_pb2.TeamQuota(name="nlp"), remove=True))
        queued = submit(plane, "q", "vision", dp=2)  # no worker: queued
    finally:
        stop_plane(control)
    control = start()
    try:
        plane = Plane(control)
        t = teams(plane)
        assert (t["vision"].nominal, t["vision"].hard_limit, t["vision"].weight, t["vision"].cohort) == (
            6,
            8,
            3.0,
            "research",
        )
        assert t["vision"].configured and "nlp" not in t  # removed by command: the file's entry is not back
        assert [q.job_id for q in plane.user(control_pb2.TeamQuery()).queue] == [queued.job_id]
    finally:
        stop_plane(control)


def test_a_job_of_a_team_below_its_share_waiting_past_the_bound_goes_first(tmp_path, store_with_no_versions):
    """The starvation bound in control (scheduler/fair_share.py): lab's 4-slot job waits behind
    busy's 1-slot jobs in the fair order (lab's share counting the job, 4/4/1, is beyond
    busy's 5/4/4) until it has waited the book's bound (1 s here) since it was queued; lab holds
    nothing (below its entitlement 1/5), so it then goes first. The order is read at the next
    change of the queue (a submit)."""
    book = QuotaBook({"busy": TeamQuota(weight=4), "lab": TeamQuota(weight=1)}, max_wait_s=1.0)
    journal = JobStore(tmp_path / "control.db")
    control = build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=book)
    try:
        plane = Plane(control)
        plane.register("w", slots=4)
        r = submit(plane, "r", "busy", dp=4)
        big = submit(plane, "big", "lab", dp=4)
        s1 = submit(plane, "s1", "busy", dp=1)
        assert r.state == JobState.WARMING_UP and big.state == s1.state == JobState.STANDBY
        assert [q.job_id for q in plane.user(control_pb2.TeamQuery()).queue] == [s1.job_id, big.job_id]
        waited = plane.get(big.job_id).queued_unix
        while time.time() < waited + 1.05:  # (past its bound; the clock, not a sleep-then-look)
            time.sleep(0.05)
        s2 = submit(plane, "s2", "busy", dp=1)
        queue = plane.user(control_pb2.TeamQuery()).queue
        assert [q.job_id for q in queue] == [big.job_id, s1.job_id, s2.job_id], [q.name for q in queue]
    finally:
        stop_plane(control)
