"""The store's record series read at scrape time (services/store/metric_series.py) export what
the Gauge and Counter children set per record exported (session 36 moved them): the same
families, help texts, types, labels and values, after any mix of steps, evaluations and
series removals. The reference below is the per-record code this replaced, kept as the spec."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.contract import engine_pb2, store_pb2
from services.store.metric_series import PHASES
from services.store.metrics_logger import MetricsLogger


class _Reference:
    """Session 35's MetricsLogger series: children set on every record, removed by labels."""

    def __init__(self, reg: CollectorRegistry):
        jr = ["job", "rank"]
        g = lambda n, d, labels=jr: Gauge(n, d, labels, registry=reg)  # noqa: E731
        c = lambda n, d: Counter(n, d, jr, registry=reg)  # noqa: E731
        self.m = {
            "loss": g("surge_train_loss", "Training loss of the last step (nats per token)."),
            "lr": g("surge_learning_rate", "Learning rate of the last step."),
            "grad_norm": g("surge_grad_norm", "Global gradient L2 norm of the last step."),
            "tps": g(
                "surge_tokens_per_second",
                "Throughput of the job's last step, all ranks together, as this rank reports it (tokens per second): "
                "the same figure on every rank's series, never to be summed over ranks (surge_job_tokens_per_second: "
                "the job's one series).",
            ),
            "job_tps": g(  # (fix36: the job's one series, from rank 0's records, gone with them)
                "surge_job_tokens_per_second",
                "Throughput of the job's last step, all ranks together (tokens per second), from rank 0's record: "
                "one series per job.",
                ["job"],
            ),
            "step_seconds": g("surge_step_seconds", "Wall time of the last step (seconds)."),
            "phase": g(
                "surge_step_phase_seconds", "Wall time of one phase of the last step (seconds).", [*jr, "phase"]
            ),
            "loss_scale": g("surge_loss_scale", "Mixed-precision loss scale of the last step."),
            "mfu": g("surge_mfu_ratio", "Model FLOPs utilisation estimate of the last step (0..1)."),
            "flops_per_token": g("surge_model_flops_per_token", "Training FLOPs per token (6N + attention)."),
            "step": g("surge_train_step", "Step number of the last record."),
            "epoch": g("surge_train_epoch", "Data epoch of the last record."),
            "steps": c("surge_train_steps", "Step records received."),
            "tokens": Counter(  # (fix37: the job's tokens once, from rank 0's records, gone with them)
                "surge_train_tokens",
                "Non-padding tokens the job trained, all ranks together, counted once (from rank 0's records).",
                ["job"],
                registry=reg,
            ),
            "skipped": c("surge_skipped_steps", "Steps reported as skipped (overflow)."),
            "eval_loss": g("surge_eval_loss", "Held-out loss of the last evaluation (nats per token)."),
            "eval_seconds": g("surge_eval_seconds", "Wall time of the last evaluation (seconds)."),
            "evals": c("surge_eval_runs", "Evaluation records received."),
        }
        self.seen: set[tuple[str, str]] = set()

    def _touch(self, jr: tuple[str, str]) -> None:
        if jr not in self.seen:  # (a _Series built: every step child at 0)
            self.seen.add(jr)
            for k, metric in self.m.items():
                if k == "phase":
                    for p in PHASES:
                        metric.labels(*jr, p)
                elif k in ("job_tps", "tokens"):
                    if jr[1] == "0":
                        metric.labels(jr[0])
                elif not k.startswith("eval"):
                    metric.labels(*jr)

    def step(self, msg: engine_pb2.StepCompleted) -> None:
        jr = (msg.job_id, str(msg.rank))
        self._touch(jr)
        m = self.m
        for k, field in (
            ("loss", "loss"),
            ("lr", "learning_rate"),
            ("grad_norm", "grad_norm"),
            ("tps", "tokens_per_second"),
            ("step_seconds", "step_seconds"),
            ("loss_scale", "loss_scale"),
            ("mfu", "mfu"),
            ("flops_per_token", "flops_per_token"),
            ("step", "step"),
            ("epoch", "epoch"),
        ):
            m[k].labels(*jr).set(getattr(msg, field))
        if jr[1] == "0":
            m["job_tps"].labels(jr[0]).set(msg.tokens_per_second)
        for p in PHASES:
            m["phase"].labels(*jr, p).set(getattr(msg, f"{p}_seconds"))
        m["steps"].labels(*jr).inc()
        if jr[1] == "0":
            m["tokens"].labels(jr[0]).inc(msg.tokens)
        if msg.skipped:
            m["skipped"].labels(*jr).inc()

    def eval(self, msg: engine_pb2.EvalCompleted) -> None:
        jr = (msg.job_id, str(msg.rank))
        self._touch(jr)
        self.m["eval_loss"].labels(*jr).set(msg.loss)
        self.m["eval_seconds"].labels(*jr).set(msg.seconds)
        self.m["evals"].labels(*jr).inc()

    def remove(self, job: str, rank: int) -> None:
        self.seen.discard((job, str(rank)))
        for k, metric in self.m.items():
            if k in ("job_tps", "tokens"):
                labels_of = [(job,)] if rank == 0 else []
            else:
                labels_of = [(job, str(rank), p) for p in PHASES] if k == "phase" else [(job, str(rank))]
            for labels in labels_of:
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass


