"""L5-2 metrics logger: persists every raw metric event and exports it to Prometheus.

Ranks push one ``StepCompleted`` per step and an ``EvalCompleted`` per evaluation; this
module writes each one, unchanged, as one JSON line to ``<root>/metrics/<job_id>.jsonl``
and exports it to Prometheus (labels ``job`` and ``rank``; the last record of each, read at scrape
time: metric_series.py). It never polls
anyone, never smooths or corrects a value, never judges convergence and never triggers
anything: the acknowledgement (``MetricsAck``) is its only output.

JSONL line: ``{"type": "step"|"eval", <the record's fields>}``, the record in the proto3
JSON mapping with proto field names and every field present (zeros included). Doubles keep
their exact value (NaN and infinities as the strings ``"NaN"``, ``"Infinity"``); 64-bit
integers are numbers when a double holds them exactly, strings otherwise.
``json_format.ParseDict`` of a line without ``type`` gives back the original message.

Bounded on disk (``metric_files.py``): a job's file is rotated at ``SURGE_STORE_METRICS_MAX_BYTES``
(``.jsonl.1`` .. ``.jsonl.<backups>``) and the file rotated out is compacted (thinned to every
k-th step, evaluations kept) into the job's history, ``.jsonl.<backups + 1>``, on the sink
thread (``defer``); readers take the files oldest first (services/common/rotated_files.py).

Each acknowledged record has been written and flushed to the OS (a batch of one: a rank's
stream lasts the whole run, so records cannot wait for the stream to end). Not fsynced:
metrics are observations, not the training state.

Written once: a rank holds each record until the store acknowledged it and resends what was
not acknowledged after a reconnect (a store restart, a broken stream), so a record may arrive
twice. A record whose JSONL line is identical to one of the job's last ``RECENT_LINES`` lines
is acknowledged (``records`` 0) and not written again, nor counted in Prometheus. The line is
the record's identity: a resend is byte-identical, while a step replayed after a recovery is
a new record (its ``unix_time`` and timings differ) and is written. After a store restart the
recent lines are read back from the end of the job's file (its last ``RECENT_TAIL_BYTES``).

Prometheus (names per the Prometheus conventions: base units, ``_total`` for counters):
``surge_train_loss``, ``surge_learning_rate``, ``surge_grad_norm``,
``surge_tokens_per_second``, ``surge_step_seconds`` (last step),
``surge_job_tokens_per_second{job}`` (the job's one throughput series, from rank 0's record: each
rank's ``surge_tokens_per_second`` holds the same all-rank figure, so a sum over ranks counts it
world-size times; chart and alert on this one),
``surge_step_phase_seconds{phase}`` (data_wait, forward, backward, reduction, optimizer),
``surge_loss_scale``, ``surge_train_step``, ``surge_train_epoch``, ``surge_eval_loss``,
``surge_eval_seconds`` (gauges of the last record); ``surge_train_steps_total``,
``surge_train_tokens_total{job}`` (the job's tokens once, from rank 0's records: each rank
reports its step's all-rank count, so a counter per rank counted them world-size times),
``surge_skipped_steps_total``, ``surge_eval_runs_total`` (counters).

A rank's series end with it: its loop's last message on its metric stream is
``StopLogCollection`` (the loop finished or was stopped; services/engine/training_loop), and
``linger_s`` seconds later (``SURGE_STORE_SERIES_LINGER_SECONDS``, default 300: every scraper
has read the last values by then) the rank's label sets are removed from every series above,
so a finished job's series do not stay on /metrics until the store restarts. A record of the
job and rank before then (a stopped job resumed) keeps them. The timer is the composition
root's (``later``); this module keeps none. A rank that died without ending its loop (SIGKILL,
a lost node) sends no ``StopLogCollection``: L1-1's ``RetireMetricSeries`` retires every rank's
series of the job after the same linger: after a relaunch of its ranks each is kept by a record
of its rank before then (the new generation's ranks); after the job's end (``ended``) every one
goes, whatever came meanwhile (a rank being killed may send a step or two after control's
decision: seen on a real stack, its series then stayed). A job that left RUNNING for the queue
(``queued``: preempted, moved, its ranks killed) is retired the same way: a queued job's last
tokens/s must not stay exported as if it trained; its series come back with its next record.

Sinks (``metric_sinks.py``): a job's ``LogCollectionConfig`` (its spec's ``metrics:``, pushed by
its ranks) turns on TensorBoard event files and an offline W&B run; every record written
here (rank 0's) goes there too, unchanged. Their work (opening a W&B run takes seconds) is
handed to ``defer``, the composition root's one sink thread, in arrival order, so a record is
acknowledged once its JSONL line is written, never later because of a sink. A sink that
fails is closed and its ``LogWriteFailed`` (typed) is published with the job's next command
or record here (the failure happened on the sink thread, outside any call); the records go
on being written and acknowledged.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import structlog
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from services.contract import engine_pb2, store_pb2
from services.store import metric_files, metric_lines, metric_series, metric_sinks
from services.store.metric_sinks import SINK_RANK, Sinks
from services.store.profile_files import ProfileFiles

# Per job: lines remembered to recognise a resent record. Only records that were sent but
# not acknowledged when a stream broke can come twice: at most what one stream had in flight
# (gRPC's flow-control window), far fewer than this.
RECENT_LINES = 1 << 16
RECENT_TAIL_BYTES = 16 << 20  # read back from a job's file after a restart
SERIES_LINGER_S = 300.0  # a rank's series stay this long after its loop ended (scrapers read the last values)
_log = structlog.get_logger("metrics_logger")
_JOB_ID = metric_files.JOB_ID


class MetricsLogger:
    """Raw metric events -> ``<root>/metrics/<job_id>.jsonl`` and Prometheus.

    Thread-safe (records from many rank streams arrive on the relay's thread pool).

    Args:
        root: the store root; this module owns ``root/metrics``.
        registry: where the series register (the process's default registry in the
            service; a private one by default so tests can build several loggers).
    """

    def __init__(
        self,
        root: Path,
        registry: CollectorRegistry | None = None,
        emit: Any = None,
        defer: Callable[..., Any] | None = None,
        bound: metric_files.MetricFileBound | None = None,
        later: Callable[[float, Callable[..., Any], tuple], Any] | None = None,
        linger_s: float = SERIES_LINGER_S,
        profiles: ProfileFiles | None = None,
    ):
        """``emit``: publishes this module's events (its failure event ``LogWriteFailed`` for
        a sink that failed); None: such a failure is only logged. ``defer(fn, *args)``: runs
        the sinks' work in order off the caller's thread (the service's sink thread); None:
        at once, on the caller's thread. ``bound``: the files' rotation and compaction
        (default: ``metric_files.bound_from_env()``). ``later(seconds, fn, args)``: calls
        ``fn(*args)`` once, ``seconds`` from now, on another thread (the root's timer): when a
        rank's series are removed after its loop ended; None: at once. ``profiles``: where
        the ranks' profiles are kept (default: under ``root``, profile_files.py)."""
        self._dir = Path(root) / "metrics"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, IO[str]] = {}
        self._sizes: dict[str, int] = {}  # job -> bytes in its file being written
        self._bound = bound or metric_files.bound_from_env()
        self._recent: dict[str, _Recent] = {}
        # (job, rank) -> the token of its removal in waiting (its loop ended); a record since: gone
        self._ending: dict[tuple[str, int], object] = {}
        self._later, self._linger_s = later, linger_s
        self._last = metric_series.LastRecords()
        (registry if registry is not None else CollectorRegistry()).register(self._last)
        self._emit = emit
        self._defer = defer or _now
        self._failed: dict[str, list[store_pb2.LogWriteFailed]] = {}  # job -> not yet published
        self._sinks = Sinks(self._dir, on_failure=self._sink_failed)
        self._sinking: dict[str, bool] = {}  # job -> its sink choice names a sink (else no hop to them)
        self._profiles = profiles or ProfileFiles(root)

    # ------------------------------------------------------------------ commands

    def log_collection_config(self, msg: store_pb2.LogCollectionConfig, payload: Any = None) -> store_pb2.MetricsAck:
        """The job's sinks (kept, see ``metric_sinks.py``); a config is no record: ``records`` 0.

        Raises:
            ValueError: ``job_id`` is not a safe file name.
            OSError: the config's copy could not be written (nothing was acknowledged).
        """
        if not _JOB_ID.match(msg.job_id):
            raise ValueError(f'metrics: job_id "{msg.job_id}": must match {_JOB_ID.pattern}')
        self._sinking[msg.job_id] = metric_sinks.wanted(msg)
        self._defer(self._sinks.configure, msg)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=0)

    def stop_log_collection(self, msg: store_pb2.StopLogCollection, payload: Any = None) -> store_pb2.MetricsAck:
        """A rank's training ended: the job's sinks are closed (rank 0's say; ``records`` 0)
        and the rank's Prometheus series are removed after the linger."""
        self._defer(self._sinks.stop, msg)
        self._end_series(msg.job_id, msg.rank)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=0)

    def retire_metric_series(self, msg: store_pb2.RetireMetricSeries, payload: Any = None) -> store_pb2.MetricsAck:
        """L1-1 ended the job (``ended``) or replaced its ranks: every rank's series of the job
        (those this process holds) are removed after the linger; after a relaunch each unless
        its rank records first."""
        ranks = self._last.ranks_of(msg.job_id)
        for rank in ranks:
            self._end_series(msg.job_id, rank, whatever_came=msg.ended or msg.queued)
        _log.info(
            "metric_series_retired",
            job=msg.job_id,
            ranks=len(ranks),
            reason=msg.reason,
            ended=msg.ended,
            queued=msg.queued,
        )
        return store_pb2.MetricsAck(records=0)

    def store_profile(self, msg: store_pb2.StoreProfile, payload: Mapping[str, str]) -> store_pb2.ProfileStored:
        """A rank's profile, staged by the relay (``payload``: {file name: staged path}), kept
        beside the job's metrics (profile_files.py). Raises ProfileRefused (a ValueError)."""
        files, size = self._profiles.keep(msg, payload)
        return store_pb2.ProfileStored(files=files, bytes=size)

    def on_step_completed(self, msg: engine_pb2.StepCompleted, payload: Any = None) -> store_pb2.MetricsAck:
        """A rank's raw step metrics: persist the line, then set the Prometheus series.

        Raises:
            ValueError: ``job_id`` is not a safe file name.
            OSError: the JSONL file could not be written (nothing was acknowledged).
        """
        if not self._persist("step", msg):
            return store_pb2.MetricsAck(records=0)  # a resend of a record already written
        self._kept(msg.job_id, msg.rank)
        self._last.step(msg)  # (the series are read from it at scrape time: metric_series.py)
        if msg.rank == SINK_RANK and self._sinks_wanted(msg.job_id):  # (no hop to their thread for nothing)
            self._defer(self._sinks.record, "step", msg)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=1)

    def on_eval_completed(self, msg: engine_pb2.EvalCompleted, payload: Any = None) -> store_pb2.MetricsAck:
        """A rank's raw evaluation result (loss in nats per token): persist, then export.

        Raises:
            ValueError: ``job_id`` is not a safe file name.
            OSError: the JSONL file could not be written (nothing was acknowledged).
        """
        if not self._persist("eval", msg):
            return store_pb2.MetricsAck(records=0)
        self._kept(msg.job_id, msg.rank)
        self._last.eval(msg)
        if msg.rank == SINK_RANK and self._sinks_wanted(msg.job_id):  # (no hop to their thread for nothing)
            self._defer(self._sinks.record, "eval", msg)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=1)

    def on_sample_generated(self, msg: engine_pb2.SampleGenerated, payload: Any = None) -> store_pb2.MetricsAck:
        """A periodic sample (rank 0's continuation of a prompt): its own line (``type:
        sample``) in the job's file, read by ``surgectl samples`` and the dashboard. Text is
        no Prometheus value and the sinks take numbers: neither gets it.

        Raises:
            ValueError: ``job_id`` is not a safe file name.
            OSError: the JSONL file could not be written (nothing was acknowledged).
        """
        if not self._persist("sample", msg):
            return store_pb2.MetricsAck(records=0)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=1)

    def on_evaluation_scores(self, msg: engine_pb2.EvaluationScores, payload: Any = None) -> store_pb2.MetricsAck:
        """An evaluation job's scores for the job it evaluated (``job_id``): a line of kind
        ``scores`` in that job's file, beside its own records (`surgectl status JOB` reads it).

        Raises:
            ValueError: ``job_id`` is not a safe file name.
            OSError: the JSONL file could not be written (nothing was acknowledged).
        """
        if not self._persist("scores", msg):
            return store_pb2.MetricsAck(records=0)
        self._publish_failures(msg.job_id)
        return store_pb2.MetricsAck(records=1)

    def close(self) -> None:
        """Flush and close every JSONL file; the sinks are closed through ``defer`` (the
        service waits for its sink thread after this)."""
        self._defer(self._sinks.close)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._recent.clear()

    # ------------------------------------------------------------------ internals

    def _persist(self, kind: str, msg: Message) -> bool:
        """Write the record's line unless the job's recent lines hold it; True if written."""
        fields = metric_lines.to_dict(msg)  # (MessageToDict's, without its walk: metric_lines.py)
        line = json.dumps({"type": kind, **fields}, separators=(",", ":")) + "\n"
        job = msg.job_id
        key = hashlib.blake2b(line.encode(), digest_size=16).digest()
        with self._lock:
            f = self._files.get(job)
            if f is None:
                if not _JOB_ID.match(job):
                    raise ValueError(f'metrics: job_id "{job}": must match {_JOB_ID.pattern}')
                path = self._dir / f"{job}.jsonl"
                recent = self._recent[job] = _Recent()
                for old in _tail_lines(path, RECENT_TAIL_BYTES):
                    recent.add(hashlib.blake2b(old, digest_size=16).digest())
                f = self._files[job] = open(path, "a", encoding="utf-8")
                self._sizes[job] = path.stat().st_size
            recent = self._recent[job]
            if key in recent:
                return False
            f.write(line)
            f.flush()
            recent.add(key)
            self._sizes[job] += len(line.encode())
            if 0 < self._bound.max_bytes <= self._sizes[job]:
                self._rotate(job)
            return True

    def _rotate(self, job: str) -> None:
        """(Lock held.) The job's file reached its bound: rotated (renames), a new one
        opened; the file rotated out is compacted into the history on the sink thread."""
        path = self._dir / f"{job}.jsonl"
        self._files.pop(job).close()
        pending = metric_files.rotate(path, self._bound)
        self._files[job] = open(path, "a", encoding="utf-8")
        self._sizes[job] = 0
        if pending is not None:
            self._defer(_compact, path, pending, self._bound)

    def _sink_failed(self, event: store_pb2.LogWriteFailed) -> None:
        """(On the sink thread.) Logged now, published with the job's next call here."""
        _log.error("metric_sink_failed", job=event.failure.job_id, path=event.path, reason=event.reason)
        with self._lock:
            self._failed.setdefault(event.failure.job_id, []).append(event)

    def _publish_failures(self, job: str) -> None:
        if not self._failed:  # (read without the lock: a failure found meanwhile goes with the next call)
            return
        with self._lock:
            events = self._failed.pop(job, [])
        for event in events:
            if self._emit is not None:
                self._emit(event)

    def _end_series(self, job: str, rank: int, whatever_came: bool = False) -> None:
        """The rank's series go after the linger (a record of it before then keeps them,
        unless ``whatever_came``)."""
        token = self._ending[(job, rank)] = object()
        if self._later is None:
            self._remove_series(job, rank, token, whatever_came)
        else:
            self._later(self._linger_s, self._remove_series, (job, rank, token, whatever_came))

    def _remove_series(self, job: str, rank: int, token: object, whatever_came: bool = False) -> None:
        """The rank's loop ended ``linger_s`` ago and no record came since (or, with
        ``whatever_came``, its job ended then): its label sets go from every series (the
        JSONL file keeps every value)."""
        with self._lock:
            if self._ending.get((job, rank)) is token:
                del self._ending[(job, rank)]
            elif not whatever_came:
                return  # a record came since (a resume), or a later end has its own removal
            self._last.remove(job, rank)
        _log.info("metric_series_removed", job=job, rank=rank)

    def _sinks_wanted(self, job: str) -> bool:
        """Whether the job's records go to the sink thread: its sinks were chosen (pushed, or
        kept from before a restart). A job without any: a wake-up of that thread per rank-0
        record saved (the sinks would write nothing; a job's first push comes before its
        first record, on the same stream)."""
        wanted = self._sinking.get(job)
        if wanted is None:
            wanted = self._sinking[job] = metric_sinks.kept_wanted(self._dir, job)
        return wanted

    def _kept(self, job: str, rank: int) -> None:
        """A record of the rank came: a removal in waiting for its series is void."""
        if self._ending:  # (read without the lock: a record after its rank's end keeps its series)
            self._ending.pop((job, rank), None)


