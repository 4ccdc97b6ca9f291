"""`surgectl delete job | checkpoint | dataset`: each removal goes through the service that
owns the thing (control for a job's records, the store for a checkpoint version, the data
service for a dataset version), which refuses it while it is in use. What only control
knows (whether a job has ended, which datasets live jobs read) is asked of control first."""

from __future__ import annotations

import re

import grpc

from services.cli import clients
from services.cli.errors import CliError
from services.cli.jobs import resolve_job, resolve_versions_job
from services.common.sizes import size_text
from services.contract import control_pb2, data_pb2, store_pb2
from services.jobspec import JobSpec, spec_from_json

_DATASET = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)@(?P<version>[A-Za-z0-9_.-]+)$")


def delete_job(ref: str) -> str:
    """Control forgets the ended job ``ref`` (id or name). Returns what to print.

    Raises:
        CliError: unknown or ambiguous job (exit 2); a live job (exit 1, control's refusal).
    """
    job_id = resolve_job(ref)
    req = control_pb2.DeleteJobRequest(job_id=job_id)
    clients.call("control", lambda s: s.DeleteJob(req, timeout=30))
    return (
        f"deleted job {job_id}: control's records of it (status, events, steps); its checkpoint versions "
        f"stay (`surgectl checkpoints {job_id}`, `surgectl delete checkpoint VERSION`)"
    )


def delete_checkpoint(version: str) -> str:
    """The store removes ``version`` (``<job>:<n>``); the newest ok version of a job that has
    not ended is refused (control says whether it has), and so is a version that a job not
    ended starts from (its spec's ``init_from.checkpoint``: queued, it would fail to load
    it; live, a recovery with no checkpoint of its own starts from it again). Any job not
    TERMINATED counts, whether or not it committed a checkpoint of its own since.

    Raises:
        CliError: not ``<job>:<n>`` (exit 2); unknown version (exit 2); in use (exit 1).
    """
    job, sep, n = version.rpartition(":")
    if not sep or not job or not n.isdigit():
        raise CliError(f"VERSION: expected '<job>:<n>' (see `surgectl checkpoints`), got {version!r}", code=2)
    # (a job's name works as its id does; one neither control nor the store's listing knows
    # is left as written: the in-use check below is control's, the store's answer says the rest)
    job = resolve_versions_job(job, unknown_as_is=True)
    version = f"{job}:{n}"
    starters = _jobs_starting_from(version)
    if starters:
        raise CliError(
            f"checkpoint {version} is in use: job{'s' if len(starters) > 1 else ''} {', '.join(starters)} "
            f"start{'' if len(starters) > 1 else 's'} from it (init_from.checkpoint) and "
            f"{'have' if len(starters) > 1 else 'has'} not ended; stop or cancel "
            f"{'them' if len(starters) > 1 else 'it'} first"
        )
    req = store_pb2.DeleteCheckpoint(version=version, job_ended=_job_ended(job))
    done = clients.call("store", lambda s: s.Delete(req, timeout=120))
    return f"deleted checkpoint {done.version} ({size_text(done.bytes_freed)} freed)"


def delete_dataset(ref: str) -> str:
    """The data service removes ``name@version``; refused while a live job reads it (its spec
    names it: control's records) or a stream of it is open (the data service's count).

    Raises:
        CliError: not ``name@version`` (exit 2); unknown version (exit 2); in use (exit 1).
    """
    m = _DATASET.match(ref)
    if m is None:
        raise CliError(f"DATASET: expected 'name@version' (see `surgectl dataset list`), got {ref!r}", code=2)
    readers = _live_jobs_reading(ref)
    if readers:
        raise CliError(
            f"dataset {ref} is in use: live job{'s' if len(readers) > 1 else ''} {', '.join(readers)} "
            "read it; stop them first (or `surgectl delete job` once they ended)"
        )
    req = data_pb2.DeleteDataset(name=m["name"], version=m["version"])
    done = clients.call("data", lambda s: s.Delete(req, timeout=120))
    return f"deleted dataset {done.name}@{done.version} ({size_text(done.bytes_freed)} freed)"


def _job_ended(job_id: str) -> bool:
    """Whether control reports ``job_id`` TERMINATED, or has no record of it (deleted, or
    never one of this control's)."""
    try:
        with clients.stub("control") as s:
            status = s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10)
    except CliError as e:
        if e.status == grpc.StatusCode.NOT_FOUND:
            return True
        raise
    return status.state == control_pb2.TERMINATED


def _live_jobs_reading(dataset: str) -> list[str]:
    """The live (not TERMINATED) jobs whose spec reads ``dataset`` (control's journaled specs)."""
    return [job_id for job_id, spec in _live_specs() if dataset in {f"{n}@{v}" for n, v, _ in spec.data.datasets}]


def _jobs_starting_from(version: str) -> list[str]:
    """The jobs not TERMINATED (queued or live) whose spec's ``init_from.checkpoint`` is
    ``version`` (control's journaled specs: a ``:latest`` or a job's name was pinned to a
    version at submit)."""
    return [
        job_id for job_id, spec in _live_specs() if spec.init_from is not None and spec.init_from.checkpoint == version
    ]


def _live_specs() -> list[tuple[str, JobSpec]]:
    """(job id, effective spec) of every job control has that is not TERMINATED."""
    specs = []
    with clients.stub("control") as s:
        for j in s.ListJobs(control_pb2.JobQuery(), timeout=10).jobs:
            if j.state == control_pb2.TERMINATED:
                continue
            full = s.GetJob(control_pb2.JobQuery(job_id=j.job_id, with_spec=True), timeout=10)
            if full.spec_json:
                specs.append((j.job_id, spec_from_json(full.spec_json)))
    return specs
