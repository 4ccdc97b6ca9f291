"""What the dashboard reads, and from where: the same calls `surgectl` makes.

* control (as ``EXT_USER``, the operator's module): ListJobs (jobs, cordoned workers),
  GetJob with its spec, WatchJob's history (not followed: a page is a snapshot), StreamLogs
  (not followed);
* control's /metrics: the allocator's slot census, ``surge_slots{worker_id,kind}`` and
  ``surge_devices{worker_id,kind,name}``;
* the store: List (a job's checkpoints), ReadMetrics (a job's step records, periodic samples
  and evaluation scores: the store's access rules hold, as for `surgectl plot`; one rank's, at
  most ``POINTS`` step records a curve: a page never carries a whole 64-rank file); the store's
  files on this machine only when the store cannot be reached (the stack down), as `surgectl
  logs` reads the local rank logs; the curves from control's step events when neither has steps.

Every call has a deadline: a page waits for a slow service at most that long and says what
it could not read, never hangs. Channels are opened once and kept (gRPC reconnects them).

Whose reads: without a tokens file, the dashboard's own (SURGE_AUTH_TOKEN on its channels). With
one (``per_caller``), the channels carry no token of their own and every call carries its page's
caller's (``as_caller``: per-call metadata, the header surgectl sends): control and the store
answer as they would answer that caller's surgectl; a read made without a caller is refused by
them, never answered with the dashboard's credentials. The store's files on this machine are then
never read either: they hold every team's records, and only the store may say whose they are.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.cli.observe import LogLine, merge, parse
from services.cli.samples import SampleLine, sample_records
from services.cli.scores import ScoresLine, scores_records
from services.cli.worker_slots import Slots, read_slots
from services.common import metric_select
from services.common.grpc_server import channel
from services.common.job_refs import AmbiguousJob, UnknownJob, pick_job
from services.common.rotated_files import read_rotated
from services.contract import Module, control_pb2, control_pb2_grpc, store_pb2, store_pb2_grpc
from services.dashboard import series

log = logging.getLogger("surge.dashboard")

CALL_SECONDS = 10.0  # a read's deadline: control answers these from published snapshots
# The store's records: it reads a job's files to answer (a 64-rank job's are GBs, each line
# looked at once; a loaded host is slower): a page waits for its curves rather than draw none.
RECORDS_SECONDS = 30.0
# Step records per rank a page asks of the store (metric_select.py: past it, each bucket's
# first, last, lowest and highest of every curve).
POINTS = metric_select.CHART_POINTS
# The events series.from_events draws curves from (the fallback when the store has no records).
CURVE_EVENT_TYPES = ("eval", "step")


@dataclass(frozen=True)
class JobRecords:
    """What a job page reads of the store's records (``Sources.job_records``)."""

    series: series.Series
    samples: list[SampleLine] | None
    scores: list[ScoresLine] | None


