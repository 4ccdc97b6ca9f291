"""Rank 0's step writes that control's journal refused (a full disk, an I/O error): held,
written again first in the job's next step write (or once the journal commits again), and
said to L1-3 as L1-1's typed failure (issue 28 item 2).

Why: a rank 0 step's journal write (its step row; its events: a skipped step's record, the
status every ``persist_interval_s``) is no decision: nothing waits for it and no operator is
refused. When it failed, only the health gauge moved: the step was lost, so the job's step
history (``JobStore.steps``, what a restarted control resumes from) had a hole once the disk
recovered, and L1-3 heard of nothing. Now:

- the step is held (``HeldSteps``: per job, at most ``MAX_HELD``; beyond, the oldest go,
  counted in ``surge_control_journal_steps_dropped_total`` and logged) and its rows (the step
  and its events; not its status: a later write journals a newer one) are written first in
  the job's next step write, in one transaction, so the history keeps its order; a job that
  steps no more (ended, paused) has them written once the journal commits again (any write:
  another job's step, a node agent's event, an operator's command: ``JournalHealth``'s
  ``on_recovered``), never by a timer;
- the failure goes up to L1-3 as L1-1's failure event (OrchestratorFailed), its ``Failure``
  typed from the write's error (``failure_of``: a JournalWriteFailed is FAILURE_WRITE_REFUSED
  by SQLite's result code, never by its text), graded journal_write_failed and decided by the
  job's fault policy as a decision's refused write is (faults.py ``_journal_refused``). Once
  per job while its step writes fail, again after one commits: a disk that refuses every step
  would otherwise be a report per step of every job.

An error not typed as a refused write (a constraint: a bug, not the disk) is reported the same
way (graded internal_error) but not held: written again, it would fail again.

Threads: a write's outcome, and the journal's recovery, arrive on the journal writer's
thread (``_step_written``, ``_journal_recovered``), which takes only the leaf lock here and
hands the work to the orchestrator's deadline pool with no delay (``_report_soon``,
``_write_held_soon``): the report and the writes run there, with no lock of this module held. Held steps are taken under the
job's journal lock, so their rows are queued before any later write of the job's steps. They
live in memory only: a control restarted while the disk refuses does not have them.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import structlog
from google.protobuf.message import Message

from services.contract import Module, control_pb2, engine_pb2, route_pb2
from services.contract.failures import cause_of, failure_of
from services.control.job_store import step_row
from services.control.metrics import JOURNAL_STEPS_DROPPED, JOURNAL_STEPS_HELD

_log = structlog.get_logger("orchestrator")

MAX_HELD = 4096  # steps held per job (over an hour at a step a second)
_ORDER = itertools.count()  # (next() is atomic; taken under the job's journal lock, so in queue order)


@dataclass(frozen=True)
class HeldStep:
    """A rank 0 step whose journal write failed: its ``steps`` row and the events it carried."""

    row: tuple
    events: tuple[control_pb2.JobEvent, ...]
    order: int  # the order its write was queued in (``_ORDER``): writes of a job may fail in any grouping


class HeldSteps:
    """Per job: the steps held, and whether its step writes fail now (reported). Thread-safe
    (one leaf lock; nothing is called under it)."""

    def __init__(self, limit: int = MAX_HELD):
        self._lock = threading.Lock()
        self._limit = limit
        self._held: dict[str, list[HeldStep]] = {}
        self._failing: set[str] = set()

    def take(self, job_id: str) -> list[HeldStep]:
        """The job's held steps, in order, no longer held (their write is being queued)."""
        with self._lock:
            taken = self._held.pop(job_id, [])
        JOURNAL_STEPS_HELD.dec(len(taken))
        return taken

    def held(self, job_id: str) -> int:
        with self._lock:
            return len(self._held.get(job_id, ()))

    def jobs(self) -> list[str]:
        """The jobs with steps held."""
        with self._lock:
            return list(self._held)

    def committed(self, job_id: str) -> None:
        """A step write of the job committed: its next failure is reported again."""
        with self._lock:
            self._failing.discard(job_id)

    def failed(self, job_id: str, steps: list[HeldStep]) -> bool:
        """A step write of the job failed: ``steps`` (those it carried; none for an error
        that is not the disk's) are held again, with any held since, in the order their
        writes were queued. Returns whether it is the first failure since a commit (to be
        reported)."""
        with self._lock:
            kept = sorted([*steps, *self._held.get(job_id, ())], key=lambda h: h.order)
            dropped = max(len(kept) - self._limit, 0)
            if kept[dropped:]:
                self._held[job_id] = kept[dropped:]
            report = job_id not in self._failing
            self._failing.add(job_id)
        JOURNAL_STEPS_HELD.inc(len(steps) - dropped)
        if dropped:
            JOURNAL_STEPS_DROPPED.inc(dropped)
            _log.error("journal refuses the job's steps: the oldest held are dropped", job_id=job_id, dropped=dropped)
        return report


