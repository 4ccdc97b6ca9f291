"""An operator resume as a table of transitions (services/control/orchestrator/
resume_machine.py): the versions known and the allocator's answer give the new ``_Resume``
phase and the effects (refuse, place, queue), without a bus, a port, a lock or a clock."""

from __future__ import annotations

import pytest

from services.control.orchestrator import resume_machine as rm
from services.control.orchestrator.job import _Resume

C = rm.Candidate
V1, V2, V3 = C(10, "j:1", True), C(20, "j:2", True), C(30, "j:3", True)

ANSWERED = [
    # (case, candidates, --from, abandoned, held, phase, effects)
    ("the newest that verifies is placed", [V1, V2, V3], "", set(), "", rm.PLACING, [rm.Place(30, "j:3")]),
    (
        "one that fails verification is skipped",
        [V1, V2, C(30, "j:3", False, "bad digest")],
        "",
        set(),
        "",
        rm.PLACING,
        [rm.Place(20, "j:2")],
    ),
    ("an abandoned branch is never chosen", [V1, V2, V3], "", {"j:3"}, "", rm.PLACING, [rm.Place(20, "j:2")]),
    ("the one named, although older", [V1, V2, V3], "j:1", set(), "", rm.PLACING, [rm.Place(10, "j:1")]),
    ("the one named, although abandoned", [V1, V2, V3], "j:3", {"j:3"}, "", rm.PLACING, [rm.Place(30, "j:3")]),
    (
        "the step breaks no tie: the higher version number wins",
        [C(30, "j:9", True), C(30, "j:10", True)],
        "",
        set(),
        "",
        rm.PLACING,
        [rm.Place(30, "j:10")],
    ),
    (
        "queued jobs ahead come first: it waits in the queue",
        [V1, V2],
        "",
        set(),
        "waits for the jobs queued ahead of it",
        rm.QUEUED,
        [rm.Queue(20, "j:2", "waits for the jobs queued ahead of it")],
    ),
    (
        "no checkpoint",
        [],
        "",
        set(),
        "",
        rm.ASKING,
        [rm.Refuse("job j has no checkpoint to resume from; submit again")],
    ),
    (
        "a named version the job never had",
        [V1, V2],
        "j:7",
        set(),
        "",
        rm.ASKING,
        [rm.Refuse("--from j:7: not a committed checkpoint of j (its versions: j:1, j:2)", unknown=True)],
    ),
    (
        "a named version that fails verification",
        [V1, C(20, "j:2", False, "missing shard")],
        "j:2",
        set(),
        "",
        rm.ASKING,
        [rm.Refuse("--from j:2: fails verification (missing shard); never loaded")],
    ),
    (
        "a named version struck by a corrupt report (no reason from the store)",
        [C(20, "j:2", False)],
        "j:2",
        set(),
        "",
        rm.ASKING,
        [rm.Refuse("--from j:2: fails verification (struck); never loaded")],
    ),
    (
        "none verifies",
        [C(10, "j:1", False, "bad digest"), C(20, "j:2", False)],
        "",
        set(),
        "",
        rm.ASKING,
        [rm.Refuse("job j: no checkpoint verifies (j:1: bad digest; j:2: struck); submit again")],
    ),
]


@pytest.mark.parametrize(
    ("candidates", "named", "abandoned", "held", "phase", "effects"),
    [case[1:] for case in ANSWERED],
    ids=[case[0] for case in ANSWERED],
)
def test_answered(candidates, named, abandoned, held, phase, effects) -> None:
    before = _Resume(since=5.0)
    state, got = rm.answered(before, "j", candidates, named, abandoned, held)
    assert (state.phase, got) == (phase, effects)
    assert before.phase == rm.ASKING and before.version == ""  # (a transition is pure)
    if phase != rm.ASKING:
        assert (state.step, state.version, state.since) == (effects[0].step, effects[0].version, 5.0)


PLACING = _Resume(since=5.0, phase=rm.PLACING, step=20, version="j:2")

ALLOCATED = [
    # (case, fits, nowhere, why, beyond, phase, effects)
    ("placed: the placement started the new generation", True, "", "", False, rm.RELAUNCHED, []),
    (
        "not now: it waits in the queue for its ranks",
        False,
        "",
        "needs 2 ranks; 1 free",
        False,
        rm.QUEUED,
        [rm.Queue(20, "j:2", "needs 2 ranks; 1 free")],
    ),
    (
        "more ranks than the registered workers have: queued, holding back none behind it",
        False,
        "",
        "waits for workers",
        True,
        rm.QUEUED,
        [rm.Queue(20, "j:2", "waits for workers", beyond=True)],
    ),
    (
        "its ranks fit no registered slot: refused",
        False,
        "needs 90 GiB per rank; the largest slot has 80 GiB",
        "",
        False,
        rm.PLACING,
        [rm.Refuse("cannot resume j: needs 90 GiB per rank; the largest slot has 80 GiB", resources=True)],
    ),
]


@pytest.mark.parametrize(
    ("fits", "nowhere", "why", "beyond", "phase", "effects"),
    [case[1:] for case in ALLOCATED],
    ids=[case[0] for case in ALLOCATED],
)
def test_allocated(fits, nowhere, why, beyond, phase, effects) -> None:
    state, got = rm.allocated(PLACING, "j", fits=fits, nowhere=nowhere, why=why, beyond=beyond)
    assert (state.phase, got) == (phase, effects)
    assert PLACING.phase == rm.PLACING
