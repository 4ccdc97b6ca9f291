"""Sick nodes (issue 29 item 6): the window rule as a table (services/control/sick_nodes.py),
then on control's real build() with node agents driven from the test: repeated rank faults
on one node across incidents make L1-3 send FaultBacklogAlert, L1-1 quarantines the node
(a cordon journaled across a control restart, not ended by a restarted agent), and the
operator's uncordon releases it."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.sick_nodes import NodeFault, SickNodePolicy, SickNodes, counted, sick
from tests.control.conftest import Plane, drain, settle, stop_plane
from tests.control.test_device_health import cordoned, register

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)
POLICY = SickNodePolicy()  # 3 faults from 2 incidents within 600 s
KILLED, ERROR = "rank_exit/EXIT_KILLED", "rank_exit/EXIT_ERROR"


def f(worker: str, at: float, job: str = "j", incident: int = 0, kind: str = KILLED) -> NodeFault:
    return NodeFault(worker, job, incident, kind, at)


@pytest.mark.parametrize(
    ("case", "faults", "worker", "named"),
    [
        ("one ordinary fault", [f("wb", 0)], "wb", None),
        (
            "repeated, across jobs and incidents",
            [f("wb", 0), f("wb", 60, incident=1), f("wb", 90, job="k")],
            "wb",
            (3, 3),
        ),
        ("two ranks of one incident, then another", [f("wb", 0), f("wb", 1), f("wb", 60, incident=1)], "wb", (3, 2)),
        ("one incident, however many ranks", [f("wb", 0), f("wb", 1), f("wb", 2), f("wb", 3)], "wb", None),
        ("two faults only", [f("wb", 0), f("wb", 60, incident=1)], "wb", None),
        ("spread past the window", [f("wb", 0), f("wb", 300, incident=1), f("wb", 601, incident=2)], "wb", None),
        # The job's own fault: the same kind on two nodes in one incident (a model too big for
        # every device, a bad config) counts against neither.
        (
            "job-wide, every incident",
            [f(w, t + d, incident=i, kind="rank_oom") for i, t in enumerate((0, 60, 120)) for d, w in enumerate("ab")],
            "a",
            None,
        ),
        # The cause is on wb; the survivor on wa exits on the broken collective after it.
        (
            "the survivor is not blamed",
            [
                f(w, t + d, incident=i, kind=k)
                for i, t in enumerate((0, 60, 120))
                for d, (w, k) in enumerate((("wb", KILLED), ("wa", ERROR)))
            ],
            "wa",
            None,
        ),
        (
            "the cause's node is",
            [
                f(w, t + d, incident=i, kind=k)
                for i, t in enumerate((0, 60, 120))
                for d, (w, k) in enumerate((("wb", KILLED), ("wa", ERROR)))
            ],
            "wb",
            (3, 3),
        ),
    ],
)
def test_the_window_rule(case, faults, worker, named):
    got = sick(faults, worker, now=faults[-1].at, policy=POLICY)
    assert (None if got is None else (got.faults, got.incidents)) == named, case


def test_counted_keeps_the_causes_node_and_drops_what_the_incident_had_elsewhere():
    faults = [f("wb", 0), f("wa", 1, kind=ERROR), f("wb", 2, kind="rank_oom"), f("wa", 3, kind="rank_oom")]
    assert counted(faults) == [faults[0]]


def test_a_node_is_named_once_and_starts_from_nothing_after():
    nodes = SickNodes(POLICY)
    assert nodes.record(f("wb", 0)) is None and nodes.record(f("wb", 60, incident=1)) is None
    named = nodes.record(f("wb", 120, job="k"))
    assert named is not None and named.detail == (
        "3 rank faults on wb in 3 incidents within 600 s (rank_exit/EXIT_KILLED; jobs j, k)"
    )
    assert nodes.record(f("wb", 130, job="k", incident=1)) is None  # (its faults were forgotten)


# ---------------------------------------------------------------- on control's real build()


def _killed(plane: Plane, session, job_id: str, rank: int, worker: str) -> None:
    plane.rank_exited(
        session, job_id, rank, exit_code=-9, worker_id=worker, cause=control_pb2.EXIT_KILLED, detail="killed by SIGKILL"
    )


def test_a_node_whose_rank_keeps_dying_across_incidents_is_quarantined_and_released_by_uncordon(plane):
    a, b = register(plane, "wa", "a-1"), register(plane, "wb", "b-1")
    c = register(plane, "wc", "c-1")  # a spare: where the job goes once wb is out
    job = plane.submit(dp=2, steps=50, extra="liveness: {attribution_seconds: 0}")
    sessions = {"wa": a, "wb": b, "wc": c}
    placed = {0: "wa", 1: "wb"}
    for rank, w in placed.items():
        plane.rank_event(sessions[w], job.job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    for s in sessions.values():
        drain(s)
    for n in range(3):
        assert cordoned(plane) == []  # (two incidents, one fault each: not yet)
        _killed(plane, b, job.job_id, 1, "wb")
        # The survivor on wa exits on the broken collective: a consequence, not wa's fault.
        plane.rank_exited(a, job.job_id, 0, exit_code=1, worker_id="wa", cause=control_pb2.EXIT_ERROR)
        launched = {
            cmd.launch.ranks[0].rank: w
            for w, s in sessions.items()
            for cmd in drain(s)
            if cmd.WhichOneof("command") == "launch"
        }
        if n < 2:
            assert launched == placed  # relaunched where it was
            for rank, w in launched.items():
                plane.rank_event(sessions[w], job.job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
            assert plane.get(job.job_id).state == JobState.RUNNING
    (quarantine,) = plane.user(control_pb2.JobQuery()).cordoned
    assert quarantine.worker_id == "wb" and quarantine.quarantine
    assert quarantine.reason == (
        "quarantined: 3 rank faults on wb in 3 incidents within 600 s (rank_exit/EXIT_KILLED; jobs " + job.job_id + ")"
    )
    assert launched == {0: "wa", 1: "wc"}  # the third relaunch went around it
    assert [w.worker_id for w in plane.c.journal.load_cordons()] == ["wb"]

    register(plane, "wb", "b-2")  # its agent restarted: a quarantine stays until the operator ends it
    assert [w for w, _, _ in cordoned(plane)] == ["wb"]
    left = plane.user(control_pb2.UncordonWorkerRequest(worker_id="wb"))
    assert list(left.cordoned) == [] and list(left.jobs) == []
    assert cordoned(plane) == [] and plane.c.journal.load_cordons() == []
    with pytest.raises(ValueError, match=r"^uncordon: worker 'wb' is not cordoned \(no worker is cordoned\)$"):
        plane.user(control_pb2.UncordonWorkerRequest(worker_id="wb"))


def test_a_quarantine_survives_a_control_restart_and_ends_by_uncordon(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    first = build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    try:
        register(Plane(first), "wa", "a-1")
        alert = control_pb2.FaultBacklogAlert(worker_id="wa", reports=3, incidents=2, window_seconds=600, detail="sick")
        first.bus.publish(Module.L1_FAULT_DETECTOR, alert)
        assert cordoned(Plane(first)) == [("wa", "a-1", "quarantined: sick")]
    finally:
        stop_plane(first)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        assert cordoned(plane) == [("wa", "a-1", "quarantined: sick")]
        register(plane, "wa", "a-2")  # a new incarnation does not end a quarantine
        job_id = plane.submit(dp=1).job_id
        assert plane.get(job_id).state == JobState.STANDBY
        with pytest.raises(ValueError, match=r"^uncordon: worker 'nope' is not cordoned \(cordoned: wa\)$"):
            plane.user(control_pb2.UncordonWorkerRequest(worker_id="nope"))
        plane.user(control_pb2.UncordonWorkerRequest(worker_id="wa"))
        settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)  # the queued job is placed on it now
        assert cordoned(plane) == [] and plane.c.journal.load_cordons() == []
    finally:
        stop_plane(plane.c)


def test_quarantine_off_names_no_node_however_many_faults():
    """Control's ``--sick-node-faults 0``: the faults are not even kept."""
    off = SickNodes(SickNodePolicy(faults=0))
    assert [off.record(f("wa", t, incident=t)) for t in range(10)] == [None] * 10
    on = SickNodes(SickNodePolicy())
    assert [on.record(f("wa", t, incident=t)) is not None for t in range(3)] == [False, False, True]
