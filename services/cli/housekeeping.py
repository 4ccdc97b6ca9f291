"""`surgectl delete job | checkpoint | dataset`: each removal goes through the service that
owns the thing (control for a job's records, the store for a checkpoint version, the data
service for a dataset version), which refuses it while it is in use. What only control
knows (whether a job has ended, which datasets live jobs read) is asked of control first."""

from __future__ import annotations

import re

import grpc

from services.cli import clients
from services.cli.errors import CliError
from services.cli.jobs import resolve_job
from services.common.sizes import size_text
from services.contract import control_pb2, data_pb2, store_pb2

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
    not ended is refused (control says whether it has).

    Raises:
        CliError: not ``<job>:<n>`` (exit 2); unknown version (exit 2); in use (exit 1).
    """
    job, sep, n = version.rpartition(":")
    if not sep or not job or not n.isdigit():
        raise CliError(f"VERSION: expected '<job>:<n>' (see `surgectl checkpoints`), got {version!r}", code=2)
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
    from services.jobspec import spec_from_json

    readers = []
    with clients.stub("control") as s:
        for j in s.ListJobs(control_pb2.JobQuery(), timeout=10).jobs:
            if j.state == control_pb2.TERMINATED:
                continue
            full = s.GetJob(control_pb2.JobQuery(job_id=j.job_id, with_spec=True), timeout=10)
            if full.spec_json and spec_from_json(full.spec_json).data.dataset == dataset:
                readers.append(j.job_id)
    return readers
