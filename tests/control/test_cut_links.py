"""Cut links (issue 29 item 5): how L1-3 combines the two ends' views of a data-plane link and
grades a collective across a cut one (``link_down``, naming both nodes) or a lossy one
(``link_degraded``); how L1-1 picks the node a relaunch leaves out; which peers each node
agent probes; and the probe itself on loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from services.contract import Module, control_pb2, engine_pb2, worker_pb2
from services.contract.bus import Bus
from services.contract.relay import pack, unpack
from services.control import fault_decision as fd
from services.control.fault_detector import DEFAULT_RULES, FaultDetector
from services.control.fault_detector.links import combine
from services.control.resource_allocator.slots import _link_probe, _Worker
from services.jobspec import DEFAULT_CLASS_ACTIONS, FaultPolicySpec, LinksSpec
from services.worker.link_probe import LinkProber

from .conftest import drain
from .test_fault_detector import Reports
from .test_fault_policy import decisions, running

FaultGrade = control_pb2.FaultGrade
Link = control_pb2.LinkStateChanged
UP, DEGRADED, DOWN, FORGET = Link.UP, Link.DEGRADED, Link.DOWN, Link.STATE_UNSPECIFIED
pytestmark = pytest.mark.timeout(30)


# ---------------------------------------------------------------- the grading table


@pytest.mark.parametrize(
    ("a", "b", "link"),
    [
        (UP, UP, UP),
        (DOWN, DOWN, DOWN),  # cut both ways
        (DOWN, DEGRADED, DEGRADED),  # one way: one end still hears the other's probes
        (DEGRADED, DOWN, DEGRADED),
        (DEGRADED, UP, DEGRADED),
        (DEGRADED, DEGRADED, DEGRADED),
        (DOWN, UP, None),  # undecided until the other end's view arrives
        (UP, DOWN, None),
    ],
)
def test_a_links_state_combines_both_ends_views(a, b, link):
    assert combine(a, b) == link


def test_link_classes_are_graded_and_decided_by_default():
    assert DEFAULT_RULES["link_down"] == FaultGrade.SEVERE
    assert DEFAULT_RULES["link_degraded"] == FaultGrade.MINOR
    assert DEFAULT_CLASS_ACTIONS["link_down"] == "exclude_node"
    policy = FaultPolicySpec()
    assert policy.action_for("link_degraded", "MINOR") == "ignore"


# ---------------------------------------------------------------- L1-3


def wired(**deadlines) -> tuple[Bus, Reports]:
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR))
    for msg_type, handler in (
        (control_pb2.StartFaultMonitoring, detector.start_fault_monitoring),
        (control_pb2.ResetFaultLedger, detector.reset_fault_ledger),
        (worker_pb2.RankHeartbeat, detector.on_rank_heartbeat),
        (control_pb2.LinkStateChanged, detector.on_link_state_changed),
        (control_pb2.AgentHeartbeat, detector.on_agent_heartbeat),
        (control_pb2.WorkerRegistration, detector.on_worker_registration),
        (engine_pb2.TrainingLoopFailed, detector.on_training_loop_failed),
    ):
        bus.subscribe(Module.L1_FAULT_DETECTOR, msg_type, handler)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    bus.command(
        Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j", **deadlines)
    )
    return bus, reports


def beat(bus: Bus, rank: int, worker: str, phase: int = worker_pb2.PHASE_COLLECTIVE, step: int = 3) -> None:
    bus.publish(
        Module.EXT_HARDWARE,
        worker_pb2.RankHeartbeat(
            job_id="j", rank=rank, step=step, stepping=True, step_seconds=0.01, worker_id=worker,
            interval_seconds=0.2, phase=phase,  # (beats every 0.05 s: quiet only after 0.3 s, even under load)
        ),
    )  # fmt: skip


def link(bus: Bus, me: str, peer: str, state: int, rt: float = 1.0, inbound: float = 1.0) -> None:
    fact = Link(worker_id=me, peer_worker_id=peer, state=state, round_trip_loss=rt, inbound_loss=inbound)
    bus.publish(Module.EXT_HARDWARE, fact)


def beating(bus: Bus, placement: dict[int, str]):
    """Every rank beats (in a collective, no progress) from a thread until the returned stop."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.05):
            for rank, worker in placement.items():
                beat(bus, rank, worker)

    for rank, worker in placement.items():
        beat(bus, rank, worker)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lambda: (stop.set(), t.join())


