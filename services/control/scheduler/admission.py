"""Whether one job of a team may start now as far as quotas go (the allocator says whether
its ranks fit the free slots; both must agree).

Rules, in order (slots: a job's world size):

1. A job needing more slots than its team may ever hold never starts: beyond its hard limit,
   beyond its nominal plus its borrow limit, or beyond the nominal of its whole cohort (what
   the cohort's teams own together, when the cohort is not the default's: teams with no entry
   join that one as they come). Refused at submit (``Admission.never``, one line naming the
   quota's field and the bound), and, queued before a quota change, it waits saying it can
   never run as things stand, without holding its team back, and starts once the bound is
   raised. The test is usage-free: on an idle cluster the same answer.
2. The team's slots in use plus the job's must stay within its hard limit, whatever is idle.
3. Within the team's nominal: admitted.
4. Beyond it, the slots above nominal are borrowed: admitted only when they stay within its
   borrow limit and the cohort has that much idle nominal capacity (the cohort's nominal
   slots minus the slots its teams use). A cohort one of whose teams has an unlimited nominal
   (the default) has unlimited idle nominal: only the cluster bounds it.

``borrowed`` (what a started job runs on beyond its team's nominal) is recorded with the job:
its ranks are the first reclaimed (reclaim.py) when the lenders need their nominal back.

Device kinds (quotas.py): a job is of kind ``gpu``, ``cpu`` or ``any`` (its spec's
``parallel.device``); usage is counted per (team, kind). Each rule reads its bound's scope: an
int bound counts the team's slots of every kind together, a per-kind bound the team's slots
of the job's kind (and, conservatively, its ``any`` jobs', which may hold either kind). A team
with a per-kind bound refuses ``any`` jobs (rule 1's NEVER: the job must name its kind). The
answer's ``scope`` is the kind a wait is about ("" every kind): a job held by its team's gpu
limit does not hold back the team's cpu jobs. A cohort lends per kind: the idle nominal of a
kind is its members' per-kind nominal of that kind plus their int nominal, minus their slots
of that kind and of ``any``, never more than the whole cohort's idle nominal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.control.scheduler.quotas import KINDS, QuotaBook, TeamQuota

ADMITTED, WAIT_HARD_LIMIT, WAIT_BORROW_LIMIT, WAIT_COHORT, NEVER = (
    "admitted",
    "hard_limit",
    "borrow_limit",
    "cohort_full",
    "beyond_hard_limit",
)


@dataclass(frozen=True)
class Admission:
    """One answer of :func:`admit`: ``kind`` (ADMITTED or why not), ``borrowed`` (the slots
    beyond nominal it would run on), ``reason`` (one line for people, "" when admitted),
    ``scope`` (the device kind a wait is about: "gpu"/"cpu", or "" for every kind)."""

    kind: str
    borrowed: int = 0
    reason: str = ""
    scope: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == ADMITTED

    @property
    def never(self) -> bool:
        return self.kind == NEVER


Usage = Mapping[str, Mapping[str, int] | int]  # team -> slots held per job kind (an int: of every kind)


def team_usage(running: Iterable) -> dict[str, dict[str, int]]:
    """Slots held per team and job kind by ``running`` (anything with ``team`` and ``slots``,
    and ``kind``: gpu, cpu or any; none: any)."""
    usage: dict[str, dict[str, int]] = {}
    for r in running:
        per = usage.setdefault(r.team, {})
        kind = getattr(r, "kind", "any")
        per[kind] = per.get(kind, 0) + r.slots
    return usage


def held(per_kind: Mapping[str, int] | int | None, scope: str) -> int:
    """A team's slots held in ``scope`` ("": every kind; a kind: that kind's and its ``any``
    jobs')."""
    if per_kind is None:
        return 0
    if isinstance(per_kind, int):
        return per_kind
    if not scope:
        return sum(per_kind.values())
    return per_kind.get(scope, 0) + per_kind.get("any", 0)


