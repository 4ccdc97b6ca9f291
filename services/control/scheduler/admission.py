"""Whether one job of a team may start now as far as quotas go (the allocator says whether
its ranks fit the free slots; both must agree).

Rules, in order (slots: a job's world size):

1. A job needing more slots than its team's hard limit never starts: refused at submit
   (``Admission.never``), and, queued before a quota change, it waits without holding its
   team back.
2. The team's slots in use plus the job's must stay within its hard limit, whatever is idle.
3. Within the team's nominal: admitted.
4. Beyond it, the slots above nominal are borrowed: admitted only when they stay within its
   borrow limit and the cohort has that much idle nominal capacity (the cohort's nominal
   slots minus the slots its teams use). A cohort one of whose teams has an unlimited nominal
   (the default) has unlimited idle nominal: only the cluster bounds it.

``borrowed`` (what a started job runs on beyond its team's nominal) is recorded with the job:
its ranks are the first reclaimed (reclaim.py) when the lenders need their nominal back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.control.scheduler.quotas import QuotaBook

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
    beyond nominal it would run on), ``reason`` (one line for people, "" when admitted)."""

    kind: str
    borrowed: int = 0
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == ADMITTED

    @property
    def never(self) -> bool:
        return self.kind == NEVER


def team_usage(running: Iterable) -> dict[str, int]:
    """Slots held per team by ``running`` (anything with ``team`` and ``slots``)."""
    usage: dict[str, int] = {}
    for r in running:
        usage[r.team] = usage.get(r.team, 0) + r.slots
    return usage


def cohort_idle(book: QuotaBook, usage: Mapping[str, int], cohort: str) -> float:
    """The idle nominal slots of ``cohort``: its teams' nominal minus their usage (inf when a
    team of it, or the default for teams with no entry, has an unlimited nominal)."""
    if book.default.cohort == cohort and book.default.nominal is None:
        return math.inf
    nominal = 0
    members = {t for t, q in book.teams.items() if q.cohort == cohort}
    for t in members:
        n = book.teams[t].nominal
        if n is None:
            return math.inf
        nominal += n
    # Teams with no entry fall under the default: its nominal counts once per team using it.
    used = 0
    for t, u in usage.items():
        if t in members:
            used += u
        elif t not in book.teams and book.default.cohort == cohort:
            nominal += book.default.nominal or 0
            used += u
    return nominal - used


def admit(book: QuotaBook, usage: Mapping[str, int], team: str, slots: int) -> Admission:
    """Whether a job of ``team`` needing ``slots`` slots may start given ``usage`` (slots held
    per team by running jobs), by the rules of the module docstring."""
    q = book.get(team)
    held = usage.get(team, 0)
    if q.hard_limit is not None and slots > q.hard_limit:
        return Admission(NEVER, reason=f"needs {slots} slots, beyond team {team}'s hard limit of {q.hard_limit}")
    if q.hard_limit is not None and held + slots > q.hard_limit:
        return Admission(
            WAIT_HARD_LIMIT,
            reason=f"team {team} at its hard limit ({held} of {q.hard_limit} slots held, this job needs {slots})",
        )
    if q.nominal is None or held + slots <= q.nominal:
        return Admission(ADMITTED)
    borrowed = held + slots - q.nominal  # the team's slots beyond nominal once it runs
    if q.borrow_limit is not None and borrowed > q.borrow_limit:
        return Admission(
            WAIT_BORROW_LIMIT,
            reason=(
                f"team {team} beyond its nominal {q.nominal} would borrow {borrowed} slots, "
                f"over its borrow limit of {q.borrow_limit}"
            ),
        )
    idle = cohort_idle(book, usage, q.cohort)
    if idle < slots:
        return Admission(
            WAIT_COHORT,
            reason=(
                f"team {team} beyond its nominal {q.nominal} ({held} held) and cohort {q.cohort} has "
                f"{max(0, int(idle))} idle nominal slots to lend, this job needs {slots}"
            ),
        )
    return Admission(ADMITTED, borrowed=min(slots, borrowed))
