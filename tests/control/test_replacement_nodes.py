"""A frozen node under the rebuild policy (issue 29 item 4; found by the measure29 bench: rank 1
and its node agent stopped together, the replacement went to that node and no step came for
120 s; then, placed elsewhere, the survivor stayed blocked in its all-reduce with the stopped
rank, which its frozen agent could not end: first step 124.9 s after the stop). The rules are
table-tested (replacement_nodes.py, triage, the decision), L1-3's flag on a silent rank whose
agent is quiet too and its early agent_silent, then L1-1 on the real in-process plane, the test
standing in for the node agents (fixtures of test_fault_policy.py)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from services.contract import Module, control_pb2, engine_pb2, worker_pb2
from services.contract.bus import Bus
from services.control import fault_decision as fd
from services.control.fault_detector import AGENT_MISSED_BEATS, AGENT_SILENT_MIN_SECONDS, FaultDetector
from services.control.orchestrator.job import _Incident, _Job
from services.control.orchestrator.replacement_nodes import unkillable, waiting_on
from services.control.orchestrator.triage import CONSEQUENCE, NEW_INCIDENT, _no_rebuild, triage
from services.jobspec import parse_job_spec

from .conftest import drain, settle, spec_yaml
from .test_fault_detector import Reports
from .test_fault_policy import REBUILD, commands, decisions, plane, restarted, running, store  # noqa: F401

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)
SPEC = parse_job_spec(spec_yaml(dp=2))
REBUILD_SILENT = REBUILD.replace("worker_lost: rebuild}", "worker_lost: rebuild, rank_silent: rebuild}")
REBUILD_SPEC = parse_job_spec(spec_yaml(dp=2, extra=REBUILD_SILENT))


def silent(rank: int = 1, worker_id: str = "wb", *, unheard: bool, **kw) -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id="j",
        grade=control_pb2.SEVERE,
        fault_class=kw.pop("fault_class", "rank_silent"),
        rank=rank,
        worker_id=worker_id,
        agent_unheard=unheard,
        detail=f"rank {rank} on worker {worker_id} sent no heartbeat for 4.0 s (deadline 3 s)",
        **kw,
    )


def rebuilding(*, placed_on=("wb",), relaunched=True, started=(0,), action="rebuild") -> _Job:
    """A dp 2 job whose rebuild replaces rank 1 (its old process on wb still to end)."""
    incident = _Incident(
        cause=silent(unheard=False),
        fault_class="rank_silent",
        action=action,
        decided=0.0,
        dying=Counter({1: 1}),
        lost=[1],
        relaunched=relaunched,
        placed_on=list(placed_on),
    )
    status = control_pb2.JobStatus(job_id="j", state=JobState.FAULT_FROZEN, world_size=2)
    return _Job(status=status, spec=SPEC, activity=incident, started=set(started))


# ------------------------------------------------------------ the rules, as tables


def lost(worker_id: str = "wb", fault_class: str = "worker_lost") -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id="j", grade=control_pb2.SEVERE, fault_class=fault_class, rank=1, worker_id=worker_id
    )


UNKILLABLE = "rank 1's node agent on wb is unheard, its process cannot be ended"


@pytest.mark.parametrize(
    ("report", "why"),
    [
        (silent(unheard=True), UNKILLABLE),  # frozen with its agent: nobody can end it
        (silent(unheard=False), ""),  # its agent heard since: it kills the rank, the rebuild goes on
        (silent(unheard=True, worker_id=""), "rank 1's node agent is unheard, its process cannot be ended"),
        (lost(), ""),  # (a lost node's ranks are gone with it)
        # L1-3 names the silent agent itself (worker_lost, subclass agent_silent): still unkillable.
        (silent(unheard=True, fault_class="worker_lost", subclass="agent_silent"), UNKILLABLE),
    ],
)
def test_a_silent_rank_whose_node_agent_is_unheard_cannot_be_ended(report, why):
    assert unkillable(report).startswith(why) and bool(unkillable(report)) == bool(why)


def running_job() -> _Job:
    status = control_pb2.JobStatus(job_id="j", state=JobState.RUNNING, world_size=2)
    return _Job(status=status, spec=REBUILD_SPEC, placement={0: "wa", 1: "wb"})


@pytest.mark.parametrize(
    ("job", "report", "action"),
    [
        (running_job(), silent(unheard=True), "restart_ranks"),  # its survivors could not be freed
        (running_job(), silent(unheard=False), "rebuild"),
        # During a rebuild (rank 0 holding the state), its replacement silent on a frozen node:
        # no rebuild around it either (one whose node's agent beats is rebuilt again, as before).
        (rebuilding(), silent(unheard=True), "restart_ranks"),
        (rebuilding(), silent(unheard=False), "rebuild"),
    ],
)
def test_the_policys_rebuild_of_a_rank_that_cannot_be_ended_relaunches_every_rank(job, report, action):
    view = fd.JobView(restarts={}, ignored={}, no_rebuild=_no_rebuild(job, report))
    decision = fd.decide(REBUILD_SPEC.fault_policy, view, report)
    assert decision.action == action, decision.text
    if action == "restart_ranks":  # (why, in the decision's own words)
        assert decision.text.endswith(
            f"; restart_ranks instead of rebuild: rank {report.rank}'s node agent on {report.worker_id} is unheard, "
            "its process cannot be ended (its survivors would wait in their collective with it)"
        ), decision.text


@pytest.mark.parametrize(
    ("job", "worker_id", "ranks"),
    [
        (rebuilding(), "wb", [1]),
        (rebuilding(), "wc", []),  # placed elsewhere: nothing waits there
        (rebuilding(started=(0, 1)), "wb", []),  # the replacement is ready already
        (rebuilding(relaunched=False), "wb", []),  # not placed yet
        (rebuilding(action="restart_ranks"), "wb", []),  # a relaunch of every rank: not a rebuild
        (rebuilding(), "", []),
    ],
)
def test_a_rebuild_waits_on_a_worker_only_for_replacements_launched_there_and_not_ready(job, worker_id, ranks):
    assert waiting_on(job, worker_id) == ranks


@pytest.mark.parametrize(
    ("job", "report", "kind"),
    [
        # The node holding the replacement is lost: the recovery's own fault, decided anew.
        (rebuilding(), lost(), NEW_INCIDENT),
        (rebuilding(), lost(fault_class="worker_departed"), NEW_INCIDENT),
        # Lost where no replacement waits (the old rank's node; the replacement elsewhere): its
        # old rank's end, as before.
        (rebuilding(placed_on=("wc",)), lost(), CONSEQUENCE),
        (rebuilding(started=(0, 1)), lost(), CONSEQUENCE),
        (rebuilding(relaunched=False), lost(), CONSEQUENCE),
        (rebuilding(), lost(fault_class="rank_exit"), CONSEQUENCE),  # (its old process reaped)
    ],
)
def test_a_lost_node_holding_a_replacement_the_rebuild_waits_for_is_a_new_incident(job, report, kind):
    assert triage(report, job) == kind


# ------------------------------------------------------------ L1-3: the agent heard or not


def _detector() -> tuple[Bus, Reports]:
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR))
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    bus.subscribe(Module.L1_FAULT_DETECTOR, worker_pb2.RankHeartbeat, detector.on_rank_heartbeat)
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.AgentHeartbeat, detector.on_agent_heartbeat)
    reports = Reports()
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, reports.add)
    start = control_pb2.StartFaultMonitoring(job_id="j", heartbeat_timeout_seconds=0.6)
    bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, start)
    return bus, reports


@pytest.mark.parametrize("agent", ["beats on", "frozen with it", "never heard"])
def test_a_silent_rank_says_whether_its_node_agent_was_heard_from_since(agent):
    bus, reports = _detector()

    def agent_beat() -> None:
        hb = control_pb2.AgentHeartbeat(worker_id="w", interval_seconds=0.1, received_monotonic=time.monotonic())
        bus.publish(Module.EXT_HARDWARE, hb)

    first_beat = time.monotonic()
    if agent != "never heard":
        agent_beat()
    bus.publish(Module.EXT_HARDWARE, worker_pb2.RankHeartbeat(job_id="j", rank=1, worker_id="w", interval_seconds=0.1))
    deadline = time.monotonic() + 5.0
    while not reports and time.monotonic() < deadline:
        if agent == "beats on":
            agent_beat()
        time.sleep(0.05)
    # Frozen with it (no beat since the rank's last, and quiet now): the agent that relays the
    # rank's beats is the party at fault, named (worker_lost, subclass agent_silent: session 34);
    # an agent that never beat here (none runs) is not known to be silent: the rank is.
    silents = [r for r in reports.wait(1) if r.job_id]
    assert [(r.rank, r.worker_id) for r in silents] == [(1, "w")], list(reports)
    frozen = agent == "frozen with it"
    assert (silents[0].fault_class, silents[0].subclass) == (
        ("worker_lost", "agent_silent") if frozen else ("rank_silent", "")
    ), silents[0]
    assert silents[0].agent_unheard == frozen
    # That agent is reported silent with it, before the rank (L1-1 holds its node before it
    # relaunches: its own deadline, 3 s here, is far off), and its next beat clears that.
    agents = [(r.fault_class, r.worker_id, r.cleared) for r in reports if not r.job_id]
    if agent != "frozen with it":
        assert agents == [], list(reports)
        return
    assert agents == [("agent_silent", "w", False)], list(reports)
    assert [r.fault_class for r in reports][:2] == ["agent_silent", "worker_lost"], list(reports)
    assert "not since before rank 1 there went silent" in reports[0].detail, reports[0].detail
    # Its own deadline (AGENT_SILENT_MIN_SECONDS after its beat) was cancelled: not declared twice.
    time.sleep(max(0.0, first_beat + AGENT_SILENT_MIN_SECONDS + 0.5 - time.monotonic()))
    assert [r.fault_class for r in reports if not r.job_id] == ["agent_silent"], list(reports)
    agent_beat()
    cleared = [r for r in reports.wait(len(reports) + 1) if r.cleared]
    assert [(r.fault_class, r.worker_id) for r in cleared] == [("agent_silent", "w")], list(reports)


# ------------------------------------------------------------ L1-1, in process


def relaunches(plane, job_id: str) -> list[str]:  # noqa: F811
    return [e.message for e in plane.events(job_id) if e.type == "recovery" and "launched on" in e.message]


def launched_ranks(cmds) -> list[int]:
    return [r.rank for k, m in cmds if k == "launch" for r in m.ranks]


def launched_on(session, ranks: list[int]) -> None:
    """The launch of ``ranks`` reaches ``session``: waited for, since the decision's event is
    emitted at its journal commit and its commands are sent just after, by the deciding thread."""
    seen: list[int] = []
    settle(lambda: seen.extend(launched_ranks(commands(session))) or seen, ranks)


def frozen(plane, job_id: str, worker_id: str = "wb") -> None:  # noqa: F811
    """Rank 1 silent on ``worker_id`` with that node's agent unheard, reported as L1-3 does
    (fault_detector/liveness.py): the agent's agent_silent first, then the rank's."""
    agent = control_pb2.FaultReport(
        grade=control_pb2.MEDIUM, fault_class="agent_silent", worker_id=worker_id,
        detail=f"the node agent of {worker_id} sent no AgentHeartbeat for 4.0 s, not since before rank 1 there went silent",
    )  # fmt: skip
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, agent)
    report = silent(worker_id=worker_id, unheard=True)
    report.job_id = job_id
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, report)


def agent_back(plane, worker_id: str = "wb") -> None:  # noqa: F811
    """That agent beats again: L1-3's agent_silent ``cleared`` (L1-1 lifts the hold)."""
    back = control_pb2.FaultReport(
        grade=control_pb2.MEDIUM, fault_class="agent_silent", worker_id=worker_id, cleared=True,
        detail=f"the node agent of {worker_id} beats again after 6.0 s",
    )  # fmt: skip
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, back)


