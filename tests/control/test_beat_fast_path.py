"""A node agent's beat that changes nothing is taken on the loop that reads it (a stamp and its
silence deadline moved: services/control/beat_stamps.py), never queued for the event applier;
one that changes something is applied, in order with the agent's other messages. And L1-3
holds its agent_silent verdicts while control is behind or most agents go quiet at once
(services/control/fault_detector/disruption.py): slowness is never death. In process: the
real applier, stamps and detector; nothing here asserts a duration."""

from __future__ import annotations

import threading
import time

import pytest

from services.contract import Module, control_pb2, worker_pb2
from services.contract.bus import Bus
from services.control.beat_stamps import BeatStamps
from services.control.event_applier import NODE, EventApplier
from services.control.fault_detector import FaultDetector
from services.control.fault_detector.rules import AGENT_MISSED_BEATS
from services.control.session_hub import AgentSession

from .test_event_applier import rank_beats
from .test_fault_detector import Reports

pytestmark = pytest.mark.timeout(60)


class DetectorHub:
    """What the applier hands a session hub: every message applied, in order; an agent's own
    beat goes on to L1-3 as the real hub's relay sends it (``on_agent_heartbeat``)."""

    def __init__(self, detector: FaultDetector):
        self.applied: list[control_pb2.WorkerEvent] = []
        self._detector = detector

    def admit(self, session, ev) -> bool:
        return True

    def on_worker_events(self, burst, admitted=False, wait=True) -> None:
        for session, ev in burst:
            self.applied.append(ev)
            beat = ev.heartbeat if ev.HasField("heartbeat") else None
            if ev.HasField("rank_beats") and ev.rank_beats.HasField("agent"):
                beat = ev.rank_beats.agent
            if beat is not None:
                beat.worker_id = session.worker_id
                self._detector.on_agent_heartbeat(beat)


def drained(applier: EventApplier, *keys: str) -> None:
    """Returns once everything queued on ``keys`` before it is applied."""
    done = [threading.Event() for _ in keys]
    for key, event in zip(keys, done, strict=True):
        applier.call(event.set, key)
    assert all(event.wait(10) for event in done)


def agent_beat(period: float = 1.0) -> control_pb2.WorkerEvent:
    return control_pb2.WorkerEvent(heartbeat=control_pb2.AgentHeartbeat(interval_seconds=period, unix_time=time.time()))


def test_a_liveness_only_agent_beat_never_reaches_the_applier_and_one_with_a_change_does_in_order():
    # 10,000 agents at 1 Hz: every agent beat was a message on the node queue, applied by a
    # pool thread through the hub, the bus and L1-3's lock (~340 us a beat on a 2-core host):
    # control read 2,000 of 10,000 beats a second and declared healthy agents silent.
    bus = Bus()
    stamps = BeatStamps()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR), stamps=stamps)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    hub = DetectorHub(detector)
    applier = EventApplier(hub, workers=2, stamps=stamps)
    session = AgentSession("wa")
    try:
        applier.event(session, agent_beat())  # the first: L1-3 arms its deadline (applied)
        drained(applier, NODE)
        assert [ev.WhichOneof("event") for ev in hub.applied] == ["heartbeat"]
        armed = stamps.last("wa")
        assert armed is not None

        applier.event(session, agent_beat())  # alive, same period: a stamp, no message
        applier.event(session, rank_beats("j", 1))  # its ranks' beats go on; the riding agent beat does not
        drained(applier, NODE, "j")
        assert [ev.WhichOneof("event") for ev in hub.applied] == ["heartbeat", "rank_beats"]
        assert not hub.applied[1].rank_beats.HasField("agent")
        assert [b.rank for b in hub.applied[1].rank_beats.beats] == [0, 1]
        assert stamps.last("wa") > armed and stamps.taken == 2

        # A beat that changes something (a new period) is applied, behind what the agent's
        # stream sent before it on the node queue.
        pressure = control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=1))
        applier.event(session, pressure)
        applier.event(session, agent_beat(period=2.0))
        drained(applier, NODE)
        kinds = [ev.WhichOneof("event") for ev in hub.applied]
        assert kinds == ["heartbeat", "rank_beats", "memory_pressure", "heartbeat"], kinds
        assert hub.applied[-1].heartbeat.interval_seconds == 2.0
        applier.event(session, agent_beat(period=2.0))  # (steady again at its new period)
        drained(applier, NODE)
        assert len(hub.applied) == 4 and stamps.taken == 3
        assert list(reports) == []
    finally:
        applier.stop()
        detector.close()


