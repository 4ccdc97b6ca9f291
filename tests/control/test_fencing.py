"""Fencing in control (issue 29 item 4), on the real in-process control plane: every launch
of a rank is a newer generation; a replacement is never placed on a node whose agent missed
its beats; the session relay drops a replaced incarnation's events and has its agent end it."""

from __future__ import annotations

import time

import pytest

from services.common.fencing import FENCED_CALLS
from services.contract import Module, control_pb2, engine_pb2, worker_pb2
from services.control.fault_detector import AGENT_MISSED_BEATS

from .conftest import drain, registration, settle
from .test_resource_allocator import allocate

pytestmark = pytest.mark.timeout(30)


def beat(plane, session, seconds_ago: float = 0.0) -> None:
    """The node agent's own beat, as control's session relay stamps its receipt."""
    hb = control_pb2.AgentHeartbeat(interval_seconds=1.0, received_monotonic=time.monotonic() - seconds_ago)
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(heartbeat=hb))


def replace_in_place(plane, job_id: str, lost: list[int]):
    msg = control_pb2.RebuildCommunicator(job_id=job_id, reason="test", in_place=True, lost_ranks=lost)
    return plane.c.bus.command(Module.L1_RECOVERY_CONTROLLER, Module.L1_RESOURCE_ALLOCATOR, msg).message


def launched(cmds) -> list:
    return [r for c in cmds if c.WhichOneof("command") == "launch" for r in c.launch.ranks]


def released(cmds) -> list[control_pb2.ReleaseRanks]:
    return [c.release for c in cmds if c.WhichOneof("command") == "release"]


def rank_1_killed_after_the_start(plane) -> tuple[dict, str, dict[int, tuple[str, int]]]:
    """A dp 2 job on three workers whose ranks started, then rank 1 exited (-9): the
    sessions by worker, the job id and each rank's first (worker, generation)."""
    w = {n: plane.register(n) for n in ("wa", "wb", "wc")}
    job_id = plane.submit(dp=2, steps=20).job_id
    first = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    for rank, (n, _) in first.items():
        plane.rank_event(w[n], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    plane.rank_exited(w[first[1][0]], job_id, 1, exit_code=-9, generation=first[1][1])
    return w, job_id, first


def test_a_replacement_avoids_a_silent_agent_and_is_a_newer_generation(plane):
    a, b, c = plane.register("wa"), plane.register("wb"), plane.register("wc")
    for s in (a, b, c):
        beat(plane, s)
    assert list(allocate(plane, "j-f", dp=2).worker_ids) == ["wa", "wb"]
    (r0,), (r1,) = launched(drain(a)), launched(drain(b))
    assert r0.generation == r1.generation > 0  # one launch, one generation
    drain(c)

    # wb's agent went quiet (frozen, cut off) past its allowance (5 beats): L1-3's deadline
    # reports the node agent_silent, L1-1 holds wb out of placement.
    beat(plane, b, seconds_ago=AGENT_MISSED_BEATS + 1.0)
    settle(lambda: "agent" in allocate(plane, "j-probe", dp=3).reason, True)
    ready = replace_in_place(plane, "j-f", lost=[1])
    assert isinstance(ready, control_pb2.ResourcesReady), ready
    assert list(ready.worker_ids) == ["wc"]  # not its own (frozen) node, the free one
    (replacement,) = launched(drain(c))
    assert (replacement.rank, replacement.worker_id) == (1, "wc")
    assert replacement.generation > r1.generation
    # The kill of the old incarnation carries the fence its agent keeps for when it wakes.
    (kill,) = released(drain(b))
    assert (list(kill.ranks), kill.kill, kill.below_generation) == ([1], True, replacement.generation)

    # A new job that needs wb too is told why it is held; its next beat makes wb a candidate again.
    short = allocate(plane, "j-g", dp=2)
    assert isinstance(short, control_pb2.ResourcesInsufficient)
    assert "the node agent of wb sent no AgentHeartbeat for" in short.reason, short.reason
    beat(plane, b)
    assert isinstance(allocate(plane, "j-g", dp=1), control_pb2.ResourcesReady)


def test_events_of_a_replaced_incarnation_are_dropped_and_its_agent_told_to_end_it(plane):
    a, b, c = plane.register("wa"), plane.register("wb"), plane.register("wc")
    allocate(plane, "j-h", dp=2)
    (old,) = launched(drain(b))
    drain(a)
    replace_in_place(plane, "j-h", lost=[1])  # (no beats: agents that never beat are candidates)
    (new,) = [r for s in (b, c) for r in launched(drain(s))]  # (on wb: its own node first)

    def heartbeat(session, generation: int) -> None:
        hb = worker_pb2.RankHeartbeat(step=3, interval_seconds=0.5)
        ev = worker_pb2.RankEvent(job_id="j-h", rank=1, heartbeat=hb, generation=generation)
        plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(rank_event=ev))

    before = FENCED_CALLS.labels("control")._value.get()
    new_session = c if new.worker_id == "wc" else b
    heartbeat(new_session, new.generation)
    assert released(drain(new_session)) == []
    for _ in range(3):  # the old process woke up on wb: its backlog of beats
        heartbeat(b, old.generation)
    assert FENCED_CALLS.labels("control")._value.get() - before == 3
    (end,) = released(drain(b))  # once, not per event
    assert (end.job_id, list(end.ranks), end.kill, end.below_generation) == ("j-h", [1], True, new.generation)


