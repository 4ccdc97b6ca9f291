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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.control.scheduler.quotas import QuotaBook


def reclaim_victims(
    book: QuotaBook, usage: Mapping[str, int], team: str, slots: int, free: int, running: Iterable
) -> list[str]:
    """The job ids to reclaim, in the order to reclaim them, for a job of ``team`` needing
    ``slots`` slots with ``free`` slots free now; [] when there is nothing to reclaim (the job
    is beyond its team's nominal, it fits already, or the borrowers cannot free enough).

    ``running``: objects with ``job_id``, ``team``, ``slots``, ``priority``, ``started``
    (unix seconds) and ``borrowed`` (slots beyond its team's nominal, recorded at its start).
    """
    q = book.get(team)
    if q.nominal is None or usage.get(team, 0) + slots > q.nominal or free >= slots:
        return []
    cohort = q.cohort
    borrowers = [
        r for r in running if r.borrowed > 0 and r.team != team and book.cohort_of(r.team) == cohort and r.slots > 0
    ]
    borrowers.sort(key=lambda r: (r.priority, -r.started, r.job_id))
    victims, freed = [], free
    for r in borrowers:
        if freed >= slots:
            break
        victims.append(r.job_id)
        freed += r.slots
    return victims if freed >= slots else []
