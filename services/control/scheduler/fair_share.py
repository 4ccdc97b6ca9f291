"""The order in which waiting jobs are tried, and one scheduling pass over it.

Across teams: weighted dominant share, progressive filling (Ghodsi et al., "Dominant Resource
Fairness", NSDI 2011, with weights as in its section 4.3): the next job tried is the head of
the team whose share once that job starts, ``(slots held by its running jobs and those picked
ahead in this order + the job's slots) / cluster slots / weight``, is the lowest (counting the
job itself keeps a team of small weight from overshooting its share with every large job it
starts: measured in tests/control/test_scheduler_policy.py); ties go to the head with the higher priority, then the older.
The dominant share is the largest over the resources: each device kind's slots held
(``gpu``, ``cpu``) over that kind's capacity, and all the slots held (``any`` jobs' included)
over the cluster's; a kind of no known capacity (an int ``capacity``, a cluster without GPUs)
is left out, so with one kind the share is the slot share, as before device kinds. Within a
team: priority (higher first), then submission order, as the queue before issue 30. A drained
job's queued resume (``first``) goes ahead of everything, as before.

A preemptor's claim (``claims``): a queued job whose preemption made others release (or
checkpoint to release) their slots goes right after the ``first`` ones, ahead of the overdue
and the fair order, until it starts: the slots its preemption frees are its own (Kueue and
Volcano place the preemptor on them). Without it, a victim whose team is below its fair share
came first, was placed straight back on the slots it had just released, and the preemptor
waited (a fresh user's finding, session 33: hp2 waited 115 s while n2 ran again). Its victims
wait behind it; fair share orders everything else. The claims by priority, then submission order.

The starvation bound (the book's ``max_wait_s``, the quota file's ``max_wait_minutes``; quotas.py
says the default): a team's next job (by priority, then age, as above) that has waited that
long (``now - queued``: its time in the queue, its earlier waits included when it was
preempted or requeued: control passes an entry time moved back by them) goes ahead of the fair order, right
after the ``first`` ones, while its team's weighted dominant share *before* the job is below
its entitlement (1 / the weights of the teams with work, running or queued: an equal
division by weight); then the team's next, if overdue too and the team still below. The
overdue jobs by priority, then submission order, across teams. Within a team the order is
unchanged (its higher priority still first: with one team, the queue's order as before).
Under gang admission that makes the job the first of its kind to be tried, so it holds back
the later jobs of its kind (and the ``any`` ones) until its ranks fit: it starts within the
bound plus the time the running jobs take to free its slots. Its team's own limits (hard
limit, borrow limit) still hold it.
Why: counting the job's own slots in its share (above) puts a large job of a small-weight
team behind every other team's small jobs, and without backfill it never reached the head (a
team asking 0.3x its weighted share waited 18 h for one 32-GPU job: docs/LOG.md session 30,
``ageing30``). A team at or above its entitlement gets no promotion: its jobs wait while
teams below theirs have work, as fair share means (a bound for every job would turn an
overloaded kind into FIFO by age: measured, bench/scheduler_bench.py ``--max-wait``).
Slurm bounds this with an age factor, Volcano with its ``sla`` plugin's waiting time.

One pass (:func:`schedule`) walks that order once:
- a job needing more slots than the cluster has holds no one back (it waits for workers);
- a job its team's own limits hold back (hard limit, borrow limit: admission.py) holds back
  the later jobs of its team only (no overtaking within a team) -- except one beyond its
  team's hard limit by itself, which never starts and holds no one back;
- a job waiting for its cohort to have enough idle nominal slots to lend holds back every later
  job of its cohort: that capacity is shared, and letting the cohort's smaller jobs take it as
  it frees up would starve the larger one (measured: bench/scheduler_bench.py on 64 slots left
  130 of 412 jobs never started before this rule) -- except a job of another team that its
  own team's nominal admits with nothing borrowed (backfill within nominal, Kueue's
  BestEffortFIFO within nominal): those slots are its team's, which would reclaim them from a
  borrower at once (reclaim.py), so the held job could never count on them; it waited behind a
  job that could not start with its own team's slot free (a fresh user's finding, session 33).
  Within the held job's team nothing overtakes it (its team's nominal is what it needs first);
- a job the quota admits but whose ranks do not fit the free slots holds back every job after
  it in the order (gang admission without backfill: nothing is partially held, and a large job
  is not starved by small ones, as before issue 30).
Per device kind: a hold by a per-kind bound (``Admission.scope``), a cohort's wait for a
kind's idle slots and a job of kind ``gpu``/``cpu`` whose ranks do not fit hold back the later
jobs of that kind and the ``any`` jobs only (a gpu job waiting for GPUs does not keep a cpu job
off free CPU slots); an ``any`` job holds back every kind.
With a single team (every job in "default"), the order and the pass are the queue's before
issue 30.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from services.control.scheduler.admission import WAIT_COHORT, Admission, Usage, admit, held, team_usage
from services.control.scheduler.quotas import KINDS, QuotaBook

# What ``try_start`` answers in a pass.
STARTED, NO_ROOM, BEYOND_CLUSTER, GONE = "started", "no_room", "beyond_cluster", "gone"


@dataclass(frozen=True)
class Waiting:
    """A queued job: ``slots`` (its ranks), ``priority``, ``seq`` (submission order), ``kind``
    (the device kind its ranks need: gpu, cpu or any), ``queued`` (when it last entered the
    queue, on the clock of the ``now`` passed to the order; None: not known, never overdue)."""

    job_id: str
    team: str
    slots: int
    priority: int = 0
    seq: int = 0
    first: bool = False
    kind: str = "any"
    queued: float | None = None
    claims: bool = False  # a preemptor not started yet: its victims' slots are its own (module docstring)
    submitted: float = 0.0  # its submission's unix time (job_queue.QueueEntry: a preempted job keeps it)

    def key(self) -> tuple[bool, int, float, int]:
        return (not self.first, -self.priority, self.submitted, self.seq)


@dataclass(frozen=True)
class Running:
    """A running job: ``started`` (unix seconds), ``borrowed`` (its slots beyond its team's
    nominal, recorded at its start), ``kind`` (gpu, cpu or any)."""

    job_id: str
    team: str
    slots: int
    priority: int = 0
    started: float = 0.0
    borrowed: int = 0
    kind: str = "any"


@dataclass
class Pass:
    """What one pass decided: ``started`` (job id, slots borrowed) in start order; ``waits``
    (job id -> (kind, reason)) for each job left waiting; ``order`` (the fair order tried)."""

    started: list[tuple[str, int]] = field(default_factory=list)
    waits: dict[str, tuple[str, str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


Capacity = int | Mapping[str, int]  # the cluster's slots, or its slots per device kind


def _capacities(capacity: Capacity) -> tuple[int, dict[str, int]]:
    """(all slots, slots per kind known) of ``capacity``."""
    if isinstance(capacity, int):
        return capacity, {}
    return sum(capacity.get(k, 0) for k in KINDS), {k: capacity[k] for k in KINDS if capacity.get(k)}


_Caps = tuple[int, int, int]  # (all slots (at least 1), gpu slots, cpu slots; 0: not known)
_Held = tuple[int, int, int]  # (all slots held, gpu slots held, cpu slots held)


def _caps(capacity: Capacity) -> _Caps:
    total, kinds = _capacities(capacity)
    return max(total, 1), kinds.get("gpu", 0), kinds.get("cpu", 0)


def _held(per_kind: Mapping[str, int] | int | None) -> _Held:
    if per_kind is None:
        return (0, 0, 0)
    if isinstance(per_kind, int):
        return (per_kind, 0, 0)
    return (sum(per_kind.values()), per_kind.get("gpu", 0), per_kind.get("cpu", 0))


def _with(h: _Held, kind: str, slots: int) -> _Held:
    return (h[0] + slots, h[1] + (slots if kind == "gpu" else 0), h[2] + (slots if kind == "cpu" else 0))


def _dominant(h: _Held, caps: _Caps) -> float:
    d = h[0] / caps[0]
    if caps[1]:
        d = max(d, h[1] / caps[1])
    if caps[2]:
        d = max(d, h[2] / caps[2])
    return d


def dominant(per_kind: Mapping[str, int] | int | None, capacity: Capacity) -> float:
    """The dominant share of a team holding ``per_kind`` (slots per job kind) of ``capacity``."""
    return _dominant(_held(per_kind), _caps(capacity))


def share(book: QuotaBook, team: str, held: Mapping[str, int] | int | None, capacity: Capacity) -> float:
    """``team``'s weighted dominant share holding ``held`` (slots per job kind, or an int: of
    every kind) of ``capacity``."""
    return dominant(held, capacity) / book.get(team).weight


def _plus(held: Mapping[str, int] | int | None, kind: str, slots: int) -> dict[str, int]:
    out = {"any": held} if isinstance(held, int) else dict(held or {})
    out[kind] = out.get(kind, 0) + slots
    return out


def next_overdue(waiting: Iterable[Waiting], book: QuotaBook, now: float) -> float | None:
    """The earliest time after ``now`` at which one of ``waiting`` reaches the book's
    starvation bound (None: none will): when the order may change with no other event."""
    if book.max_wait_s is None:
        return None
    return min((w.queued + book.max_wait_s for w in waiting if w.queued is not None and w.queued + book.max_wait_s > now),
               default=None)  # fmt: skip


def overdue(w: Waiting, book: QuotaBook, now: float | None) -> bool:
    """Whether ``w`` has waited past the book's starvation bound at ``now`` (module docstring)."""
    return (
        now is not None and book.max_wait_s is not None and w.queued is not None and now - w.queued >= book.max_wait_s
    )