def cohort_idle(book: QuotaBook, usage: Usage, cohort: str, kind: str = "any") -> float:
    """The idle nominal slots of ``cohort`` a job of ``kind`` may borrow (module docstring; inf
    when a team of it, or the default for teams with no entry, has an unlimited nominal)."""
    pools = {"gpu": 0.0, "cpu": 0.0, "int": 0.0}  # per-kind nominal of each kind, int nominal

    def add(q: TeamQuota) -> bool:
        if q.nominal is None:
            return False
        if isinstance(q.nominal, dict):
            for k in KINDS:
                pools[k] += math.inf if q.nominal[k] is None else q.nominal[k]
        else:
            pools["int"] += q.nominal
        return True

    if book.default.cohort == cohort and book.default.nominal is None:
        return math.inf
    members = {t for t, q in book.teams.items() if q.cohort == cohort}
    for t in members:
        if not add(book.teams[t]):
            return math.inf
    # Teams with no entry fall under the default: its nominal counts once per team using it.
    used = {"gpu": 0, "cpu": 0, "any": 0}
    for t, u in usage.items():
        if t in members or (t not in book.teams and book.default.cohort == cohort):
            if t not in members:
                add(book.default)
            if isinstance(u, int):
                used["any"] += u
            else:
                for k, n in u.items():
                    used[k] = used.get(k, 0) + n
    idle = pools["gpu"] + pools["cpu"] + pools["int"] - sum(used.values())
    if kind in KINDS:  # (that kind's own pool and the int pool; "any" jobs may hold either kind)
        idle = min(idle, pools[kind] + pools["int"] - used[kind] - used["any"])
    return idle


def admit(book: QuotaBook, usage: Usage, team: str, slots: int, kind: str = "any") -> Admission:
    """Whether a job of ``team`` and device ``kind`` (gpu, cpu, any) needing ``slots`` slots may
    start given ``usage`` (slots held per team and job kind by running jobs), by the rules of the
    module docstring."""
    q = book.get(team)
    if kind not in KINDS and q.per_kind:
        return Admission(
            NEVER,
            reason=(
                f"team {team}'s quota is per device kind: the job must say parallel.device: gpu or cpu "
                "(or backend nccl), not any"
            ),
        )
    mine = usage.get(team)
    hard, hs = q.bound("hard_limit", kind)
    unit = f"{hs} slots" if hs else "slots"
    if hard is not None and slots > hard:
        return Admission(NEVER, reason=_at_most(slots, unit, team, hard, _field("hard_limit", hs)))
    used = held(mine, hs)
    if hard is not None and used + slots > hard:
        return Admission(
            WAIT_HARD_LIMIT,
            reason=(
                f"team {team} at its {hs + ' ' if hs else ''}hard limit ({used} of {hard} {unit} held, "
                f"this job needs {slots})"
            ),
            scope=hs,
        )
    nominal, ns = q.bound("nominal", kind)
    used = held(mine, ns)
    if nominal is None or used + slots <= nominal:
        return Admission(ADMITTED)
    of = f" {ns}" if ns else ""
    borrowed = used + slots - nominal  # the team's slots beyond nominal once it runs
    limit, ls = q.bound("borrow_limit", kind)
    if limit is not None and slots > nominal + limit:  # (beyond what it may ever hold, idle or not)
        field = f"{_field('nominal', ns)} {nominal} + {_field('borrow_limit', ls)} {limit}"
        unit = f"{ns or ls} slots" if ns or ls else "slots"
        return Admission(NEVER, reason=_at_most(slots, unit, team, nominal + limit, field), scope=ns)
    if limit is not None and borrowed > limit:
        return Admission(
            WAIT_BORROW_LIMIT,
            reason=(
                f"team {team} beyond its{of} nominal {nominal} would borrow {borrowed}{of} slots, "
                f"over its borrow limit of {limit}"
            ),
            scope=ns,
        )
    idle = cohort_idle(book, usage, q.cohort, kind)
    if idle < slots and book.default.cohort != q.cohort:
        # The cohort's teams are those with an entry (the default's teams are not in it): what
        # they own together bounds what it lends, however idle it is.
        whole = cohort_idle(book, {}, q.cohort, kind)
        if whole < slots:
            field = f"cohort {q.cohort}'s{of} nominal: what its teams own together"
            unit = f"{ns} slots" if ns else "slots"
            return Admission(NEVER, reason=_at_most(slots, unit, team, int(whole), field), scope=ns)
    if idle < slots:
        return Admission(
            WAIT_COHORT,
            reason=(
                f"team {team} beyond its{of} nominal {nominal} ({used} held) and cohort {q.cohort} has "
                f"{max(0, int(idle))} idle nominal{of} slots to lend, this job needs {slots}"
            ),
            scope=kind if kind in KINDS else "",
        )
    return Admission(ADMITTED, borrowed=min(slots, borrowed))