def test_a_stamped_beat_moves_the_agents_deadline_and_one_declared_silent_is_cleared_by_its_next_beat():
    bus = Bus()
    stamps = BeatStamps()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR), stamps=stamps)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    try:
        wait = AGENT_MISSED_BEATS * 1.0
        received = time.monotonic() - (wait - 2.0)  # its last beat applied: its deadline 2 s away
        detector.on_agent_heartbeat(
            control_pb2.AgentHeartbeat(worker_id="wa", interval_seconds=1.0, received_monotonic=received)
        )
        before = detector._agents["wa"][1].when
        assert stamps.beat("wa", 1.0, received + 0.5)  # a beat read half a second later: stamped
        assert detector._agents["wa"][1].when - before == pytest.approx(0.5, abs=0.05)  # moved with it
        assert stamps.beat("wa", 2.0, received + 0.6) is False  # a new period: applied, not stamped
        (silent,) = reports.wait(1)  # no beat since the stamp: declared, counted from the stamp
        assert (silent.fault_class, silent.worker_id, silent.cleared) == ("agent_silent", "wa", False)
        assert silent.occurred_unix < silent.detected_unix - wait + 0.5
        # Its last beat heard is the stamp's (a rank of it silent later says how long it was quiet).
        assert detector._agent_beats["wa"][0] == received + 0.5
        # Declared: its next beat is no stamp (it must reach L1-3, which reports it cleared).
        assert stamps.beat("wa", 1.0, time.monotonic()) is False
        detector.on_agent_heartbeat(
            control_pb2.AgentHeartbeat(worker_id="wa", interval_seconds=1.0, received_monotonic=time.monotonic())
        )
        cleared = reports.wait(2)[1]
        assert (cleared.fault_class, cleared.cleared) == ("agent_silent", True)
    finally:
        detector.close()


# ------------------------------------------------------------------ held verdicts


class Lag:
    """Control's health as L1-3 reads it (``ControlHealth.behind``), set by the test."""

    def __init__(self):
        self.value: tuple[str, float] | None = None

    def behind(self, limit_s: float, now: float | None = None) -> tuple[str, float] | None:
        return self.value


def detector_of(n: int, quiet: set[str], health=None, period: float = 2.0):
    """A detector watching agents w0..w{n-1}: those in ``quiet`` beat last ``period *
    AGENT_MISSED_BEATS - 0.2`` s ago (their deadlines pass in 0.2 s), the others now (a
    full deadline away, ten seconds: far beyond what the test waits)."""
    bus = Bus()
    stamps = BeatStamps()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR), stamps=stamps, health=health)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    wait = AGENT_MISSED_BEATS * period
    for i in range(n):
        worker = f"w{i}"
        received = time.monotonic() - (wait - 0.2 if worker in quiet else 0.0)
        beat = control_pb2.AgentHeartbeat(worker_id=worker, interval_seconds=period, received_monotonic=received)
        detector.on_agent_heartbeat(beat)
    return detector, stamps, reports


def beat(detector: FaultDetector, worker: str, period: float = 2.0) -> None:
    detector.on_agent_heartbeat(
        control_pb2.AgentHeartbeat(worker_id=worker, interval_seconds=period, received_monotonic=time.monotonic())
    )


