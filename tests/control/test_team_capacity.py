"""Issue 30's remaining gaps in control (session 31), in-process on the real bus and sessions:
the placeable capacity per device kind follows every change of it (one place derives it: the
allocator's offer); the kind an ``any`` job landed on is recorded at each placement, journaled,
and its team counted there only; the starvation bound set by command and a promotion said in
the queue; a requeued job's earlier wait kept; the borrowed ranks after a quota is lowered; a
gpu job on a cluster without GPUs says so."""

from __future__ import annotations

import time

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.scheduler import QuotaBook, QuotaFileError, TeamQuota

from .conftest import Plane, drain, launched, registration, settle, spec_yaml, stop_plane
from .test_preemption import make_plane, paused, saved, started, step, to_ranks

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)
U = -1


def submit(plane: Plane, name: str, team: str = "default", device: str = "any", dp: int = 1, priority: int = 0):
    text = spec_yaml(name=name, dp=dp, steps=100, extra=f"team: {team}").replace(
        "threads_per_rank: 1}", f"threads_per_rank: 1, device: {device}}}"
    )
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml", priority=priority))


def cluster(plane: Plane) -> tuple[int, int]:
    c = plane.user(control_pb2.TeamQuery()).cluster_by_kind
    return c.gpu, c.cpu


def fault(plane: Plane, worker_id: str, fault_class: str, cleared: bool = False) -> None:
    """A worker's own fault as L1-3 reports it (no job): a device error cordons, a silent agent holds."""
    plane.c.bus.publish(
        Module.L1_FAULT_DETECTOR,
        control_pb2.FaultReport(
            worker_id=worker_id, fault_class=fault_class, detail=f"{fault_class} on {worker_id}", cleared=cleared
        ),
    )


# ---------------------------------------------------------------- 1. capacity per kind