def test_an_agent_back_after_a_partition_re_attaches_no_replaced_rank_and_is_told_to_end_it(plane):
    a, b, c = plane.register("wa"), plane.register("wb"), plane.register("wc")
    allocate(plane, "j-p", dp=2)
    (r0,), (old,) = launched(drain(a)), launched(drain(b))
    plane.c.sessions.close(b, reason="stream broke")  # wb cut off: its slot withdrawn, rank 1 reported lost
    replace_in_place(plane, "j-p", lost=[1])
    (new,) = launched(drain(c))
    # The partition heals: wb registers again, still running its rank 1 (and nothing else).
    from .conftest import registration

    reg = registration("wb")
    reg.running.append(control_pb2.LaunchRanks(job_id="j-p", ranks=[old]))
    back = plane.c.sessions.open(reg)
    assert ("j-p", 1) not in back.ranks  # not re-attached
    (end,) = released(drain(back))
    assert (list(end.ranks), end.kill, end.below_generation) == ([1], True, new.generation)
    assert new.generation > old.generation == r0.generation


def test_a_held_node_whose_agent_restarts_is_placeable_at_its_registration_before_it_beats(plane):
    a, b = plane.register("wa"), plane.register("wb")
    for s in (a, b):
        beat(plane, s)
    beat(plane, b, seconds_ago=AGENT_MISSED_BEATS + 1.0)  # wb's agent silent: held
    settle(lambda: "agent" in allocate(plane, "j-probe", dp=3).reason, True)  # (3 never fits: a probe)
    plane.c.sessions.close(b, "the agent was killed")  # its stream closed: withdrawn
    reg = registration("wb")
    reg.incarnation = "wb-2"  # the restarted agent, not yet beating
    plane.c.sessions.open(reg)
    # Its registration is its sign of life: a grow-back tried at once finds the slot.
    assert isinstance(allocate(plane, "j-h", dp=2), control_pb2.ResourcesReady)


def test_a_restarted_agent_is_not_held_by_the_silence_deadline_of_the_agent_it_replaced(plane):
    # Seen in CI (tests/faults/test_resize_in_place.py, a loaded host): worker-1's agent was
    # killed, `surgectl restart` brought it back within its old deadline, a grow-back was
    # decided on its registration; then the killed agent's deadline, armed by its last beat,
    # fired and held the new agent's node before that agent's first beat (1 s after its
    # start): the placement found no free slot. Its registration is its sign of life.
    a, b = plane.register("wa"), plane.register("wb")
    beat(plane, a)
    beat(plane, b, seconds_ago=AGENT_MISSED_BEATS - 0.5)  # wb's last beat: its deadline fires in 0.5 s
    plane.c.sessions.close(b, "the agent was killed")  # its stream closed: withdrawn
    reg = registration("wb")
    reg.incarnation = "wb-2"  # the restarted agent, registered, not yet beating
    plane.c.sessions.open(reg)
    time.sleep(1.0)  # past the killed agent's deadline
    assert isinstance(allocate(plane, "j-g", dp=2), control_pb2.ResourcesReady)


