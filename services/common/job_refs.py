"""A job named by its id or by its name (``name:`` of its spec), as every JOB argument of the
CLI and every job URL of the dashboard reads it: one rule, shared."""

from __future__ import annotations

from collections.abc import Iterable

from services.contract import control_pb2


class UnknownJob(ValueError):
    """No job has the id or name, or the name is ambiguous (the message: one line)."""


class AmbiguousJob(UnknownJob):
    """Several ended jobs have the name: the listing answered, so nothing more is asked."""


def pick_job(ref: str, jobs: Iterable[control_pb2.JobStatus]) -> str:
    """The job id of ``ref`` among ``jobs`` (control's list). A name several jobs share means
    the newest live one (not TERMINATED); when none of them is live it is ambiguous.

    Raises:
        UnknownJob: no job has that id or name, or the name is ambiguous (one line listing the ids).
    """
    jobs = list(jobs)
    if any(j.job_id == ref for j in jobs):
        return ref
    named = sorted((j for j in jobs if j.name == ref), key=lambda j: (j.created_unix, j.job_id))
    if not named:
        raise UnknownJob(f"no job {ref!r}: no job has that id or name (`surgectl status` lists them)")
    live = [j for j in named if j.state != control_pb2.TERMINATED]
    if len(named) == 1 or live:
        return (live or named)[-1].job_id
    ids = ", ".join(j.job_id for j in named)
    raise AmbiguousJob(f"job name {ref!r} is ambiguous: {len(named)} ended jobs have it ({ids}); give the id")