def fair_order(
    waiting: Iterable[Waiting],
    usage: Usage,
    book: QuotaBook,
    capacity: Capacity,
    now: float | None = None,
    promoted: set[str] | None = None,
) -> list[Waiting]:
    """The waiting jobs in the order to try them (module docstring): the ``first`` ones, the
    preemptors' claims, each team's next jobs overdue at ``now`` (None: none is), then the
    fair order. O(n log n). ``promoted``: filled with the ids of the jobs the starvation bound put ahead."""
    per_team: dict[str, list[Waiting]] = {}
    firsts: list[Waiting] = []
    claims: list[Waiting] = []
    for w in waiting:
        (firsts if w.first else claims if w.claims else per_team.setdefault(w.team, [])).append(w)
    firsts.sort(key=Waiting.key)
    claims.sort(key=Waiting.key)
    caps = _caps(capacity)
    held: dict[str, _Held] = {t: _held(u) for t, u in usage.items()}
    for w in claims:  # (picked ahead: their slots count in their team's share, as the ``late`` ones' do)
        held[w.team] = _with(held.get(w.team, (0, 0, 0)), w.kind, w.slots)
    late: list[Waiting] = []
    # A team's entitlement: its weight's part of the weights of the teams with work (running or
    # waiting); its overdue heads go ahead while its share before them is below that.
    entitled = 1.0 / max(sum(book.get(t).weight for t in {*per_team, *(t for t, h in held.items() if h[0])}), 1e-9)
    for team, jobs in per_team.items():
        jobs.sort(key=Waiting.key, reverse=True)  # (popped from the end)
        weight = book.get(team).weight
        while jobs and overdue(jobs[-1], book, now) and _dominant(held.get(team, (0, 0, 0)), caps) / weight < entitled:
            w = jobs.pop()
            late.append(w)
            held[team] = _with(held.get(team, (0, 0, 0)), w.kind, w.slots)  # (picked ahead: counted)
    late.sort(key=Waiting.key)
    if promoted is not None:
        promoted.update(w.job_id for w in late)
    heap = []
    for team, jobs in per_team.items():
        if not jobs:
            continue
        head, weight = jobs[-1], book.get(team).weight
        h = held.get(team, (0, 0, 0))
        heapq.heappush(heap, (_dominant(_with(h, head.kind, head.slots), caps) / weight, head.key(), team))
    order = [*firsts, *claims, *late]
    while heap:
        _, _, team = heapq.heappop(heap)
        jobs = per_team[team]
        w = jobs.pop()
        order.append(w)
        held[team] = h = _with(held.get(team, (0, 0, 0)), w.kind, w.slots)
        if jobs:
            nxt = jobs[-1]
            s = _dominant(_with(h, nxt.kind, nxt.slots), caps) / book.get(team).weight
            heapq.heappush(heap, (s, nxt.key(), team))
    return order


