"""The order in which waiting jobs are tried, and one scheduling pass over it.

Across teams: weighted dominant share, progressive filling (Ghodsi et al., "Dominant Resource
Fairness", NSDI 2011, with weights as in its section 4.3): the next job tried is the head of
the team whose share once that job starts, ``(slots held by its running jobs and those picked
ahead in this order + the job's slots) / cluster slots / weight``, is the lowest (counting the
job itself keeps a team of small weight from overshooting its share with every large job it
starts: measured in tests/control/test_scheduler_policy.py); ties go to the head with the higher priority, then the older. Slots
are one kind here (a job spec asks for ranks, not a device kind), so the dominant share is the
slot share. Within a team: priority (higher first), then submission order, as the queue before
issue 30. A drained job's queued resume (``first``) goes ahead of everything, as before.

One pass (:func:`schedule`) walks that order once:
- a job needing more slots than the cluster has holds no one back (it waits for workers);
- a job its team's own limits hold back (hard limit, borrow limit: admission.py) holds back
  the later jobs of its team only (no overtaking within a team) -- except one beyond its
  team's hard limit by itself, which never starts and holds no one back;
- a job waiting for its cohort to have enough idle nominal slots to lend holds back every later
  job of its cohort: that capacity is shared, and letting the cohort's smaller jobs take it as
  it frees up would starve the larger one (measured: bench/scheduler_bench.py on 64 slots left
  130 of 412 jobs never started before this rule);
- a job the quota admits but whose ranks do not fit the free slots holds back every job after
  it in the order (gang admission without backfill: nothing is partially held, and a large job
  is not starved by small ones, as before issue 30).
With a single team (every job in "default"), the order and the pass are the queue's before
issue 30.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from services.control.scheduler.admission import WAIT_COHORT, Admission, admit, team_usage
from services.control.scheduler.quotas import QuotaBook

# What ``try_start`` answers in a pass.
STARTED, NO_ROOM, BEYOND_CLUSTER, GONE = "started", "no_room", "beyond_cluster", "gone"


@dataclass(frozen=True)
class Waiting:
    """A queued job: ``slots`` (its ranks), ``priority``, ``seq`` (submission order)."""

    job_id: str
    team: str
    slots: int
    priority: int = 0
    seq: int = 0
    first: bool = False

    def key(self) -> tuple[bool, int, int]:
        return (not self.first, -self.priority, self.seq)


@dataclass(frozen=True)
class Running:
    """A running job: ``started`` (unix seconds), ``borrowed`` (its slots beyond its team's
    nominal, recorded at its start)."""

    job_id: str
    team: str
    slots: int
    priority: int = 0
    started: float = 0.0
    borrowed: int = 0


@dataclass
class Pass:
    """What one pass decided: ``started`` (job id, slots borrowed) in start order; ``waits``
    (job id -> (kind, reason)) for each job left waiting; ``order`` (the fair order tried)."""

    started: list[tuple[str, int]] = field(default_factory=list)
    waits: dict[str, tuple[str, str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def share(book: QuotaBook, team: str, held: int, capacity: int) -> float:
    """``team``'s weighted dominant share holding ``held`` of ``capacity`` slots."""
    return held / max(capacity, 1) / book.get(team).weight


def fair_order(waiting: Iterable[Waiting], usage: Mapping[str, int], book: QuotaBook, capacity: int) -> list[Waiting]:
    """The waiting jobs in the order to try them (module docstring). O(n log n)."""
    per_team: dict[str, list[Waiting]] = {}
    firsts: list[Waiting] = []
    for w in waiting:
        (firsts if w.first else per_team.setdefault(w.team, [])).append(w)
    firsts.sort(key=Waiting.key)
    held = dict(usage)
    heap = []
    for team, jobs in per_team.items():
        jobs.sort(key=Waiting.key, reverse=True)  # (popped from the end)
        head = jobs[-1]
        heapq.heappush(heap, (share(book, team, held.get(team, 0) + head.slots, capacity), head.key(), team))
    order = list(firsts)
    while heap:
        _, _, team = heapq.heappop(heap)
        jobs = per_team[team]
        w = jobs.pop()
        order.append(w)
        held[team] = held.get(team, 0) + w.slots
        if jobs:
            heapq.heappush(heap, (share(book, team, held[team] + jobs[-1].slots, capacity), jobs[-1].key(), team))
    return order