def held(detector: FaultDetector, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(detector._held_agents) < n:
        assert time.monotonic() < deadline, f"{len(detector._held_agents)} verdicts held, expected {n}"
        time.sleep(0.02)


def test_one_agent_silent_among_many_that_beat_is_declared():
    detector, _, reports = detector_of(20, quiet={"w3"})
    try:
        (silent,) = reports.wait(1)
        assert (silent.fault_class, silent.worker_id) == ("agent_silent", "w3")
        assert detector._held_agents == {}
    finally:
        detector.close()


def test_most_agents_quiet_at_once_are_held_and_once_most_beat_again_only_the_really_silent_are_declared():
    # The Kubernetes node lifecycle controller's full disruption: most nodes not ready at once
    # is likelier the controller's (or the network's) fault than theirs; no eviction storm.
    quiet = {f"w{i}" for i in range(15)}
    detector, stamps, reports = detector_of(20, quiet=quiet)
    try:
        held(detector, 15)
        assert list(reports) == []
        # Ten of them beat again (their deadlines ran: the beats are applied, not stamped):
        # 5 of 20 still quiet is no disruption to begin, but does not end one either (starved
        # agents come back in waves: the rest would be declared by the thousand).
        for i in range(10):
            assert stamps.beat(f"w{i}", 2.0, time.monotonic()) is False
            beat(detector, f"w{i}")
        detector._share_cache = None  # (counted afresh now, not within half a second)
        assert detector._verdicts_held_because()[0] == "disruption"
        assert list(reports) == []
        # All but one beat again: 1 of 20 quiet ends it; only that one is declared.
        for i in range(10, 14):
            beat(detector, f"w{i}")
        (silent,) = reports.wait(1, timeout=15)
        assert (silent.fault_class, silent.worker_id, silent.cleared) == ("agent_silent", "w14", False)
        assert detector._held_agents == {}
    finally:
        detector.close()


def test_control_behind_holds_a_silence_verdict_and_catching_up_declares_only_the_agent_still_quiet():
    lag = Lag()
    lag.value = ("loop", 4.0)  # control's loop is 4 s behind: the beats may be waiting unread
    detector, stamps, reports = detector_of(3, quiet={"w0", "w1"}, health=lag)
    try:
        held(detector, 2)
        assert list(reports) == []
        beat(detector, "w0")  # w0's beat, read as control catches up
        lag.value = None
        (silent,) = reports.wait(1, timeout=15)
        assert (silent.fault_class, silent.worker_id) == ("agent_silent", "w1")
        assert detector._held_agents == {}
        time.sleep(0.2)
        assert len(reports) == 1  # (w0 is armed again, not declared)
    finally:
        detector.close()


def test_control_behind_holds_a_ranks_silence_verdict_and_catching_up_declares_only_the_rank_still_quiet():
    # 10,000 agents, control reading a fifth of their beats: a rank_silent cascade ("no
    # heartbeat for 18.2 s") of ranks that beat all along (session 34).
    lag = Lag()
    lag.value = ("loop", 4.0)
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR), health=lag)
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    bus.subscribe(Module.L1_FAULT_DETECTOR, worker_pb2.RankHeartbeat, detector.on_rank_heartbeat)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    timeouts = {"j": 2.0, "k": 30.0}  # (k's rank, once it beat again, is far from its next deadline)
    for job_id, timeout in timeouts.items():
        monitor = control_pb2.StartFaultMonitoring(job_id=job_id, heartbeat_timeout_seconds=timeout)
        bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, monitor)

    def rank_beat(job_id: str, ago: float) -> None:
        msg = worker_pb2.RankHeartbeat(job_id=job_id, rank=0, worker_id="w", received_monotonic=time.monotonic() - ago)
        bus.publish(Module.EXT_HARDWARE, msg)

    try:
        for job_id, timeout in timeouts.items():
            rank_beat(job_id, ago=timeout - 0.2)  # both deadlines pass in 0.2 s
        deadline = time.monotonic() + 10
        while len(detector._held_ranks) < 2:
            assert time.monotonic() < deadline, detector._held_ranks
            time.sleep(0.02)
        assert list(reports) == []
        rank_beat("k", ago=0.0)  # k's rank beats again (read as control catches up)
        lag.value = None
        (silent,) = reports.wait(1, timeout=15)
        assert (silent.job_id, silent.fault_class, silent.rank) == ("j", "rank_silent", 0), silent
        assert detector._held_ranks == {}
    finally:
        detector.close()