def blocks(scope: str, kind: str) -> bool:
    """Whether a hold of ``scope`` ("" or "any": every kind; a kind) holds back a job of ``kind``."""
    return scope in ("", "any") or kind == "any" or scope == kind


class Holds:
    """Which job holds back the later jobs of an owner (a team, or a cohort), per scope (a
    device kind; "" or "any": every kind): the first held wins; a lookup reads one owner's
    few scopes, not every hold of the pass."""

    def __init__(self) -> None:
        self._by_owner: dict[str, dict[str, str]] = {}

    def hold(self, owner: str, scope: str, job_id: str) -> None:
        self._by_owner.setdefault(owner, {}).setdefault(scope, job_id)

    def of(self, owner: str, kind: str) -> str | None:
        """The job that holds back a job of ``owner``'s and ``kind``; None when none does."""
        return next((j for scope, j in self._by_owner.get(owner, {}).items() if blocks(scope, kind)), None)


def schedule(
    waiting: Iterable[Waiting],
    running: Iterable[Running],
    book: QuotaBook,
    capacity: Capacity,
    try_start: Callable[[Waiting, Admission], str],
    now: float | None = None,
) -> Pass:
    """One pass over the fair order (module docstring). ``capacity``: the registered cluster's
    slots (an int, or per device kind). ``now``: the clock of the jobs' ``queued`` (None: no
    job is overdue). ``try_start(job, admission)``: called for each job the
    quota admits, in order; starts it if its ranks fit and answers STARTED, NO_ROOM (they do
    not fit the free slots), BEYOND_CLUSTER (more than the registered slots) or GONE (it ended
    instead, e.g. refused). The quota usage it counts grows with each start."""
    usage = team_usage(running)
    result = Pass()
    order = fair_order(waiting, usage, book, capacity, now)
    result.order = [w.job_id for w in order]
    teams = {w.job_id: w.team for w in order}
    held_teams = Holds()  # team, scope -> the job of it that holds its later ones back
    held_cohorts = Holds()  # cohort, kind -> the job waiting for its idle nominal slots
    blockers: dict[str, Waiting] = {}  # kind -> the first job of it whose ranks did not fit
    total, kinds = _capacities(capacity)
    caps = _caps(capacity)
    for w in order:
        blocker = next((b for k, b in blockers.items() if blocks(k, w.kind)), None)
        if blocker is not None:
            result.waits[w.job_id] = _behind(w, blocker, usage, book, caps)
            continue
        if (job := held_teams.of(w.team, w.kind)) is not None:
            result.waits[w.job_id] = ("team", f"waits behind job {job} of team {w.team}")
            continue
        cohort = book.cohort_of(w.team)
        a = admit(book, usage, w.team, w.slots, w.kind)
        if (job := held_cohorts.of(cohort, w.kind)) is not None and not backfills(w.team, teams[job], a):
            result.waits[w.job_id] = ("cohort", cohort_wait(job, cohort))
            continue
        if a.never:
            result.waits[w.job_id] = (a.kind, a.reason)
            continue
        if not a.ok:
            result.waits[w.job_id] = (a.kind, a.reason)
            if a.kind == WAIT_COHORT:
                held_cohorts.hold(cohort, w.kind, w.job_id)
            else:
                held_teams.hold(w.team, a.scope, w.job_id)
            continue
        outcome = try_start(w, a)
        if outcome == STARTED:
            result.started.append((w.job_id, a.borrowed))
            usage[w.team] = _plus(usage.get(w.team), w.kind, w.slots)
        elif outcome == BEYOND_CLUSTER:
            of, cap = (f" {w.kind}", kinds.get(w.kind, 0)) if w.kind in KINDS and kinds else ("", total)
            result.waits[w.job_id] = (BEYOND_CLUSTER, f"needs {w.slots}{of} slots, more than the cluster's {cap}")
        elif outcome == NO_ROOM:
            result.waits[w.job_id] = (NO_ROOM, f"waits for {w.slots} slots to free up")
            blockers[w.kind] = w
    return result


