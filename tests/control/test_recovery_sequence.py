"""A recovery's own sequence as a table (services/control/orchestrator/recovery_machine.py):
the policy's decision taking effect (``decided``), its relaunch refused
(``relaunch_refused``) and every rank ready again (``recovered``), each an incident and an
event in, the effects out, checked without a bus, a lock or a clock; and which machine's
event "every rank ready" is (activity.py's ``ready_for``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from services.contract import control_pb2
from services.control import fault_decision as fd
from services.control.orchestrator import recovery_machine as rm
from services.control.orchestrator.activity import RECOVERED, RELOADED, SCALED, STARTED, ready_for
from services.control.orchestrator.effects import Record, ResetFaults, StartGroup, Transition
from services.control.orchestrator.job import ORCH, _Incident, _Reload, _Resume, _Scale
from services.jobspec import at_data_parallel_size, parse_job_spec

from .conftest import spec_yaml

JobState = control_pb2.JobState
SPEC = parse_job_spec(spec_yaml(dp=4))
DP2 = at_data_parallel_size(SPEC, 2, source="shrink")


def incident(action: str = "restart_ranks", **fields) -> _Incident:
    cause = control_pb2.FaultReport(job_id="j", rank=1, fault_class="rank_exit")
    return _Incident(cause=cause, fault_class="rank_exit", action=action, decided=0.0, **fields)


def refusal(requested: int = 4, available: int = 2, no_placement: bool = True) -> rm.Refusal:
    return rm.Refusal("2 slots free", requested, available, no_placement)


WHO = "rank_exit of rank 1"
SHRUNK = Record(
    ORCH,
    "decision",
    f"shrink after {WHO}: 2 slots free; the job goes on at dp 4 -> 2, and grows back to dp 4 when slots return",
)
FALLBACK = Record(
    ORCH,
    "decision",
    f"restart_ranks instead of rebuild after {WHO}: 2 slots free; every rank relaunched from the newest checkpoint",
)
CAPACITY = "waiting for capacity to resume from checkpoint j:3: needs {} ranks, 2 free (2 slots free)"

# (name, incident, refusal, the layout it could shrink to, effects)
REFUSED = [
    ("a shrink whose ranks did not fit goes on smaller", incident("shrink"), refusal(), DP2, [SHRUNK, rm.Shrink(DP2)]),
    (
        "a shrink with no smaller layout relaunches every rank instead",
        incident("shrink"),
        refusal(),
        None,
        [FALLBACK, rm.RelaunchAll()],
    ),
    (
        "a shrink whose placement is unknown (nothing missing) does not shrink",
        incident("shrink"),
        refusal(requested=2, available=2),
        DP2,
        [FALLBACK, rm.RelaunchAll()],
    ),
    (
        "a shrink already shrunk does not shrink again",
        incident("shrink", shrunk=DP2),
        refusal(),
        DP2,
        [FALLBACK, rm.RelaunchAll()],
    ),
    (
        "a rebuild with no slot relaunches every rank",
        incident("rebuild"),
        refusal(),
        None,
        [FALLBACK, rm.RelaunchAll()],
    ),
    (
        "a relaunch with no slot waits for capacity",
        incident(),
        refusal(),
        None,
        [rm.WaitCapacity(CAPACITY.format(4))],
    ),
    (
        "a wait for capacity names the job's size when the refusal does not",
        incident(),
        refusal(requested=0),
        None,
        [rm.WaitCapacity(CAPACITY.format(4))],
    ),
    (
        "a relaunch refused for another cause ends the job",
        incident(),
        refusal(no_placement=False),
        None,
        [rm.Fail("recovery failed: 2 slots free")],
    ),
]


@pytest.mark.parametrize("name, before, refused, smaller, expected", REFUSED, ids=[c[0] for c in REFUSED])
def test_relaunch_refused(name, before, refused, smaller, expected) -> None:
    text = "dp 4 -> 2" if smaller is not None else ""
    effects = rm.relaunch_refused(
        before, refused, smaller=smaller, smaller_text=text, dp=4, world_size=4, source="checkpoint j:3"
    )
    assert effects == expected
    assert before == incident(before.action, shrunk=before.shrunk)  # (read only: the incident is unchanged)


RESUMED = f"recovered from {WHO}: all 2 ranks restored from checkpoint j:3, read from memory (own node), at step 30"

# (name, incident, effects)
RECOVERED_CASES = [
    (
        "restored from a checkpoint: the group starts, the job runs",
        incident(version="j:3", restored_from=Counter(memory=10)),
        [
            StartGroup(),
            rm.Ended(held=False),
            ResetFaults(),
            Transition(JobState.RUNNING, ORCH, f"{RESUMED} 2.5 s after the decision; training resumed"),
        ],
    ),
    (
        "paused when the fault came: it stays paused, its group not started",
        incident(version="j:3", restored_from=Counter(memory=10), paused=True),
        [
            rm.Ended(held=True),
            ResetFaults(),
            Transition(JobState.PAUSED, ORCH, f"{RESUMED}; paused, as before the fault (resume continues it)"),
        ],
    ),
    (
        "from scratch",
        incident(),
        [
            StartGroup(),
            rm.Ended(held=False),
            ResetFaults(),
            Transition(
                JobState.RUNNING,
                ORCH,
                f"recovered from {WHO}: all 2 ranks restored from scratch at step 30 2.5 s after the decision; "
                "training resumed",
            ),
        ],
    ),
    (
        "a rollback loaded in place",
        incident(version="j:3", reload=True),
        [
            StartGroup(),
            rm.Ended(held=False),
            ResetFaults(),
            Transition(
                JobState.RUNNING,
                ORCH,
                f"recovered from {WHO}: all 2 ranks loaded checkpoint j:3 in place (none relaunched) at step 30 "
                "2.5 s after the decision; training resumed",
            ),
        ],
    ),
    (
        "a rebuild in place: the healed rank named",
        incident("rebuild", lost=[1], healed_from={1: 0, 0: 0}),
        [
            StartGroup(),
            rm.Ended(held=False),
            ResetFaults(),
            Transition(
                JobState.RUNNING,
                ORCH,
                f"recovered from {WHO}: group of 2 rebuilt in place: rank 1 healed from rank 0's memory, 1 rank kept "
                "its process at step 30 2.5 s after the decision; training resumed",
            ),
        ],
    ),
]


@pytest.mark.parametrize("name, before, expected", RECOVERED_CASES, ids=[c[0] for c in RECOVERED_CASES])
def test_recovered(name, before, expected) -> None:
    assert rm.recovered(before, 2, 30, seconds=2.5) == expected


# (name, the activity in flight, whose event "every rank ready" is)
READY = [
    ("nothing in flight: the job's start", None, STARTED),
    ("a recovery", incident(), RECOVERED),
    ("a recovery held for inspection too", incident(phase="frozen"), RECOVERED),
    ("a resize rebuilding its group", _Scale(DP2, "scale", phase="rebuilding"), SCALED),
    ("a resize still pausing: no ranks of its own report ready", _Scale(DP2, "scale"), STARTED),
    ("a rollback loading in place", _Reload("j:3", 3, phase="loading"), RELOADED),
    ("a rollback still pausing", _Reload("j:3", 3), STARTED),
    ("an operator resume (its relaunch is the job's start)", _Resume(phase="relaunched"), STARTED),
]


@pytest.mark.parametrize("name, activity, expected", READY, ids=[c[0] for c in READY])
def test_ready_for(name, activity, expected) -> None:
    assert ready_for(activity) == expected


CAUSE = control_pb2.FaultReport(job_id="j", rank=1, fault_class="rank_exit")


def decision(action: str = "restart_ranks", fault_class: str = "rank_exit", **fields) -> fd.Decision:
    return fd.Decision(fault_class, action, action, f"{action} after {fault_class}", 0, **fields)


def facts(**fields) -> rm.Facts:
    base = dict(
        previous=None,
        step=30,
        world_size=4,
        exited=frozenset({1}),
        lost=(1,),
        paused=False,
        unusable=frozenset(),
        frozen=False,
        hold=0.0,
    )
    return rm.Facts(**{**base, **fields})


FROZEN_NOW = Transition(JobState.FAULT_FROZEN, ORCH, "recovering from rank_exit of rank 1")


@pytest.mark.parametrize("action", ["ignore", "skip_step", "skip_save"])
def test_a_decision_that_lets_the_ranks_go_on_begins_nothing(action) -> None:
    assert rm.decided(decision(action), CAUSE, facts(), 5.0) == (None, [])


def test_a_stop_ends_the_job_and_a_pause_parks_it() -> None:
    stop = decision("stop", outcome=control_pb2.JobOutcome.FAILED, final="budget spent")
    assert rm.decided(stop, CAUSE, facts(), 5.0) == (
        None,
        [rm.Terminate(control_pb2.JobOutcome.FAILED, "budget spent")],
    )
    assert rm.decided(decision("pause", final="paused"), CAUSE, facts(), 5.0) == (None, [rm.PauseJob("paused")])


def test_a_relaunch_spends_a_restart_begins_the_incident_and_starts_its_recovery() -> None:
    incident, effects = rm.decided(decision(), CAUSE, facts(), 5.0)
    assert effects == [
        rm.Spend("rank_exit"),
        rm.Begin(incident, "restart_ranks after rank_exit"),
        FROZEN_NOW,
        rm.Recover(),
    ]
    assert (incident.cause, incident.action, incident.decided, incident.at_step) == (CAUSE, "restart_ranks", 5.0, 30)
    assert dict(incident.dying) == {0: 1, 2: 1, 3: 1}  # every rank not seen ended will end
    assert not incident.paused and incident.lost == []


def test_a_relaunch_for_the_stores_outage_spends_no_restart() -> None:
    incident, effects = rm.decided(dataclasses.replace(decision(), spends=False), CAUSE, facts(), 5.0)
    assert effects == [rm.Begin(incident, "restart_ranks after rank_exit"), FROZEN_NOW, rm.Recover()]


def test_a_job_frozen_already_is_not_said_frozen_again_and_a_hold_freezes_instead_of_recovering() -> None:
    _, effects = rm.decided(decision(), CAUSE, facts(frozen=True), 5.0)
    assert effects[-2:] == [effects[-2], rm.Recover()] and FROZEN_NOW not in effects
    incident, effects = rm.decided(decision(), CAUSE, facts(hold=30.0), 5.0)
    assert effects[-1] == rm.Freeze(30.0) and rm.Recover() not in effects and FROZEN_NOW not in effects


def test_a_rebuild_during_a_rebuild_replaces_both_lost_sets_and_keeps_the_operators_pause() -> None:
    previous = incident("rebuild", lost=[3], paused=True)
    previous.dying.update([3])
    new, _ = rm.decided(decision("rebuild"), CAUSE, facts(previous=previous, exited=frozenset()), 5.0)
    assert new.lost == [1, 3] and dict(new.dying) == {1: 1, 3: 2}
    assert new.paused  # (the operator's pause outlives both faults)
    assert rm.decided(decision(), CAUSE, facts(paused=True), 5.0)[0].paused


def test_a_version_that_failed_to_load_is_struck_once() -> None:
    struck = decision(strike="j:3")
    _, effects = rm.decided(struck, CAUSE, facts(), 5.0)
    assert effects[1:3] == [
        rm.Strike("j:3"),
        Record(ORCH, "checkpoint", "checkpoint j:3 fails its digest check on load; never loaded again"),
    ]
    _, effects = rm.decided(struck, CAUSE, facts(unusable=frozenset({"j:3"})), 5.0)
    assert rm.Strike("j:3") not in effects


def test_a_replica_divergence_strikes_what_was_saved_after_the_last_agreeing_check() -> None:
    diverged = decision("rollback", fd.REPLICA_DIVERGENCE, bound=20, strike="j:4")
    incident, effects = rm.decided(diverged, CAUSE, facts(), 5.0)
    assert effects[1:4] == [
        rm.Strike("j:4"),
        Record(
            ORCH,
            "checkpoint",
            "checkpoint j:4 reproduced the replica divergence it was loaded to recover from: suspect; never "
            "loaded again",
        ),
        rm.NeverLoadDiverged(20),
    ]
    assert incident.bound == 20
