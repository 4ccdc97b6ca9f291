"""A node that announces its departure (issue 30 item 5), in-process through the real bus and
sessions: a node agent's WorkerDeparting or `surgectl drain` checkpoints the job at an agreed
boundary and relaunches its ranks off the node (no fault, restart budgets kept); a deadline
too short for a save moves the ranks now from the newest checkpoint with a warning, or, with
none, leaves the deadline's kill to the fault policy; bad input is one line."""

from __future__ import annotations

import time

import grpc
import pytest

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.contract.relay import pack
from services.control.orchestrator.refusals import BadDeparture

from .conftest import Plane, drain, kinds, launched, served_control, settle, to_ranks

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


def running_on_three(plane: Plane, steps: int = 50):
    """A dp-2 job running on wa and wb, wc a free spare (registered last: placed last)."""
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=steps).job_id
    c = plane.register("wc")
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b), drain(c)
    return job_id, a, b, c


def step(plane: Plane, session, job_id: str, n: int, agreed: int = 0, unix: float = 0.0) -> None:
    plane.rank_event(
        session,
        job_id,
        0,
        step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64, commands_agreed=agreed, unix_time=unix),
    )


def saved(plane: Plane, session, job_id: str, version: int, at: int, seconds: float = 0.5) -> None:
    plane.rank_event(
        session, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:{version}", step=at, seconds=seconds)
    )


def departing(plane: Plane, session, worker_id: str, deadline_s: float) -> None:
    """What a node agent sends on SIGTERM: its departing registration, then the announcement."""
    reg = control_pb2.WorkerRegistration(worker_id=worker_id, departing=True)
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(register=reg))
    ev = control_pb2.WorkerDeparting(deadline_seconds=deadline_s, unix_time=time.time(), signal="SIGTERM")
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(routed=pack(ev, Module.EXT_HARDWARE)))


def messages(plane: Plane, job_id: str) -> list[str]:
    return [e.message for e in plane.events(job_id)]


def pause_then_paused(plane: Plane, job_id: str, a, b, at: int, version: int) -> engine_pb2.PauseTraining:
    """The pause the departure sent, its boundary at ``at``, its commit, every rank paused."""
    (cmd,) = drain(b)
    pause = to_ranks(cmd)
    assert type(pause) is engine_pb2.PauseTraining and pause.checkpoint
    step(plane, a, job_id, at, agreed=pause.seq)
    saved(plane, a, job_id, version, at)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=at))
    return pause


def test_a_departing_node_agent_s_job_checkpoints_at_a_boundary_and_moves_to_the_spare(plane):
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 14)
    departing(plane, a, "wa", 30.0)
    assert (
        "node wa departs in 30 s (its node agent got SIGTERM): checkpoint at the next step boundary"
        in (messages(plane, job_id)[-1])
    )
    pause_then_paused(plane, job_id, a, b, 16, 1)
    sent = launched({"wa": a, "wb": b, "wc": c}, 2)
    assert "ReleaseRanks" not in str(kinds(sent["wc"]))
    assert [k for k in kinds(sent["wa"]) if k == "launch"] == []  # never placed on the leaving node
    for w in ("wb", "wc"):
        (launch,) = [cmd.launch for cmd in sent[w] if cmd.WhichOneof("command") == "launch"]
        assert launch.init.resume_version == f"{job_id}:1"
    s = plane.get(job_id)
    assert s.state == JobState.WARMING_UP and s.step == 16
    text = messages(plane, job_id)
    assert (
        f"node wa departs: checkpoint at step 16 ({job_id}:1): continues from it off wa, queued at position 1 of 1"
        in text
    )
    assert any(m.startswith("resume STANDBY from checkpoint") and "allocated on wb, wc" in m for m in text), text
    assert not [e for e in plane.events(job_id) if e.type == "fault"]
    assert any("restart budgets kept" in m for m in text)


def test_drain_cordons_the_node_and_moves_its_job_a_node_with_no_job_is_only_cordoned(plane):
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 8)
    reply = plane.user(control_pb2.DrainWorkerRequest(worker_id="wb", deadline_seconds=60))
    assert [j.job_id for j in reply.jobs] == [job_id]
    assert "node wb departs in 60 s (`surgectl drain`)" in messages(plane, job_id)[-1]
    (cmd,) = drain(a)
    pause = to_ranks(cmd)
    drain(b)
    step(plane, a, job_id, 10, agreed=pause.seq)
    saved(plane, a, job_id, 1, 10)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=10))
    sent = launched({"wa": a, "wb": b, "wc": c}, 2)
    text = messages(plane, job_id)
    assert (
        f"node wb departs: checkpoint at step 10 ({job_id}:1): continues from it off wb, queued at position 1 of 1"
        in text
    )
    assert any(m.startswith("resume STANDBY from checkpoint") and "allocated on wa, wc" in m for m in text), text
    assert not [cmd for cmd in sent["wb"] if cmd.WhichOneof("command") == "launch"]
    cordons = plane.user(control_pb2.JobQuery()).cordoned
    assert [(x.worker_id, x.reason) for x in cordons] == [("wb", "draining: leaves within 60 s (`surgectl drain`)")]
    idle = plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=5))
    assert list(idle.jobs) == []  # (wa holds rank 0 of the new generation only once it reports ready)