class Sources:
    """Read-only calls to control and the store. ``metrics_url``: control's /metrics ("" none:
    the cluster page then says the slots are unknown); ``records_dir``: where the store's
    metrics files are, when on this machine: read only while the store is unreachable (None:
    never); ``per_caller``: a tokens file: every read carries the caller's token (``as_caller``),
    never the dashboard's own, and the local files are never read."""

    def __init__(
        self,
        control: str,
        store: str,
        metrics_url: str = "",
        records_dir: Path | None = None,
        per_caller: bool = False,
    ):
        self._control_channel = channel(control, module=Module.EXT_USER, bearer=not per_caller)
        self._store_channel = channel(store, module=Module.EXT_USER, bearer=not per_caller)
        self._control = control_pb2_grpc.ControlServiceStub(self._control_channel)
        self._store = store_pb2_grpc.StoreServiceStub(self._store_channel)
        self._metrics_url = metrics_url
        self._records_dir = None if per_caller else records_dir
        self._metadata: tuple[tuple[str, str], ...] | None = None

    def as_caller(self, token: str) -> Sources:
        """These sources (the same channels) reading as the holder of ``token``: each call
        carries it as ``authorization: Bearer``."""
        view = copy.copy(self)
        view._metadata = (("authorization", f"Bearer {token}"),)
        return view

    def close(self) -> None:
        self._control_channel.close()
        self._store_channel.close()

    def jobs(self) -> control_pb2.JobList:
        return self._control.ListJobs(control_pb2.JobQuery(), timeout=CALL_SECONDS, metadata=self._metadata)

    def resolve(self, ref: str) -> str:
        """The job id of ``ref``, an id or a job's name, as the CLI reads a JOB argument
        (services/cli/jobs.py resolve_job): an id not listed is asked of control, whose
        refusal stands (another team's job: "job X belongs to team Y; ...").

        Raises:
            UnknownJob: no job has that id or name, or the name is ambiguous (one line).
            grpc.RpcError: PERMISSION_DENIED, control's refusal of the caller."""
        try:
            return pick_job(ref, self.jobs().jobs)
        except AmbiguousJob:
            raise
        except UnknownJob as e:
            unknown = e
        try:
            self._control.GetJob(control_pb2.JobQuery(job_id=ref), timeout=CALL_SECONDS, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise
            raise unknown from None
        return ref

    def job(self, job_id: str) -> control_pb2.JobStatus:
        """Raises grpc.RpcError (NOT_FOUND: no such job)."""
        return self._control.GetJob(
            control_pb2.JobQuery(job_id=job_id, with_spec=True), timeout=CALL_SECONDS, metadata=self._metadata
        )

    def events(self, job_id: str, tail: int = 0, types: Sequence[str] = ()) -> list[control_pb2.JobEvent]:
        """The job's newest ``tail`` events (0: all) of ``types`` (none: every type), in seq
        order: control's journal selects them (a page never reads a long job's whole history)."""
        query = control_pb2.JobQuery(job_id=job_id, follow=False, tail=tail, types=sorted(types))
        return list(self._control.WatchJob(query, timeout=CALL_SECONDS, metadata=self._metadata))

    def curve_events(self, job_id: str) -> list[control_pb2.JobEvent]:
        """Every step and eval event of the job: the curves' fallback (series.from_events) when
        the store has no step records for it. O(the job's sampled steps), read only then. None
        when control does not answer either: the curves are then empty, the rest of the page
        is still drawn (the job's own status says what control said)."""
        try:
            return self.events(job_id, types=CURVE_EVENT_TYPES)
        except grpc.RpcError as e:
            log.warning("curve events of %s not read: control answered %s", job_id, e.code().name)
            return []

    def records(
        self, job_id: str, record_type: str = "", ranks: Sequence[int] = (), points: int = 0
    ) -> tuple[str, str] | None:
        """(the job's records, only those of ``record_type`` if given, of ``ranks`` (none:
        every rank), each rank's step records thinned to about ``points`` (0: all); where they
        were read): through the store (ReadMetrics: a refusal stands, "" when it has none yet),
        the local file only when the store is unreachable (the same selection, made here);
        None: refused, or neither has them."""
        try:
            query = store_pb2.MetricsQuery(job_id=job_id, type=record_type, ranks=ranks, points=points)
            parts = list(self._store.ReadMetrics(query, timeout=RECORDS_SECONDS, metadata=self._metadata))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or self._records_dir is None:
                return None
            local = self._records_dir / f"{job_id}.jsonl"
            try:
                text = read_rotated(local) if local.is_file() else None
            except OSError:
                return None
            sel = metric_select.Selection(record_type, frozenset(ranks), points)
            return None if text is None else (metric_select.select_text(text, sel), str(local))
        found = bool(parts) and parts[0].found
        return (b"".join(p.text for p in parts[1:]).decode(errors="replace") if found else ""), "the store"

    def series(self, job_id: str, rank: int = 0) -> series.Series:
        """``rank``'s curves from the store's records (at most ``POINTS`` a curve) when it has
        them, else the sampled events (``curve_events``: read only then)."""
        if read := self.records(job_id, ranks=(rank,), points=POINTS):
            found = series.from_text(*read, rank=rank)
            if found is not None:
                return found
        return series.from_events(self.curve_events(job_id))

    def job_records(self, job_id: str, rank: int = 0) -> JobRecords:
        """A job page's records in one read of the store: ``rank``'s curves (at most
        ``POINTS`` a curve; the sampled events when the store has no step: ``curve_events``,
        read only then), and rank 0's samples and scores (rank 0 writes them). Samples and
        scores are None when the records cannot be read."""
        read = self.records(job_id, ranks=sorted({0, rank}), points=POINTS)
        if read is None:
            return JobRecords(series.from_events(self.curve_events(job_id)), None, None)
        text, where = read
        return JobRecords(
            series.from_text(text, where, rank) or series.from_events(self.curve_events(job_id)),
            sample_records(text),
            scores_records(text),
        )

    def samples(self, job_id: str) -> list[SampleLine] | None:
        """The job's periodic samples from the store's records; None when they cannot be read."""
        read = self.records(job_id, "sample")
        return None if read is None else sample_records(read[0])

    def scores(self, job_id: str) -> list[ScoresLine] | None:
        """The job's evaluation scores from the store's records; None when they cannot be read."""
        read = self.records(job_id, "scores")
        return None if read is None else scores_records(read[0])

    def checkpoints(self, job_id: str) -> list[store_pb2.CheckpointInfo] | None:
        """The job's versions; None when the store does not answer (the page says so)."""
        try:
            query = store_pb2.CheckpointQuery(job_id=job_id)
            return list(self._store.List(query, timeout=CALL_SECONDS, metadata=self._metadata).checkpoints)
        except grpc.RpcError:
            return None

    def logs(self, job_id: str) -> list[LogLine] | None:
        """Every rank's lines merged by time (control has the job's node agents read them);
        None when control cannot stream them."""
        try:
            stream = self._control.StreamLogs(
                control_pb2.LogQuery(job_id=job_id, follow=False, rank=-1),
                timeout=CALL_SECONDS,
                metadata=self._metadata,
            )
            return merge(parse(m.rank, m.line) for m in stream)
        except grpc.RpcError:
            return None

    def slots(self) -> list[Slots] | None:
        """Each registered worker's slots from control's census; None when not readable."""
        return read_slots(self._metrics_url, CALL_SECONDS) if self._metrics_url else None