def test_a_collective_stalled_across_a_link_both_ends_say_is_down_is_link_down_naming_both_nodes():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01)
    stop = beating(bus, {0: "w1", 1: "w2"})
    try:
        link(bus, "w1", "w2", DOWN)
        link(bus, "w2", "w1", DOWN)
        report = reports.wait(1)[0]
        time.sleep(0.6)  # (the other rank's deadline passes too: it waits for the same link)
    finally:
        stop()
    assert (report.fault_class, report.grade) == ("link_down", FaultGrade.SEVERE)
    assert [(e.worker_id, e.links_down) for e in report.link_ends] == [("w1", 1), ("w2", 1)]
    assert "w1 <-> w2" in report.detail
    assert [r.fault_class for r in reports] == ["link_down"]  # one report: no rank is blamed


def test_a_stall_with_the_link_only_one_end_says_is_down_is_a_stall_of_its_ranks():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01)
    stop = beating(bus, {0: "w1", 1: "w2"})
    try:
        link(bus, "w1", "w2", DOWN)  # the other end has not said (undecided): not a cut link
        first = reports.wait(1)[0]
    finally:
        stop()
    assert first.fault_class == "rank_stalled_in_collective"


def test_a_down_link_between_other_nodes_does_not_grade_this_jobs_stall():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01)
    link(bus, "w1", "w9", DOWN)
    link(bus, "w9", "w1", DOWN)
    stop = beating(bus, {0: "w1", 1: "w2"})
    try:
        first = reports.wait(1)[0]
    finally:
        stop()
    assert first.fault_class == "rank_stalled_in_collective"


def test_a_collective_error_across_a_cut_link_is_link_down_at_once():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=30, attribution_seconds=2.0)
    stop = beating(bus, {0: "w1", 1: "w2"})
    try:
        link(bus, "w1", "w2", DOWN)
        link(bus, "w2", "w1", DOWN)
        t0 = time.monotonic()
        failed = engine_pb2.TrainingLoopFailed(job_id="j", rank=1, step=3, fault_class="comm_error", detail="timed out")
        bus.publish(Module.L2_TRAINING_LOOP, failed)
        (report,) = reports.wait(1)
    finally:
        stop()
    assert report.fault_class == "link_down" and report.rank == 1
    assert time.monotonic() - t0 < 1.0  # a cause: not held for the attribution window (2 s)


def test_a_degraded_link_is_a_warning_for_each_job_across_it_once_per_change():
    bus, reports = wired()
    beat(bus, 0, "w1", phase=worker_pb2.PHASE_FORWARD)
    beat(bus, 1, "w2", phase=worker_pb2.PHASE_FORWARD)
    link(bus, "w1", "w2", DEGRADED, rt=0.6, inbound=0.0)  # one way: w1's probes lost
    link(bus, "w2", "w1", DOWN, rt=1.0, inbound=1.0)  # (w2 hears nothing of w1: still one way)
    link(bus, "w1", "w2", DEGRADED, rt=0.7, inbound=0.0)  # no change of the link's state
    (report,) = reports.wait(1)
    assert (report.fault_class, report.grade) == ("link_degraded", FaultGrade.MINOR)
    assert {e.worker_id for e in report.link_ends} == {"w1", "w2"}
    time.sleep(0.1)
    assert len(reports) == 1
    link(bus, "w1", "w2", UP, rt=0.0, inbound=0.0)
    link(bus, "w2", "w1", FORGET)  # no longer probed: its view is forgotten, the link is up
    link(bus, "w1", "w2", DEGRADED, rt=0.5, inbound=0.1)
    # (up at one end, down at the other: undecided; the other's view forgotten: up, cleared)
    assert [(r.fault_class, r.cleared) for r in reports.wait(3)] == [
        ("link_degraded", False),
        ("link_degraded", True),
        ("link_degraded", False),
    ]