def _exported(reg: CollectorRegistry) -> tuple[list, list]:
    """(the families' names, types and help in order; every sample but ``_created``, sorted),
    and the label sets that have a ``_created`` sample, from the exposition text."""
    families, samples, created = [], [], []
    for f in text_string_to_metric_families(generate_latest(reg).decode()):
        families.append((f.name, f.type, f.documentation))
        for s in f.samples:
            labels = tuple(sorted(s.labels.items()))
            if s.name.endswith("_created"):
                created.append((s.name, labels))
            else:
                samples.append((s.name, labels, repr(s.value)))
    return families, sorted(samples), sorted(created)


def _random_step(rnd: random.Random, job: str, rank: int, step: int) -> engine_pb2.StepCompleted:
    r = lambda: rnd.choice([0.0, -0.0, 1e-300, 3.25, rnd.random() * 10, float("inf"), float("nan")])  # noqa: E731
    return engine_pb2.StepCompleted(
        job_id=job,
        rank=rank,
        step=step,
        epoch=rnd.randrange(4),
        loss=r(),
        learning_rate=r(),
        grad_norm=r(),
        tokens_per_second=r(),
        step_seconds=r(),
        data_wait_seconds=r(),
        forward_seconds=r(),
        backward_seconds=r(),
        reduction_seconds=r(),
        optimizer_seconds=r(),
        loss_scale=r(),
        mfu=r(),
        flops_per_token=r(),
        tokens=rnd.choice([0, 64, 2**40]),
        skipped=rnd.random() < 0.2,
    )


def test_the_series_read_at_scrape_time_are_those_set_per_record_through_steps_evaluations_and_removals(tmp_path):
    rnd = random.Random(36)
    reference_reg, logger_reg = CollectorRegistry(), CollectorRegistry()
    reference = _Reference(reference_reg)
    logger = MetricsLogger(tmp_path, registry=logger_reg)  # (later None: a removal is at once)
    try:
        step = 0
        for i in range(600):
            job, rank = rnd.choice(["a", "b"]), rnd.randrange(3)
            roll = rnd.random()
            step += 1
            if roll < 0.75:
                msg = _random_step(rnd, job, rank, step)
                logger.on_step_completed(msg)
                reference.step(msg)
            elif roll < 0.9:
                ev = engine_pb2.EvalCompleted(job_id=job, rank=rank, step=step, loss=rnd.random(), seconds=rnd.random())
                logger.on_eval_completed(ev)
                reference.eval(ev)
            elif roll < 0.95:
                logger.stop_log_collection(store_pb2.StopLogCollection(job_id=job, rank=rank))
                reference.remove(job, rank)
            else:
                ranks = sorted({int(r) for j, r in reference.seen if j == job})
                logger.retire_metric_series(store_pb2.RetireMetricSeries(job_id=job, reason="x", ended=True))
                for r in ranks:
                    reference.remove(job, r)
            if i % 25 == 0 or i == 599:
                assert _exported(logger_reg) == _exported(reference_reg), f"after record {i}"
        families, samples, created = _exported(logger_reg)
        assert len(families) >= 17 and samples and created  # (the comparison compared something)
    finally:
        logger.close()


def test_a_scrape_shows_each_rank_s_last_record_and_its_counts(tmp_path):
    reg = CollectorRegistry()
    logger = MetricsLogger(tmp_path, registry=reg)
    try:
        for step, loss in ((1, 4.0), (2, 3.5), (3, 3.0)):
            logger.on_step_completed(
                engine_pb2.StepCompleted(job_id="j", rank=1, step=step, loss=loss, tokens=100, skipped=step == 2)
            )
        labels = {"job": "j", "rank": "1"}
        got = {n: reg.get_sample_value(n, labels) for n in ("surge_train_loss", "surge_train_step")}
        assert got == {"surge_train_loss": 3.0, "surge_train_step": 3.0}
        assert reg.get_sample_value("surge_train_steps_total", labels) == 3.0
        assert reg.get_sample_value("surge_train_tokens_total", {"job": "j"}) is None  # (rank 0's records count them)
        logger.on_step_completed(engine_pb2.StepCompleted(job_id="j", rank=0, step=3, tokens=100))
        assert reg.get_sample_value("surge_train_tokens_total", {"job": "j"}) == 100.0
        assert reg.get_sample_value("surge_skipped_steps_total", labels) == 1.0
        assert reg.get_sample_value("surge_step_phase_seconds", {**labels, "phase": "forward"}) == 0.0
    finally:
        logger.close()
