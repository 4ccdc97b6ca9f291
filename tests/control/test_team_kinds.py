"""Quotas per device kind in control (issue 30 item 1), in-process on the real bus: a job says
its kind (``parallel.device``), the allocator places it on slots of that kind only, and its
team's quota counts it per (team, kind): a gpu quota full while cpu is free, borrowing and
lending per kind, a per-kind hard limit on an idle cluster, an int quota (an old file) still
bounding every kind together, and the spec's contradictions refused in one line."""

from __future__ import annotations

import pytest

from services.contract import control_pb2
from services.control.orchestrator.refusals import BeyondHardLimit
from services.control.scheduler import QuotaBook, Running, TeamQuota, reclaim_victims
from services.control.scheduler.quotas import parse_quota_text
from services.jobspec import JobSpecError, parse_job_spec

from .conftest import Plane, drain, spec_yaml

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)
U = -1  # a bound's wire form of "none"


def set_team(plane: Plane, name: str, **fields) -> control_pb2.TeamList:
    """``fields``: ints (every kind) or dicts per kind (``nominal={"gpu": 2}``: a kind left out
    owns none / has no limit, as the quota file reads it)."""
    q = control_pb2.TeamQuota(name=name, nominal=U, borrow_limit=U, hard_limit=U, weight=1.0, cohort="default")
    for field, value in fields.items():
        if isinstance(value, dict):
            missing = 0 if field == "nominal" else U
            by_kind = getattr(q, f"{field}_by_kind")
            by_kind.gpu, by_kind.cpu = value.get("gpu", missing), value.get("cpu", missing)
        else:
            setattr(q, field, value)
    return plane.user(control_pb2.SetTeamQuotaRequest(quota=q))


def submit(plane: Plane, name: str, team: str, device: str, dp: int = 1) -> control_pb2.JobStatus:
    text = spec_yaml(name=name, dp=dp, extra=f"team: {team}").replace(
        "threads_per_rank: 1}", f"threads_per_rank: 1, device: {device}}}"
    )
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml"))


def devices(session) -> dict[str, list[str]]:
    """job id -> the devices its launched ranks got on ``session``'s worker."""
    out: dict[str, list[str]] = {}
    for c in drain(session):
        if c.WhichOneof("command") == "launch":
            out.setdefault(c.launch.job_id, []).extend(r.device for r in c.launch.ranks)
    return out


def teams(plane: Plane) -> dict[str, control_pb2.TeamQuota]:
    return {t.name: t for t in plane.user(control_pb2.TeamQuery()).teams}


def test_a_gpu_quota_full_while_cpu_is_free_a_cpu_job_runs_and_a_gpu_job_waits_saying_why(plane):
    w = plane.register("w", slots=8, cuda=4)  # 4 GPUs, 4 CPU slots
    set_team(plane, "vision", hard_limit={"gpu": 2})
    g1 = submit(plane, "g1", "vision", "gpu", dp=2)
    g2 = submit(plane, "g2", "vision", "gpu", dp=1)  # 2 GPUs idle, but its gpu limit is full
    c1 = submit(plane, "c1", "vision", "cpu", dp=3)  # cpu: no limit, free slots of its kind
    assert (g1.state, g2.state, c1.state) == (JobState.WARMING_UP, JobState.STANDBY, JobState.WARMING_UP)
    assert g2.message == "queued: team vision at its gpu hard limit (2 of 2 gpu slots held, this job needs 1)"
    placed = devices(w)
    assert placed == {g1.job_id: ["cuda:0", "cuda:1"], c1.job_id: ["cpu", "cpu", "cpu"]}
    t = teams(plane)["vision"]
    assert (t.used, t.used_by_kind.gpu, t.used_by_kind.cpu, t.hard_limit_by_kind.gpu) == (5, 2, 3, 2)
    assert t.hard_limit_by_kind.cpu == U and t.HasField("hard_limit_by_kind") and not t.HasField("nominal_by_kind")
    queue = plane.user(control_pb2.TeamQuery()).queue
    assert [(q.job_id, q.device) for q in queue] == [(g2.job_id, "gpu")]
    # Another team's gpu job that does not fit the 2 free GPUs waits for GPUs only: a cpu job
    # submitted after it still takes the free CPU slot (no gang wait across kinds).
    big = submit(plane, "big", "nlp", "gpu", dp=3)
    assert big.state == JobState.STANDBY and "1 gpu slot is free" not in big.message
    assert "2 gpu slots are free" in big.message, big.message
    c2 = submit(plane, "c2", "nlp", "cpu", dp=1)
    assert c2.state == JobState.WARMING_UP and devices(w) == {c2.job_id: ["cpu"]}