def backfills(team: str, holder_team: str, admission: Admission) -> bool:
    """Whether a job of ``team`` that ``admission`` answers goes past a job of ``holder_team``
    waiting for their cohort's idle slots (module docstring, backfill within nominal): it is
    admitted within its own team's nominal (nothing borrowed) and is of another team."""
    return team != holder_team and admission.ok and not admission.borrowed


def cohort_wait(job_id: str, cohort: str) -> str:
    """Why a job waits behind ``job_id``, which waits for cohort ``cohort``'s idle slots."""
    return f"waits behind job {job_id}, first in line for cohort {cohort}'s idle slots"


def _behind(w: Waiting, blocker: Waiting, usage: Usage, book: QuotaBook, caps: _Caps) -> tuple[str, str]:
    """Why ``w`` waits behind ``blocker`` (the first job of its kind whose ranks did not fit)."""
    if w.team == blocker.team:
        return ("team", f"waits behind job {blocker.job_id} of team {w.team}")
    mine = _dominant(_held(usage.get(w.team)), caps) / book.get(w.team).weight
    theirs = _dominant(_held(usage.get(blocker.team)), caps) / book.get(blocker.team).weight
    return (
        "fair_share",
        f"waits for its fair share: team {w.team} holds {held(usage.get(w.team), '')} slots "
        f"(weighted share {mine:.3f} vs team {blocker.team}'s {theirs:.3f}, whose job {blocker.job_id} is next)",
    )
