"""Issue 30's scheduler gaps closed in session 32, in-process on the real bus and sessions: a job
held back by its own team's quota preempts its team's lower-priority jobs (the rules of
preemption across teams hold); every waiting job's reason and place are decided again at a
capacity change that frees nothing; a job's borrowed slots follow its team's other jobs; a
shrunk ``any`` job counts against the kind it runs on only."""

from __future__ import annotations

import time

import pytest

from services.cli.render import state_text
from services.contract import Module, control_pb2, engine_pb2
from services.control.orchestrator.teams import held_by_kind
from services.control.scheduler import QuotaBook, TeamQuota
from services.jobspec import parse_job_spec, spec_to_json

from .conftest import Plane, drain, launched, settle, spec_yaml, stop_plane, to_ranks
from .test_preemption import launched_jobs, make_plane, messages, paused, saved, started, step

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def submit(plane: Plane, name: str, team: str, dp: int, priority: int = 0, extra: str = "") -> control_pb2.JobStatus:
    text = spec_yaml(name=name, dp=dp, steps=100, extra=f"team: {team}\n{extra}")
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml", priority=priority))


def running_job(plane: Plane, name: str, team: str, sessions: tuple, priority: int = 0, extra: str = "") -> str:
    """A job of ``team`` RUNNING on ``sessions`` (one rank each), checkpointed at step 4."""
    job_id = submit(plane, name, team, len(sessions), priority, extra).job_id
    assert plane.get(job_id).state == JobState.WARMING_UP
    started(plane, job_id, sessions)
    for s in sessions:
        drain(s)
    step(plane, sessions[0], job_id, 4)
    saved(plane, sessions[0], job_id, 1, 4)
    return job_id


def pauses(*sessions) -> list:
    return [
        to_ranks(c)
        for s in sessions
        for c in drain(s)
        if c.WhichOneof("command") == "routed" and type(to_ranks(c)) is engine_pb2.PauseTraining
    ]


# ---------------------------------------------------------------- 1. preemption within a team


def test_a_job_held_by_its_own_team_s_quota_preempts_that_team_s_lower_priority_job_which_comes_back(
    tmp_path, store_with_no_versions
):
    """Before: preemption ran only where the allocator refused the ranks; a job whose team's
    nominal was used up with nothing to borrow waited for its team's low job to end."""
    book = QuotaBook({"lab": TeamQuota(nominal=2, borrow_limit=0, cohort="lab")})
    plane = make_plane(tmp_path / "c.db", quotas=book)
    try:
        w = {n: plane.register(n) for n in ("wa", "wb", "wc", "wd")}
        low = running_job(plane, "low", "lab", (w["wa"], w["wb"]))
        high = submit(plane, "high", "lab", 2, priority=5)
        assert high.state == JobState.STANDBY  # (two slots idle: its team's quota holds it)
        assert "over its borrow limit of 0" in high.message, high.message
        (pause,) = pauses(w["wa"])
        drain(w["wb"])
        assert pause.checkpoint
        assert plane.get(low).preempted_by == high.job_id
        step(plane, w["wa"], low, 6, agreed=pause.seq)
        saved(plane, w["wa"], low, 2, 6)
        paused(plane, low, (w["wa"], w["wb"]), 6)
        got = launched(w, 2)
        placed = [(wid, job) for wid, job, _ in launched_jobs(got)]
        assert [job for _, job in placed] == [high.job_id] * 2
        s = plane.get(low)
        assert s.state == JobState.STANDBY and s.preempted_by == high.job_id and s.step == 6
        assert state_text(s).startswith(f"PREEMPTED (by {high.job_id}"), state_text(s)
        assert any("(priority 5 > 0, within team lab's quota)" in m for m in messages(plane, low))
        assert any(e.type == "preemption" and "within its team's quota" in e.message for e in plane.events(high.job_id))
        assert not [e for e in plane.events(low) if e.type == "fault"]
        # The high job finishes: the low one continues from its checkpoint by itself.
        for rank, (wid, _) in enumerate(placed):
            plane.rank_event(w[wid], high.job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=100))
        got = launched(w, 2)
        assert {(job, version) for _, job, version in launched_jobs(got)} == {(low, f"{low}:2")}
        # (its launches go out as the relaunch is placed, on another thread than this read: the
        # status that says PREEMPTED no more may come a moment after them; ci16 read it before)
        deadline = time.monotonic() + 10
        while plane.get(low).preempted_by:
            assert time.monotonic() < deadline, plane.get(low)
            time.sleep(0.02)
    finally:
        stop_plane(plane.c)


