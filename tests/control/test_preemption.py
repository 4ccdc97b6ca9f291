"""Priority preemption (issue 30 item 2), in-process through the real bus and sessions: a
higher-priority job that does not fit makes a lower one checkpoint at an agreed boundary and
yield its slots; the victim waits PREEMPTED (STANDBY, preempted_by) at its priority and
continues from that checkpoint by itself when the slots return, no fault, budgets kept. The
minimum run time, the grace period, an operator stop, and a control restart mid-preemption.
Gang admission: two simultaneous submits that together do not fit, 20 times."""

from __future__ import annotations

import threading
import time

import pytest

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.jobspec import parse_job_spec, spec_to_json

from .conftest import Plane, drain, launched, settle, spec_yaml, stop_plane, to_ranks

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def make_plane(db, **kw) -> Plane:
    kw.setdefault("preemption_min_run_s", 0.0)
    return Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0, **kw))


@pytest.fixture
def preempt_plane(tmp_path, store_with_no_versions):
    plane = make_plane(tmp_path / "control.db")
    yield plane
    stop_plane(plane.c)


def submit(plane: Plane, name: str, priority: int = 0, dp: int = 2, extra: str = "") -> control_pb2.JobStatus:
    text = spec_yaml(name=name, dp=dp, steps=100, extra=extra)
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml", priority=priority))


def started(plane: Plane, job_id: str, sessions) -> None:
    for rank, session in enumerate(sessions):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))


def step(plane: Plane, session, job_id: str, n: int, agreed: int = 0) -> None:
    plane.rank_event(
        session, job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64, commands_agreed=agreed)
    )


def saved(plane: Plane, session, job_id: str, version: int, at: int) -> None:
    plane.rank_event(
        session, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:{version}", step=at, seconds=0.2)
    )


def paused(plane: Plane, job_id: str, sessions, at: int) -> None:
    for rank, session in enumerate(sessions):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=at))


def launched_jobs(got: dict[str, list]) -> list[tuple[str, str, str]]:
    return sorted(
        (w, c.launch.init.job_id, c.launch.init.resume_version)
        for w, cmds in got.items()
        for c in cmds
        if c.WhichOneof("command") == "launch"
    )


def messages(plane: Plane, job_id: str) -> list[str]:
    return [e.message for e in plane.events(job_id)]


def free_slots(plane: Plane) -> int:
    """The allocator's free slots, asked as L1-1 asks (a placement too large to fit: refused)."""
    reply = plane.c.bus.command(
        Module.L1_ORCHESTRATOR,
        Module.L1_RESOURCE_ALLOCATOR,
        control_pb2.AllocateResources(
            job_id="probe",
            world_size=99,
            backend="auto",
            init=engine_pb2.InitJob(spec_json=spec_to_json(parse_job_spec(spec_yaml(name="probe", dp=1), "p.yaml"))),
        ),
    ).message
    assert isinstance(reply, control_pb2.ResourcesInsufficient), reply
    return reply.available_ranks


def low_running(plane: Plane):
    """A low-priority dp-2 job RUNNING on wa and wb (the whole cluster), checkpointed at step 4."""
    a, b = plane.register("wa"), plane.register("wb")
    low = submit(plane, "low").job_id
    started(plane, low, (a, b))
    drain(a), drain(b)
    step(plane, a, low, 4)
    saved(plane, a, low, 1, 4)
    step(plane, a, low, 6)
    assert plane.get(low).state == JobState.RUNNING
    return low, a, b


def preempt_to_the_boundary(plane: Plane, low: str, a, b, at: int = 8) -> str:
    """A priority-5 job is submitted; the low job's ranks agree on the preemption's boundary
    ``at``, checkpoint it (version 2) and pause. Returns the high job's id."""
    high = submit(plane, "high", priority=5)
    assert high.state == JobState.STANDBY
    (cmd,) = drain(a)
    drain(b)
    pause = to_ranks(cmd)
    assert type(pause) is engine_pb2.PauseTraining and pause.checkpoint
    s = plane.get(low)
    assert s.state == JobState.RUNNING and s.preempted_by == high.job_id
    step(plane, a, low, at, agreed=pause.seq)
    saved(plane, a, low, 2, at)
    paused(plane, low, (a, b), at)
    return high.job_id


