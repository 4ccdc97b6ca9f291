"""A job's metric records for `surgectl plot` and `samples`: read through the store
(``StoreService.ReadMetrics``), so that a tokens file's team reads its own jobs' records only
(services/store/access.py); the local store's files only when the store cannot be reached (the
stack is down), as `surgectl logs` reads the local rank log files only when control cannot be
(cmd_jobs.py). Never past a refusal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.cli import clients, observe
from services.cli.errors import CliError
from services.cli.jobs import resolve_job
from services.cli.scores import ScoresLine, scores_records
from services.common import metric_select
from services.common.rotated_files import read_rotated
from services.contract import store_pb2


@dataclass(frozen=True)
class Records:
    job: str  # the job's id
    text: str | None  # its JSONL records ("": none yet); None: neither the store nor a local file has them
    where: str  # where they were read: "the store", or the local file's path
    why: str = ""  # why the store was not asked (its health check failed: clients.store_outage); "" if it was


def job_records(ref: str, record_type: str = "") -> Records:
    """The records of job ``ref`` (an id or a name), only those of ``record_type`` if given.

    Raises:
        CliError: control or the store refused (another team's job, an unknown job), in one line.
    """
    return records_of(_job_id(ref), record_type)


def _job_id(ref: str) -> str:
    try:
        return resolve_job(ref)
    except CliError as e:
        if not e.unreachable:
            raise
        # Control is down: a name is looked up among this machine's metric files (was: taken as
        # an id, no file of that name, then control asked for its events: "address unknown")
        return observe.local_metrics_job(ref) or ref


def job_scores(job: str) -> list[ScoresLine] | None:
    """The evaluation scores recorded in job id ``job``'s records (`status`, `evaluate --wait`,
    `compare`); None when neither the store nor this machine has its records.

    Raises:
        CliError: the store refused (another team's job), in one line.
    """
    records = records_of(job, "scores")
    return None if records.text is None else scores_records(records.text)


def records_of_status(job: str, record_type: str, store_answers: bool) -> Records:
    """``records_of`` for `surgectl status`, which must answer in its usual time whatever the
    store does: a store that did not answer its health check (``store_answers`` False: stopped,
    hung) is not asked at all, and one that answers it gets ``STATUS_READ_SECONDS`` (was: 120 s,
    cut at about 20 s by gRPC's handshake timeout against a SIGSTOPped store). Either way the
    local files are read instead, as when the store is down; ``where`` says which."""
    if not store_answers:
        return _local(job, record_type, ())
    return records_of(job, record_type, timeout=STATUS_READ_SECONDS)


STATUS_READ_SECONDS = 10.0  # (control's own GetJob deadline in `status`)


def chart_records(ref: str, rank: int | None = None, resolved: bool = False) -> Records:
    """What `plot` and `compare` draw of job ``ref`` (``resolved``: ``ref`` is a job id control
    already gave): ``rank``'s records (None: rank 0's) with at most
    ``metric_select.CHART_POINTS`` step records (each bucket's first, last, lowest and highest:
    a 100,000-step x 64-rank job is read as a 2,000-point curve, not GBs). When that rank has
    no step record, every record (``rank`` None: the curve is then the lowest rank's; else the
    reader names the ranks present).

    Raises:
        CliError: control or the store refused (another team's job, an unknown job), in one line.
    """
    want = 0 if rank is None else rank
    job = ref if resolved else _job_id(ref)
    # A store that fails its health check (status's one check) is not asked: the local file
    # is read at once (was: 30.7 s against a SIGSTOPped store, two reads cut by gRPC's
    # handshake timeout), and ``why`` says so.
    outage = clients.store_outage()

    def read(ranks: Sequence[int] = (), points: int = 0) -> Records:
        if outage:
            return replace(_local(job, "", ranks, points), why=outage)
        return records_of(job, ranks=ranks, points=points)

    records = read((want,), metric_select.CHART_POINTS)
    if records.text is None or want in observe.step_records(records.text, records.where, strict=False)[0]:
        return records
    return read()  # (rank 0 absent: the lowest rank's; a --rank absent: the ranks present, for its error)


def records_of(
    job: str, record_type: str = "", ranks: Sequence[int] = (), points: int = 0, timeout: float = 120.0
) -> Records:
    """``job_records`` of a job id control already resolved (or that is taken as given): only
    ``ranks``' records (none: every rank's), each rank's step records thinned to about
    ``points`` (0: every one; services/common/metric_select.py), the same selection made
    here when the local file is read.

    Raises:
        CliError: the store refused, in one line.
    """
    query = store_pb2.MetricsQuery(job_id=job, type=record_type, ranks=ranks, points=points)
    try:
        parts = clients.call("store", lambda s: list(s.ReadMetrics(query, timeout=timeout)))
    except CliError as e:
        if not e.unreachable:
            raise
        return _local(job, record_type, ranks, points)
    if not parts or not parts[0].found:
        return Records(job, "", "the store")
    return Records(job, b"".join(p.text for p in parts[1:]).decode(errors="replace"), "the store")


def _local(job: str, record_type: str = "", ranks: Sequence[int] = (), points: int = 0) -> Records:
    """The local store's file of ``job`` (this machine's), the same selection the store makes;
    ``text`` None when there is none."""
    local = observe.metrics_file(job)
    if not local.is_file():
        return Records(job, None, str(local))
    sel = metric_select.Selection(record_type, frozenset(ranks), points)
    return Records(job, metric_select.select_text(read_rotated(local), sel), str(local))
