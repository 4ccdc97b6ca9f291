"""A node agent's ranks' beats go up as one message per job per period (issue 28 item 3):
the beat grid (services/common/beat_grid.py), the keeper (services/worker/rank_beats.py), and
control applying a RankBeats message beat by beat (fenced, stamped, on its job's queue). The
agent's own beat rides with them when due (one message per node and period), alone when
none is due; control applies a riding one as it applies one sent alone."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from services.common.beat_grid import node_phase, phase_from, seconds_to_next_beat
from services.contract import control_pb2, engine_pb2, worker_pb2
from services.control.event_applier import NODE, EventApplier, job_of, split_agent_beat
from services.control.metrics import event_kind
from services.worker import rank_beats
from services.worker.rank_beats import RankBeats
from tests.worker.test_node_agent import cluster  # noqa: F401 - control servers and real agents (fixture)

pytestmark = pytest.mark.timeout(30)


def beat(job: str, rank: int, step: int = 1) -> worker_pb2.RankEvent:
    hb = worker_pb2.RankHeartbeat(job_id=job, rank=rank, step=step, stepping=True)
    return worker_pb2.RankEvent(job_id=job, rank=rank, heartbeat=hb, generation=1)


def kinds(sent: list[control_pb2.WorkerEvent]) -> list:
    out = []
    for ev in sent:
        if ev.HasField("rank_beats"):
            out.append((ev.rank_beats.job_id, [b.rank for b in ev.rank_beats.beats]))
        else:
            out.append(ev.WhichOneof("event"))
    return out


# ------------------------------------------------------------------ the grid


@pytest.mark.parametrize(
    ("now", "interval", "phase", "wait"),
    [
        (10.2, 1.0, 0.0, 0.8),
        (10.2, 1.0, 0.5, 0.3),
        (10.5, 1.0, 0.5, 1.0),  # due exactly now: it was just sent, the next is a period away
        (10.7, 1.0, 0.5, 0.8),
        (10.0, 0.5, 0.2, 0.1),
        (3.0, 0.0, 0.3, 0.0),  # no period: no wait (the caller's own loop decides)
    ],
)
def test_the_next_beat_is_the_next_grid_point_never_more_than_a_period_away(now, interval, phase, wait):
    assert seconds_to_next_beat(now, interval, phase) == pytest.approx(wait)


def test_ranks_of_one_node_share_a_grid_point_and_nodes_spread_over_the_period():
    phases = [node_phase(f"worker-{i}") for i in range(64)]
    assert phases[3] == node_phase("worker-3") and all(0.0 <= p < 1.0 for p in phases)  # stable
    assert len({round(p, 3) for p in phases}) > 56  # spread, not one instant for every node
    # Two ranks of a node (phase 0.9) that beat 0.58 s apart next beat at the same instant.
    t0 = 1000.0
    first, second = t0 + 0.13, t0 + 0.71
    assert first + seconds_to_next_beat(first, 1.0, 0.9) == pytest.approx(t0 + 0.9)
    assert second + seconds_to_next_beat(second, 1.0, 0.9) == pytest.approx(t0 + 0.9)


@pytest.mark.parametrize(("value", "phase"), [("0.25", 0.25), ("", 0.0), ("x", 0.0), ("1.0", 0.0), ("-0.1", 0.0)])
def test_a_phase_from_the_environment_is_a_fraction_or_none(value, phase):
    assert phase_from({"SURGE_BEAT_PHASE": value} if value else {}) == phase


# ------------------------------------------------------------------ the keeper


def test_a_jobs_beats_go_up_in_one_message_once_every_rank_of_it_here_has_beaten():
    sent: list = []
    keeper = RankBeats(sent.append, window_s=5.0)
    keeper.beat(beat("a", 0), ranks_here=3)
    keeper.beat(beat("b", 4), ranks_here=1)  # another job: its own message, at once
    keeper.beat(beat("a", 2), ranks_here=3)
    keeper.beat(beat("a", 2, step=2), ranks_here=3)  # twice in a window: the newer kept
    assert kinds(sent) == [("b", [4])]
    keeper.beat(beat("a", 1), ranks_here=3)
    assert kinds(sent) == [("b", [4]), ("a", [0, 1, 2])]
    assert [b.heartbeat.step for b in sent[1].rank_beats.beats] == [1, 1, 2]
    assert keeper.sent == 2
    keeper.close()


def test_a_late_or_missing_rank_holds_the_others_no_longer_than_the_window():
    sent: list = []
    arrived = threading.Event()
    keeper = RankBeats(lambda ev: (sent.append((time.monotonic(), ev)), arrived.set()), window_s=0.1)
    t0 = time.monotonic()
    keeper.beat(beat("a", 0), ranks_here=2)  # rank 1 is gone (or late)
    assert arrived.wait(2.0)
    ((at, ev),) = sent
    assert 0.09 <= at - t0 < 1.0 and [b.rank for b in ev.rank_beats.beats] == [0]
    keeper.close()


def test_no_message_about_a_job_overtakes_the_beats_kept_of_it():
    sent: list = []
    keeper = RankBeats(sent.append, window_s=5.0)
    keeper.beat(beat("a", 1), ranks_here=2)
    keeper.beat(beat("b", 0), ranks_here=2)
    # Rank 1 of job a exits: its last beat goes up first, job b's stay kept.
    keeper.emit(control_pb2.WorkerEvent(rank_exited=control_pb2.RankExited(job_id="a", rank=1)))
    assert kinds(sent) == [("a", [1]), "rank_exited"]
    # A message about no one job (memory pressure) follows every beat kept.
    keeper.emit(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(worker_id="w")))
    assert kinds(sent) == [("a", [1]), "rank_exited", ("b", [0]), "memory_pressure"]
    keeper.close()
    keeper.beat(beat("a", 0), ranks_here=1)  # closed: nothing more goes up
    assert len(sent) == 4


# ------------------------------------------------------------------ the agent's own beat


def test_a_beat_sent_alone_out_of_phase_is_followed_by_riding_ones(monkeypatch):
    sent: list = []
    alone: list = []
    clock = [1000.0]
    monkeypatch.setattr(rank_beats.time, "monotonic", lambda: clock[0])
    keeper = RankBeats(sent.append, window_s=5.0)
    keeper.keep_agent_beat(1.0, alone.append)
    with keeper._lock:  # (as the clock thread does when no flush came: alone, at 1000.3)
        clock[0] = 1000.3
        keeper._agent_beat(clock[0])
    for t in (1000.6, 1001.6, 1002.6, 1003.6):  # the ranks' flushes, on their own grid
        clock[0] = t
        keeper.beat(beat("a", 0), ranks_here=1)
    # 1000.6 is too soon after 1000.3; 1001.6 carries it (before 1000.3 + 1.5), and so on.
    assert [ev.rank_beats.HasField("agent") for ev in sent] == [False, True, True, True]
    keeper.close()


def test_the_agents_beat_rides_with_a_flush_when_due_and_only_then():
    sent: list = []
    alone: list = []
    keeper = RankBeats(sent.append, window_s=5.0)
    with keeper._lock:  # (the keeper's clock would send the first alone if it ran before the first flush)
        keeper.keep_agent_beat(10.0, alone.append)  # due at once; a long period: no second one here
        keeper.beat(beat("a", 0), ranks_here=1)
        keeper.beat(beat("b", 0), ranks_here=1)  # the next flush: the agent's beat is a period away
        keeper.beat(beat("a", 0, step=2), ranks_here=1)
    riding = [ev.rank_beats.HasField("agent") for ev in sent]
    assert riding == [True, False, False] and alone == []
    agent = sent[0].rank_beats.agent
    assert agent.interval_seconds == 10.0 and abs(agent.unix_time - time.time()) < 5.0
    assert (keeper.sent, keeper.agent_riding, keeper.agent_alone) == (3, 1, 0)
    keeper.close()


def test_a_flush_half_a_period_after_the_agents_last_beat_carries_the_next_an_earlier_one_does_not(monkeypatch):
    sent: list = []
    clock = [1000.0]
    monkeypatch.setattr(rank_beats.time, "monotonic", lambda: clock[0])
    keeper = RankBeats(sent.append, window_s=5.0)
    with keeper._lock:  # (as above: the first flush before the clock's first look)
        keeper.keep_agent_beat(1.0, lambda ev: None)
        keeper.beat(beat("a", 0), ranks_here=1)  # carries it
    clock[0] = 1000.4  # ranks on a shorter period than the agent's: not this flush
    keeper.beat(beat("a", 0), ranks_here=1)
    clock[0] = 1000.97  # the grid's jitter, a little early: this one
    keeper.beat(beat("a", 0), ranks_here=1)
    assert [ev.rank_beats.HasField("agent") for ev in sent] == [True, False, True]
    keeper.close()


def test_an_idle_nodes_agent_beats_alone_every_period():
    sent: list = []
    alone: list = []
    two = threading.Event()
    keeper = RankBeats(sent.append, window_s=5.0)
    t0 = time.monotonic()
    keeper.keep_agent_beat(0.2, lambda ev: (alone.append((time.monotonic(), ev)), len(alone) >= 2 and two.set()))
    assert two.wait(5.0)
    # No rank beats here: the first goes at once, the next a period after it; each a
    # WorkerEvent.heartbeat, as the session sent it before.
    (t1, first), (t2, second) = alone[:2]
    assert first.WhichOneof("event") == "heartbeat" and first.heartbeat.interval_seconds == 0.2
    assert t1 - t0 < 1.0 and t2 - t1 >= 0.2 - 0.01  # (a loaded machine may wake the clock late)
    assert sent == []
    keeper.close()


def test_the_agents_beat_waits_longer_for_a_ride_only_where_its_ranks_beats_flow(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(rank_beats.time, "monotonic", lambda: clock[0])
    keeper = RankBeats(lambda ev: None, window_s=5.0)
    keeper.keep_agent_beat(1.0, lambda ev: None)
    with keeper._lock:
        keeper._agent_beat(1000.0)
        assert keeper._alone_at() == 1001.0  # idle: a period after the last
    clock[0] = 1000.2
    keeper.beat(beat("a", 0), ranks_here=1)  # (too soon to carry it)
    with keeper._lock:
        assert keeper._alone_at() == 1000.0 + 1 + rank_beats.GRACE  # its ranks beat: a flush may carry it
    keeper.close()


# ------------------------------------------------------------------ control's side


def test_control_stamps_each_beat_of_a_batch_and_queues_it_on_its_jobs_queue():
    applied: list = []

    class Hub:
        def admit(self, session, ev):
            return True

        def on_worker_events(self, burst, admitted=False, wait=True):
            applied.extend(ev for _, ev in burst)

    batch = control_pb2.RankBeats(job_id="j")
    batch.beats.extend([beat("j", 0), beat("j", 1)])
    ev = control_pb2.WorkerEvent(rank_beats=batch, seq=1)
    assert job_of(ev) == "j" and event_kind(ev) == "RankBeats"
    applier = EventApplier(Hub())
    queued = time.monotonic()
    applier.event(SimpleNamespace(worker_id="wa"), ev)
    applier.stop()
    (got,) = applied
    stamps = [b.heartbeat.received_monotonic for b in got.rank_beats.beats]
    assert len(stamps) == 2 and all(queued <= s < queued + 1.0 for s in stamps)


def test_the_hub_relays_each_beat_of_a_batch_to_the_fault_detector_and_fences_an_older_incarnations(tmp_path):
    from tests.control.test_worker_events import open_plane, running_job

    plane, journal = open_plane(tmp_path / "control.db")
    job_id, session, launch = running_job(plane)
    hub = plane.c.sessions
    relayed: list = []
    real = hub._hardware
    hub._hardware = lambda msg: (relayed.append(msg) if isinstance(msg, worker_pb2.RankHeartbeat) else None, real(msg))
    newest = launch.ranks[0].generation
    batch = control_pb2.RankBeats(job_id=job_id)
    batch.beats.extend([beat(job_id, 0, step=3), beat(job_id, 0, step=4)])
    batch.beats[0].generation, batch.beats[1].generation = newest, newest
    hub.on_worker_events([(session, control_pb2.WorkerEvent(rank_beats=batch, seq=2))])
    assert [(b.job_id, b.rank, b.step, b.worker_id) for b in relayed] == [(job_id, 0, 3, "wa"), (job_id, 0, 4, "wa")]
    # Rank 0 is relaunched (a newer generation): a beat of the old incarnation in a batch is
    # dropped, the new one's beside it applied.
    hub.launch_ranks(
        control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=0, generation=newest + 1)]), "wa"
    )
    relayed.clear()
    mixed = control_pb2.RankBeats(job_id=job_id)
    mixed.beats.extend([beat(job_id, 0, step=5), beat(job_id, 0, step=6)])
    mixed.beats[0].generation, mixed.beats[1].generation = newest, newest + 1
    hub.on_worker_events([(session, control_pb2.WorkerEvent(rank_beats=mixed, seq=3))])
    assert [b.step for b in relayed] == [6]
    plane.c.detector.close()  # (no deadline fires into the closed journal after the test)
    journal.close()


def test_control_applies_a_riding_agent_beat_as_one_sent_alone_on_the_node_queue():
    applied: list = []

    class Hub:
        def admit(self, session, ev):
            return True

        def on_worker_events(self, burst, admitted=False, wait=True):
            applied.extend(ev for _, ev in burst)

    batch = control_pb2.RankBeats(job_id="j", agent=control_pb2.AgentHeartbeat(interval_seconds=1.0))
    batch.beats.extend([beat("j", 0)])
    ev = control_pb2.WorkerEvent(rank_beats=batch, seq=7)
    copy = control_pb2.WorkerEvent()
    copy.CopyFrom(ev)
    alone = split_agent_beat(copy)
    assert alone.WhichOneof("event") == "heartbeat" and alone.seq == 0 and not copy.rank_beats.HasField("agent")
    assert job_of(alone) == NODE and split_agent_beat(copy) is None  # taken out: not applied twice
    applier = EventApplier(Hub())
    queued = time.monotonic()
    applier.event(SimpleNamespace(worker_id="wa"), ev)
    applier.stop()
    by_kind = {e.WhichOneof("event"): e for e in applied}
    assert set(by_kind) == {"heartbeat", "rank_beats"} and len(applied) == 2
    agent, beats = by_kind["heartbeat"], by_kind["rank_beats"]
    assert agent.seq == 0 and beats.seq == 7 and not beats.rank_beats.HasField("agent")
    stamp = agent.heartbeat.received_monotonic
    assert queued <= stamp < queued + 1.0 and stamp == beats.rank_beats.beats[0].heartbeat.received_monotonic


@pytest.mark.parametrize("through", ["applier", "hub"])
def test_a_riding_agent_beat_re_arms_the_fault_detectors_agent_deadline(tmp_path, through):
    from tests.control.test_worker_events import open_plane, running_job

    plane, journal = open_plane(tmp_path / "control.db")
    job_id, session, launch = running_job(plane)
    hub, detector = plane.c.sessions, plane.c.detector
    batch = control_pb2.RankBeats(job_id=job_id, agent=control_pb2.AgentHeartbeat(interval_seconds=1.0))
    batch.beats.append(beat(job_id, 0, step=3))
    batch.beats[0].generation = launch.ranks[0].generation
    ev = control_pb2.WorkerEvent(rank_beats=batch, seq=2)
    before = time.monotonic()
    if through == "applier":
        applier = EventApplier(hub)
        applier.event(session, ev)
        applier.stop()
    else:  # a caller that does not split it off (in-process control)
        ev.rank_beats.agent.received_monotonic = before
        hub.on_worker_events([(session, ev)])
    deadline = detector._agents.get("wa")
    last = detector._agent_beats.get("wa")
    assert deadline is not None and last is not None  # armed by the riding beat
    assert last[0] >= before - 1e-6 and last[1] == 1.0  # from its receipt, with its period
    plane.c.detector.close()  # (no deadline fires into the closed journal after the test)
    journal.close()


# ------------------------------------------------------------------ a real node agent


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_real_agents_own_beat_rides_with_its_ranks_beats(cluster):  # noqa: F811
    from tests.worker.test_node_agent import launch

    control = cluster.control()
    cluster.agent(control.port, "--slots", "2")
    control.servicer.registration()
    launch(control.servicer, "bj", "beat", world_size=2)
    # Two ranks beat every second on the node's grid; the agent's beat, on the same period,
    # rides with their flush once it has locked on (a lone beat or two before that).
    riding, alone, deadline = 0, 0, time.monotonic() + 30
    while riding < 4:
        assert time.monotonic() < deadline, (riding, alone)
        ev = control.servicer.next_event(timeout=10)
        if ev.WhichOneof("event") == "rank_event" and ev.rank_event.HasField("hello"):
            cluster.track(ev.rank_event.hello.pid)  # (ended by PID after the test)
        if ev.WhichOneof("event") != "rank_beats":
            continue  # (a hello, a TrainingLoopStarted: one rank may beat before the other started)
        assert ev.rank_beats.job_id == "bj" and ev.seq == 0  # (a fact: in stream order, never acknowledged)
        if ev.rank_beats.HasField("agent"):
            riding += 1
            assert ev.rank_beats.agent.interval_seconds == 1.0 and ev.rank_beats.agent.unix_time > 0
        while not control.servicer.beats.empty():
            control.servicer.beats.get()
            alone += riding > 0  # (before the first ride, while the ranks start, it beats alone)
    assert riding >= 4 and alone <= riding  # (a loaded machine may make a flush late: that beat goes alone)


def test_with_datagrams_a_ranks_progress_only_beats_ride_the_agents_datagram_and_the_rest_the_session():
    # hb37: the ranks' beats that only move their progress go in the agent's liveness datagram
    # (services/common/liveness_progress.py); its first beat of a session and a change go up the session.
    from services.common.liveness_progress import ProgressSplit, pack
    from services.contract import control_pb2 as pb

    sent: list = []
    datagrams: list = []
    split = ProgressSplit()

    def ride(job, beats):  # as ControlSession._ride: the split, then one datagram of what rides
        riding, left = split.split(job, beats)
        if not riding:
            return beats, False
        packed, unfit = pack(job, riding)
        datagrams.append(pb.LivenessProgress.FromString(packed))
        return left + unfit, True

    keeper = RankBeats(sent.append, window_s=5.0)
    with keeper._lock:
        keeper.keep_agent_beat(10.0, lambda ev: None, ride=False, progress=ride)
        keeper.beat(beat("a", 0), ranks_here=2)
        keeper.beat(beat("a", 1), ranks_here=2)  # both firsts: the session
        keeper.beat(beat("a", 0, step=2), ranks_here=2)
        keeper.beat(beat("a", 1, step=2), ranks_here=2)  # progress only: one datagram, nothing on the session
        staging = beat("a", 1, step=3)
        staging.heartbeat.phase = worker_pb2.PHASE_CHECKPOINT_STAGING
        keeper.beat(beat("a", 0, step=3), ranks_here=2)
        keeper.beat(staging, ranks_here=2)  # rank 1 enters a phase L1-3 decides on: the session
    assert kinds(sent) == [("a", [0, 1]), ("a", [1])]
    assert [[(b.rank, b.heartbeat.step) for b in d.jobs[0].beats] for d in datagrams] == [[(0, 2), (1, 2)], [(0, 3)]]
    assert all(not b.heartbeat.job_id and not b.heartbeat.worker_id for d in datagrams for b in d.jobs[0].beats)
    assert keeper.agent_riding == 2  # (each datagram was the agent's beat of its period)
    keeper.close()
