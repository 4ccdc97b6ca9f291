"""The job queue (issue 15 part 3): a submit whose ranks do not fit waits, FIFO within
priority; its status shows its place and what it waits for; it starts when ranks free up
(a job ends, a worker registers); cancel takes it out; a control restart keeps the queue
and its order. The data structure alone, then the orchestrator in-process (real bus)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.job_queue import JobQueue
from services.control.orchestrator import IllegalTransition

from .conftest import Plane, drain, settle, spec_yaml

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def test_the_queue_orders_by_priority_then_submission_and_a_restore_keeps_the_order():
    q = JobQueue()
    for job_id, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)):
        q.add(job_id, priority)
    assert [e.job_id for e in q.ordered()] == ["b", "d", "a", "c", "e"]
    assert (q.head().job_id, q.position("a"), q.position("e"), q.position("zz")) == ("b", 3, 5, 0)
    assert q.leads(6) and not q.leads(5)  # equal priority queues behind
    q.take("b")
    again = JobQueue()
    for e in reversed(q.ordered()):  # journaled entries come back in any order
        again.restore(e.job_id, e.to_json())
    assert [e.job_id for e in again.ordered()] == ["d", "a", "c", "e"]
    assert again.add("f", 0).seq == 6  # after every restored one
    with pytest.raises(ValueError, match="^priority: must be between -1000 and 1000, got 1001$"):
        again.add("g", 1001)


def test_a_drained_job_s_queued_resume_goes_ahead_of_every_priority_and_a_restore_keeps_it_there():
    q = JobQueue()
    q.add("high", 100)
    q.add("drained", -5, first=True)  # `surgectl up`'s resume of a job drained by `down`
    assert [e.job_id for e in q.ordered()] == ["drained", "high"]
    assert q.blocks(1000) and not q.leads(1000)  # a submit of any priority waits behind it
    again = JobQueue()
    for e in q.ordered():
        again.restore(e.job_id, e.to_json())
    assert [(e.job_id, e.first) for e in again.ordered()] == [("drained", True), ("high", False)]


def test_a_job_marked_beyond_the_registered_cluster_blocks_no_one_until_a_worker_registers():
    q = JobQueue()
    q.add("big", 0)
    assert q.blocks(0) and not q.blocks(1)
    q.mark_beyond_cluster("big", True)
    assert not q.blocks(0) and q.head().job_id == "big"  # keeps its place
    q.add("mid", 0)
    assert q.blocks(0) and q.blocks(-5) and not q.blocks(1)
    q.clear_beyond_cluster()  # a worker registered: stale until tried again
    assert not q.beyond_cluster("big")
    q.mark_beyond_cluster("big", True)
    q.take("big")
    assert not q.beyond_cluster("big")  # the mark goes with the entry
    q.mark_beyond_cluster("gone", True)  # not queued: no mark
    assert not q.beyond_cluster("gone")


def submit(plane: Plane, name: str, dp: int = 1, priority: int = 0) -> control_pb2.JobStatus:
    return plane.user(
        control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name=name, dp=dp), spec_path="job.yaml", priority=priority)
    )


def finish(plane: Plane, session, job_id: str) -> None:
    """The one rank of ``job_id`` on ``session`` reports ready, then finished."""
    plane.rank_event(session, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    plane.rank_event(session, job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=3))
    assert plane.get(job_id).outcome == JobOutcome.FINISHED


def launched(session) -> list[str]:
    return [c.launch.job_id for c in drain(session) if c.WhichOneof("command") == "launch"]


def places(plane: Plane, *job_ids: str) -> list[int]:
    return [plane.get(j).queue_position for j in job_ids]


def test_jobs_wait_in_order_and_the_head_starts_when_the_running_job_ends(plane):
    wa = plane.register("wa")
    a = submit(plane, "a")
    b, c = submit(plane, "b"), submit(plane, "c")
    assert (a.state, a.queue_position) == (JobState.WARMING_UP, 0)
    assert (b.state, b.queue_position, c.queue_position) == (JobState.STANDBY, 1, 2)
    assert (
        b.message
        == "queued: needs 1 rank (parallel.dp=1); 0 are free on 1 registered worker: waits for ranks to free up"
    )
    assert c.message == "queued: waits for the jobs queued ahead of it"
    assert launched(wa) == [a.job_id]
    finish(plane, wa, a.job_id)
    settle(lambda: plane.get(b.job_id).state, JobState.WARMING_UP)
    # (the queue's places are published after the decision's states: read once they are)
    settle(lambda: (plane.get(c.job_id).state, places(plane, b.job_id, c.job_id)), (JobState.STANDBY, [0, 1]))
    assert launched(wa) == [b.job_id]
    log = [(e.type, e.message) for e in plane.events(b.job_id)]
    assert log[0][0] == "queue" and log[0][1].startswith("queued at position 1 of 1, priority 0: needs 1 rank")
    assert log[-1][1].startswith("STANDBY -> WARMING_UP: left the queue after ")


def test_a_higher_priority_goes_first_and_a_smaller_job_never_overtakes_the_head(plane):
    wa, wb = plane.register("wa"), plane.register("wb")
    a = submit(plane, "a", dp=2)
    low, high = submit(plane, "low", dp=2), submit(plane, "high", dp=2, priority=5)
    small = submit(plane, "small", dp=1)  # would fit once a slot frees: still behind the head
    assert places(plane, high.job_id, low.job_id, small.job_id) == [1, 2, 3]
    assert plane.get(high.job_id).priority == 5
    drain(wa), drain(wb)
    plane.rank_event(wa, a.job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=3))
    plane.rank_event(wb, a.job_id, 1, finished=engine_pb2.TrainingLoopFinished(rank=1, step=3))
    settle(lambda: plane.get(high.job_id).state, JobState.WARMING_UP)
    assert places(plane, low.job_id, small.job_id) == [1, 2]
    assert launched(wa) == launched(wb) == [high.job_id]


def test_a_queued_job_starts_when_a_worker_registers(plane):
    plane.register("wa")
    job = submit(plane, "big", dp=2)
    assert (
        job.message
        == "queued: needs 2 ranks (parallel.dp=2), more than the 1 registered: can never run as things stand; waits for workers to join"
    )
    wb = plane.register("wb")
    settle(lambda: plane.get(job.job_id).state, JobState.WARMING_UP)
    assert launched(wb) == [job.job_id]


def test_cancel_takes_a_queued_job_out_and_the_next_moves_up_but_refuses_a_running_one(plane):
    wa = plane.register("wa")
    a, b, c = submit(plane, "a"), submit(plane, "b"), submit(plane, "c")
    with pytest.raises(IllegalTransition, match=f"^job {a.job_id} is WARMING_UP, not queued: `surgectl stop "):
        plane.user(control_pb2.StopJobRequest(job_id=a.job_id, queued_only=True))
    assert plane.get(a.job_id).state == JobState.WARMING_UP
    gone = plane.user(control_pb2.StopJobRequest(job_id=b.job_id, queued_only=True))
    assert (gone.state, gone.outcome, gone.queue_position) == (JobState.TERMINATED, JobOutcome.STOPPED, 0)
    assert gone.message == "STOPPED: taken out of the queue (position 1) by the operator"
    with pytest.raises(IllegalTransition, match=f"^job {b.job_id} is TERMINATED \\(STOPPED\\), not queued$"):
        plane.user(control_pb2.StopJobRequest(job_id=b.job_id, queued_only=True))  # an ended job: no advice to stop it
    settle(lambda: plane.get(c.job_id).queue_position, 1)
    # A plain stop of a queued job does the same; neither sends its (never launched) ranks anything.
    assert plane.user(control_pb2.StopJobRequest(job_id=c.job_id)).outcome == JobOutcome.STOPPED
    assert launched(wa) == [a.job_id] and drain(wa) == []
    finish(plane, wa, a.job_id)  # nothing is left to start
    assert [j.job_id for j in plane.user(control_pb2.JobQuery()).jobs if j.state != JobState.TERMINATED] == []


def test_a_priority_out_of_range_is_refused_and_persists_nothing(plane):
    plane.register("wa")
    with pytest.raises(ValueError, match="^priority: must be between -1000 and 1000, got -1001$"):
        submit(plane, "x", priority=-1001)
    assert plane.c.journal.load_jobs() == []


def test_a_control_restart_keeps_the_queue_in_its_order_and_starts_its_head_when_ranks_free_up(tmp_path):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    from .conftest import registration

    def open_plane() -> tuple[Plane, JobStore]:
        journal = JobStore(tmp_path / "control.db")
        return Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)), journal

    plane, journal = open_plane()
    reg = registration("wa")
    reg.incarnation = "i1"
    wa = plane.c.sessions.open(reg)
    a = submit(plane, "a")
    (launch,) = drain(wa)
    plane.rank_event(wa, a.job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    b, c, d = submit(plane, "b"), submit(plane, "c", priority=1), submit(plane, "d")
    assert places(plane, c.job_id, b.job_id, d.job_id) == [1, 2, 3]
    journal.close()

    plane, journal = open_plane()  # control restarted; the node agent re-attaches a's rank
    for job in (b, c, d):
        s = plane.get(job.job_id)
        assert (s.state, s.message) == (JobState.STANDBY, job.message)  # not frozen: still queued
    assert places(plane, c.job_id, b.job_id, d.job_id) == [1, 2, 3]
    reg.running.append(launch.launch)
    wa = plane.c.sessions.open(reg)
    plane.rank_event(wa, a.job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=3))
    assert plane.get(a.job_id).outcome == JobOutcome.FINISHED
    settle(lambda: plane.get(c.job_id).state, JobState.WARMING_UP)
    assert places(plane, b.job_id, d.job_id) == [1, 2]
    assert launched(wa) == [c.job_id]
    e = submit(plane, "e")  # numbered after the restored ones: behind them
    assert e.queue_position == 3
    journal.close()


def test_a_drained_job_holds_the_queue_across_a_restart_until_it_is_resumed_or_stopped(tmp_path):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    def open_plane() -> tuple[Plane, JobStore]:
        journal = JobStore(tmp_path / "control.db")
        return Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)), journal

    plane, journal = open_plane()
    wa = plane.register("wa")
    a = submit(plane, "a").job_id
    plane.rank_event(wa, a, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    plane.user(control_pb2.PauseJobRequest(job_id=a, drain=True))  # `surgectl down`
    plane.rank_event(wa, a, 0, paused=engine_pb2.TrainingLoopPaused(rank=0, step=2))
    assert plane.get(a).drained
    b = submit(plane, "b")
    held = (
        f"queued: waits for drained job {a} to be resumed (`surgectl up` resumes it, `surgectl stop` ends it; "
        "live jobs first)"
    )
    assert (b.state, b.message) == (JobState.STANDBY, held)
    journal.close()

    plane, journal = open_plane()  # `surgectl up`: a's ranks went with the stack; its slot is free
    wa = plane.register("wa")  # b is tried (on the orchestrator's pool), and held again: live jobs first
    settle(lambda: plane.c.orchestrator._start_armed is None, True)  # (the try began; get() waits for its end)
    assert (plane.get(b.job_id).state, plane.get(b.job_id).message) == (JobState.STANDBY, held)
    assert launched(wa) == []
    plane.user(control_pb2.StopJobRequest(job_id=a))  # the operator ends it instead
    settle(lambda: plane.get(b.job_id).state, JobState.WARMING_UP)
    assert launched(wa) == [b.job_id]
    journal.close()


def test_a_job_needing_more_ranks_than_are_registered_holds_back_none_behind_it(plane):
    wa, wb = plane.register("wa"), plane.register("wb")  # 2 ranks registered
    big = submit(plane, "big", dp=64)
    waits = "queued: needs 64 ranks (parallel.dp=64), more than the 2 registered: can never run as things stand; waits for workers to join"
    assert (big.state, big.queue_position, big.message) == (JobState.STANDBY, 1, waits)
    small = submit(plane, "small")  # behind it, but it can start only once workers join: small starts now
    assert (small.state, small.queue_position) == (JobState.WARMING_UP, 0)
    # FIFO among the jobs that fit the registered cluster: mid (2 ranks, 1 free) blocks the one behind it.
    mid, late = submit(plane, "mid", dp=2), submit(plane, "late")
    assert places(plane, big.job_id, mid.job_id, late.job_id) == [1, 2, 3]
    assert plane.get(mid.job_id).message.endswith("waits for ranks to free up")
    assert plane.get(late.job_id).message == "queued: waits for the jobs queued ahead of it"
    assert plane.get(big.job_id).message == waits  # still says what it waits for
    assert sorted(launched(wa) + launched(wb)) == [small.job_id]
    # A worker with 64 slots joins: big, still the head, starts first; mid needs 2 of the 1 left.
    wc = plane.register("wc", slots=64)
    settle(lambda: plane.get(big.job_id).state, JobState.WARMING_UP)
    assert places(plane, mid.job_id, late.job_id) == [1, 2]
    assert launched(wc) == [big.job_id]


def test_when_ranks_free_up_the_jobs_behind_one_waiting_for_workers_are_tried_in_order(plane):
    wa = plane.register("wa")  # 1 rank registered
    a = submit(plane, "a")
    big, b = submit(plane, "big", dp=2), submit(plane, "b")
    assert places(plane, big.job_id, b.job_id) == [1, 2]
    assert b.message == (
        "queued: needs 1 rank (parallel.dp=1); 0 are free on 1 registered worker: waits for ranks to free up"
    )
    assert launched(wa) == [a.job_id]
    finish(plane, wa, a.job_id)
    settle(lambda: plane.get(b.job_id).state, JobState.WARMING_UP)
    s = plane.get(big.job_id)
    assert (s.state, s.queue_position, s.message) == (
        JobState.STANDBY,
        1,
        "queued: needs 2 ranks (parallel.dp=2), more than the 1 registered: can never run as things stand; waits for workers to join",
    )
    assert launched(wa) == [b.job_id]