def test_within_a_team_nothing_is_preempted_unless_the_job_would_then_fit(tmp_path, store_with_no_versions):
    """Its team's low job would free its quota, but the cluster's slots are another team's
    higher-priority job's: nothing is preempted until that job ends."""
    book = QuotaBook({"lab": TeamQuota(nominal=2, hard_limit=2, cohort="lab")})
    plane = make_plane(tmp_path / "c.db", quotas=book)
    try:
        w = {n: plane.register(n) for n in ("wa", "wb", "wc", "wd")}
        low = running_job(plane, "low", "lab", (w["wa"],))
        other = running_job(plane, "other", "nlp", (w["wb"], w["wc"], w["wd"]), priority=9)
        high = submit(plane, "high", "lab", 2, priority=5)
        assert high.message.startswith("queued: team lab at its hard limit (1 of 2 slots held"), high.message
        time.sleep(0.3)
        assert pauses(*w.values()) == [] and plane.get(low).preempted_by == ""
        for rank, wid in enumerate(("wb", "wc", "wd")):  # it ends, its slots free up: now it would fit
            plane.rank_event(w[wid], other, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=100))
        settle(lambda: plane.get(low).preempted_by, high.job_id)
        # (the pause goes to the ranks once the decision's journal write committed: on its own thread)
        got: list = []
        settle(lambda: got.extend(p.checkpoint for p in pauses(w["wa"])) or got, [True])
    finally:
        stop_plane(plane.c)


def test_within_a_team_equal_priorities_and_preemptible_false_are_never_preempted(tmp_path, store_with_no_versions):
    book = QuotaBook({"lab": TeamQuota(nominal=2, hard_limit=2, cohort="lab")})
    plane = make_plane(tmp_path / "c.db", quotas=book)
    try:
        w = {n: plane.register(n) for n in ("wa", "wb", "wc", "wd")}
        keep = running_job(plane, "keep", "lab", (w["wa"],), extra="preemptible: false")
        same = running_job(plane, "same", "lab", (w["wb"],))
        equal = submit(plane, "equal", "lab", 1, priority=0)  # (equal priority: preempts nothing)
        assert equal.state == JobState.STANDBY
        time.sleep(0.3)
        assert pauses(*w.values()) == []
        high = submit(plane, "high", "lab", 1, priority=5)  # keep is not preemptible: same is the victim
        assert plane.get(same).preempted_by == high.job_id and plane.get(keep).preempted_by == ""
        assert [p.checkpoint for p in pauses(w["wb"])] == [True] and pauses(w["wa"]) == []
        said = [e.message for e in plane.events(high.job_id) if e.type == "preemption"]
        assert (
            len(said) == 1 and f"preempts {same} (priority 0): 1 slot(s) freed ({keep} is not preemptible)" in said[0]
        )
    finally:
        stop_plane(plane.c)


# ---------------------------------------------------------------- 2. reasons at every change


def test_a_drain_that_frees_nothing_decides_every_waiting_job_s_reason_and_place_again(plane):
    """Before: an offer with no free slot only replaced fair share's denominators; the queue
    kept saying "2 are free on 2 registered workers" after wb was drained."""
    a, b = plane.register("wa", slots=4), plane.register("wb", slots=2)
    r = submit(plane, "r", "lab", 4)
    assert r.state == JobState.WARMING_UP
    q = submit(plane, "q", "lab", 3)
    q2 = submit(plane, "q2", "vision", 3)  # (ahead of q in the fair order: vision holds nothing)
    was = "queued: needs 3 ranks (parallel.dp=3); 2 are free on 2 registered workers: waits for ranks to free up"
    assert q.message == q2.message == was
    plane.user(control_pb2.DrainWorkerRequest(worker_id="wb", deadline_seconds=60))
    now = "queued: needs 3 ranks (parallel.dp=3); 0 are free on 1 placeable of 2 registered workers (wb cordoned"
    settle(lambda: plane.get(q2.job_id).message.startswith(now), True)
    behind = f"waits behind job {q2.job_id}, first in line for slots to free up"
    settle(lambda: plane.get(q.job_id).message, f"queued: {behind}")
    queue = plane.user(control_pb2.TeamQuery()).queue
    assert [(j.job_id, j.position) for j in queue] == [(q2.job_id, 1), (q.job_id, 2)]
    assert queue[1].reason == behind
    drain(a), drain(b)


