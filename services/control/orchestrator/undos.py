"""The undos of the operator's decisions on a live job whose journal record fails at its commit
(a full disk, an I/O error; issue 28 item 2): pause, drain, forced down, scale (and growing
back), rollback, revoke, a node's departure (its checkpoint before the move; the move, one
write with its release: one_write.py; a PAUSED job's release). The stop's, the submit's and the resume's sit beside their decisions
(operator.py, queue.py, resume.py); the recovery decision's is a rewrite (recovery.py).

Why: a decision must not stay in memory when its record is not in the journal. Its commands
to the ranks wait behind that record in the outbox and are dropped with it (nothing to
unsend), but what it changed of the job's bookkeeping would otherwise act later: a pause
"in flight" that never went refuses every later pause, stop, scale or rollback; an activity
waits for ranks that were never asked; a restarted control, reading the journal, knows none
of it. Each decision takes a ``Before`` of what it changes and registers its undo
(``_undo_if_lost``); the undo runs under the lock as a decision of its own, puts back
only what the decision changed (events applied between the decision and its undo stay
applied) and journals the job as it is then (``_keep``). The operator's reply is the write's
error: the command was not done; asked again, it is decided afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from services.contract import engine_pb2
from services.control.orchestrator.activity import begin, end
from services.control.orchestrator.job import ORCH, JobState, _Job, _Recovered

_log = structlog.get_logger("orchestrator")


@dataclass(frozen=True)
class Before:
    """What an operator's decision may change of a job besides its boundary command, as it
    was before the decision (``of``)."""

    state: int
    message: str
    draining: bool
    drained: bool
    parked: bool
    parked_live: bool
    resume_after_pause: bool
    boundary_failed: bool
    boundary: str
    pending_at: int
    pending_seq: int
    paused: frozenset[int]
    in_flight: tuple[tuple[int, Any], ...]
    activity: Any
    grow_to: tuple[int, ...]
    last_resize: float
    departure: str

    @classmethod
    def of(cls, job: _Job) -> Before:
        s = job.status
        return cls(
            s.state, s.message, job.draining, s.drained, job.parked, job.parked_live, job.resume_after_pause,
            job.boundary_failed, job.boundary, job.pending_at, job.pending_seq, frozenset(job.paused),
            tuple(job.in_flight.items()), job.activity, job.grow_to, job.last_resize, job.departure,
        )  # fmt: skip


class Undos:
    """The undos of the operator's decisions on a live job (a part of ``Orchestrator``, see core.py)."""

    def _undo_if_lost(self, job_id: str, undo: Callable[[BaseException], None]) -> None:
        """Under the lock, beside a decision: ``undo`` (given the write's error) runs if one
        of the job's journal writes this decision queued fails at its commit (a full disk, an
        I/O error), under the lock as a decision of its own, once the decision's commands
        committed before it are sent (those behind the failed write are dropped: the outbox).
        A decision must not stay in memory when its record is not in the journal (a restarted
        control would not know it) and the operator is told it failed. Out of a decision the
        write is waited for in place, where its error undoes it (the handlers' except paths)."""
        if self._lock.held():
            undos = getattr(self._decided, "undos", None)
            if undos is None:
                undos = self._decided.undos = []
            undos.append((job_id, undo))

    def _undo(self, undos: list[tuple[str, Callable[[BaseException], None]]], lost: dict[str, BaseException]) -> None:
        """The undos of the decisions whose writes failed (``lost``: job -> the error), last
        decided first. An undo that fails itself (its own write: the disk still refuses) is
        logged: what it changed in memory stays undone; the operator's reply says the first
        failure."""
        for job_id, undo in reversed(undos):
            if job_id not in lost:
                continue
            _log.error(
                "a decision's journal write failed at its commit: undone", job_id=job_id, error=str(lost[job_id])
            )
            try:
                with self._lock:
                    undo(lost[job_id])
            except Exception:  # noqa: BLE001 - the decision's own failure is the one the caller reports
                _log.exception("a decision's undo failed", job_id=job_id)

    def _boundary_undone(self, job: _Job, cmd: Any, before: Before) -> None:
        """Under the lock: a pause (or a drain's) whose record was lost: its PauseTraining is
        not in flight (dropped with the record), the drain's flags are as they were."""
        if self._unsent(job, cmd, before):
            job.boundary = before.boundary
            job.paused.clear()
            job.paused.update(before.paused)
        self._flags_back(job, before)
        self._keep(job)

    def _unsaved_drain_undone(self, job: _Job, cmd: Any, before: Before) -> None:
        """Under the lock: the drain of a PAUSED job with no checkpoint of its step whose record
        was lost: PAUSED as the journal has it (its PauseTraining, behind the record, was
        dropped with it)."""
        self._boundary_undone(job, cmd, before)
        job.status.state, job.status.message = before.state, before.message
        self._keep(job)

    def _drain_undone(self, job: _Job, before: Before) -> None:
        """Under the lock: a drain of a PAUSED job, or of a pause in flight, whose record was
        lost: parked / draining as before (`up` would otherwise resume a job the journal
        says nothing of, or the stack stop under a drain never journaled)."""
        self._flags_back(job, before)
        self._keep(job)

    def _forced_down_undone(self, job: _Job, before: Before) -> None:
        """Under the lock: `surgectl down --force` whose record was lost: the job is as the
        journal has it (RUNNING, or PAUSED and not parked), with the pause, stop or rollback
        it had in flight. Nothing was sent for it (its ranks go with the stack): nothing to
        unsend. Only while the job is still the one parked (a later decision stands)."""
        if not job.parked:
            return
        job.status.state, job.status.message = before.state, before.message
        job.boundary, job.pending_at, job.pending_seq = before.boundary, before.pending_at, before.pending_seq
        job.in_flight.update(before.in_flight)
        if job.activity is None and before.activity is not None:
            job.activity = before.activity  # (a rollback's pause it ended: its ranks were not killed)
        self._flags_back(job, before)
        self._keep(job)

    def _departure_undone(self, job: _Job, cmd: Any | None, before: Before) -> None:
        """Under the lock: a node's departure whose record of the job was lost: the move is not
        under way (its checkpoint's PauseTraining, ``cmd``, dropped with the record; an
        operator's pause in flight it took over is the operator's again), and a PAUSED job
        whose ranks it released is not parked (the release went with the record). Its ranks
        there end at the deadline, and the job's fault policy decides (worker_departed), as
        for a node that leaves unannounced."""
        if cmd is not None and self._unsent(job, cmd, before):
            job.boundary = before.boundary
            job.paused.clear()
            job.paused.update(before.paused)
        job.departure = before.departure
        self._flags_back(job, before)
        self._keep(job)

    def _move_undone(
        self, job: _Job, worker_id: str, before: Before, waited: tuple[float, int], paused: bool, error: BaseException
    ) -> None:
        """Under the lock: a node's departure moving the job (departure.py ``_move``) whose one
        write was lost: all its records, and its release with them (the outbox), so the job's
        ranks run on (or wait paused at the departure's boundary). The job leaves the queue
        and is as the journal has it, RUNNING; paused ranks continue; their end at the deadline
        is the job's worker_departed fault, decided by its policy, as for a node that leaves
        unannounced. Said in its log (a node agent's notice has no operator to refuse). Only
        while it still waits in the queue for this move (the release it waits for was dropped:
        nothing places it before this undo)."""
        job_id = job.status.job_id
        if self._jobs.get(job_id) is not job or job.queued is None or job.status.state != JobState.STANDBY:
            return
        self._queue.take(job_id)
        job.queued = job.relaunch = None
        job.status.state, job.status.message = before.state, before.message
        job.status.queued_unix, job.status.borrowed_slots = waited
        job.departure = ""
        self._flags_back(job, before)
        text = (
            f"WARNING: node {worker_id} departs: the move of the job's ranks was not journaled "
            f"({type(error).__name__}); "
        )
        if paused:
            text += "the ranks paused for it continue; "
        self._record(
            job,
            ORCH,
            "departure",
            f"{text}their end at the deadline is decided by the job's fault policy (worker_departed)",
        )
        if paused:  # (after its record: every rank waits at the checkpoint's boundary for a release that never comes)
            self._loop(engine_pb2.ResumeTraining(job_id=job_id))

    def _revoke_undone(self, job: _Job, order: int, cmd: Any) -> None:
        """Under the lock: a revoke whose record was lost: the order is held again (its
        RevokeStandingOrder was dropped with the record); asked again, it is revoked afresh."""
        if job.revoked.get(order, (0, 0))[0] == cmd.seq:
            del job.revoked[order]
        job.in_flight.pop(cmd.seq, None)
        self._keep(job)

    def _activity_undone(self, job: _Job, activity: Any, cmd: Any, before: Before) -> None:
        """Under the lock: a scale (or a growing back) or a rollback whose record was lost: its
        pause is not in flight and the activity leaves the slot while it still waits for
        that pause (one that moved on was not this decision's: a recovery superseding it,
        say), the job's growth target and last resize as before."""
        current = job.activity
        if type(current) is type(activity) and current.since == activity.since and current.phase == "pausing":
            end(job, current)
            if isinstance(before.activity, _Recovered):  # (the recovery's first step, still awaited)
                begin(job, before.activity)
        if self._unsent(job, cmd, before):
            job.paused.clear()
            job.paused.update(before.paused)
        job.grow_to, job.last_resize = before.grow_to, before.last_resize
        self._keep(job)

    @staticmethod
    def _unsent(job: _Job, cmd: Any, before: Before) -> bool:
        """The boundary command ``cmd`` never went: not in flight, its boundary not awaited.
        Whether it was still the job's boundary in flight (else a later decision's stands)."""
        job.in_flight.pop(cmd.seq, None)
        if job.pending_seq != cmd.seq:
            return False
        job.pending_at, job.pending_seq = before.pending_at, before.pending_seq
        return True

    @staticmethod
    def _flags_back(job: _Job, before: Before) -> None:
        job.draining, job.status.drained = before.draining, before.drained
        job.parked, job.parked_live = before.parked, before.parked_live
        job.resume_after_pause, job.boundary_failed = before.resume_after_pause, before.boundary_failed