def test_a_silent_rank_whose_agent_is_heard_is_rebuilt_on_its_own_node(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", "wc", extra=REBUILD_SILENT)
    report = silent(unheard=False)
    report.job_id = job_id
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, report)

    assert decisions(plane, job_id)[0].startswith("rebuild after rank_silent of rank 1 on wb"), decisions(plane, job_id)
    on_b, on_c = commands(w["wb"]), commands(w["wc"])
    assert [k for k, _ in on_b][:1] == ["release"]  # (its agent kills the old incarnation)
    assert launched_ranks(on_b) == [1] and launched_ranks(on_c) == []


def test_a_frozen_nodes_silent_rank_relaunches_every_rank_without_that_node_for_that_relaunch_only(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", "wc", extra=REBUILD_SILENT)
    frozen(plane, job_id)

    # Its process cannot be ended (its agent is frozen): a rebuild could not free the survivor
    # from their all-reduce, so every rank is relaunched; the survivor's own agent kills it.
    assert decisions(plane, job_id) == [
        "restart_ranks after rank_silent of rank 1 on wb (restart 1 of 3 for rank_silent); restart_ranks instead "
        "of rebuild: rank 1's node agent on wb is unheard, its process cannot be ended (its survivors would wait "
        "in their collective with it)"
    ]
    on_a, on_b, on_c = commands(w["wa"]), commands(w["wb"]), commands(w["wc"])
    assert [k for k, _ in on_a][:1] == ["release"] and [k for k, _ in on_b] == ["release"]  # (wb's: when it wakes)
    assert launched_ranks(on_a) == [0] and launched_ranks(on_c) == [1]  # the held node gets none
    restarted(plane, job_id, {0: w["wa"], 1: w["wc"]}, start_step=0)
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)
    # The hold is listed with the cordons (`surgectl workers` / `status`: was shown healthy and
    # placeable, the fresh user's find), not journaled, ended by the agent's next beat.
    (held,) = plane.user(control_pb2.JobQuery()).cordoned
    assert (held.worker_id, held.held, held.cleared) == ("wb", True, False)
    assert held.reason.startswith("placement held: the node agent of wb sent no AgentHeartbeat"), held.reason

    # The agent beats again (the node woke): the hold ends, and a later relaunch may use it.
    agent_back(plane)
    assert list(plane.user(control_pb2.JobQuery()).cordoned) == []
    plane.c.sessions.close(w["wc"], reason="session closed")
    settle(lambda: len(decisions(plane, job_id)), 2)
    assert decisions(plane, job_id)[1].startswith("rebuild after worker_lost of rank 1 on wc"), decisions(plane, job_id)
    launched_on(w["wb"], [1])