class HeldStepWrites:
    """Rank 0's step writes, held when the journal refuses them (a part of ``Orchestrator``,
    see core.py)."""

    def _write_step(self, msg: engine_pb2.StepCompleted, later: list) -> Future:
        """Under the job's journal lock: queue rank 0's step ``msg`` and the writes of its
        decision (``later``: ``_record``'s), after the job's held steps, as one write."""
        held = self._held_steps.take(msg.job_id)
        unix = msg.unix_time or time.time()
        events = tuple(event for event, _, _ in later)
        emitted = [e for h in held for e in h.events] + list(events)
        future = self._journal.record_step(
            msg.job_id,
            msg.step,
            msg.loss,
            msg.tokens,
            unix,
            [(event.status, event, runtime, spec_json) for event, runtime, spec_json in later],
            held=[(h.row, h.events) for h in held],
            on_commit=self._emitted(*emitted) if emitted else None,
            wait=False,
        )
        carried = [*held, HeldStep(step_row(msg.job_id, msg.step, msg.loss, msg.tokens, unix), events, next(_ORDER))]
        future.add_done_callback(lambda f: self._step_written(msg, carried, f))
        return future

    def _step_written(self, msg: engine_pb2.StepCompleted, carried: list[HeldStep], future: Future) -> None:
        """On the journal writer's thread: a step write's outcome (module docstring)."""
        error = future.exception()
        if error is None:
            self._held_steps.committed(msg.job_id)
            return
        refused = cause_of(error) == route_pb2.FAILURE_WRITE_REFUSED
        if not refused:
            _log.error("a step's journal write failed: not held", job_id=msg.job_id, step=msg.step, error=str(error))
        if self._held_steps.failed(msg.job_id, carried if refused else []):
            self._report_soon(msg, error)

    def _report_soon(self, msg: Message, error: BaseException) -> None:
        """Off the journal writer's thread (a hand-off, no delay): ``_report_step_write`` (also
        a rank event's refused write, decided without waiting for it: commit_later.py)."""
        self._deadlines.after(0.0, self._report_step_write, (msg, error))

    def _report_step_write(self, msg: Message, error: BaseException) -> None:
        """On the deadline pool: L1-1's failure event for the job's write of ``msg``, typed from
        its error, to L1-3 (which grades it; the job's policy decides: ``_journal_refused``)."""
        failure = failure_of(error, Module.L1_ORCHESTRATOR, msg.DESCRIPTOR.full_name, msg)
        self._emit(control_pb2.OrchestratorFailed(job_id=msg.job_id, detail=failure.detail, failure=failure))

    def _journal_recovered(self) -> None:
        """On the journal writer's thread: a transaction committed after the journal failed."""
        if self._held_steps.jobs():
            self._write_held_soon()

    def _write_held_soon(self) -> None:
        """Off the journal writer's thread (a hand-off, no delay): ``_write_held``."""
        self._deadlines.after(0.0, self._write_held)

    def _write_held(self) -> None:
        """On the deadline pool: each job's held steps written alone (those no step write of
        the job carried meanwhile), one write per job, under its journal lock."""
        for job_id in self._held_steps.jobs():
            with self._journal_lock(job_id):
                held = self._held_steps.take(job_id)
                if not held:
                    continue
                emitted = [e for h in held for e in h.events]
                future = self._journal.write_held_steps(
                    [(h.row, h.events) for h in held],
                    on_commit=self._emitted(*emitted) if emitted else None,
                    wait=False,
                )
                last = engine_pb2.StepCompleted(job_id=job_id, rank=0, step=held[-1].row[1])
                future.add_done_callback(lambda f, held=held, last=last: self._step_written(last, held, f))