def test_the_jobs_behind_an_any_job_that_does_not_fit_get_their_reason_too(plane):
    """Before: the pass returned at the first ``any`` job that did not fit: the jobs behind it
    kept whatever reason they had (here, the one of their submit)."""
    plane.register("wa", slots=2)
    small = submit(plane, "small", "lab", 1)  # runs
    head = submit(plane, "head", "lab", 2)  # does not fit the one free slot
    tail = submit(plane, "tail", "lab", 1, priority=-1)  # behind head
    assert (small.state, head.state, tail.state) == (JobState.WARMING_UP, JobState.STANDBY, JobState.STANDBY)
    assert tail.message == "queued: waits for the jobs queued ahead of it"
    plane.user(  # a quota change (another team's): a pass
        control_pb2.SetTeamQuotaRequest(
            quota=control_pb2.TeamQuota(name="nlp", nominal=4, borrow_limit=-1, hard_limit=-1, weight=1.0)
        )
    )
    why = f"queued: waits behind job {head.job_id}, first in line for slots to free up"
    settle(lambda: plane.get(tail.job_id).message, why)
    assert [(j.job_id, j.position) for j in plane.user(control_pb2.TeamQuery()).queue] == [
        (head.job_id, 1),
        (tail.job_id, 2),
    ]


# ---------------------------------------------------------------- 3. borrowed slots derived


def test_a_job_s_borrowed_slots_follow_its_team_s_other_jobs(plane):
    """Before: recorded at a placement and a quota change only: when the team's first job
    ended, the second still said "(2 borrowed)" although the team was within its nominal."""
    w = plane.register("w", slots=4)
    plane.user(
        control_pb2.SetTeamQuotaRequest(
            quota=control_pb2.TeamQuota(name="lab", nominal=2, borrow_limit=-1, hard_limit=-1, weight=1.0)
        )
    )
    a = submit(plane, "a", "lab", 2)
    b = submit(plane, "b", "lab", 2)
    assert (a.borrowed_slots, b.borrowed_slots) == (0, 2)
    assert state_text(plane.get(b.job_id)) == "WARMING_UP (2 borrowed)"
    plane.user(control_pb2.StopJobRequest(job_id=a.job_id))
    settle(lambda: plane.get(b.job_id).borrowed_slots, 0)
    assert state_text(plane.get(b.job_id)) == "WARMING_UP"
    lab = next(t for t in plane.user(control_pb2.TeamQuery()).teams if t.name == "lab")
    assert (lab.used, lab.borrowed) == (2, 0)
    c = submit(plane, "c", "lab", 1, priority=5)  # higher priority: within the nominal, b borrows 1
    assert (c.borrowed_slots, plane.get(b.job_id).borrowed_slots) == (0, 1)
    drain(w)


# ---------------------------------------------------------------- 4. a shrunk any job


def test_a_shrunk_any_job_counts_against_the_kind_it_landed_on_only():
    """Before: once its size no longer matched its recorded placement it counted as ``any``
    (against both kinds) until placed again."""
    s = control_pb2.JobStatus(device="any", world_size=2, placed_by_kind=control_pb2.KindSlots(gpu=3))
    assert held_by_kind(s) == {"gpu": 2}
    s = control_pb2.JobStatus(device="any", world_size=3, placed_by_kind=control_pb2.KindSlots(gpu=2, cpu=2))
    assert held_by_kind(s) == {"gpu": 1, "cpu": 1, "any": 1}  # (one rank of either kind: not told apart)
    s = control_pb2.JobStatus(device="any", world_size=4, placed_by_kind=control_pb2.KindSlots(cpu=3))
    assert held_by_kind(s) == {"cpu": 3, "any": 1}  # (grown, the new rank not placed yet)


def test_a_rebuild_counts_a_rank_on_a_worker_gone_meanwhile_as_the_kind_it_was_placed_on(plane):
    """Before: such a rank counted as cpu, so an ``any`` job on three GPUs shrunk to two while
    a second GPU node was gone reported 1 gpu + 1 cpu: its team counted in both kinds."""
    sessions = {w: plane.register(w, cuda=1) for w in ("wa", "wb", "wc")}
    spec = parse_job_spec(spec_yaml(name="j", dp=3))
    bus = plane.c.bus
    ready = bus.command(
        Module.L1_ORCHESTRATOR,
        Module.L1_RESOURCE_ALLOCATOR,
        control_pb2.AllocateResources(
            job_id="j-1", world_size=3, init=engine_pb2.InitJob(job_id="j-1", spec_json=spec_to_json(spec))
        ),
    ).message
    assert (ready.placed.gpu, ready.placed.cpu) == (3, 0)
    plane.c.sessions.close(sessions["wb"])  # rank 1's node gone (its loss not the one reported)
    rebuilt = bus.command(
        Module.L1_RECOVERY_CONTROLLER,
        Module.L1_RESOURCE_ALLOCATOR,
        control_pb2.RebuildCommunicator(
            job_id="j-1",
            in_place=True,
            lost_ranks=[2],
            layout=engine_pb2.DataParallelLayout(dp=2, micro_batch_size=1, grad_accum=2),
            reason="shrink",
        ),
    ).message
    assert isinstance(rebuilt, control_pb2.ResourcesReady), rebuilt
    assert (rebuilt.world_size, rebuilt.placed.gpu, rebuilt.placed.cpu) == (2, 2, 0)