def _field(name: str, scope: str) -> str:
    """A quota field as the quota file names it (``hard_limit``, per kind ``hard_limit.gpu``)."""
    return f"{name}.{scope}" if scope else name


def _at_most(slots: int, unit: str, team: str, most: int, field: str) -> str:
    """Why a job can never start under its team's quota: one line naming the bound, e.g.
    ``needs 16 gpu slots; team vision may hold at most 8 (hard_limit.gpu)``."""
    return f"needs {slots} {unit}; team {team} may hold at most {most} ({field})"


def quota_deficit(book: QuotaBook, usage: Usage, team: str, slots: int, kind: str = "any") -> int | None:
    """The fewest of ``team``'s held slots (counted in every scope: what its own running jobs
    would free) that, released, let :func:`admit` start a job of ``slots`` slots of ``kind``:
    0 when it is admitted now, None when no release would (beyond its hard limit alone, or
    beyond what the team holds). A preemption within the team needs at least this much
    (preemption.py); every rule is of the form used - freed + slots <= bound, so the answer
    is found by bisection."""
    first = admit(book, usage, team, slots, kind)
    if first.ok:
        return 0
    if first.never:
        return None
    mine = usage.get(team)
    total = held(mine, "")

    def admitted_after(freed: int) -> bool:
        per = dict(mine) if isinstance(mine, Mapping) else {"any": mine or 0}
        per["any"] = per.get("any", 0) - freed  # ("any" counts in every scope: freed from all of them)
        return admit(book, {**usage, team: per}, team, slots, kind).ok

    if total <= 0 or not admitted_after(total):
        return None
    lo, hi = 1, total  # admitted_after(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if admitted_after(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def borrowed_by_job(q: TeamQuota, jobs: Sequence[tuple[str, Mapping[str, int]]]) -> dict[str, int]:
    """Each of a team's jobs' slots beyond the team's nominal ``q.nominal``: ``jobs`` (job id,
    slots held per kind) in the order the nominal covers them -- the team's own queue order,
    higher priority first, then earlier submission (control passes them so); the slots past
    the nominal are the later jobs' borrowed ones. Derived from what runs now, never kept: a
    job of the team that ends moves the later ones back within the nominal. The sum is the
    team's borrowed slots (`surgectl team list`). Per scope, as admission counts: an int
    nominal bounds every kind together, a per-kind one each kind (its jobs and ``any`` ones)."""
    got = {job_id: 0 for job_id, _ in jobs}
    nominal = q.nominal
    scopes = list(nominal.items()) if isinstance(nominal, dict) else [("", nominal)]
    for scope, bound in scopes:
        if bound is None:
            continue
        used = 0
        for job_id, per in jobs:
            mine = held(per, scope)
            got[job_id] += max(0, min(mine, used + mine - bound))
            used += mine
    return got
