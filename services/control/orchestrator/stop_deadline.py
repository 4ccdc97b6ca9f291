"""A stop's own deadline (a part of ``Orchestrator``, see core.py).

An operator's stop of a RUNNING or PAUSED job ends when every rank has stopped at the boundary
step the ranks agree on (after its checkpoint's commit): ``on_training_loop_finished``. A rank
that never gets there (hung outside a collective, its node agent frozen) left the job
stopping for good unless L1-3 graded something. So a stop has a deadline, armed by the stop's
decision (``_arm_policy_timer``, the preemption's timers: one heap, no thread per job) and
armed again for a stop journaled in flight when control restarts: past it the job's ranks
are killed and the job is TERMINATED (STOPPED), its message saying that the stop did not
finish cleanly, which ranks had not stopped at the boundary, and that no checkpoint of the
stop is claimed. A policy's wait on the operator's command, never a judgment of a rank's
liveness (that stays L1-3's).
"""

from __future__ import annotations

from services.contract import control_pb2
from services.control.monitoring import _env_seconds
from services.control.orchestrator.job import JobState
from services.control.orchestrator.texts import _newest

JobOutcome = control_pb2.JobOutcome

# How long a stop may take, from its decision to every rank stopped at its boundary (the
# checkpoint's save and commit included): SURGE_STOP_DEADLINE_SECONDS overrides the 15 min.
STOP_DEADLINE_S = _env_seconds("SURGE_STOP_DEADLINE_SECONDS", 900.0)
# ... and never less than this many of the job's last measured saves: a large model's save on
# a slow store may take longer than the floor, and a slow save is no hung stop.
SAVE_MULTIPLE = 4.0


def stop_deadline_seconds(save_seconds: float) -> float:
    """A stop's deadline for a job whose last save took ``save_seconds`` (0: none measured)."""
    return max(STOP_DEADLINE_S, SAVE_MULTIPLE * max(save_seconds, 0.0))


_SHOWN = 16  # ranks named in the message; the rest are counted


class StopDeadlines:
    """A stop's deadline (a part of ``Orchestrator``, see core.py)."""

    def _arm_stop_deadline(self, job_id: str, seq: int) -> None:
        """Under the lock: the stop #``seq`` of ``job_id`` (its StopTraining's number) has
        ``stop_deadline_seconds`` to end (read at each arming, so a test may set it)."""
        job = self._jobs.get(job_id)
        limit = stop_deadline_seconds(job.save_seconds if job is not None else 0.0)

        def overdue() -> None:
            with self._lock:
                self._policy_timers.pop(f"stop:{job_id}", None)
                self._stop_overdue(job_id, seq, limit)

        self._arm_policy_timer(f"stop:{job_id}", limit, overdue)

    def _rearm_stops(self) -> None:
        """Under the lock, after a restore: a stop journaled in flight gets its deadline again."""
        for job in self._jobs.values():
            if job.pending == "stop" and job.status.state != JobState.TERMINATED:
                self._arm_stop_deadline(job.status.job_id, job.pending_seq)

    def _stop_overdue(self, job_id: str, seq: int, limit: float) -> None:
        """Under the lock: the stop #``seq`` passed its deadline. Still in flight (not ended,
        not undone, not superseded): the ranks are killed and the job ends STOPPED."""
        job = self._jobs.get(job_id)
        if job is None or job.status.state == JobState.TERMINATED or job.pending != "stop" or job.pending_seq != seq:
            return  # (it ended in time, or its record was lost and the operator may ask again)
        world = job.status.world_size
        missing = [r for r in range(world) if r not in job.finished]
        named = ", ".join(str(r) for r in missing[:_SHOWN]) + (
            f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        )
        where = f"the boundary after step {job.pending_at}" if job.pending_at else "a boundary (none agreed)"
        self._terminate(
            job,
            JobOutcome.STOPPED,
            f"stopped by the operator, not cleanly: the stop did not finish within {limit:g} s; "
            f"{len(missing)} of {world} ranks had not stopped at {where} (rank{'s' if len(missing) != 1 else ''} "
            f"{named}): every rank was killed; no checkpoint of the stop is claimed (newest committed: "
            f"{_newest(job)})",
            kill=True,
        )
