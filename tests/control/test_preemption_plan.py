"""Which running jobs the queue's head preempts (preemption_plan.py): a table of cases."""

from __future__ import annotations

import pytest

from services.control.orchestrator.preemption_plan import Running, choose_victims

NOW = 10_000.0


def run(job_id: str, priority: int, ranks: int = 1, *, preemptible: bool = True, ran: float = 600.0) -> Running:
    return Running(job_id, priority, ranks, preemptible, NOW - ran)


CASES = [
    # (case, needs, free, priority, running, borrowed, min_run, victims)
    ("fits already: nothing", 2, 2, 5, [run("a", 0, 2)], (), 120, ()),
    ("lower priority only", 2, 0, 5, [run("hi", 9, 2), run("eq", 5, 2), run("lo", 1, 2)], (), 120, ("lo",)),
    ("equal priorities never", 2, 0, 5, [run("eq", 5, 2)], (), 120, ()),
    ("higher priority never", 1, 0, 0, [run("hi", 3, 1)], (), 120, ()),
    ("preemptible false never", 2, 0, 5, [run("keep", 0, 2, preemptible=False)], (), 120, ()),
    (
        "preemptible false skipped, another taken",
        2,
        0,
        5,
        [run("keep", 0, 2, preemptible=False), run("go", 1, 2)],
        (),
        120,
        ("go",),
    ),
    ("still would not fit: nothing", 4, 1, 5, [run("a", 0, 1), run("b", 0, 1)], (), 120, ()),
    ("would fit with free slots", 4, 2, 5, [run("a", 0, 1), run("b", 0, 1)], (), 120, ("a", "b")),
    ("min run time protects", 2, 0, 5, [run("young", 0, 2, ran=30)], (), 120, ()),
    ("min run time over", 2, 0, 5, [run("old", 0, 2, ran=121)], (), 120, ("old",)),
    ("never started: protected", 1, 0, 5, [Running("cold", 0, 1, True, 0.0)], (), 0, ()),
    (
        "fewest victims: one large over two small",
        2,
        0,
        5,
        [run("s1", 0, 1), run("s2", 0, 1), run("big", 1, 2)],
        (),
        120,
        ("big",),
    ),
    ("lowest priority first", 1, 0, 5, [run("p3", 3), run("p1", 1), run("p2", 2)], (), 120, ("p1",)),
    ("newest first at equal priority", 1, 0, 5, [run("old", 1, ran=900), run("new", 1, ran=200)], (), 120, ("new",)),
    ("two needed: lowest two", 2, 0, 5, [run("p3", 3), run("p1", 1), run("p2", 2)], (), 120, ("p1", "p2")),
    (
        "the preferred one kept out when the set would not fit",
        3,
        0,
        5,
        [run("lo1", 0, 1), run("mid2", 2, 2), run("mid3", 3, 2)],
        (),
        120,
        ("lo1", "mid2"),
    ),
    (
        "borrowed taken first even at a higher priority",
        1,
        0,
        5,
        [run("lo", 0), run("lent", 7)],
        ("lent",),
        120,
        ("lent",),
    ),
    ("borrowed at an equal priority", 1, 0, 5, [run("eq", 5)], ("eq",), 120, ("eq",)),
    ("borrowed but not preemptible", 1, 0, 5, [run("eq", 5, preemptible=False)], ("eq",), 120, ()),
    ("borrowed but young", 1, 0, 5, [run("eq", 5, ran=10)], ("eq",), 120, ()),
    ("empty borrowed list: priorities alone", 1, 0, 5, [run("eq", 5), run("lo", 4)], (), 120, ("lo",)),
]


@pytest.mark.parametrize(
    ("needs", "free", "priority", "running", "borrowed", "min_run", "victims"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_victim_selection(needs, free, priority, running, borrowed, min_run, victims):
    choice = choose_victims(
        needs=needs, free=free, priority=priority, running=running, now=NOW, min_run_seconds=min_run, borrowed=borrowed
    )
    assert choice.victims == victims, choice.why


def test_the_reasons_name_what_was_skipped_and_the_shortfall():
    choice = choose_victims(
        needs=4,
        free=0,
        priority=5,
        running=[run("keep", 0, 2, preemptible=False), run("young", 0, 1, ran=5), run("ok", 0, 1)],
        now=NOW,
        min_run_seconds=120,
    )
    assert choice.victims == ()
    assert choice.why == (
        "preempting every candidate would free 1 of the 4 more slots it needs: nothing preempted "
        "(keep is not preemptible; young ran 5 s of the 120 s minimum)"
    )
    took = choose_victims(needs=1, free=0, priority=5, running=[run("a", 2)], now=NOW, min_run_seconds=0)
    assert took.why == "preempts a (priority 2): 1 slot(s) freed"


WITHIN_TEAM = [
    # (case, deficit, needs, free, priority, team, others, victims)
    ("the team's lowest frees the quota, slots are free", 2, 2, 2, 5, [run("t0", 0, 2), run("t1", 1, 2)], [], ("t0",)),
    ("equal priority in the team never", 1, 1, 1, 5, [run("eq", 5, 1)], [], ()),
    ("preemptible false in the team never", 1, 1, 1, 5, [run("keep", 0, 1, preemptible=False)], [], ()),
    ("inside the minimum run time never", 1, 1, 1, 5, [run("young", 0, 1, ran=5)], [], ()),
    # The team's job frees 1 slot and the quota; 1 free; another team's low job the rest.
    (
        "the rest of the slots from a lower job of any team",
        1,
        3,
        1,
        5,
        [run("t0", 0, 1)],
        [run("t0", 0, 1), run("o", 1, 1)],
        ("t0", "o"),
    ),
    # The quota would admit it, but the slots are a higher priority's: nothing.
    ("still would not fit: nothing", 1, 2, 0, 5, [run("t0", 0, 1)], [run("t0", 0, 1), run("o", 9, 1)], ()),
]


@pytest.mark.parametrize(
    ("deficit", "needs", "free", "priority", "team", "others", "victims"),
    [c[1:] for c in WITHIN_TEAM],
    ids=[c[0] for c in WITHIN_TEAM],
)
def test_victims_within_a_team(deficit, needs, free, priority, team, others, victims):
    from services.control.orchestrator.preemption_plan import choose_within_team

    frees = {r.job_id: r.ranks for r in [*team, *others]}
    choice = choose_within_team(
        deficit=deficit,
        needs=needs,
        free=free,
        priority=priority,
        team=team,
        frees=frees,
        others=others,
        now=NOW,
        min_run_seconds=120,
    )
    assert choice.victims == victims, choice.why
