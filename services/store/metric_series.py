"""L5-2's Prometheus series of the ranks' records, read at scrape time from the last record kept.

A training job sends every rank's StepCompleted every step; setting 15 gauge and counter
children per record (each ``set`` takes the child's lock) was 22 % of the store's record path
(session 35's profile), for values a scraper reads every 15 s or so. Here a record is kept
as it came (one reference, one lock, three counter additions) and the series are built from
the last record of each (job, rank) when ``/metrics`` is read (``collect``): the names, help
texts, types, labels and values are those the ``Gauge`` and ``Counter`` objects gave
(metrics_logger.py's docstring lists them), ``_created`` samples of the counters included
unless prometheus_client's created series are turned off (the stack turns them off).

What a (job, rank) exports: from its first record on, every step series (a rank whose first
record is an evaluation exports its step gauges at 0, as before); its evaluation series from
its first evaluation on (a job that never evaluates exports no ``surge_eval_loss`` of 0);
nothing after ``remove`` until its next record (the series' retirement, metrics_logger.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import prometheus_client.metrics
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.contract import engine_pb2

PHASES = ("data_wait", "forward", "backward", "reduction", "optimizer")
_JR = ["job", "rank"]
_EMPTY_STEP = engine_pb2.StepCompleted()  # (every field 0: a rank's step gauges before its first step)

# (family name, help, the StepCompleted field read) in the order the registry listed them
_STEP_GAUGES = (
    ("surge_train_loss", "Training loss of the last step (nats per token).", "loss"),
    ("surge_learning_rate", "Learning rate of the last step.", "learning_rate"),
    ("surge_grad_norm", "Global gradient L2 norm of the last step.", "grad_norm"),
    (
        "surge_tokens_per_second",
        "Throughput of the job's last step, all ranks together, as this rank reports it (tokens per second): "
        "the same figure on every rank's series, never to be summed over ranks (surge_job_tokens_per_second: "
        "the job's one series).",
        "tokens_per_second",
    ),
    ("surge_step_seconds", "Wall time of the last step (seconds).", "step_seconds"),
)
# The job's one throughput series, from rank 0's records (every rank reports the same all-rank
# figure: a dashboard summing the per-rank series counted it world-size times); gone with them.
_JOB_TPS = (
    "surge_job_tokens_per_second",
    "Throughput of the job's last step, all ranks together (tokens per second), from rank 0's record: "
    "one series per job.",
)
_SINK_RANK = "0"
# Counted once per job, from rank 0's records: every rank reports its step's all-rank tokens, so
# a counter per rank counted the job's tokens world-size times (labelled job only; fix37).
_ONCE_PER_JOB = frozenset({"surge_train_tokens"})
_PHASE = ("surge_step_phase_seconds", "Wall time of one phase of the last step (seconds).")
_PHASE_FIELDS = tuple(f"{p}_seconds" for p in PHASES)
_LATER_GAUGES = (
    ("surge_loss_scale", "Mixed-precision loss scale of the last step.", "loss_scale"),
    ("surge_mfu_ratio", "Model FLOPs utilisation estimate of the last step (0..1).", "mfu"),
    ("surge_model_flops_per_token", "Training FLOPs per token (6N + attention).", "flops_per_token"),
    ("surge_train_step", "Step number of the last record.", "step"),
    ("surge_train_epoch", "Data epoch of the last record.", "epoch"),
)
_STEP_COUNTERS = (
    ("surge_train_steps", "Step records received.", "steps"),
    (
        "surge_train_tokens",
        "Non-padding tokens the job trained, all ranks together, counted once (from rank 0's records).",
        "tokens",
    ),
    ("surge_skipped_steps", "Steps reported as skipped (overflow).", "skipped"),
)
_EVAL_GAUGES = (
    ("surge_eval_loss", "Held-out loss of the last evaluation (nats per token).", "loss"),
    ("surge_eval_seconds", "Wall time of the last evaluation (seconds).", "seconds"),
)
_EVAL_RUNS = ("surge_eval_runs", "Evaluation records received.")


class _Rank:
    """One (job, rank): its last step record (kept, never copied or changed: a handler's
    request message, which nobody writes after it was handled), its counts, its last
    evaluation."""

    __slots__ = ("step", "steps", "tokens", "skipped", "created", "eval", "evals", "eval_created")

    def __init__(self) -> None:
        self.step: engine_pb2.StepCompleted = _EMPTY_STEP
        self.steps = self.tokens = self.skipped = 0.0
        self.created = time.time()
        self.eval: engine_pb2.EvalCompleted | None = None
        self.evals = 0.0
        self.eval_created = 0.0


class LastRecords(Collector):
    """The ranks' series, from their last records (a prometheus_client Collector: register it
    on a registry). Thread-safe: records come from many streams, scrapes from the HTTP thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, str], _Rank] = {}

    def step(self, msg: engine_pb2.StepCompleted) -> None:
        key = (msg.job_id, str(msg.rank))
        with self._lock:
            r = self._ranks.get(key)
            if r is None:
                r = self._ranks[key] = _Rank()
            r.step = msg
            r.steps += 1.0
            r.tokens += msg.tokens
            if msg.skipped:
                r.skipped += 1.0

    def eval(self, msg: engine_pb2.EvalCompleted) -> None:
        key = (msg.job_id, str(msg.rank))
        with self._lock:
            r = self._ranks.get(key)
            if r is None:
                r = self._ranks[key] = _Rank()
            if r.eval is None:
                r.eval_created = time.time()
            r.eval = msg
            r.evals += 1.0

    def remove(self, job: str, rank: int) -> None:
        """The (job, rank)'s series go (its next record brings them back, counters from 0)."""
        with self._lock:
            self._ranks.pop((job, str(rank)), None)

    def ranks_of(self, job: str) -> list[int]:
        with self._lock:
            return sorted(int(rank) for j, rank in self._ranks if j == job)

    @staticmethod
    def label_names() -> dict[str, tuple[str, ...]]:
        """Every family's label names (what a Gauge's ``_labelnames`` said: read by tests that
        check every job series is labelled ``job``)."""
        names = [n for n, *_ in (*_STEP_GAUGES, *_LATER_GAUGES, *_STEP_COUNTERS, *_EVAL_GAUGES, _EVAL_RUNS)]
        once = {n: ("job",) for n in _ONCE_PER_JOB}
        return {_PHASE[0]: (*_JR, "phase"), _JOB_TPS[0]: ("job",), **{n: tuple(_JR) for n in names}, **once}

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry's check for names registered twice)."""
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            ranks = {
                key: (r.step, r.steps, r.tokens, r.skipped, r.created, r.eval, r.evals, r.eval_created)
                for key, r in self._ranks.items()
            }
        return self._families(ranks)

    @staticmethod
    def _families(ranks: dict) -> Iterator[Metric]:
        created = getattr(prometheus_client.metrics, "_use_created", True)  # (disable_created_metrics())
        items = ranks.items()
        for name, doc, field in _STEP_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=_JR)
            for labels, v in items:
                g.add_metric(labels, float(getattr(v[0], field)))
            yield g
            if field == "tokens_per_second":  # (the job's own series next to the ranks')
                g = GaugeMetricFamily(*_JOB_TPS, labels=["job"])
                for (job, rank), v in items:
                    if rank == _SINK_RANK:
                        g.add_metric([job], float(v[0].tokens_per_second))
                yield g
        g = GaugeMetricFamily(*_PHASE, labels=[*_JR, "phase"])
        for labels, v in items:
            for phase, field in zip(PHASES, _PHASE_FIELDS):
                g.add_metric([*labels, phase], float(getattr(v[0], field)))
        yield g
        for name, doc, field in _LATER_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=_JR)
            for labels, v in items:
                g.add_metric(labels, float(getattr(v[0], field)))
            yield g
        for i, (name, doc, _) in enumerate(_STEP_COUNTERS):
            once = name in _ONCE_PER_JOB
            c = CounterMetricFamily(name, doc, labels=["job"] if once else _JR)
            for (job, rank), v in items:
                if not once:
                    c.add_metric([job, rank], v[1 + i], created=v[4] if created else None)
                elif rank == _SINK_RANK:
                    c.add_metric([job], v[1 + i], created=v[4] if created else None)
            yield c
        for name, doc, field in _EVAL_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=_JR)
            for labels, v in items:
                if v[5] is not None:
                    g.add_metric(labels, float(getattr(v[5], field)))
            yield g
        c = CounterMetricFamily(*_EVAL_RUNS, labels=_JR)
        for labels, v in items:
            if v[5] is not None:
                c.add_metric(labels, v[6], created=v[7] if created else None)
        yield c
