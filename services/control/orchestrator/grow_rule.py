"""Which shrunk jobs grow back into returned slots first (issue 30 item 3): a pure function,
table-tested in tests/control/test_grow_rule.py; resize.py acts on the answer.

The rule, stated: when slots return, (1) the queue's head is tried first (resize.py schedules
the growth after it): a job waiting to start at all is placed whole before a running one grows
(gang admission: no job holds part of its slots while it waits); (2) a job does not grow while
the queue's head has its priority or a higher one (the slots are that job's to wait for; a head
that needs more slots than are registered holds back no one); (3) among the jobs that want to
grow: the higher priority first, then the older (submitted first), then the job id; each takes
what its new ranks need and the next gets the rest; (4) a job resizes at most once per
``min_interval_s`` (a grow-back tried earlier waits for its interval to end: no job flaps
between sizes as slots come and go). Rule (2) holds for `surgectl scale`'s growth too
(resize.py ``_check_growth``: refused, not kept waiting).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Grower:
    """A running job shrunk by a fault that wants to grow back."""

    job_id: str
    priority: int
    created_unix: float
    last_resize: float = 0.0  # unix time its last resize began (0: none; journaled: job.py)


def arbitrate(
    growers: Sequence[Grower], now: float, min_interval_s: float, waiting_priority: int | None = None
) -> tuple[list[str], float | None]:
    """The jobs to grow, in order, and the seconds until a job held back by its interval may
    try (None: none is). ``waiting_priority``: the queue's head's priority (None: no head, or
    one waiting for workers to join)."""
    order, later = [], None
    for g in sorted(growers, key=lambda g: (-g.priority, g.created_unix, g.job_id)):
        if waiting_priority is not None and waiting_priority >= g.priority:
            continue
        wait = g.last_resize + min_interval_s - now if g.last_resize else 0.0
        if wait > 0:
            later = wait if later is None else min(later, wait)
            continue
        order.append(g.job_id)
    return order, later