def test_a_deadline_too_short_for_a_save_moves_now_from_the_newest_checkpoint_with_a_warning(plane):
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 10)
    saved(plane, a, job_id, 1, 10, seconds=8.0)
    step(plane, a, job_id, 13)
    departing(plane, a, "wa", 3.0)
    text = messages(plane, job_id)
    warning = next(m for m in text if m.startswith("WARNING: node wa departs in 3 s"))
    assert "too short for a save (" in warning and f"move now from checkpoint {job_id}:1 (step 10" in warning
    assert "3 steps lost" in warning
    sent = launched({"wb": b, "wc": c}, 2)
    launches = [cmd.launch for cmds in sent.values() for cmd in cmds if cmd.WhichOneof("command") == "launch"]
    assert sorted(la.init.resume_version for la in launches) == [f"{job_id}:1"] * 2
    assert plane.get(job_id).state == JobState.WARMING_UP


def test_a_deadline_too_short_with_no_checkpoint_leaves_it_to_the_fault_policy(plane):
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 4)
    departing(plane, a, "wa", 1.0)
    last = messages(plane, job_id)[-1]
    assert last.startswith("WARNING: node wa departs in 1 s") and "no checkpoint to move to" in last
    assert "worker_departed" in last
    assert plane.get(job_id).state == JobState.RUNNING
    assert drain(b) == []  # nothing asked of the ranks


def test_drain_refuses_bad_input_in_one_line(plane):
    with pytest.raises(BadDeparture, match=r"^drain: --deadline must be a finite number of seconds > 0, got 0$"):
        plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=0))
    for bad, says in ((-5, "-5"), (float("inf"), "inf"), (float("nan"), "nan")):
        with pytest.raises(BadDeparture, match=says):
            plane.user(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=bad))


def test_drain_of_an_unknown_worker_is_refused_over_grpc(tmp_path, monkeypatch):
    with served_control(tmp_path / "c.db", monkeypatch) as (control, stub):
        Plane(control).register("wa")
        with pytest.raises(grpc.RpcError) as e:
            stub.DrainWorker(control_pb2.DrainWorkerRequest(worker_id="nope", deadline_seconds=30), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "drain: worker 'nope' is not registered (registered: wa)"
        with pytest.raises(grpc.RpcError) as e:
            stub.DrainWorker(control_pb2.DrainWorkerRequest(worker_id="wa", deadline_seconds=0), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_fault_during_the_move_is_a_recovery_that_supersedes_it_and_a_second_notice_is_folded(plane):
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 6)
    departing(plane, a, "wa", 30.0)
    departing(plane, a, "wa", 30.0)  # (said again: folded into the move under way)
    assert messages(plane, job_id)[-1].endswith("folded into the move off wa under way")
    plane.rank_exited(b, job_id, 1, -9)  # rank 1 killed before the boundary
    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN
    assert not [m for m in messages(plane, job_id) if "moving to" in m]
    # The relaunch (from scratch: no checkpoint yet) never places a rank on the leaving node.
    assert not [cmd for cmd in drain(a) if cmd.WhichOneof("command") == "launch"]


def test_with_no_free_slot_the_job_waits_first_in_the_queue_and_continues_from_its_checkpoint(plane):
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=50).job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b)
    step(plane, a, job_id, 20)
    departing(plane, a, "wa", 30.0)
    pause_then_paused(plane, job_id, a, b, 22, 1)
    settle(lambda: plane.get(job_id).queue_position, 1)
    s = plane.get(job_id)
    assert s.state == JobState.STANDBY and s.queue_position == 1
    assert (
        f"node wa departs: checkpoint at step 22 ({job_id}:1): continues from it off wa, queued at position 1 of 1"
        in (messages(plane, job_id))
    )
    for rank, session in ((0, a), (1, b)):  # the released ranks end (the agent leaves once its rank did)
        plane.rank_exited(session, job_id, rank, -9, released=True)
    back = plane.register("wa")  # (the node agent restarted in place: placeable again)
    settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
    launches = [c.launch for s in (back, b) for c in drain(s) if c.WhichOneof("command") == "launch"]
    assert sorted(la.init.resume_version for la in launches) == [f"{job_id}:1"] * 2
    placed = [m for m in messages(plane, job_id) if m.startswith("resume STANDBY from checkpoint")]
    assert len(placed) == 1 and f"{job_id}:1 (step 22) (node wa departs" in placed[0]
    assert placed[0].endswith("restart budgets kept")
    decided = [e.message for e in plane.events(job_id) if e.type == "decision" and " after " in e.message]
    assert decided == []  # (the released ranks' exits are recorded, nothing is decided on them)
    # ... as the ranks' ends, not as faults (the move said "no fault"; a fresh user saw two MINOR ones)
    assert not [e.message for e in plane.events(job_id) if e.type == "fault"]
    ends = [e.message for e in plane.events(job_id) if e.type == "rank" and "ended after its release" in e.message]
    assert len(ends) == 2, ends