def test_a_higher_priority_job_preempts_a_lower_one_which_comes_back_from_its_checkpoint(preempt_plane):
    plane = preempt_plane
    low, a, b = low_running(plane)
    high = preempt_to_the_boundary(plane, low, a, b, at=8)
    got = launched({"wa": a, "wb": b}, 2)
    assert launched_jobs(got) == [("wa", high, ""), ("wb", high, "")]
    s = plane.get(low)
    assert s.state == JobState.STANDBY and s.preempted_by == high and s.step == 8
    assert s.message.startswith(f"queued: PREEMPTED by job {high}"), s.message
    assert (
        f"PREEMPTED by job {high} at step 8: continues from {low}:2 when capacity returns" in messages(plane, low)[-3]
    )
    assert s.outcome == control_pb2.OUTCOME_UNSPECIFIED  # (not FAILED)
    assert plane.user(control_pb2.JobQuery(job_id=low)).queue_position == 1
    # The high job runs and finishes; the slots return and the low job continues by itself.
    started(plane, high, (a, b))
    for rank, session in enumerate((a, b)):
        plane.rank_event(session, high, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=100))
    got = launched({"wa": a, "wb": b}, 2)
    assert launched_jobs(got) == [("wa", low, f"{low}:2"), ("wb", low, f"{low}:2")]
    s = plane.get(low)
    assert s.state == JobState.WARMING_UP and s.preempted_by == "" and s.step == 8
    text = messages(plane, low)
    assert any(m.startswith(f"preempted by job {high} (priority 5 > 0): checkpoint at the next step") for m in text)
    assert any("restart budgets kept" in m for m in text), text
    assert not [e for e in plane.events(low) if e.type == "fault"]
    assert any(e.type == "preemption" and f"preempts {low} (priority 0)" in e.message for e in plane.events(high))


def test_a_preempted_job_keeps_its_place_ahead_of_an_equal_priority_job_submitted_after_it(preempt_plane):
    # (session 35's trial: its queue age restarted at the preemption, behind every job of its
    # priority submitted meanwhile; Slurm and Kubernetes keep the original submit time)
    plane = preempt_plane
    low, a, b = low_running(plane)
    later = submit(plane, "later").job_id  # same priority, submitted while low runs: it waits
    assert plane.get(later).state == JobState.STANDBY
    high = preempt_to_the_boundary(plane, low, a, b, at=8)
    launched({"wa": a, "wb": b}, 2)
    assert plane.get(low).state == JobState.STANDBY
    places = {j: plane.user(control_pb2.JobQuery(job_id=j)).queue_position for j in (low, later)}
    assert places == {low: 1, later: 2}, places
    started(plane, high, (a, b))
    for rank, session in enumerate((a, b)):
        plane.rank_event(session, high, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=100))
    got = launched({"wa": a, "wb": b}, 2)
    assert launched_jobs(got) == [("wa", low, f"{low}:2"), ("wb", low, f"{low}:2")]
    assert plane.get(later).state == JobState.STANDBY


def test_the_state_sequence_of_a_preempted_job(preempt_plane):
    plane = preempt_plane
    low, a, b = low_running(plane)
    preempt_to_the_boundary(plane, low, a, b)
    launched({"wa": a, "wb": b}, 2)
    seen = [(e.status.state, e.status.preempted_by != "") for e in plane.events(low) if e.type == "state"]
    tail = [(JobState.Name(s), p) for s, p in seen][-3:]
    assert tail == [("RUNNING", False), ("PAUSED", True), ("STANDBY", True)], tail


