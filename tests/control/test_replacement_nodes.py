"""A frozen node under the rebuild policy (issue 29 item 4; found by the measure29 bench: rank 1
and its node agent stopped together, the replacement went to that node and no step came for
120 s). The rules are table-tested (replacement_nodes.py, triage), L1-3's flag on a silent
rank whose agent is quiet too, then L1-1 on the real in-process plane, the test standing in for
the node agents (fixtures of test_fault_policy.py)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from services.contract import Module, control_pb2, engine_pb2, worker_pb2
from services.contract.bus import Bus
from services.control.fault_detector import AGENT_MISSED_BEATS, FaultDetector
from services.control.orchestrator.job import _Incident, _Job
from services.control.orchestrator.replacement_nodes import left_out, waiting_on
from services.control.orchestrator.triage import CONSEQUENCE, NEW_INCIDENT, triage
from services.jobspec import parse_job_spec

from .conftest import drain, settle, spec_yaml
from .test_fault_detector import Reports
from .test_fault_policy import REBUILD, commands, decisions, plane, running, store  # noqa: F401

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)
SPEC = parse_job_spec(spec_yaml(dp=2))
REBUILD_SILENT = REBUILD.replace("worker_lost: rebuild}", "worker_lost: rebuild, rank_silent: rebuild}")


def silent(rank: int = 1, worker_id: str = "wb", *, unheard: bool) -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id="j",
        grade=control_pb2.SEVERE,
        fault_class="rank_silent",
        rank=rank,
        worker_id=worker_id,
        agent_unheard=unheard,
        detail=f"rank {rank} on worker {worker_id} sent no heartbeat for 4.0 s (deadline 3 s)",
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


@pytest.mark.parametrize(
    ("action", "cause", "exclude", "out"),
    [
        ("rebuild", silent(unheard=True), [], ["wb"]),  # frozen with its agent: elsewhere
        ("shrink", silent(unheard=True), [], ["wb"]),
        ("rebuild", silent(unheard=False), [], []),  # its agent heard since: its own node first
        ("rebuild", silent(unheard=True), ["wb"], ["wb"]),  # (excluded already: once)
        ("rebuild", silent(unheard=True, worker_id=""), [], []),  # where it ran unknown
        ("restart_ranks", silent(unheard=True), [], []),  # every rank: the node's hold decides
        ("exclude_node", silent(unheard=False), ["wa"], ["wa"]),
    ],
)
def test_a_rebuild_leaves_out_a_silent_ranks_node_only_when_its_agent_is_unheard(action, cause, exclude, out):
    incident = _Incident(cause=cause, fault_class=cause.fault_class, action=action, decided=0.0, exclude=exclude)
    assert left_out(incident) == out
    assert incident.exclude == exclude  # (for that placement only: nothing kept)


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


def lost(worker_id: str = "wb", fault_class: str = "worker_lost") -> control_pb2.FaultReport:
    return control_pb2.FaultReport(
        job_id="j", grade=control_pb2.SEVERE, fault_class=fault_class, rank=1, worker_id=worker_id
    )


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

    if agent != "never heard":
        agent_beat()
    bus.publish(Module.EXT_HARDWARE, worker_pb2.RankHeartbeat(job_id="j", rank=1, worker_id="w", interval_seconds=0.1))
    deadline = time.monotonic() + 5.0
    while not reports and time.monotonic() < deadline:
        if agent == "beats on":
            agent_beat()
        time.sleep(0.05)
    silents = [r for r in reports.wait(1) if r.fault_class == "rank_silent"]
    assert [(r.rank, r.worker_id) for r in silents] == [(1, "w")], list(reports)
    # Frozen with it: no beat since the rank's last (and quiet now); an agent that never beat
    # here (none runs) is not known to be silent.
    assert silents[0].agent_unheard == (agent == "frozen with it")


# ------------------------------------------------------------ L1-1, in process


def relaunches(plane, job_id: str) -> list[str]:  # noqa: F811
    return [e.message for e in plane.events(job_id) if e.type == "recovery" and "launched on" in e.message]


def launched_ranks(cmds) -> list[int]:
    return [r.rank for k, m in cmds if k == "launch" for r in m.ranks]


@pytest.mark.parametrize("unheard", [True, False])
def test_a_silent_ranks_replacement_goes_elsewhere_when_its_node_agent_was_not_heard_since(plane, store, unheard):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", "wc", extra=REBUILD_SILENT)
    report = silent(unheard=unheard)
    report.job_id = job_id
    plane.c.bus.publish(Module.L1_FAULT_DETECTOR, report)

    assert decisions(plane, job_id)[0].startswith("rebuild after rank_silent of rank 1 on wb"), decisions(plane, job_id)
    on_b, on_c = commands(w["wb"]), commands(w["wc"])
    # The old incarnation is killed on its node either way (its agent does it when it wakes).
    assert [k for k, _ in on_b][:1] == ["release"]
    if unheard:
        assert launched_ranks(on_c) == [1] and launched_ranks(on_b) == []
        assert relaunches(plane, job_id)[-1].endswith(
            "replacement for rank(s) 1 launched on wc, the survivors keep their processes"
        )
        said = [e.message for e in plane.events(job_id) if e.message.startswith("no replacement on wb")]
        assert said == ["no replacement on wb: its node agent was not heard from since rank 1 went silent "
                        "(the node may be frozen); another worker is tried"]  # fmt: skip
    else:  # its agent beats on: its own node first, as before
        assert launched_ranks(on_b) == [1] and launched_ranks(on_c) == []


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
    assert launched_ranks(commands(w["wc"])) == [1]
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
    assert decisions(plane, job_id)[1].startswith("rebuild after worker_lost of rank 1 on wb"), decisions(plane, job_id)
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert any("worker_lost (agent_silent): the replacement of rank(s) 1 waits on wb" in f for f in faults), faults
    assert launched_ranks(commands(w["wc"])) == [1]
