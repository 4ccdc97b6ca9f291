"""Which running jobs the queue's head preempts (issue 30 item 2): a pure function of the
head's need, the free slots and the running jobs. No clock, no lock, no port here: table-tested
in tests/control/test_preemption_plan.py; preemption.py acts on the answer.

The rule, as a cluster's administrators expect it (Kueue's and Slurm's priority preemption):
- a victim has a strictly lower priority than the preemptor (never an equal one), is
  ``preemptible`` (its spec's ``preemptible: false`` opts out) and has run at least the
  minimum run time since it last started or resumed (no thrashing: a job preempted and
  resumed is not preempted again at once);
- a job named on the borrowed-capacity list (the team quotas' reclaim: it runs on capacity its
  team borrowed and the owner needs) is a candidate whatever its priority, and is taken first;
  ``preemptible: false`` and the minimum run time still hold for it;
- nothing is preempted unless the free slots and the candidates' slots together fit the
  preemptor: a preemption that still would not let it start costs the victims and gains nothing;
- the fewest victims that free enough; among sets of that size the borrowed first, then the
  lowest priorities, then the newest (the least work to redo, should the checkpoint fail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Running:
    """A running job as the plan weighs it."""

    job_id: str
    priority: int
    ranks: int  # the placeable slots it holds (freed when it is preempted)
    preemptible: bool = True
    started_unix: float = 0.0  # when it last started or resumed training (0: not yet)


@dataclass(frozen=True)
class Choice:
    victims: tuple[str, ...]  # empty: nothing is preempted
    why: str  # what was chosen, or why nothing (for the preemptor's event)


def _preference(job: Running, borrowed: frozenset[str]) -> tuple:
    # The borrowed first, then the lowest priority, then the newest start; the id breaks ties
    # so that a restarted control picks the same set.
    return (job.job_id not in borrowed, job.priority, -job.started_unix, job.job_id)


def choose_victims(
    *,
    needs: int,
    free: int,
    priority: int,
    running: Sequence[Running],
    now: float,
    min_run_seconds: float,
    borrowed: Sequence[str] = (),
) -> Choice:
    """The jobs a preemptor of ``priority`` needing ``needs`` slots (``free`` free now)
    preempts, by the rule in the module docstring."""
    deficit = needs - free
    if deficit <= 0:
        return Choice((), "it fits without preempting")
    lent = frozenset(borrowed)
    candidates, skipped = [], []
    for job in running:
        if job.ranks <= 0:
            continue
        if job.job_id not in lent and job.priority >= priority:
            continue  # (never an equal or higher priority: not worth a line)
        if not job.preemptible:
            skipped.append(f"{job.job_id} is not preemptible")
        elif not job.started_unix or now - job.started_unix < min_run_seconds:
            ran = max(now - job.started_unix, 0.0) if job.started_unix else 0.0
            skipped.append(f"{job.job_id} ran {ran:.0f} s of the {min_run_seconds:g} s minimum")
        else:
            candidates.append(job)
    note = f" ({'; '.join(skipped)})" if skipped else ""
    if sum(j.ranks for j in candidates) < deficit:
        return Choice(
            (),
            f"preempting every candidate would free {sum(j.ranks for j in candidates)} of the {deficit} "
            f"more slots it needs: nothing preempted{note}",
        )
    candidates.sort(key=lambda j: _preference(j, lent))
    by_size = sorted((j.ranks for j in candidates), reverse=True)
    k = next(n for n in range(1, len(by_size) + 1) if sum(by_size[:n]) >= deficit)  # the fewest that free enough
    chosen: list[Running] = []
    left = list(candidates)
    short = deficit
    while len(chosen) < k:
        # The most preferred candidate after which the largest of the rest can still close the gap.
        for i, job in enumerate(left):
            rest = sorted((j.ranks for j in left[:i] + left[i + 1 :]), reverse=True)[: k - len(chosen) - 1]
            if job.ranks + sum(rest) >= short:
                chosen.append(job)
                short -= job.ranks
                left.pop(i)
                break
    names = ", ".join(f"{j.job_id} (priority {j.priority}{', borrowed' if j.job_id in lent else ''})" for j in chosen)
    return Choice(
        tuple(j.job_id for j in chosen), f"preempts {names}: {sum(j.ranks for j in chosen)} slot(s) freed{note}"
    )


def choose_within_team(
    *,
    deficit: int,
    needs: int,
    free: int,
    priority: int,
    team: Sequence[Running],
    frees: dict[str, int],
    others: Sequence[Running],
    now: float,
    min_run_seconds: float,
) -> Choice:
    """The jobs a preemptor held back by its own team's quota (hard limit, borrow limit, or
    nominal used up with nothing to borrow) preempts: first its team's jobs that free
    ``deficit`` slots of the quota (``team``: their ``ranks`` the slots the quota counts),
    by the rule of the module docstring (strictly lower priority, preemptible, past the
    minimum run time, the fewest); then, where the free slots of its kind (``free``) and
    those the chosen free (``frees``: job id -> its placeable slots of the preemptor's kind)
    still do not fit its ``needs``, more lower-priority jobs of any team (``others``) by the
    same rule. Nothing unless both parts succeed: a preemptor that still would not fit
    never preempts."""
    first = choose_victims(
        needs=deficit, free=0, priority=priority, running=team, now=now, min_run_seconds=min_run_seconds
    )
    if not first.victims:
        return Choice((), f"within its team's quota: {first.why}")
    have = free + sum(frees.get(v, 0) for v in first.victims)
    if have >= needs:
        return Choice(first.victims, f"{first.why} within its team's quota")
    rest = [r for r in others if r.job_id not in first.victims]
    more = choose_victims(
        needs=needs, free=have, priority=priority, running=rest, now=now, min_run_seconds=min_run_seconds
    )
    if not more.victims:
        return Choice(
            (),
            f"within its team's quota it would preempt {', '.join(first.victims)}, but for slots to place it "
            f"{more.why}",
        )
    return Choice(first.victims + more.victims, f"{first.why} within its team's quota; for slots {more.why}")