def test_a_replaced_incarnations_exit_or_loss_that_comes_up_late_is_stated_replaced_not_dropped(plane):
    """Session 36's F2: wb's agent froze past its deadline; rank 1 was replaced on wc. The old
    rank 1 failed meanwhile (its peer killed) and its exit comes up once the agent wakes; or
    the agent never comes back and its session ends. Either way the relay states the fact
    (``replaced``: the generation is older than the newest launched of the rank) and passes
    it on to L1-3 (grading) and L1-1 (the decision): it drops nothing itself. The newest
    incarnation's own exit and loss are not replaced."""
    exits = []
    relay = plane.c.sessions
    emit = relay._hardware  # (the relay's emitter as EXT_HARDWARE: watched, passed through)
    relay._hardware = lambda msg: (exits.append(msg) if isinstance(msg, control_pb2.RankExited) else None, emit(msg))
    a, b, c = plane.register("wa"), plane.register("wb"), plane.register("wc")
    for s in (a, b, c):
        beat(plane, s)
    allocate(plane, "j-s", dp=2)
    (r0,), (old,) = launched(drain(a)), launched(drain(b))
    beat(plane, b, seconds_ago=AGENT_MISSED_BEATS + 1.0)  # wb's agent frozen past its deadline
    settle(lambda: "agent" in allocate(plane, "j-probe", dp=3).reason, True)
    replace_in_place(plane, "j-s", lost=[1])
    (new,) = launched(drain(c))
    assert new.generation > old.generation
    # wb's agent does not come back in time: its session ends with the old rank 1 counted
    # there. Its loss names the launch that ran there (the old code: the newest, on wc).
    relay.close(b, reason="stream broke")
    # It comes back (a reconnect): the old rank is not re-attached, and its exit comes up.
    reg = registration("wb")
    reg.running.append(control_pb2.LaunchRanks(job_id="j-s", ranks=[old]))
    back = relay.open(reg)
    woke = control_pb2.RankExited(job_id="j-s", rank=1, exit_code=1, generation=old.generation, pid=4242)
    relay.on_worker_event(back, control_pb2.WorkerEvent(rank_exited=woke))
    ours = control_pb2.RankExited(job_id="j-s", rank=0, exit_code=1, generation=r0.generation, pid=4343)
    relay.on_worker_event(a, control_pb2.WorkerEvent(rank_exited=ours))
    relay.close(c, reason="stream broke")  # the newest incarnation's node lost
    assert [(e.rank, e.worker_id, e.worker_lost, e.generation, e.replaced) for e in exits] == [
        (1, "wb", True, old.generation, True),
        (1, "wb", False, old.generation, True),
        (0, "wa", False, r0.generation, False),
        (1, "wc", True, new.generation, False),
    ]