@pytest.fixture
def verified_plane(tmp_path, monkeypatch):
    """A plane whose store verifies version 1 of every job, at step 8 (as an event and in the call)."""
    from services.control.__main__ import build
    from services.control.job_store import JobStore
    from services.control.store_relay import StoreRelay

    from .conftest import stop_plane

    def verify(relay, msg, payload=None):
        info = store_pb2.CheckpointInfo(version=f"{msg.job_id}:1", step=8, job_id=msg.job_id)
        reply = store_pb2.CheckpointVerification(
            job_id=msg.job_id, versions=[store_pb2.CheckpointVerdict(info=info, ok=True)]
        )
        if hasattr(relay, "_events"):
            relay._events(reply)
        return reply

    monkeypatch.setattr(StoreRelay, "verify_checkpoints", verify)
    control = build(JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    yield Plane(control)
    stop_plane(control)


def test_a_paused_jobs_ranks_on_a_leaving_node_are_released_and_its_resume_relaunches_it_off_the_node(verified_plane):
    plane = verified_plane
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 6)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    (cmd,) = drain(b)
    drain(a)
    step(plane, a, job_id, 8, agreed=to_ranks(cmd).seq)
    saved(plane, a, job_id, 1, 8)
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=8))
    assert plane.get(job_id).state == JobState.PAUSED
    departing(plane, a, "wa", 30.0)
    said = messages(plane, job_id)[-1]
    assert "PAUSED at step 8: its ranks are released now (no fault, no restart spent)" in said, said
    assert f"relaunches it from {job_id}:1 (step 8) off wa" in said and "lost" not in said
    settle(lambda: "release" in kinds(drain(a) + drain(b)), True)
    assert plane.get(job_id).state == JobState.PAUSED
    assert not [e for e in plane.events(job_id) if e.type == "fault"]

    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    sent = launched({"wa": a, "wb": b, "wc": c}, 2)
    assert not [x for x in sent["wa"] if x.WhichOneof("command") == "launch"]  # (wa is leaving)
    launches = [x.launch for cmds in sent.values() for x in cmds if x.WhichOneof("command") == "launch"]
    assert sorted(la.init.resume_version for la in launches) == [f"{job_id}:1"] * 2


def test_a_deadline_under_10_s_is_said_with_its_decimal(plane):
    """(was: `--deadline 0.5` said as "departs in 0 s")"""
    job_id, a, b, c = running_on_three(plane)
    step(plane, a, job_id, 8)
    plane.user(control_pb2.DrainWorkerRequest(worker_id="wb", deadline_seconds=0.5))
    assert "node wb departs in 0.5 s (`surgectl drain`)" in "\n".join(messages(plane, job_id))


def test_a_second_drained_job_s_departure_says_the_place_the_queue_gives_it(plane):
    # Was: "first in the queue" while its decision and `status` said #2, behind a job drained
    # earlier that still waits for slots.
    a, b = plane.register("wa"), plane.register("wb")
    jobs = [plane.submit(dp=1, steps=50).job_id for _ in range(2)]
    for job_id, session in zip(jobs, (a, b), strict=True):
        plane.rank_event(session, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    drain(a), drain(b)
    for n, (job_id, session, worker) in enumerate(zip(jobs, (a, b), ("wa", "wb"), strict=True), start=1):
        step(plane, session, job_id, 4)
        plane.user(control_pb2.DrainWorkerRequest(worker_id=worker, deadline_seconds=60))
        (cmd,) = drain(session)
        pause = to_ranks(cmd)
        step(plane, session, job_id, 6, agreed=pause.seq)
        saved(plane, session, job_id, 1, 6)
        plane.rank_event(session, job_id, 0, paused=engine_pb2.TrainingLoopPaused(rank=0, step=6))
        said = [m for m in messages(plane, job_id) if "continues from it off" in m]
        assert said == [f"node {worker} departs: checkpoint at step 6 ({job_id}:1): continues from it off {worker}, "
                        f"queued at position {n} of {n}"], said  # fmt: skip
        assert plane.user(control_pb2.JobQuery(job_id=job_id)).queue_position == n
