"""A job's metric records for `surgectl plot` and `samples`: read through the store
(``StoreService.ReadMetrics``), so that a tokens file's team reads its own jobs' records only
(services/store/access.py); the local store's files only when the store cannot be reached (the
stack is down), as `surgectl logs` reads the local rank log files only when control cannot be
(cmd_jobs.py). Never past a refusal."""

from __future__ import annotations

from dataclasses import dataclass

from services.cli import clients, observe
from services.cli.errors import CliError
from services.cli.jobs import resolve_job
from services.cli.scores import ScoresLine, scores_records
from services.common.rotated_files import read_rotated
from services.contract import store_pb2


@dataclass(frozen=True)
class Records:
    job: str  # the job's id
    text: str | None  # its JSONL records ("": none yet); None: neither the store nor a local file has them
    where: str  # where they were read: "the store", or the local file's path


def job_records(ref: str, record_type: str = "") -> Records:
    """The records of job ``ref`` (an id or a name), only those of ``record_type`` if given.

    Raises:
        CliError: control or the store refused (another team's job, an unknown job), in one line.
    """
    try:
        job = resolve_job(ref)
    except CliError as e:
        if not e.unreachable:
            raise
        job = ref  # control is down: the id as given (a name is resolved by control only)
    return records_of(job, record_type)


def job_scores(job: str) -> list[ScoresLine] | None:
    """The evaluation scores recorded in job id ``job``'s records (`status`, `evaluate --wait`,
    `compare`); None when neither the store nor this machine has its records.

    Raises:
        CliError: the store refused (another team's job), in one line.
    """
    records = records_of(job, "scores")
    return None if records.text is None else scores_records(records.text)


def records_of(job: str, record_type: str = "") -> Records:
    """``job_records`` of a job id control already resolved (or that is taken as given).

    Raises:
        CliError: the store refused, in one line.
    """
    try:
        parts = clients.call(
            "store",
            lambda s: list(s.ReadMetrics(store_pb2.MetricsQuery(job_id=job, type=record_type), timeout=120)),
        )
    except CliError as e:
        if not e.unreachable:
            raise
        local = observe.metrics_file(job)
        return Records(job, read_rotated(local) if local.is_file() else None, str(local))
    if not parts or not parts[0].found:
        return Records(job, "", "the store")
    return Records(job, b"".join(p.text for p in parts[1:]).decode(errors="replace"), "the store")