class _Recent:
    """The keys of a job's last RECENT_LINES lines (a set with a FIFO bound)."""

    def __init__(self) -> None:
        self._order: deque[bytes] = deque()
        self._keys: set[bytes] = set()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> None:
        if key in self._keys:
            return
        self._order.append(key)
        self._keys.add(key)
        if len(self._order) > RECENT_LINES:
            self._keys.discard(self._order.popleft())


def _now(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


def _compact(path: Path, pending: Path, bound: metric_files.MetricFileBound) -> None:
    """(The sink thread.) A file rotated out, thinned into the job's history; never raises
    (it stays pending on disk, named, for an operator)."""
    try:
        stride = metric_files.compact(path, pending, bound)
        _log.info("metrics_compacted", path=str(metric_files.history_path(path, bound)), stride=stride)
    except OSError as e:
        _log.error("metrics_compaction_failed", path=str(pending), error=f"{type(e).__name__}: {e}")


def _tail_lines(path: Path, limit: int) -> list[bytes]:
    """The complete lines (with their newline) among the last ``limit`` bytes of ``path``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - limit)
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.splitlines(keepends=True)
    if start > 0 and lines:
        lines = lines[1:]  # began mid-line
    return [x for x in lines if x.endswith(b"\n")][-RECENT_LINES:]
