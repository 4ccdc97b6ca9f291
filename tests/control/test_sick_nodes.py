"""Sick nodes (issue 29 item 6): the window rule as a table (services/control/sick_nodes.py),
then on control's real build() with node agents driven from the test: repeated rank faults
on one node across incidents make L1-3 send FaultBacklogAlert, L1-1 quarantines the node
(a cordon journaled across a control restart, not ended by a restarted agent), and the
operator's uncordon releases it."""

from __future__ import annotations

import random
from dataclasses import replace

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


def f(worker: str, at: float, job: str = "j", incident: int = 0, kind: str = KILLED, gen: int = 0) -> NodeFault:
    return NodeFault(worker, job, incident, kind, at, gen)


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
        # One launch's ranks dying in one incident count once (generation unknown: the incident's).
        ("two ranks of one incident, then another", [f("wb", 0), f("wb", 1), f("wb", 60, incident=1)], "wb", None),
        ("one incident, however many ranks", [f("wb", 0), f("wb", 1), f("wb", 2), f("wb", 3)], "wb", None),
        # A node that kills each relaunched rank at its start: one incident (no recovery
        # finishes), a new generation each time (measure29: 5 such deaths, no quarantine).
        ("start-up deaths of new launches, one incident", [f("wb", t, gen=t + 1) for t in (0, 5, 10)], "wb", (3, 3)),
        # Per launch, as per incident before: the job's own fault (every launch OOMs on every
        # node) and a survivor's exit after a silence (which names no launch) count nowhere.
        (
            "job-wide, every launch of one incident",
            [f(w, 10 * g + d, kind="rank_oom", gen=g) for g in (1, 2, 3) for d, w in enumerate("ab")],
            "a",
            None,
        ),
        (
            "the survivor's exit after a silence is not blamed",
            [
                f(w, 60 * i + d, incident=i, kind=k, gen=g)
                for i in range(3)
                for d, (w, k, g) in enumerate((("wb", "rank_silent", 0), ("wa", ERROR, i + 1)))
            ],
            "wa",
            None,
        ),
        (
            "a node lost with 8 ranks of one launch counts once",
            [f("wb", 0.01 * r, kind="worker_lost", gen=7) for r in range(8)] + [f("wb", 60, incident=1, gen=8)],
            "wb",
            None,
        ),
        (
            "two launches' node losses, then a third launch's death",
            [
                f("wb", t + 0.01 * r, incident=i, kind="worker_lost", gen=i + 1)
                for i, t in ((0, 0), (1, 60))
                for r in range(8)
            ]
            + [f("wb", 120, incident=2, gen=3)],
            "wb",
            (3, 3),
        ),
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


def test_start_up_deaths_on_different_nodes_do_not_add_up():
    """Each job's launches die at start on its own node, one incident each: six deaths of new
    generations in all, two per node, and no node is named."""
    nodes = SickNodes(POLICY)
    deaths = [
        f(w, 10 * i + t, job=j, gen=100 * i + t + 1)
        for i, (j, w) in enumerate(zip("jkm", ("wa", "wb", "wc")))
        for t in (0, 5)
    ]
    assert [nodes.record(d) for d in deaths] == [None] * 6
    assert [sick(deaths, w, now=30, policy=POLICY) for w in ("wa", "wb", "wc")] == [None] * 3
    # The same six on one node would be: the count is per node, not a sum over nodes.
    assert sick([replace(d, worker_id="wa") for d in deaths], "wa", now=30, policy=POLICY) is not None


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


def _killed(plane: Plane, session, job_id: str, rank: int, worker: str, generation: int = 0) -> None:
    plane.rank_exited(
        session, job_id, rank, exit_code=-9, worker_id=worker, cause=control_pb2.EXIT_KILLED, detail="killed by SIGKILL",
        generation=generation,
    )  # fmt: skip


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


