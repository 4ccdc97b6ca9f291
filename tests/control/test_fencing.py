"""Fencing in control (issue 29 item 4), on the real in-process control plane: every launch
of a rank is a newer generation; a replacement is never placed on a node whose agent missed
its beats; the session relay drops a replaced incarnation's events and has its agent end it."""

from __future__ import annotations

import time

import pytest

from services.common.fencing import FENCED_CALLS
from services.contract import Module, control_pb2, worker_pb2
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