def _agent_beats(bus: Bus, workers: dict[str, threading.Event]) -> callable:
    """Each worker's node agent beats every 0.1 s while its event is set (cleared: paused)."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.1):
            for worker, live in workers.items():
                if live.is_set():
                    beat = control_pb2.AgentHeartbeat(
                        worker_id=worker, interval_seconds=0.1, received_monotonic=time.monotonic()
                    )
                    bus.publish(Module.EXT_HARDWARE, beat)

    threading.Thread(target=run, daemon=True).start()
    return stop.set


def test_a_lossy_link_while_an_end_s_node_agent_is_paused_is_that_pause_not_a_degraded_link():
    # The probes live in the agents: w2's agent paused (a SIGSTOP, a debugger) stops answering
    # w1's probes, and its beats to control stop too. Held, then dropped; a loss that outlasts
    # the pause is reported once the agents beat on. (Other reports, e.g. the ranks' silence
    # here, are not this test's.)
    bus, reports = wired(heartbeat_timeout_seconds=60.0)
    beat(bus, 0, "w1", phase=worker_pb2.PHASE_FORWARD)
    beat(bus, 1, "w2", phase=worker_pb2.PHASE_FORWARD)

    def degraded() -> list:
        return [r for r in list(reports) if r.fault_class == "link_degraded"]

    agents = {"w1": threading.Event(), "w2": threading.Event()}
    for live in agents.values():
        live.set()
    stop = _agent_beats(bus, agents)
    try:
        time.sleep(0.3)
        agents["w2"].clear()  # paused
        time.sleep(0.3)
        lossy = Link(worker_id="w1", peer_worker_id="w2", state=DEGRADED, round_trip_loss=0.4, inbound_loss=0.4)
        lossy.window_seconds = 1.0  # (the probes' window: the hold)
        bus.publish(Module.EXT_HARDWARE, lossy)
        time.sleep(1.3)  # past the hold: w2's agent is quiet, nothing reported
        assert degraded() == []
        agents["w2"].set()  # back; the link stays lossy (it was the pause, or it is real)
        time.sleep(0.5)  # held again: w2's quiet spell ended within the probes' window
        assert degraded() == []
        deadline = time.monotonic() + 8.0
        while not degraded():  # it outlasted the pause: the link's
            assert time.monotonic() < deadline, "a loss that outlasted the pause was never reported"
            time.sleep(0.05)
    finally:
        stop()
    (report,) = degraded()
    assert not report.cleared


def test_a_node_agent_registering_again_forgets_its_views():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01)
    link(bus, "w1", "w2", DOWN)
    link(bus, "w2", "w1", DOWN)
    reg = control_pb2.WorkerRegistration(worker_id="w2", slots=1, address="10.0.0.2:1")
    bus.publish(Module.EXT_HARDWARE, reg)  # a new incarnation: it restates what it still sees
    stop = beating(bus, {0: "w1", 1: "w2"})
    try:
        first = reports.wait(1)[0]
    finally:
        stop()
    assert first.fault_class == "rank_stalled_in_collective"


# ---------------------------------------------------------------- L1-1


def _link_report(ends: list[tuple[str, int]], rank0: str = "") -> control_pb2.FaultReport:
    report = control_pb2.FaultReport(
        job_id="j", fault_class="link_down", grade=FaultGrade.SEVERE, rank=1, worker_id="w2", detail="cut"
    )
    for worker_id, down in ends:
        report.link_ends.add(worker_id=worker_id, links_down=down)
    return report


@pytest.mark.parametrize(
    ("ends", "rank0", "left_out"),
    [
        ([("w1", 1), ("w2", 1)], "w1", "w2"),  # a tie: the end not hosting rank 0
        ([("w1", 1), ("w2", 1)], "w2", "w1"),
        ([("w1", 3), ("w2", 1)], "w1", "w1"),  # more links down: likelier the broken node, rank 0 or not
        ([("w1", 1), ("w2", 2)], "w9", "w2"),
        ([("w1", 1), ("w2", 1)], "", "w2"),  # rank 0's node unknown: a fixed order
    ],
)
def test_a_cut_link_relaunch_leaves_out_the_end_with_more_links_down_else_the_one_without_rank_0(ends, rank0, left_out):
    assert fd.link_endpoint(_link_report(ends), rank0) == left_out
    view = fd.JobView(restarts={}, ignored={}, rank0_worker_id=rank0)
    decision = fd.decide(FaultPolicySpec(), view, _link_report(ends))
    assert (decision.action, decision.exclude) == ("exclude_node", (left_out,))
    assert decision.text.startswith("exclude_node after link_down") and f"excluding {left_out}" in decision.text


# ---------------------------------------------------------------- L1-2: who probes whom


def _workers(n: int) -> dict[str, _Worker]:
    return {
        f"w{i}": _Worker(control_pb2.WorkerRegistration(worker_id=f"w{i}", address=f"10.0.0.{i}:7000", slots=1))
        for i in range(n)
    }


def test_each_node_probes_its_ring_neighbours_and_rank_0s_node_which_probes_all():
    workers = _workers(8)
    rank_nodes = [f"w{i}" for i in range(8)]
    live = LinksSpec(probe_seconds=0.5)
    peers = {w: [p.worker_id for p in _link_probe(live, rank_nodes, workers, w).peers] for w in rank_nodes}
    assert peers["w0"] == [f"w{i}" for i in range(1, 8)]
    assert peers["w4"] == ["w0", "w3", "w5"]
    assert all(len(p) <= 3 for w, p in peers.items() if w != "w0")
    assert all(w in peers[p] for w, ps in peers.items() for p in ps)  # both ends of a link probe it
    probe = _link_probe(live, rank_nodes, workers, "w4")
    assert (probe.interval_seconds, probe.down_probes, probe.peers[0].address) == (0.5, 3, "10.0.0.0:7000")
    assert _link_probe(live, ["w1", "w1"], workers, "w1") is None  # one node: no link


def test_link_probe_settings_are_range_checked():
    with pytest.raises(ValueError, match="probe_seconds"):
        LinksSpec(probe_seconds=0)
    with pytest.raises(ValueError, match="degraded_loss"):
        LinksSpec(degraded_loss=1.0)
    with pytest.raises(ValueError, match="down_probes"):
        LinksSpec(down_probes=1)


# ---------------------------------------------------------------- the node agent's probe


class _Facts(list):
    def __init__(self):
        super().__init__()
        self._cond = threading.Condition()

    def put(self, event: control_pb2.WorkerEvent) -> None:
        fact = unpack(event.routed)
        assert isinstance(fact, control_pb2.LinkStateChanged)
        with self._cond:
            self.append(fact)
            self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 5.0) -> control_pb2.LinkStateChanged:
        with self._cond:
            assert self._cond.wait_for(lambda: any(pred(f) for f in self), timeout), list(self)
            return next(f for f in self if pred(f))


class _Log:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_probes_on_loopback_see_a_link_up_then_down_when_the_peer_goes_silent_then_forget_it():
    facts = _Facts()
    pa, pb = _free_udp_port(), _free_udp_port()
    a = LinkProber("a", "127.0.0.1", pa, facts.put, _Log())
    b = LinkProber("b", "127.0.0.1", pb, lambda e: None, _Log())
    probe = control_pb2.LinkProbe(interval_seconds=0.05, degraded_loss=0.2, down_probes=3)
    probe_a, probe_b = control_pb2.LinkProbe(), control_pb2.LinkProbe()
    probe_a.CopyFrom(probe), probe_b.CopyFrom(probe)
    probe_a.peers.add(worker_id="b", address=f"127.0.0.1:{pb}")
    probe_b.peers.add(worker_id="a", address=f"127.0.0.1:{pa}")
    a.set_peers("j", probe_a), b.set_peers("j", probe_b)
    a.start(), b.start()
    try:
        time.sleep(0.8)  # answered: no statement (up is where every link starts)
        assert list(facts) == []
        b.stop()  # nothing either way from b now
        down = facts.wait_for(lambda f: f.state == DOWN)
        # (the losses are over the window of 10 probes: the last 3 at least were lost both ways)
        assert (down.worker_id, down.peer_worker_id) == ("a", "b")
        assert down.round_trip_loss >= 0.3 and down.inbound_loss >= 0.3, down
        a.forget("j")
        facts.wait_for(lambda f: f.state == FORGET)
    finally:
        a.stop()


# ---------------------------------------------------------------- through the control plane


def _fact(plane, session, me: str, peer: str, state: int, loss: float) -> None:
    fact = Link(worker_id=me, peer_worker_id=peer, state=state, round_trip_loss=loss, inbound_loss=loss)
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))


def _beats(plane, w: dict, job_id: str) -> None:
    for rank, worker in ((0, "wa"), (1, "wb")):
        beat = worker_pb2.RankHeartbeat(
            job_id=job_id, rank=rank, step=6, stepping=True, worker_id=worker, phase=worker_pb2.PHASE_COLLECTIVE
        )
        plane.rank_event(w[worker], job_id, rank, heartbeat=beat)


def test_through_the_control_plane_a_degraded_link_is_listed_until_cleared_and_a_cut_one_relaunches_without_wb(
    plane,
):
    job_id, w = running(plane, "wa", "wb", "wc", extra="liveness: {attribution_seconds: 0}")
    _beats(plane, w, job_id)
    _fact(plane, w["wa"], "wa", "wb", DEGRADED, 0.5)
    s = plane.get(job_id)
    assert [(f.fault_class, list(f.worker_ids)) for f in s.links] == [("link_degraded", ["wa", "wb"])]
    assert decisions(plane, job_id)[-1].startswith("ignore link_degraded of rank 0 on wa")
    _fact(plane, w["wa"], "wa", "wb", UP, 0.0)
    assert list(plane.get(job_id).links) == []
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[-1] == "link_degraded cleared: link wa <-> wb up again"

    _fact(plane, w["wa"], "wa", "wb", DOWN, 1.0)
    _fact(plane, w["wb"], "wb", "wa", DOWN, 1.0)
    for session in w.values():
        drain(session)
    _beats(plane, w, job_id)
    failed = engine_pb2.TrainingLoopFailed(job_id=job_id, rank=1, step=6, fault_class="comm_error", detail="timed out")
    plane.rank_event(w["wb"], job_id, 1, failed=failed)
    s = plane.get(job_id)
    assert [(f.fault_class, list(f.worker_ids)) for f in s.links] == [("link_down", ["wa", "wb"])]
    assert decisions(plane, job_id)[-1] == (
        "exclude_node after link_down of rank 1 on wb (restart 1 of 3 for link_down); excluding wb "
        "(link to wa cut; a tie, wb does not host rank 0)"
    )
    for session in w.values():
        drain(session)


def test_a_peer_whose_pings_arrive_but_which_answers_none_is_a_degraded_link_not_a_down_one():
    # One way cut (a -> b lost): a hears b's pings, none of its own come back.
    facts = _Facts()
    pa = _free_udp_port()
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b.bind(("127.0.0.1", 0))
    a = LinkProber("a", "127.0.0.1", pa, facts.put, _Log())
    probe = control_pb2.LinkProbe(interval_seconds=0.05, degraded_loss=0.2, down_probes=3)
    probe.peers.add(worker_id="b", address=f"127.0.0.1:{b.getsockname()[1]}")
    a.set_peers("j", probe)
    stop = threading.Event()

    def b_pings():
        seq = 0
        while not stop.wait(0.05):
            seq += 1
            b.sendto(b"SGLP1 P %d b" % seq, ("127.0.0.1", pa))

    t = threading.Thread(target=b_pings, daemon=True)
    a.start(), t.start()
    try:
        degraded = facts.wait_for(lambda f: f.state == DEGRADED)
        assert degraded.round_trip_loss >= 0.5 and degraded.inbound_loss <= 0.2, degraded
        time.sleep(0.5)
        assert [f.state for f in facts] == [DEGRADED], list(facts)
    finally:
        stop.set(), t.join(), a.stop(), b.close()
