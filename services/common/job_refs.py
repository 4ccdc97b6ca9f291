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
    the one live job (not TERMINATED) among them, the ended ones set aside (a name run again);
    with several live ones, or none and several ended, it is ambiguous: a command must not
    choose which of two running jobs it stops (was: the newest live one, silently; fresh-user
    trial, session 39: `stop try2` stopped the queued try2, not the running one).

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
    if len(live) == 1:
        return live[0].job_id
    if len(named) == 1:
        return named[0].job_id
    if live:
        ids = ", ".join(f"{j.job_id} ({control_pb2.JobState.Name(j.state)})" for j in live)
        raise AmbiguousJob(f"job name {ref!r} is ambiguous: {len(live)} live jobs have it ({ids}); give the id")
    ids = ", ".join(j.job_id for j in named)
    raise AmbiguousJob(f"job name {ref!r} is ambiguous: {len(named)} ended jobs have it ({ids}); give the id")
