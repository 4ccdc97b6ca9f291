"""The orchestrator's job queue (issue 15 part 3): a submitted job whose ranks do not fit
waits here, FIFO within priority (higher first), until L1-1 starts it.

Not a seed module: a data structure L1-1 (services/control/orchestrator/) owns, like its
journal. It decides nothing and touches nothing: the orchestrator asks it which job is at
the head and where a job stands; the allocator (L1-2) says whether the head's ranks fit.

Order here: ``(-priority, submitted, seq)``. ``submitted`` is the job's submission time (a
preempted job queued again keeps its first one: its age is not restarted), ``seq`` the order
it entered the queue, handed out here; both are journaled with the entry, so a restarted
control rebuilds the same order (``restore``). The
pass that starts queued jobs (orchestrator/queue.py) takes them in the order the scheduler
gives (scheduler/fair_share.py: teams by their weighted share, then priority and age; a
preemptor first until it starts; a job its own team's nominal admits past another team's
wait for the cohort's idle slots) and may preempt (orchestrator/preemption.py); otherwise a
job that does not fit holds back the ones behind it, no backfill by run-time estimates
(which Surge does not have).

One exception to "only the head": a job that needs more ranks than every registered worker's
slots together can start only once more workers join, so it holds no one back: it keeps its
place (and starts first once it fits) while the jobs behind it are tried in order, as if it
were not there (``mark_beyond_cluster``, set by the orchestrator from the allocator's
refusal). A job that fits the registered cluster but not the free ranks still blocks every
job behind it. The mark is not journaled and is cleared whenever a worker registers: an
unmarked job blocks until it is tried again, never the other way round.

Teams (issue 30): the orchestrator sets ``order`` to the scheduler's fair order across teams
(services/control/scheduler/fair_share.py), which is this order when every job is of one team;
``ordered``, ``head`` and ``position`` follow it.

Journal form (``QueueEntry.to_json``): ``{"priority": p, "seq": n, "submitted": t}`` in the job's journaled
bookkeeping (job_store's ``runtime``); a job without it is not queued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.contract.failures import Refusal

# The priorities an operator may give (``surgectl submit --priority``; 0 by default).
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


class PriorityOutOfRange(ValueError, Refusal):
    """A submit's priority is outside [MIN_PRIORITY, MAX_PRIORITY] (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class QueueEntry:
    """One queued job: its priority (higher first) and its place in submission order:
    ``submitted`` (unix time of the job's submission: a preempted or moved job queued again
    keeps it, as Slurm and Kubernetes keep the original submit time; 0: not known) then
    ``seq`` (the order it entered this queue)."""

    job_id: str
    priority: int
    seq: int
    first: bool = False  # a drained job's resume (`surgectl up`): ahead of every priority
    submitted: float = 0.0

    def key(self) -> tuple[bool, int, float, int]:
        return (not self.first, -self.priority, self.submitted, self.seq)

    def to_json(self) -> dict:
        return {
            "priority": self.priority,
            "seq": self.seq,
            **({"first": True} if self.first else {}),
            **({"submitted": self.submitted} if self.submitted else {}),
        }


def check_priority(priority: int) -> int:
    """``priority`` if in [MIN_PRIORITY, MAX_PRIORITY].

    Raises:
        PriorityOutOfRange: one line naming the field and the range.
    """
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise PriorityOutOfRange(f"priority: must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority}")
    return priority