def test_a_per_kind_hard_limit_holds_on_an_idle_cluster_and_an_any_job_is_refused(plane):
    w = plane.register("w", slots=8, cuda=4)
    set_team(plane, "vision", hard_limit={"gpu": 1})
    with pytest.raises(
        BeyondHardLimit, match=r"^job.yaml: team: needs 2 gpu slots; team vision may hold at most 1 \(hard_limit.gpu\)$"
    ):
        submit(plane, "wide", "vision", "gpu", dp=2)
    with pytest.raises(BeyondHardLimit, match=r"^job.yaml: team: team vision's quota is per device kind: .*not any$"):
        submit(plane, "vague", "vision", "any", dp=1)
    a = submit(plane, "a", "vision", "gpu")
    b = submit(plane, "b", "vision", "gpu")  # 3 GPUs idle: still never beyond 1
    c = submit(plane, "c", "vision", "cpu", dp=4)  # no cpu limit: every CPU slot
    assert (a.state, b.state, c.state) == (JobState.WARMING_UP, JobState.STANDBY, JobState.WARMING_UP)
    assert b.message == "queued: team vision at its gpu hard limit (1 of 1 gpu slots held, this job needs 1)"
    assert {j: len(d) for j, d in devices(w).items()} == {a.job_id: 1, c.job_id: 4}
    assert {j.name for j in plane.user(control_pb2.JobQuery()).jobs} == {"a", "b", "c"}  # nothing of the refused


def test_a_team_borrows_its_cohort_s_idle_nominal_per_kind_and_reclaim_names_the_borrower_of_that_kind(plane):
    w = plane.register("w", slots=8, cuda=4)
    set_team(plane, "vision", nominal={"gpu": 2}, borrow_limit={"cpu": 2}, cohort="research")
    set_team(plane, "nlp", nominal={"gpu": 2, "cpu": 4}, cohort="research")
    g = submit(plane, "g", "vision", "gpu", dp=2)  # its own gpu nominal
    c = submit(plane, "c", "vision", "cpu", dp=2)  # owns no cpu: borrows 2 of nlp's idle 4
    assert (g.state, g.borrowed_slots, c.state, c.borrowed_slots) == (JobState.WARMING_UP, 0, JobState.WARMING_UP, 2)
    c3 = submit(plane, "c3", "vision", "cpu", dp=1)  # 3 borrowed cpu > its cpu borrow limit 2
    assert c3.message == (
        "queued: team vision beyond its cpu nominal 0 would borrow 3 cpu slots, over its borrow limit of 2"
    )
    g3 = submit(plane, "g3", "vision", "gpu", dp=2)  # borrows nlp's 2 idle gpu (no gpu borrow limit)
    assert (g3.state, g3.borrowed_slots) == (JobState.WARMING_UP, 2)
    g4 = submit(plane, "g4", "vision", "gpu", dp=1)  # the cohort's gpu nominal is all in use
    assert g4.message == (
        "queued: team vision beyond its gpu nominal 2 (4 held) and cohort research has 0 idle nominal gpu slots "
        "to lend, this job needs 1"
    )
    t = teams(plane)
    assert (t["vision"].borrowed_by_kind.gpu, t["vision"].borrowed_by_kind.cpu, t["vision"].borrowed) == (2, 2, 4)
    # nlp claims its cpu nominal back: the borrower of cpu is named, never the gpu borrower.
    running = [
        Running(s.job_id, s.team, s.world_size, s.priority, s.created_unix, s.borrowed_slots, s.device)
        for s in plane.user(control_pb2.JobQuery()).jobs
        if s.state == JobState.WARMING_UP
    ]
    book = QuotaBook(
        {
            "vision": TeamQuota(nominal={"gpu": 2}, borrow_limit={"cpu": 2}, cohort="research"),
            "nlp": TeamQuota(nominal={"gpu": 2, "cpu": 4}, cohort="research"),
        }
    )
    usage = {"vision": {"gpu": 4, "cpu": 2}}
    assert reclaim_victims(book, usage, "nlp", 4, 2, running, "cpu") == [c.job_id]
    assert reclaim_victims(book, usage, "nlp", 2, 0, running, "gpu") == [g3.job_id]
    assert sorted(devices(w)) == sorted([g.job_id, c.job_id, g3.job_id])


def test_an_int_quota_of_an_old_file_bounds_every_kind_together(plane, tmp_path):
    book = parse_quota_text("teams:\n  vision: {nominal: 2, hard_limit: 2}\n")  # (a file of before kinds)
    assert book.get("vision") == TeamQuota(nominal=2, hard_limit=2) and not book.get("vision").per_kind
    w = plane.register("w", slots=8, cuda=4)
    set_team(plane, "vision", nominal=2, hard_limit=2)
    a = submit(plane, "a", "vision", "gpu")
    b = submit(plane, "b", "vision", "cpu")
    c = submit(plane, "c", "vision", "cpu")
    d = submit(plane, "d", "vision", "any")  # (an int quota takes any job, counted alike)
    assert (a.state, b.state, c.state, d.state) == (JobState.WARMING_UP, JobState.WARMING_UP) + (JobState.STANDBY,) * 2
    assert c.message == "queued: team vision at its hard limit (2 of 2 slots held, this job needs 1)"
    assert devices(w) == {a.job_id: ["cuda:0"], b.job_id: ["cpu"]}