def test_a_replaced_generations_exit_after_the_recovery_is_recorded_as_its_end_never_decided(plane):
    """Session 36's F2, through L1-3 and L1-1: rank 1 died, the job was relaunched (restart 1)
    and recovered. Then the old rank 0's own exit comes up (its agent was frozen through the
    recovery: it ended unheard, not killed). It is the end of a replaced generation: recorded
    as such (type ``rank``), no second restart, no fault counted (surge_faults_total). The old
    code decided it as a new rank_exit (restart 2 of 3) and rolled the healthy job back."""
    from prometheus_client import REGISTRY

    from .test_fault_policy import decisions, restarted

    def exit_faults() -> float:
        return sum(
            REGISTRY.get_sample_value("surge_faults_total", {"grade": "SEVERE", "class": "rank_exit", "role": r}) or 0.0
            for r in ("cause", "consequence")
        )

    w, job_id, first = rank_1_killed_after_the_start(plane)
    assert decisions(plane, job_id) == [
        f"restart_ranks after rank_exit of rank 1 on {first[1][0]} (restart 1 of 3 for rank_exit)"
    ]
    second = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    assert sorted(second) == [0, 1] and all(second[r][1] > first[r][1] for r in (0, 1))
    restarted(plane, job_id, {r: w[n] for r, (n, _) in second.items()}, start_step=0)
    plane.rank_event(w[second[0][0]], job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    assert plane.get(job_id).state == control_pb2.JobState.RUNNING
    before = exit_faults()

    # The old rank 0's exit, come up late through its agent (its generation, not released).
    plane.rank_exited(w[first[0][0]], job_id, 0, exit_code=1, generation=first[0][1])
    said = f"rank 0 on worker {first[0][0]} ended (exit code 1)"
    settle(lambda: [e.message for e in plane.events(job_id) if said in e.message] != [], True)
    assert len(decisions(plane, job_id)) == 1, decisions(plane, job_id)
    assert plane.get(job_id).state == control_pb2.JobState.RUNNING
    (stale,) = [e for e in plane.events(job_id) if "replaced" in e.message]
    assert stale.type == "rank" and stale.message.startswith(
        f"rank 0 (rank_exit) ended after its generation was replaced: {said}"
    ), stale.message
    assert exit_faults() == before


def test_a_replaced_generations_exit_that_comes_up_after_a_control_restart_is_stale_before_its_successor_re_attaches(
    tmp_path, store_with_no_versions, monkeypatch
):
    """stale36's left case: control restarted after the job recovered from rank 1's exit
    (both ranks relaunched); the old rank 0's agent comes back first, with that old rank's
    exit, then the agents of the ranks that run re-attach them. The relay's fence knew only
    what it saw since the restart (no launch, no newer rank re-attached yet), so the exit was
    not stated replaced and was decided as a new fault.
    L1-1 journals each rank's newest launched generation: the exit is recorded stale, and L1-3
    (told those generations) counts it toward no node's sick count."""
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    from .conftest import Plane, stop_plane
    from .test_fault_policy import QUICK, decisions, restarted

    # (no re-attach deadline during the test: the ranks that run are heard from below; a loaded
    # host must not turn the wait into a worker_lost of its own)
    monkeypatch.setattr("services.control.monitoring.REATTACH_MIN_SECONDS", 120.0)
    db = tmp_path / "control.db"
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    w = {n: plane.register(n) for n in ("wa", "wb", "wc")}
    job_id = plane.submit(dp=2, steps=20, extra=QUICK).job_id
    first = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    for rank, (n, _) in first.items():
        plane.rank_event(w[n], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    plane.rank_exited(w[first[1][0]], job_id, 1, exit_code=-9, generation=first[1][1])
    second = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    assert sorted(second) == [0, 1] and all(second[r][1] > first[r][1] for r in (0, 1))
    restarted(plane, job_id, {r: w[n] for r, (n, _) in second.items()}, start_step=0)
    plane.rank_event(w[second[0][0]], job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    assert plane.get(job_id).state == control_pb2.JobState.RUNNING
    stop_plane(plane.c)  # (control goes; the job's ranks run on)

    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        old = plane.register(first[0][0])  # the old rank 0's agent, back first: nothing to re-attach
        plane.rank_exited(old, job_id, 0, exit_code=1, generation=first[0][1])
        for name in sorted({n for n, _ in second.values()}):  # then the agents of the ranks that run
            reg = registration(name)
            ranks = [engine_pb2.RankAssignment(rank=r, generation=g) for r, (n, g) in second.items() if n == name]
            reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=ranks))
            session = plane.c.sessions.open(reg)
            for r in ranks:  # (each heard from: its beat)
                plane.rank_event(
                    session, job_id, r.rank, heartbeat=worker_pb2.RankHeartbeat(step=1, interval_seconds=0.5)
                )
        said = f"rank 0 on worker {first[0][0]} ended (exit code 1)"
        settle(lambda: [e.message for e in plane.events(job_id) if said in e.message] != [], True)
        assert decisions(plane, job_id) == [
            f"restart_ranks after rank_exit of rank 1 on {first[1][0]} (restart 1 of 3 for rank_exit)"
        ]
        (stale,) = [e for e in plane.events(job_id) if said in e.message]
        assert stale.type == "rank" and stale.message.startswith(
            f"rank 0 (rank_exit) ended after its generation was replaced: {said}"
        ), stale.message
        # L1-3 knew it replaced too (the journaled generations, StartFaultMonitoring): it
        # counts toward no node's sick count (the old code counted it on the old rank's node).
        counted = [(f.worker_id, f.kind) for f in plane.c.detector._sick._faults]
        assert counted == [], counted
    finally:
        stop_plane(plane.c)


def test_a_replaced_generations_failure_event_is_recorded_stale_never_a_fault_and_its_beats_stay_dropped(plane):
    """stale36's other left item: the relay dropped every event of a replaced incarnation, its
    failure reports too, so what the old rank said never reached the job's log. A failure
    event now goes on marked (``Failure.replaced``): L1-3 grades it replaced, L1-1 records it
    (type ``rank``) without an incident; its beats and steps are still dropped."""
    from services.contract.relay import pack

    from .test_fault_policy import decisions, restarted

    w, job_id, first = rank_1_killed_after_the_start(plane)
    second = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    restarted(plane, job_id, {r: w[n] for r, (n, _) in second.items()}, start_step=0)
    plane.rank_event(w[second[0][0]], job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    assert plane.get(job_id).state == control_pb2.JobState.RUNNING
    fenced = FENCED_CALLS.labels("control")._value.get()

    def old_rank_0(msg, sender=Module.L2_TRAINING_LOOP) -> None:
        ev = worker_pb2.RankEvent(job_id=job_id, rank=0, generation=first[0][1], routed=pack(msg, sender))
        plane.c.sessions.on_worker_event(w[first[0][0]], control_pb2.WorkerEvent(rank_event=ev))

    old_rank_0(engine_pb2.StepCompleted(step=7, loss=9.0, tokens=64))  # (its step: dropped, as before)
    failed = engine_pb2.TrainingLoopFailed(step=7, fault_class="comm_error", detail="Connection closed by peer")
    old_rank_0(failed)
    said = "rank 0 failed at step 7: Connection closed by peer"
    settle(lambda: [e.message for e in plane.events(job_id) if said in e.message] != [], True)
    (stale,) = [e for e in plane.events(job_id) if said in e.message]
    assert stale.type == "rank" and stale.message == f"rank 0 (comm_error) of a replaced generation failed: {said}"
    assert len(decisions(plane, job_id)) == 1, decisions(plane, job_id)
    assert plane.get(job_id).state == control_pb2.JobState.RUNNING and plane.get(job_id).step == 1
    assert FENCED_CALLS.labels("control")._value.get() == fenced + 2  # (both fenced; the agent told once)
    assert [r.below_generation for r in released(drain(w[first[0][0]]))] == [second[0][1]]


def test_an_admitted_failure_event_carries_the_incarnation_that_failed_and_other_events_are_left_alone():
    """The relay stamps an admitted rank event's failure part with its generation (never
    ``replaced``): a broken collective that L1-3 held past its relaunch's placement is then
    told to be the failed generation's (triage ``_replaced``; test_recovery's SIGKILL case)."""
    from services.contract import route_pb2
    from services.control.session_fence import admitted_stamp

    ev = worker_pb2.RankEvent(job_id="j", rank=0, generation=3)
    stamp = admitted_stamp(ev, "worker-1")
    failed = engine_pb2.TrainingLoopFailed(step=7, failure=route_pb2.Failure(cause=route_pb2.FAILURE_COMMUNICATION))
    stamp(failed)
    assert (failed.failure.generation, failed.failure.replaced, failed.failure.rank) == (3, False, 0)
    assert failed.failure.job_id == "j"
    step = engine_pb2.StepCompleted(step=1)
    stamp(step)  # (no failure field at all)
    assert step.step == 1
    unknown = admitted_stamp(worker_pb2.RankEvent(job_id="j", rank=0), "worker-1")  # (an agent that states none)
    mine = engine_pb2.TrainingLoopFailed(failure=route_pb2.Failure(cause=route_pb2.FAILURE_COMMUNICATION))
    unknown(mine)
    assert mine.failure.generation == 0