def test_the_capacity_per_kind_follows_every_change_of_the_placeable_slots(tmp_path, store_with_no_versions):
    """Before: refreshed at a registration and a hold's lift only, so a lost, cordoned,
    quarantined, drained, held or departing node stayed in fair share's denominators."""
    plane = Plane(build(JobStore(tmp_path / "c.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        g = plane.register("g", slots=4, cuda=2)  # 2 gpu + 2 cpu
        c = plane.register("c", slots=4)  # 4 cpu
        assert cluster(plane) == (2, 6)
        plane.user(control_pb2.DrainWorkerRequest(worker_id="c", deadline_seconds=60))  # drained (a cordon)
        assert cluster(plane) == (2, 2)
        plane.user(control_pb2.UncordonWorkerRequest(worker_id="c"))
        assert cluster(plane) == (2, 6)
        fault(plane, "g", "device_error")  # a device's fatal error: cordoned
        assert cluster(plane) == (0, 4)
        plane.user(control_pb2.UncordonWorkerRequest(worker_id="g"))
        assert cluster(plane) == (2, 6)
        plane.c.bus.publish(  # a sick node (L1-3's backlog): quarantined
            Module.L1_FAULT_DETECTOR, control_pb2.FaultBacklogAlert(worker_id="g", detail="3 faults in 60 s")
        )
        assert cluster(plane) == (0, 4)
        plane.user(control_pb2.UncordonWorkerRequest(worker_id="g"))
        fault(plane, "c", "agent_silent")  # its agent silent: held (a node declared dead to placement)
        assert cluster(plane) == (2, 2)
        fault(plane, "c", "agent_silent", cleared=True)
        assert cluster(plane) == (2, 6)
        leaving = registration("c", 4)
        leaving.departing = True
        plane.c.sessions.on_worker_event(c, control_pb2.WorkerEvent(register=leaving))
        assert cluster(plane) == (2, 2)  # (its agent is leaving)
        plane.c.sessions.close(c)  # its session ends: the worker is gone
        assert cluster(plane) == (2, 2)
        plane.c.sessions.close(g)  # lost
        assert cluster(plane) == (0, 0)
        plane.register("g", slots=4, cuda=4)  # back with other devices
        assert cluster(plane) == (4, 0)
        fault(plane, "g", "device_error")
        assert cluster(plane) == (0, 0)
    finally:
        stop_plane(plane.c)
    # A restart: the journaled cordon is commanded again and the registrations offer the rest.
    plane = Plane(build(JobStore(tmp_path / "c.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        plane.register("g", slots=4, cuda=4)  # (the same incarnation: still cordoned)
        plane.register("c", slots=2)
        assert cluster(plane) == (0, 2)
    finally:
        stop_plane(plane.c)


def test_an_older_offer_arriving_late_is_not_applied(plane):
    plane.register("w", slots=4, cuda=2)
    newest = plane.user(control_pb2.TeamQuery())
    stale = control_pb2.ResourcesReady(free_ranks=9, gpu_slots=9, cpu_slots=9, offer=1)
    plane.c.bus.publish(Module.L1_RESOURCE_ALLOCATOR, stale)
    assert cluster(plane) == (newest.cluster_by_kind.gpu, newest.cluster_by_kind.cpu) == (2, 2)


# ---------------------------------------------------------------- 2. the kind an any job landed on


def test_an_any_job_s_landed_kind_is_recorded_counted_shown_and_kept_across_a_restart(tmp_path, store_with_no_versions):
    from services.cli.render import state_text

    db = tmp_path / "c.db"
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        w = plane.register("w", slots=4, cuda=2)
        a = submit(plane, "a", "lab", "any", dp=2)  # (CUDA slots first)
        assert a.state == JobState.WARMING_UP
        assert (a.placed_by_kind.gpu, a.placed_by_kind.cpu) == (2, 0)
        started(plane, a.job_id, (w, w))
        s = plane.get(a.job_id)
        assert state_text(s) == "RUNNING (any: on gpu)"
        lab = next(t for t in plane.user(control_pb2.TeamQuery()).teams if t.name == "lab")
        assert (lab.used, lab.used_by_kind.gpu, lab.used_by_kind.cpu) == (2, 2, 0)  # (before: in neither kind)
        drain(w)
    finally:
        stop_plane(plane.c)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        s = plane.get(a.job_id)
        assert (s.placed_by_kind.gpu, s.placed_by_kind.cpu) == (2, 0)  # (journaled with the status)
    finally:
        stop_plane(plane.c)


def test_a_gpu_job_preempts_an_any_job_that_landed_on_gpus_which_then_lands_on_cpus(tmp_path, store_with_no_versions):
    """Before: an ``any`` job counted as either kind, so a gpu head found no victim in it (its
    slots "may be of either kind") and waited for it to end."""
    from services.cli.render import state_text

    plane = make_plane(tmp_path / "c.db")
    try:
        a, b = plane.register("wa", cuda=1), plane.register("wb", cuda=1)
        low = submit(plane, "low", dp=2).job_id
        assert plane.get(low).placed_by_kind.gpu == 2
        started(plane, low, (a, b))
        drain(a), drain(b)
        step(plane, a, low, 4)
        saved(plane, a, low, 1, 4)
        high = submit(plane, "high", device="gpu", dp=2, priority=5).job_id
        (cmd,) = drain(a)
        drain(b)
        pause = to_ranks(cmd)
        assert type(pause) is engine_pb2.PauseTraining and pause.checkpoint
        assert plane.get(low).preempted_by == high
        step(plane, a, low, 6, agreed=pause.seq)
        saved(plane, a, low, 2, 6)
        paused(plane, low, (a, b), 6)
        launched({"wa": a, "wb": b}, 2)  # the gpu job on the two GPUs
        s = plane.get(low)
        assert s.state == JobState.STANDBY and state_text(s).startswith("PREEMPTED")
        c = plane.register("wc", slots=2)  # CPU slots join: the any job goes on there
        got = launched({"wc": c}, 1)
        assert [r.device for cmd in got["wc"] if cmd.WhichOneof("command") == "launch" for r in cmd.launch.ranks] == [
            "cpu",
            "cpu",
        ]
        s = settle(lambda: plane.get(low).state, JobState.WARMING_UP) and plane.get(low)
        assert (s.placed_by_kind.gpu, s.placed_by_kind.cpu) == (0, 2)
        assert state_text(s) == "WARMING_UP"  # (on CPU slots only: nothing to tell)
        t = next(t for t in plane.user(control_pb2.TeamQuery()).teams if t.name == "default")
        assert (t.used_by_kind.gpu, t.used_by_kind.cpu) == (2, 2)
    finally:
        stop_plane(plane.c)


# ---------------------------------------------------------------- 3. the starvation bound by command


def test_the_starvation_bound_is_set_by_command_journaled_and_refused_out_of_range(tmp_path, store_with_no_versions):
    db = tmp_path / "c.db"
    book = QuotaBook(max_wait_s=120 * 60.0)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=book))
    try:
        assert plane.user(control_pb2.TeamQuery()).max_wait_minutes == 120
        listed = plane.user(control_pb2.SetTeamQuotaRequest(set_max_wait=True, max_wait_minutes=45))
        assert listed.max_wait_minutes == 45
        for bad in (0, -2, float("nan"), 2e6):
            with pytest.raises(QuotaFileError, match=r"^surgectl team set: max_wait_minutes: must be > 0 and"):
                plane.user(control_pb2.SetTeamQuotaRequest(set_max_wait=True, max_wait_minutes=bad))
    finally:
        stop_plane(plane.c)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=book))
    try:
        assert plane.user(control_pb2.TeamQuery()).max_wait_minutes == 45  # (the command's, over the file's)
        listed = plane.user(control_pb2.SetTeamQuotaRequest(set_max_wait=True, max_wait_minutes=-1))
        assert listed.max_wait_minutes == U
    finally:
        stop_plane(plane.c)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=book))
    try:
        assert plane.user(control_pb2.TeamQuery()).max_wait_minutes == U
    finally:
        stop_plane(plane.c)


