"""Losing the liveness datagram path makes no healthy agent look dead
(services/control/liveness_datagrams.py): control tells each session it no longer hears to beat
on its stream (``BeatOnSession``) well inside the silence deadline, and if the agents cannot
switch in time (all quiet at once) L1-3's disruption hold keeps their verdicts. In process: the
real liveness socket on 127.0.0.1, the agent's own sender, the real stamps, applier and
detector; the agents' gRPC beats are the applier's ``event`` (what the session's reader calls)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from services.contract import Module, control_pb2
from services.contract.bus import Bus
from services.control.beat_stamps import BeatStamps
from services.control.event_applier import EventApplier
from services.control.fault_detector import FaultDetector
from services.control.liveness_datagrams import LivenessDatagrams
from services.control.session_hub import AgentSession
from services.worker.liveness_sender import LivenessSender
from tests.ports import free_port

from .test_beat_fast_path import DetectorHub, agent_beat
from .test_fault_detector import Reports

pytestmark = pytest.mark.timeout(60)

AGENTS = 20


class Cluster:
    """``AGENTS`` agents beating as datagrams every 0.5 s (period 1 s: deadline 5 s) to a real
    liveness socket; ``cut()`` sends their datagrams to a port nothing reads (a firewall).
    Those in ``obey`` beat on their session (the applier) once told ``BeatOnSession``."""

    def __init__(self, obey: set[str]):
        bus = Bus()
        self.stamps = BeatStamps()
        self.detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR), stamps=self.stamps)
        self.reports = Reports()
        bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, self.reports.add)
        self.applier = EventApplier(DetectorHub(self.detector), workers=2, stamps=self.stamps)
        self.liveness = LivenessDatagrams(self.stamps, self.applier.events, "127.0.0.1", 0)
        self.liveness.start()
        self.sessions = [AgentSession(f"w{i}") for i in range(AGENTS)]
        self._grants = [self.liveness.grant(s) for s in self.sessions]
        self.senders = [LivenessSender(g, "127.0.0.1") for g in self._grants]
        self.told: dict[str, float] = {}  # worker -> when its session was told BeatOnSession
        self._obey = obey
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def cut(self, n: int = AGENTS) -> None:
        """From now on the first ``n`` agents' datagrams go to a port nothing reads (the kernel
        drops them)."""
        dead = free_port()
        old, self.senders = self.senders, list(self.senders)
        for i, grant in enumerate(self._grants[:n]):
            lost = control_pb2.LivenessGrant()
            lost.CopyFrom(grant)
            lost.port = dead
            self.senders[i] = LivenessSender(lost, "127.0.0.1")
        for sender in old[:n]:
            sender.close()

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            for session, sender in zip(self.sessions, self.senders, strict=True):
                while True:  # the session's commands, as its stream would carry them
                    try:
                        cmd = session.commands.get_nowait()
                    except queue.Empty:
                        break
                    if cmd is not None and cmd.HasField("beat_on_session"):
                        self.told.setdefault(session.worker_id, time.monotonic())
                if session.worker_id in self.told and session.worker_id in self._obey:
                    self.applier.event(session, agent_beat())  # on its session now
                else:
                    sender.send(1.0, time.time())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.liveness.close()
        for sender in self.senders:
            sender.close()
        self.detector.close()
        self.applier.stop()


def armed(cluster: Cluster) -> None:
    deadline = time.monotonic() + 10
    while not all(cluster.stamps.last(s.worker_id) for s in cluster.sessions):
        assert time.monotonic() < deadline, "not every agent armed by its datagrams in 10 s"
        time.sleep(0.05)


def test_datagrams_cut_every_healthy_agent_switches_to_its_session_in_time_and_only_the_dead_one_is_declared():
    cluster = Cluster(obey={f"w{i}" for i in range(1, AGENTS)})  # w0 is dead: it never beats again
    try:
        armed(cluster)
        cut = time.monotonic()
        cluster.cut()
        (silent,) = cluster.reports.wait(1, timeout=20)
        assert (silent.fault_class, silent.worker_id, silent.cleared) == ("agent_silent", "w0", False)
        assert set(cluster.told) == {s.worker_id for s in cluster.sessions}  # every session told once
        assert max(cluster.told.values()) - cut < 5.0  # (inside the 5 s deadline, whatever the load)
        assert cluster.detector._held_agents == {}
    finally:
        cluster.close()
    assert len(cluster.reports) == 1


def test_datagrams_cut_and_no_agent_switching_in_time_their_verdicts_are_held_as_a_disruption():
    cluster = Cluster(obey=set())  # told, none beats on its session (their streams backed up)
    try:
        armed(cluster)
        cluster.cut()
        deadline = time.monotonic() + 20
        while len(cluster.detector._held_agents) < AGENTS:  # every deadline passed, every verdict held
            assert time.monotonic() < deadline, f"{len(cluster.detector._held_agents)} held, expected {AGENTS}"
            time.sleep(0.05)
        assert list(cluster.reports) == []
        assert set(cluster.told) == {s.worker_id for s in cluster.sessions}
    finally:
        cluster.close()


def test_most_agents_unheard_while_the_others_are_read_is_no_fallback_and_their_verdicts_are_held():
    # A starved machine, not twelve blocked paths: switching them would feed the starvation.
    cluster = Cluster(obey=set())
    try:
        armed(cluster)
        cluster.cut(12)  # 12 of 20 unheard, 8 still read
        deadline = time.monotonic() + 20
        while len(cluster.detector._held_agents) < 12:  # their deadlines (5 s) passed: held, not declared
            assert time.monotonic() < deadline, f"{len(cluster.detector._held_agents)} held, expected 12"
            time.sleep(0.05)
        assert cluster.told == {}  # (the 2 s fallback point passed 3 s before the deadlines did)
        assert list(cluster.reports) == []
    finally:
        cluster.close()