def test_a_frozen_nodes_relaunch_with_no_other_slot_waits_and_uses_the_node_once_its_agent_beats(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", extra=REBUILD_SILENT)
    frozen(plane, job_id)

    assert decisions(plane, job_id)[0].startswith("restart_ranks after rank_silent of rank 1 on wb")
    # No slot but the frozen node's: the refusal path waits for capacity (the hold named).
    waits = [e.message for e in plane.events(job_id) if e.message.startswith("waiting for capacity")]
    assert len(waits) == 1 and "not since before rank 1 there went silent" in waits[0], waits
    assert launched_ranks(commands(w["wa"])) == [] and launched_ranks(commands(w["wb"])) == []

    agent_back(plane)  # the node woke: the wait's next retry places both ranks
    placed = []
    settle(
        lambda: placed.extend(launched_ranks(commands(w["wa"])) + launched_ranks(commands(w["wb"]))) or sorted(placed),
        [0, 1],
    )
    assert any(m.startswith("ranks killed and relaunched on wa, wb") for m in relaunches(plane, job_id)), relaunches(
        plane, job_id
    )


def test_a_replacements_node_lost_while_the_rebuild_waits_is_rebuilt_again_elsewhere(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", "wc", extra=REBUILD_SILENT)
    report = silent(unheard=False)  # (its agent was heard: the replacement goes to wb)
    report.job_id = job_id
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, report)
    assert launched_ranks(commands(w["wb"])) == [1]
    drain(w["wa"]), drain(w["wc"])

    # wb's agent session closes (the node froze for good, or was cut off): its ranks, the old
    # incarnation and the replacement alike, are reported lost with it.
    plane.c.sessions.close(w["wb"], reason="session closed")
    settle(lambda: len(decisions(plane, job_id)), 2)
    assert decisions(plane, job_id)[1].startswith("rebuild after worker_lost of rank 1 on wb"), decisions(plane, job_id)
    launched_on(w["wc"], [1])
    assert relaunches(plane, job_id)[-1].endswith(
        "replacement for rank(s) 1 launched on wc, the survivors keep their processes"
    )

    # The rebuilt group reports ready: recovered, RUNNING.
    for rank, session in ((0, w["wa"]), (1, w["wc"])):
        started = engine_pb2.TrainingLoopStarted(rank=rank, start_step=0, rebuild_generation=2, healed=rank == 1)
        plane.rank_event(session, job_id, rank, started=started)
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)


def test_a_replacements_node_agent_gone_silent_while_the_rebuild_waits_is_rebuilt_again_elsewhere(plane, store):  # noqa: F811
    from .test_fencing import beat

    job_id, w = running(plane, "wa", "wb", "wc", extra=REBUILD_SILENT)
    # (Only wb's agent beats here: one never heard is never declared silent, so a slow run
    # cannot hold wa or wc too.)
    beat(plane, w["wb"])
    report = silent(unheard=False)
    report.job_id = job_id
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, report)
    assert launched_ranks(commands(w["wb"])) == [1]
    drain(w["wa"]), drain(w["wc"])

    # wb's agent stops beating (frozen): past its allowance L1-3 reports it agent_silent; the
    # node is held and, to this job, lost: the waiting replacement is placed again.
    beat(plane, w["wb"], seconds_ago=AGENT_MISSED_BEATS + 1.0)
    settle(lambda: len(decisions(plane, job_id)), 2)
    assert decisions(plane, job_id)[1].startswith("rebuild after worker_lost (agent_silent) of rank 1 on wb"), (
        decisions(plane, job_id)
    )
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert any("worker_lost (agent_silent): the replacement of rank(s) 1 waits on wb" in f for f in faults), faults
    launched_on(w["wc"], [1])
