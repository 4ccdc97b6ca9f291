"""Which ranks of a job restored after a control restart have not been heard from yet.

Kept apart from the orchestrator, which decides what the job's status says: this only
counts. A rank is heard from when an event of its training loop arrives after the restart:
only its node agent, re-attached to the new control, can have sent it (resent ones first).
Nothing is journaled: after a second restart every rank is waited for again. Not
thread-safe: the orchestrator calls it under its lock (``waits_for`` aside).
"""

from __future__ import annotations


class Reattaching:
    """job id -> ranks of the job not heard from since the control restart."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[int]] = {}

    def restored(self, job_id: str, world_size: int) -> None:
        """The job was live when control restarted: ranks 0..world_size-1 must re-attach."""
        self._waiting[job_id] = set(range(world_size))

    def waits_for(self, job_id: str) -> bool:
        """Whether some rank of ``job_id`` is not heard from yet. Safe without the lock (a
        dict lookup): a job is added only at the restore, before any event."""
        return job_id in self._waiting

    def heard(self, job_id: str, rank: int) -> bool:
        """An event of ``rank`` arrived. True exactly once per restart: when it was the last
        rank of ``job_id`` not heard from."""
        waiting = self._waiting.get(job_id)
        if waiting is None:
            return False
        waiting.discard(rank)
        if waiting:
            return False
        del self._waiting[job_id]
        return True
