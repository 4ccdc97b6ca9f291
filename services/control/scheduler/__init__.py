"""The scheduler's policy (issue 30 items 1 and 4): teams, quotas with borrowing, fair share.

Pure functions over plain values, no I/O, no locks, no clock: L1-1 (the orchestrator) calls
them under its decision lock and acts on what they return; the bench (bench/scheduler_bench.py)
calls the same functions on a simulated cluster; the preemption mechanism calls
``reclaim_victims``.

Map:
- quotas.py: a team's quota (nominal, borrow limit, hard limit, weight, cohort), the default
  for a team with no entry, the quota file (YAML, pydantic) and its one-line errors.
- admission.py: whether one job of a team may start now given every team's usage (within
  nominal, on borrowed capacity, or waiting and why), and what it would borrow.
- fair_share.py: the order of the waiting jobs across teams (weighted dominant share) and
  within a team (priority, then age), and one scheduling pass over that order.
- reclaim.py: which running jobs on borrowed capacity to reclaim for a team below its nominal.
"""

from services.control.scheduler.admission import Admission, admit, team_usage
from services.control.scheduler.fair_share import Pass, Running, Waiting, fair_order, schedule
from services.control.scheduler.quotas import (
    DEFAULT_QUOTA,
    QuotaBook,
    QuotaFileError,
    TeamQuota,
    load_quota_file,
)
from services.control.scheduler.reclaim import reclaim_victims

__all__ = [
    "DEFAULT_QUOTA",
    "Admission",
    "Pass",
    "QuotaBook",
    "QuotaFileError",
    "Running",
    "TeamQuota",
    "Waiting",
    "admit",
    "fair_order",
    "load_quota_file",
    "reclaim_victims",
    "schedule",
    "team_usage",
]
