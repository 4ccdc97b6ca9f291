"""Which running jobs on borrowed capacity to reclaim so that a team can use its own nominal
quota (the preemption mechanism, issue 30 item 2, acts on the answer; this only names them).

Asked for a waiting job of ``team`` that is within the team's nominal but cannot start because
other teams of its cohort borrowed its idle nominal slots. Victims: running jobs of the other
teams of the cohort that run on borrowed slots (``borrowed > 0``), lowest priority first, then
newest first (the least work lost; Kueue reclaims within a cohort the same way), taken until
the slots they free together with the ``free`` slots cover the job. A job of a priority
higher than or equal to the claimant's is still a victim: it runs on capacity that is not its
team's. When they cannot cover the job, none is named (a preemptor that would still not fit
never preempts).

Per device kind: the claim is within the team's nominal of the job's kind (a per-kind
nominal) or of every kind (an int one), and only borrowers of the job's kind free slots it can
use (a gpu claimant reclaims gpu jobs; an ``any`` claimant any job). ``free``: the free slots
of that kind.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.control.scheduler.admission import Usage, held
from services.control.scheduler.quotas import KINDS, QuotaBook


def reclaim_victims(
    book: QuotaBook, usage: Usage, team: str, slots: int, free: int, running: Iterable, kind: str = "any"
) -> list[str]:
    """The job ids to reclaim, in the order to reclaim them, for a job of ``team`` needing
    ``slots`` slots with ``free`` slots free now; [] when there is nothing to reclaim (the job
    is beyond its team's nominal, it fits already, or the borrowers cannot free enough).

    ``running``: objects with ``job_id``, ``team``, ``slots``, ``priority``, ``started``
    (unix seconds), ``borrowed`` (slots beyond its team's nominal, recorded at its start) and
    ``kind`` (gpu, cpu or any; none: any).
    """
    q = book.get(team)
    if kind not in KINDS and q.per_kind:
        return []  # (admission refuses such a job)
    nominal, scope = q.bound("nominal", kind)
    if nominal is None or held(usage.get(team), scope) + slots > nominal or free >= slots:
        return []
    cohort = q.cohort
    borrowers = [
        r
        for r in running
        if r.borrowed > 0
        and r.team != team
        and book.cohort_of(r.team) == cohort
        and r.slots > 0
        and (kind not in KINDS or getattr(r, "kind", "any") == kind)
    ]
    borrowers.sort(key=lambda r: (r.priority, -r.started, r.job_id))
    victims, freed = [], free
    for r in borrowers:
        if freed >= slots:
            break
        victims.append(r.job_id)
        freed += r.slots
    return victims if freed >= slots else []