def schedule(
    waiting: Iterable[Waiting],
    running: Iterable[Running],
    book: QuotaBook,
    capacity: int,
    try_start: Callable[[Waiting, Admission], str],
) -> Pass:
    """One pass over the fair order (module docstring). ``capacity``: the registered cluster's
    slots. ``try_start(job, admission)``: called for each job the quota admits, in order;
    starts it if its ranks fit and answers STARTED, NO_ROOM (they do not fit the free slots),
    BEYOND_CLUSTER (more than the registered slots) or GONE (it ended instead, e.g. refused).
    The quota usage it counts grows with each start."""
    usage = team_usage(running)
    result = Pass()
    order = fair_order(waiting, usage, book, capacity)
    result.order = [w.job_id for w in order]
    held_teams: dict[str, str] = {}  # team -> the job of it that holds its later ones back
    held_cohorts: dict[str, str] = {}  # cohort -> the job waiting for its idle nominal slots
    blocker: Waiting | None = None
    for w in order:
        if blocker is not None:
            result.waits[w.job_id] = _behind(w, blocker, usage, book, capacity)
            continue
        if w.team in held_teams:
            result.waits[w.job_id] = ("team", f"waits behind job {held_teams[w.team]} of team {w.team}")
            continue
        cohort = book.cohort_of(w.team)
        if cohort in held_cohorts:
            result.waits[w.job_id] = ("cohort", cohort_wait(held_cohorts[cohort], cohort))
            continue
        a = admit(book, usage, w.team, w.slots)
        if a.never:
            result.waits[w.job_id] = (a.kind, a.reason)
            continue
        if not a.ok:
            result.waits[w.job_id] = (a.kind, a.reason)
            if a.kind == WAIT_COHORT:
                held_cohorts[cohort] = w.job_id
            else:
                held_teams[w.team] = w.job_id
            continue
        outcome = try_start(w, a)
        if outcome == STARTED:
            result.started.append((w.job_id, a.borrowed))
            usage[w.team] = usage.get(w.team, 0) + w.slots
        elif outcome == BEYOND_CLUSTER:
            result.waits[w.job_id] = (BEYOND_CLUSTER, f"needs {w.slots} slots, more than the cluster's {capacity}")
        elif outcome == NO_ROOM:
            result.waits[w.job_id] = (NO_ROOM, f"waits for {w.slots} slots to free up")
            blocker = w
    return result


def cohort_wait(job_id: str, cohort: str) -> str:
    """Why a job waits behind ``job_id``, which waits for cohort ``cohort``'s idle slots."""
    return f"waits behind job {job_id}, first in line for cohort {cohort}'s idle slots"


def _behind(w: Waiting, blocker: Waiting, usage: Mapping[str, int], book: QuotaBook, capacity: int) -> tuple[str, str]:
    """Why ``w`` waits behind ``blocker`` (the first job whose ranks did not fit)."""
    if w.team == blocker.team:
        return ("team", f"waits behind job {blocker.job_id} of team {w.team}")
    mine = share(book, w.team, usage.get(w.team, 0), capacity)
    theirs = share(book, blocker.team, usage.get(blocker.team, 0), capacity)
    return (
        "fair_share",
        f"waits for its fair share: team {w.team} holds {usage.get(w.team, 0)} slots "
        f"(weighted share {mine:.3f} vs team {blocker.team}'s {theirs:.3f}, whose job {blocker.job_id} is next)",
    )