def test_a_promoted_job_moves_up_when_it_reaches_the_bound_and_the_queue_says_why(tmp_path, store_with_no_versions):
    """Before: the order changed only at the next change of the queue, and its reason never
    said that the bound promoted it. Here no other event comes: the pass armed for the bound."""
    book = QuotaBook({"busy": TeamQuota(weight=4), "lab": TeamQuota(weight=1)})
    plane = Plane(
        build(JobStore(tmp_path / "c.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0, quotas=book)
    )
    try:
        # 3 s: the first order is read before it (a loaded host's submits take far less)
        plane.user(control_pb2.SetTeamQuotaRequest(set_max_wait=True, max_wait_minutes=0.05))
        plane.register("w", slots=4)
        submit(plane, "r", "busy", dp=4)
        big = submit(plane, "big", "lab", dp=4)
        s1 = submit(plane, "s1", "busy", dp=1)
        first = plane.user(control_pb2.TeamQuery()).queue
        assert [(q.job_id, q.promoted) for q in first] == [(s1.job_id, False), (big.job_id, False)]
        settle(lambda: [q.job_id for q in plane.user(control_pb2.TeamQuery()).queue], [big.job_id, s1.job_id], 60)
        q = (
            settle(lambda: plane.user(control_pb2.TeamQuery()).queue[0].promoted, True)
            and (plane.user(control_pb2.TeamQuery()).queue[0])
        )
        assert q.reason.startswith("promoted: waited 0h00m > 0.05 min starvation bound; "), q.reason
        assert plane.get(big.job_id).message.startswith("queued: promoted by the 0.05 min starvation bound; ")
        assert any("promoted by the 0.05 min starvation bound" in e.message for e in plane.events(big.job_id))
    finally:
        stop_plane(plane.c)


# ---------------------------------------------------------------- 4. a requeued job's wait


def test_a_preempted_job_keeps_its_earlier_wait_for_the_starvation_bound(tmp_path, store_with_no_versions):
    """Before: a preempted job's wait started again at zero (``queued_unix`` reset): one
    preempted after each short run never reached the bound."""
    plane = make_plane(tmp_path / "c.db")
    try:
        low = submit(plane, "low", dp=2).job_id  # no worker yet: it waits
        queued = plane.get(low).queued_unix
        while time.time() < queued + 0.5:  # (its first wait: at least 0.5 s, by the clock)
            time.sleep(0.05)
        a, b = plane.register("wa"), plane.register("wb")
        s = settle(lambda: plane.get(low).state, JobState.WARMING_UP) and plane.get(low)
        first = s.waited_seconds
        assert first >= 0.5, s
        started(plane, low, (a, b))
        drain(a), drain(b)
        step(plane, a, low, 4)
        saved(plane, a, low, 1, 4)
        high = submit(plane, "high", dp=2, priority=5).job_id
        (cmd,) = drain(a)
        drain(b)
        step(plane, a, low, 6, agreed=to_ranks(cmd).seq)
        saved(plane, a, low, 2, 6)
        paused(plane, low, (a, b), 6)
        launched({"wa": a, "wb": b}, 2)
        s = plane.get(low)
        assert s.state == JobState.STANDBY and s.preempted_by == high and s.waited_seconds == first
        # (the queue's view is published after the states: high's start may not be in it yet, CI ci4)
        settle(lambda: [e.job_id for e in plane.user(control_pb2.TeamQuery()).queue], [low], timeout_s=30.0)
        (q,) = plane.user(control_pb2.TeamQuery()).queue
        assert q.job_id == low and q.waiting_seconds >= first  # (its first wait and this one)
        waiting = plane.c.orchestrator._waiting_of(plane.c.orchestrator._jobs[low].queued)
        assert waiting.queued <= s.queued_unix - first  # (the bound counts from an entry moved back by it)
    finally:
        stop_plane(plane.c)


# ---------------------------------------------------------------- 5. a fresh user's findings


def test_status_says_borrowed_once_a_quota_is_lowered_below_what_the_team_holds(plane):
    from services.cli.render import state_text

    w = plane.register("w", slots=4)
    a = submit(plane, "a", "lab", dp=3)
    started(plane, a.job_id, (w, w, w))
    assert plane.get(a.job_id).borrowed_slots == 0
    q = control_pb2.TeamQuota(name="lab", nominal=1, borrow_limit=U, hard_limit=1, weight=1.0, cohort="default")
    plane.user(control_pb2.SetTeamQuotaRequest(quota=q))
    s = plane.get(a.job_id)
    assert s.borrowed_slots == 2 and state_text(s) == "RUNNING (2 borrowed)"
    lab = next(t for t in plane.user(control_pb2.TeamQuery()).teams if t.name == "lab")
    assert (lab.used, lab.borrowed) == (3, 2)
    q.nominal = q.hard_limit = U
    plane.user(control_pb2.SetTeamQuotaRequest(quota=q))
    assert plane.get(a.job_id).borrowed_slots == 0


def test_a_gpu_job_on_a_cluster_without_gpus_says_no_node_has_a_gpu(plane):
    plane.register("w", slots=4)
    g = submit(plane, "g", "lab", "gpu", dp=1)
    assert g.state == JobState.STANDBY
    assert g.message == (
        "queued: needs 1 rank (parallel.dp=1) on gpu: no node with a GPU is registered: can never run as "
        "things stand; waits for one to join"
    )
    (q,) = plane.user(control_pb2.TeamQuery()).queue
    assert q.reason == g.message.removeprefix("queued: ")
