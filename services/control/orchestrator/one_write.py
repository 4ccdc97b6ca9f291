"""A decision whose records are one journal write (``OneWrite._one_write``): all committed
together or all lost together, and the commands after them follow all of them.

Why: a decision of several records (a node's departure moving a job: PAUSED, queued to
resume, STANDBY, what it moves to) with a release of the job's ranks between them was
several writes; the writer commits a failed group's writes one by one (journal_writer.py),
so one of them could be lost while the others, and the release that followed the first,
went. The undo then had to know which of the writes failed (session 28 left ``_move``
without one). Held for one write, the records and the release form one decision: its
commit fails whole, its release is dropped with it (the outbox), and one undo puts back
what it changed (undos.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from services.contract import control_pb2
from services.control.orchestrator.job import _Job


class OneWrite:
    """Records held for one journal write (a part of ``Orchestrator``, see core.py)."""

    @contextmanager
    def _one_write(self, job: _Job) -> Iterator[None]:
        """Under the lock: the job's records (``_record``, ``_keep``) made in the block are
        held, then queued as one write (one transaction) as the block ends, in their order;
        their JobEvents are emitted once it is committed. A record of another job is written
        as usual."""
        job_id = job.status.job_id
        held: list[tuple[Any, ...]] = []
        outer = getattr(self._decided, "one_write", None)
        self._decided.one_write = (job_id, held)
        try:
            yield
        finally:
            self._decided.one_write = outer
            if held:
                events = [event for _, event, _, _ in held if event is not None]
                with self._journal_lock(job_id):
                    future = self._journal.save_statuses(held, on_commit=self._emitted(*events), wait=False)
                    self._queued(job_id, future)

    def _held_for_one_write(
        self, status: control_pb2.JobStatus, event: control_pb2.JobEvent | None, runtime: dict, spec_json: str | None
    ) -> bool:
        """Under the lock: whether the write (``save_status``'s arguments) is held for the
        decision's one write of its job (``_one_write``); the status is copied now (the
        write is made later, as the block ends)."""
        one = getattr(self._decided, "one_write", None)
        if one is None or one[0] != status.job_id:
            return False
        copy = control_pb2.JobStatus()
        copy.CopyFrom(status)
        one[1].append((copy, event, runtime, spec_json))
        return True