def test_the_spec_s_device_and_backend_contradiction_is_one_line():
    text = spec_yaml(backend="nccl").replace("threads_per_rank: 1}", "threads_per_rank: 1, device: cpu}")
    with pytest.raises(JobSpecError, match=r"^job.yaml: parallel.device: cpu contradicts parallel.backend nccl"):
        parse_job_spec(text, "job.yaml")
    with pytest.raises(JobSpecError, match=r"^job.yaml: parallel.device: Input should be 'any', 'gpu' or 'cpu'"):
        parse_job_spec(spec_yaml().replace("threads_per_rank: 1}", "threads_per_rank: 1, device: tpu}"), "job.yaml")
    assert parse_job_spec(spec_yaml(backend="nccl"), "job.yaml").parallel.device_kind == "gpu"
    assert parse_job_spec(spec_yaml(), "job.yaml").parallel.device_kind == "any"


def test_per_kind_quotas_are_journaled_and_an_old_journal_s_int_quota_loads(tmp_path, store_with_no_versions):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    from .conftest import stop_plane

    db = tmp_path / "control.db"
    old = JobStore(db)
    old.save_team_quota("nlp", {"nominal": 3, "borrow_limit": None, "hard_limit": 5, "weight": 2.0, "cohort": "x"})
    old.close()  # (the JSON a control of before device kinds journaled)

    def start():
        return build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0)

    control = start()
    try:
        plane = Plane(control)
        set_team(plane, "vision", nominal={"gpu": 16, "cpu": 64}, hard_limit={"gpu": 24})
        queued = submit(plane, "q", "vision", "gpu", dp=2)  # no worker: queued
    finally:
        stop_plane(control)
    control = start()
    try:
        plane = Plane(control)
        t = teams(plane)
        v, n = t["vision"], t["nlp"]
        assert (v.nominal_by_kind.gpu, v.nominal_by_kind.cpu, v.hard_limit_by_kind.gpu, v.hard_limit_by_kind.cpu) == (
            16,
            64,
            24,
            U,
        )
        assert not v.HasField("borrow_limit_by_kind") and v.borrow_limit == U
        assert (n.nominal, n.hard_limit, n.weight, n.cohort, n.HasField("nominal_by_kind")) == (3, 5, 2.0, "x", False)
        assert [(q.job_id, q.device) for q in plane.user(control_pb2.TeamQuery()).queue] == [(queued.job_id, "gpu")]
        w = plane.register("w", slots=4, cuda=2)  # (its registration says the slots per kind)
        listed = plane.user(control_pb2.TeamQuery())
        assert (listed.cluster_slots, listed.cluster_by_kind.gpu, listed.cluster_by_kind.cpu) == (4, 2, 2)
        from .conftest import settle

        settle(lambda: plane.get(queued.job_id).state, JobState.WARMING_UP)
        assert devices(w) == {queued.job_id: ["cuda:0", "cuda:1"]}
    finally:
        stop_plane(control)


def test_a_gpu_job_on_a_cluster_without_gpus_waits_for_workers_and_holds_no_cpu_job_back(plane):
    w = plane.register("w", slots=4)  # CPU slots only
    g = submit(plane, "g", "vision", "gpu", dp=1)
    assert g.state == JobState.STANDBY, g
    assert g.message.endswith(
        "no node with a GPU is registered: can never run as things stand; waits for one to join"
    ), g.message
    c = submit(plane, "c", "vision", "cpu", dp=2)
    assert c.state == JobState.WARMING_UP and devices(w) == {c.job_id: ["cpu", "cpu"]}
    v = plane.register("v", slots=2, cuda=2)  # a GPU node joins: the gpu job starts there
    from .conftest import settle

    settle(lambda: plane.get(g.job_id).state, JobState.WARMING_UP)
    assert devices(v) == {g.job_id: ["cuda:0"]}


def test_the_queue_walk_passes_a_gpu_job_waiting_for_gpus_to_start_a_cpu_job_and_holds_any_jobs_behind_it(plane):
    from .conftest import settle

    w = plane.register("w", slots=3, cuda=2)  # 2 GPUs, 1 CPU slot
    a = submit(plane, "a", "default", "gpu", dp=2)
    g = submit(plane, "g", "default", "gpu", dp=1)  # no GPU free
    c = submit(plane, "c", "default", "cpu", dp=2)  # 1 CPU slot free: waits too
    x = submit(plane, "x", "default", "any", dp=1)  # behind g (it could take a GPU)
    assert [s.state for s in (a, g, c, x)] == [JobState.WARMING_UP] + [JobState.STANDBY] * 3
    assert devices(w) == {a.job_id: ["cuda:0", "cuda:1"]}
    v = plane.register("v", slots=1)  # one more CPU slot: c fits now, g still does not
    settle(lambda: plane.get(c.job_id).state, JobState.WARMING_UP)
    assert plane.get(g.job_id).state == JobState.STANDBY
    assert sorted(devices(w).get(c.job_id, []) + devices(v).get(c.job_id, [])) == ["cpu", "cpu"]
    settle(
        lambda: plane.get(x.job_id).message,
        f"queued: waits behind job {g.job_id}, first in line for gpu slots to free up",
    )