def test_equal_priority_and_preemptible_false_never_preempt(preempt_plane):
    plane = preempt_plane
    a, b = plane.register("wa"), plane.register("wb")
    keep = submit(plane, "keep", extra="preemptible: false").job_id
    started(plane, keep, (a, b))
    drain(a), drain(b)
    same = submit(plane, "same", priority=0)
    high = submit(plane, "high", priority=5)
    time.sleep(0.2)
    assert drain(a) == [] and drain(b) == []
    assert plane.get(keep).state == JobState.RUNNING and plane.get(keep).preempted_by == ""
    assert plane.get(same.job_id).state == plane.get(high.job_id).state == JobState.STANDBY
    assert not [e for e in plane.events(keep) if e.type == "preemption"]


def test_the_minimum_run_time_holds_a_preemption_back_until_it_ends(tmp_path, store_with_no_versions):
    plane = make_plane(tmp_path / "control.db", preemption_min_run_s=1.5)
    try:
        low, a, b = low_running(plane)
        high = submit(plane, "high", priority=5).job_id
        assert drain(a) == []  # (ran under 1.5 s: protected)
        assert plane.get(low).preempted_by == ""
        deadline = time.monotonic() + 10
        while not (cmds := drain(a)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert type(to_ranks(cmds[0])) is engine_pb2.PauseTraining  # (once its 1.5 s ran out)
        assert plane.get(low).preempted_by == high
    finally:
        stop_plane(plane.c)


def test_past_the_grace_the_victim_moves_from_its_newest_checkpoint_with_a_warning(tmp_path, store_with_no_versions):
    plane = make_plane(tmp_path / "control.db", preemption_grace_s=0.3)
    try:
        low, a, b = low_running(plane)
        high = submit(plane, "high", priority=5).job_id
        drain(a), drain(b)
        step(plane, a, low, 9)  # (no boundary agreed: its ranks never pause)
        got = launched({"wa": a, "wb": b}, 2)
        assert launched_jobs(got) == [("wa", high, ""), ("wb", high, "")]
        s = plane.get(low)
        assert s.state == JobState.STANDBY and s.preempted_by == high and s.checkpoint_step == 4
        assert any(
            m.startswith(f"WARNING: preempted by job {high}: no checkpoint at a step boundary within the 0.3 s grace")
            and m.endswith("5 steps lost")
            for m in messages(plane, low)
        )
    finally:
        stop_plane(plane.c)


def test_an_operator_stops_a_preempted_job_it_leaves_the_queue(preempt_plane):
    plane = preempt_plane
    low, a, b = low_running(plane)
    preempt_to_the_boundary(plane, low, a, b)
    launched({"wa": a, "wb": b}, 2)
    s = plane.user(control_pb2.StopJobRequest(job_id=low))
    assert s.state == JobState.TERMINATED and s.outcome == control_pb2.STOPPED and s.preempted_by == ""
    assert plane.user(control_pb2.JobQuery(job_id=low)).queue_position == 0


def test_a_control_restart_mid_preemption_ends_in_the_same_place(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    plane = make_plane(db)
    try:
        low, a, b = low_running(plane)
        high = submit(plane, "high", priority=5).job_id
        drain(a), drain(b)
    finally:
        stop_plane(plane.c)
    # Restarted while the victim checkpoints: still RUNNING, preempted_by and its pause journaled;
    # its grace runs again (short here): it then moves from its newest checkpoint.
    plane = make_plane(db, preemption_grace_s=0.3)
    try:
        s = plane.get(low)
        assert s.preempted_by == high and s.state == JobState.RUNNING
        settle(lambda: plane.get(low).state, JobState.STANDBY)
        s = plane.get(low)
        assert s.preempted_by == high and s.message.startswith(f"queued: PREEMPTED by job {high}")
        assert any(f"PREEMPTED by job {high} at step 4: continues from {low}:1" in m for m in messages(plane, low))
    finally:
        stop_plane(plane.c)
    # Restarted again while it waits PREEMPTED in the queue: its place and checkpoint kept.
    plane = make_plane(db)
    try:
        s = plane.get(low)
        assert s.state == JobState.STANDBY and s.preempted_by == high and s.queue_position >= 1
        assert any(m.startswith(f"resume PAUSED from checkpoint {low}:1 (step 4)") for m in messages(plane, low))
    finally:
        stop_plane(plane.c)


def test_gang_admission_two_simultaneous_submits_that_do_not_fit_together_one_runs_none_holds_part(
    preempt_plane,
):
    """Three slots, two dp-2 jobs submitted at once, 20 times: one starts (2 slots), the other
    waits STANDBY holding none (1 slot stays free), then starts once the first is stopped."""
    plane = preempt_plane
    sessions = {w: plane.register(w) for w in ("wa", "wb", "wc")}
    for i in range(20):
        replies: list = []
        go = threading.Barrier(2)

        def one(name: str, go: threading.Barrier, replies: list) -> None:
            go.wait()
            replies.append(submit(plane, name))

        threads = [threading.Thread(target=one, args=(f"g{i}-{k}", go, replies)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        states = sorted(JobState.Name(r.state) for r in replies)
        assert states == ["STANDBY", "WARMING_UP"], (i, states)
        runs, waits = sorted(replies, key=lambda r: r.state != JobState.WARMING_UP)
        got = launched(sessions, 2)
        assert {j for _, j, _ in launched_jobs(got)} == {runs.job_id}
        assert free_slots(plane) == 1  # (nothing of the waiting job's held)
        plane.user(control_pb2.StopJobRequest(job_id=runs.job_id))
        got = launched(sessions, 2)
        assert {j for _, j, _ in launched_jobs(got)} == {waits.job_id}
        plane.user(control_pb2.StopJobRequest(job_id=waits.job_id))
        settle(lambda: free_slots(plane), 3)


def test_a_team_within_its_nominal_quota_reclaims_the_slots_another_team_borrowed_whatever_their_priority(
    tmp_path, store_with_no_versions
):
    # Teams a and b own one slot each in one cohort; b's dp-2 job runs on a's idle slot
    # (borrowed). a's dp-1 job, within a's nominal and of a lower priority, reclaims it: b's
    # job checkpoints at an agreed boundary and waits PREEMPTED; a's job starts.
    from services.control.scheduler import QuotaBook, TeamQuota

    book = QuotaBook({"a": TeamQuota(nominal=1, cohort="c"), "b": TeamQuota(nominal=1, borrow_limit=1, cohort="c")})
    plane = make_plane(tmp_path / "control.db", quotas=book)
    try:
        wa, wb = plane.register("wa"), plane.register("wb")
        text = spec_yaml(name="lender", dp=2, steps=100, extra="team: b")
        borrower = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="b.yaml", priority=5)).job_id
        assert plane.get(borrower).borrowed_slots == 1
        started(plane, borrower, (wa, wb))
        drain(wa), drain(wb)
        step(plane, wa, borrower, 4)
        saved(plane, wa, borrower, 1, 4)
        text = spec_yaml(name="owner", dp=1, steps=100, extra="team: a")
        owner = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="a.yaml", priority=0))
        assert owner.state == JobState.STANDBY
        (cmd,) = drain(wa)
        drain(wb)
        pause = to_ranks(cmd)
        assert type(pause) is engine_pb2.PauseTraining and pause.checkpoint
        assert plane.get(borrower).preempted_by == owner.job_id
        assert any(
            m.startswith(f"preempted by job {owner.job_id} (its team a reclaims the slots team b borrowed)")
            for m in messages(plane, borrower)
        ), messages(plane, borrower)
        step(plane, wa, borrower, 6, agreed=pause.seq)
        saved(plane, wa, borrower, 2, 6)
        paused(plane, borrower, (wa, wb), 6)
        got = launched({"wa": wa, "wb": wb}, 1)
        assert [j for _, j, _ in launched_jobs(got)] == [owner.job_id]
        assert plane.get(borrower).state == JobState.STANDBY
    finally:
        stop_plane(plane.c)