def test_a_node_that_kills_each_relaunched_rank_at_its_start_is_quarantined_inside_one_incident(plane):
    """measure29's node: each new rank-1 process on wb dies before its recovery's first step,
    so the recovery never ends and every death is of one incident; each is of a new launch
    (its generation, stated on the exit as the agent launched it), and the third quarantines wb."""
    sessions = {w: register(plane, w, f"{w}-1") for w in ("wa", "wb", "wc")}  # wc: a spare
    job = plane.submit(dp=2, steps=50, extra="liveness: {attribution_seconds: 0}\nfault_policy: {max_restarts: 10}")

    def launched() -> dict[int, tuple[str, int]]:
        return {
            a.rank: (w, a.generation)
            for w, s in sessions.items()
            for cmd in drain(s)
            if cmd.WhichOneof("command") == "launch"
            for a in cmd.launch.ranks
        }

    placed = launched()
    assert {r: w for r, (w, _) in placed.items()} == {0: "wa", 1: "wb"}
    for rank, (w, _) in placed.items():
        plane.rank_event(sessions[w], job.job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    generations = []
    for n in range(3):
        assert cordoned(plane) == []
        _, gen = placed[1]
        generations.append(gen)
        _killed(plane, sessions["wb"], job.job_id, 1, "wb", generation=gen)  # before any step
        plane.rank_exited(sessions["wa"], job.job_id, 0, exit_code=-9, worker_id="wa", released=True, generation=gen)
        placed = launched()
        if n < 2:
            assert {r: w for r, (w, _) in placed.items()} == {0: "wa", 1: "wb"}  # relaunched where it was
    assert len(set(generations)) == 3  # (three launches: the count's unit)
    (quarantine,) = plane.user(control_pb2.JobQuery()).cordoned
    assert quarantine.worker_id == "wb" and quarantine.quarantine
    assert quarantine.reason.startswith("quarantined: 3 rank faults on wb in 3 incidents within 600 s")
    assert {r: w for r, (w, _) in placed.items()} == {0: "wa", 1: "wc"}  # the third relaunch went around it


def test_a_node_lost_with_8_ranks_of_one_launch_counts_once_and_a_later_launch_lost_there_again(
    tmp_path, store_with_no_versions
):
    """A node agent's session ends with 8 ranks of one launch on it: control's relay states
    each lost rank with the launch's generation, and the node's count takes them once. With a
    policy of 2 faults from 1 launch, that loss alone does not quarantine (8 faults did); the
    job's next launch lost on that node again, inside the same incident, does."""
    policy = SickNodePolicy(faults=2, incidents=1)
    control = build(
        JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0,
        sick_nodes=policy,
    )  # fmt: skip
    plane = Plane(control)
    try:
        sessions = {w: plane.register(w, slots=8) for w in ("wa", "wb")}
        job = plane.submit(dp=8, steps=50, extra="fault_policy: {max_restarts: 10}")

        def node_of_launch() -> str:
            (node,) = {w for w, s in sessions.items() for c in drain(s) if c and c.WhichOneof("command") == "launch"}
            return node

        first = node_of_launch()
        other = "wb" if first == "wa" else "wa"
        plane.c.sessions.close(sessions[first], "agent killed")  # 8 ranks lost at once
        assert node_of_launch() == other
        assert cordoned(plane) == []  # (one launch: once)
        sessions[first] = plane.register(first, slots=8)  # its agent is back
        plane.c.sessions.close(sessions[other], "agent killed")  # (its first loss there: one, below the policy)
        assert node_of_launch() == first
        assert cordoned(plane) == []
        plane.c.sessions.close(sessions[first], "agent killed")  # a later launch lost there again
        (quarantine,) = plane.user(control_pb2.JobQuery()).cordoned
        assert quarantine.worker_id == first and quarantine.quarantine
        assert quarantine.reason == (
            f"quarantined: 2 rank faults on {first} in 2 incidents within 600 s (worker_lost; jobs {job.job_id})"
        )
    finally:
        stop_plane(control)


def test_the_kept_window_names_exactly_what_the_rule_over_the_whole_window_names():
    """SickNodes keeps the rule incrementally (a record costs the node's own faults: one launch
    of 8,192 ranks lost at once was O(n^2) under L1-3's lock); on random fault histories it
    names the same nodes, with the same counts, as ``sick`` over every fault of the window."""
    rng = random.Random(29)
    policy = SickNodePolicy(window_seconds=50.0, faults=3, incidents=2)
    kinds = (KILLED, ERROR, "rank_oom", "rank_silent")
    for _history in range(60):
        nodes, window, named_at, at = SickNodes(policy), [], {}, 0.0
        for _ in range(rng.randint(1, 120)):
            at += rng.choice((0.0, 0.5, 3.0, 20.0))
            fault = f(
                rng.choice(("wa", "wb", "wc")), at, job=rng.choice("jk"), incident=rng.randint(0, 3),
                kind=rng.choice(kinds), gen=rng.choice((0, 0, 1, 2, 3)),
            )  # fmt: skip
            window = [x for x in window if x.at > at - policy.window_seconds] + [fault]
            since = named_at.get(fault.worker_id, float("-inf"))
            expected = sick(window, fault.worker_id, now=at, policy=policy, since=since)
            assert nodes.record(fault) == expected, (window, fault)
            if expected is not None:
                named_at[fault.worker_id] = at


def test_one_launch_of_thousands_of_ranks_lost_at_once_is_counted_against_no_node():
    # 8,192 ranks of one launch on 1,024 nodes, killed alike (each record looks up its node's
    # own faults): the launch had that kind on every node, the job's doing, no node's.
    nodes = SickNodes(POLICY)
    lost = [f(f"w{i // 8}", 1000.0 + i * 1e-4, incident=1, gen=1) for i in range(8192)]
    assert [nodes.record(x) for x in lost] == [None] * len(lost)
    assert counted(lost) == []
    # Then w0's own deaths, a launch each, its kind on no other node: named at the third.
    again = [f("w0", 2000.0 + g, incident=2 + g, gen=2 + g, kind=ERROR) for g in range(3)]
    assert [nodes.record(x) is not None for x in again] == [False, False, True]
