"""What the operator's queries read (``JobViews``): each job's status as published after the
decision that changed it, never the live state under the decision lock; and the decision
lock itself (``DecisionLock``), which publishes what a decision changed as it ends.

Why: ``surgectl status`` / ``list`` / ``events`` took the orchestrator's one lock, so a list of
every job (a copy of each) or a long event history waited for, and held up, the decisions of
every job. A view is a fresh ``JobStatus`` copy made under the decision lock (``publish``)
and never changed after; a query copies the one it answers with under this file's own leaf
lock (a dict lookup) and fills in what moves with the clock (elapsed seconds) outside it.
Views are published when the outermost holder lets the decision lock go, never half-way
through a decision (a queued job taken out to be tried and put back showed no place to a
query in between); with the queue's places when its order changed (``JobQueue``'s
``on_change``), so a queued job's place is right although only the job that moved changed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from services.contract import control_pb2
from services.control.cluster_metrics import ActiveJob, JobCensus
from services.control.job_queue import JobQueue

JobState = control_pb2.JobState


class DecisionLock:
    """The orchestrator's decision lock: re-entrant (a command it sends may come back as an
    event on the same thread); ``on_release`` runs, still under it, when the outermost
    holder is about to let it go (the decision is over: its changes are published), and
    ``after`` once it has let it go, on the same thread (with the exception the block raised,
    None if none): the decision's journal writes are waited for there, and its commands sent
    (services/control/orchestrator/outbox.py), never under the lock."""

    def __init__(self, on_release: Callable[[], None], after: Callable[[BaseException | None], None] | None = None):
        self._lock = threading.RLock()
        self._mine = threading.local()  # this thread's depth (another thread's is not read)
        self._on_release = on_release
        self._after = after

    def held(self) -> bool:
        """Whether this thread holds the lock (is inside a decision)."""
        return getattr(self._mine, "depth", 0) > 0

    def outermost(self) -> bool:
        """Whether this thread holds the lock once (its decision is no other's part)."""
        return getattr(self._mine, "depth", 0) == 1

    def __enter__(self) -> DecisionLock:
        self._lock.acquire()
        self._mine.depth = getattr(self._mine, "depth", 0) + 1
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        outermost = self._mine.depth == 1
        try:
            if outermost:
                self._on_release()
        finally:
            self._mine.depth -= 1
            self._lock.release()
        if outermost and self._after is not None:
            self._after(exc)


class JobViews:
    """Published job statuses, queue places and cordons. Thread-safe; ``publish`` is called
    under the decision lock (so views are published in decision order), the readers from
    any thread without it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf: the three fields below are replaced under it
        self._jobs: dict[str, tuple[control_pb2.JobStatus, float]] = {}  # id -> (status, running since)
        self._every: dict[str, int] = {}  # id -> its spec's checkpoint.every_steps (0: at the end only)
        self._positions: dict[str, int] = {}  # queued job id -> its place (1: the head)
        self._cordons: tuple[control_pb2.WorkerCordoned, ...] = ()
        # queued job id -> when it entered the queue (unix seconds): for the queue-wait gauge.
        # Jobs queued when control (re)started count from their last journaled change.
        self._queued_since: dict[str, float] = {}
        self._restoring = True  # the first places published are the restored queue's

    def publish(self, status: control_pb2.JobStatus, running_since: float, checkpoint_every: int = 0) -> None:
        """``status`` (a copy nobody changes any more) is the job's view; ``checkpoint_every``
        its spec's checkpoint interval in steps (for the per-job gauges). Under the decision
        lock."""
        with self._lock:
            self._jobs[status.job_id] = (status, running_since)
            self._every[status.job_id] = checkpoint_every

    def publish_places(self, queue: JobQueue) -> None:
        """The queue's order changed: every queued job's place. Under the decision lock."""
        positions = {entry.job_id: place for place, entry in enumerate(queue.ordered(), start=1)}
        now = time.time()
        with self._lock:
            since = self._queued_since
            if self._restoring:  # control (re)started: the jobs it restored were queued at their last change
                since = {j: min(now, v[0].updated_unix or now) for j in positions if (v := self._jobs.get(j))}
                self._restoring = False
            self._positions = positions
            self._queued_since = {job_id: since.get(job_id, now) for job_id in positions}

    def forget(self, job_id: str) -> None:
        """The job is deleted (or its submit undone)."""
        with self._lock:
            self._jobs.pop(job_id, None)
            self._every.pop(job_id, None)

    def census(self) -> JobCensus:
        """Jobs by state, the queue's length, the queue time (unix seconds; 0: none) of its
        oldest entry among those that can run (JobStatus.cannot_run empty) and its jobs that
        can never run as things stand by cause, as published: what control's cluster gauges
        read when scraped (services/control/cluster_metrics.py)."""
        with self._lock:
            states = [status.state for status, _ in self._jobs.values()]
            # (every job not ended: its state and checkpoint interval, one series each)
            active = tuple(
                ActiveJob(job_id, status.state, status.step, status.checkpoint_step, self._every.get(job_id, 0))
                for job_id, (status, _) in self._jobs.items()
                if status.state != JobState.TERMINATED
            )
            never = {j: v[0].cannot_run for j in self._positions if (v := self._jobs.get(j)) is not None}
            queued = len(self._positions)
            # A job that can never run as things stand waits for no turn: it is counted by cause
            # (surge_queue_cannot_run), not in the oldest wait a queue-wait alert reads.
            oldest = min((t for j, t in self._queued_since.items() if not never.get(j)), default=0.0)
        by_state: dict[int, int] = {}
        for state in states:
            by_state[state] = by_state.get(state, 0) + 1
        cannot_run: dict[str, int] = {}
        for cause in never.values():
            if cause:
                cannot_run[cause] = cannot_run.get(cause, 0) + 1
        return JobCensus(by_state, queued, oldest, cannot_run, active)

    def publish_cordons(self, cordons: list[control_pb2.WorkerCordoned]) -> None:
        with self._lock:
            self._cordons = tuple(cordons)

    def status(self, job_id: str) -> control_pb2.JobStatus | None:
        """A copy of the job's view (None: no such job), its queue place and elapsed time
        as of now."""
        with self._lock:
            view = self._jobs.get(job_id)
            place = self._positions.get(job_id, 0)
        return None if view is None else _answer(*view, place)

    def listing(self) -> tuple[list[control_pb2.JobStatus], list[control_pb2.WorkerCordoned]]:
        """Every job's view (copies, oldest submit first: the same order after a control
        restart, which publishes the jobs in its journal's order) and the cordons in force."""
        with self._lock:
            views, positions, cordons = list(self._jobs.values()), self._positions, self._cordons
        views.sort(key=lambda v: (v[0].created_unix, v[0].job_id))
        return [_answer(status, since, positions.get(status.job_id, 0)) for status, since in views], list(cordons)


def _answer(status: control_pb2.JobStatus, running_since: float, place: int) -> control_pb2.JobStatus:
    copy = control_pb2.JobStatus()
    copy.CopyFrom(status)
    copy.queue_position = place
    if running_since and copy.state != JobState.TERMINATED:
        copy.elapsed_seconds = time.time() - running_since
    return copy