class JobQueue:
    """Queued jobs in start order. Not thread-safe: the orchestrator's lock guards it."""

    def __init__(self, on_change: Callable[[JobQueue], None] | None = None) -> None:
        """``on_change``: called with the queue after each change of its order (the
        orchestrator publishes the places its queries read)."""
        self._on_change = on_change
        self._entries: dict[str, QueueEntry] = {}
        self._next_seq = 1
        self._beyond: set[str] = set()  # queued jobs needing more ranks than are registered
        # The order the entries are tried in (issue 30: fair share across teams); None: by key.
        self.order: Callable[[list[QueueEntry]], list[QueueEntry]] | None = None
        # ``order``'s answer, kept until the entries change or the owner says its inputs did
        # (``forget_order``): a pass's places and events read it once, not once per job.
        self._ordered: list[QueueEntry] | None = None

    def add(self, job_id: str, priority: int, first: bool = False, submitted: float = 0.0) -> QueueEntry:
        """Queue ``job_id`` behind every job of its priority or higher submitted before it
        (``submitted``: its submission's unix time; ``first``: ahead of every job not queued
        ``first`` itself)."""
        entry = QueueEntry(job_id, check_priority(priority), self._next_seq, first, submitted)
        self._next_seq += 1
        return self.put(entry)

    def restore(self, job_id: str, journaled: dict) -> QueueEntry:
        """Queue ``job_id`` again as journaled (``QueueEntry.to_json``), in its old place."""
        return self.put(
            QueueEntry(
                job_id,
                int(journaled["priority"]),
                int(journaled["seq"]),
                bool(journaled.get("first", False)),
                float(journaled.get("submitted", 0.0)),
            )
        )

    def put(self, entry: QueueEntry) -> QueueEntry:
        """Queue ``entry`` (a new one, or one taken out to be tried, back in its place)."""
        assert entry.job_id not in self._entries, entry
        self._entries[entry.job_id] = entry
        self._ordered = None
        self._next_seq = max(self._next_seq, entry.seq + 1)
        if self._on_change is not None:
            self._on_change(self)
        return entry

    def take(self, job_id: str) -> QueueEntry | None:
        """Take ``job_id`` out of the queue (its entry; None: it was not queued). Its mark
        (``mark_beyond_cluster``) goes with it."""
        self._beyond.discard(job_id)
        entry = self._entries.pop(job_id, None)
        if entry is not None:
            self._ordered = None
            if self._on_change is not None:
                self._on_change(self)
        return entry

    def mark_beyond_cluster(self, job_id: str, beyond: bool) -> None:
        """Whether the queued ``job_id`` needs more ranks than the registered workers have
        slots (it waits for workers to join): marked, it holds back none of the jobs behind it."""
        if beyond and job_id in self._entries:
            self._beyond.add(job_id)
        else:
            self._beyond.discard(job_id)

    def beyond_cluster(self, job_id: str) -> bool:
        return job_id in self._beyond

    def clear_beyond_cluster(self) -> None:
        """A worker registered: every mark may be stale (until tried again, each blocks)."""
        self._beyond.clear()

    def ordered(self) -> list[QueueEntry]:
        if self._ordered is None:
            by_key = sorted(self._entries.values(), key=QueueEntry.key)
            self._ordered = by_key if self.order is None else self.order(by_key)
        return list(self._ordered)

    def forget_order(self) -> None:
        """What ``order`` reads besides the entries changed (its owner's usage, capacity or
        clock): the next ``ordered`` asks it again."""
        self._ordered = None

    def head(self) -> QueueEntry | None:
        if self.order is not None:
            return next(iter(self.ordered()), None)
        return min(self._entries.values(), key=QueueEntry.key, default=None)

    def position(self, job_id: str) -> int:
        """1 for the head, 2 for the next...; 0: not queued."""
        entry = self._entries.get(job_id)
        if entry is None:
            return 0
        if self.order is not None:
            return 1 + next(i for i, e in enumerate(self.ordered()) if e.job_id == job_id)
        return 1 + sum(1 for e in self._entries.values() if e.key() < entry.key())

    def leads(self, priority: int) -> bool:
        """Whether a job submitted now with ``priority`` would be the head (every queued job
        has a lower priority and none is queued ``first``)."""
        return all(e.priority < priority and not e.first for e in self._entries.values())

    def blocks(self, priority: int) -> bool:
        """Whether a job submitted now with ``priority`` must wait behind a queued one: one of
        its priority or higher (or queued ``first``) that is not marked beyond the registered
        cluster."""
        return any((e.priority >= priority or e.first) and e.job_id not in self._beyond for e in self._entries.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)
