"""L5-2: raw records persisted unchanged as JSONL, and exported to Prometheus."""

from __future__ import annotations

import json
import math

import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from services.contract import engine_pb2
from services.store.metrics_logger import MetricsLogger


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def logger(tmp_path, registry):
    m = MetricsLogger(tmp_path, registry=registry)
    yield m
    m.close()


def step(**kw) -> engine_pb2.StepCompleted:
    base = dict(job_id="demo", rank=0, step=1, loss=3.0, learning_rate=1e-3, tokens=4096)
    return engine_pb2.StepCompleted(**{**base, **kw})


def lines(tmp_path, job="demo") -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "metrics" / f"{job}.jsonl").read_text().splitlines()]


def test_jsonl_keeps_every_raw_value_unchanged(tmp_path, logger):
    sent = [
        step(
            step=2**62 + 1,
            loss=2.718281828459045,
            learning_rate=3.0000000000000004e-07,
            grad_norm=1e-300,
            tokens=123457,
            tokens_per_second=98765.4321,
            step_seconds=0.1 + 0.2,
            loss_scale=65536.0,
            skipped=True,
            epoch=3,
            unix_time=1767225600.123456,
            world_size=8,
            data_wait_seconds=0.001,
        ),
        step(step=3, loss=float("nan"), grad_norm=float("inf")),
    ]
    evals = engine_pb2.EvalCompleted(job_id="demo", rank=1, step=3, loss=2.5, tokens=1000, seconds=1.25)
    for msg in sent:
        assert logger.on_step_completed(msg).records == 1
    assert logger.on_eval_completed(evals).records == 1

    got = lines(tmp_path)
    assert [g.pop("type") for g in got] == ["step", "step", "eval"]
    assert got[0]["loss"] == 2.718281828459045 and got[0]["step_seconds"] == 0.30000000000000004
    assert got[1]["loss"] == "NaN" and got[1]["grad_norm"] == "Infinity"
    assert got[1]["forward_seconds"] == 0.0  # zeros are written, not dropped
    back = [json_format.ParseDict(g, engine_pb2.StepCompleted()) for g in got[:2]]
    assert back[0] == sent[0]
    assert back[1].step == 3 and math.isnan(back[1].loss) and back[1].grad_norm == math.inf
    assert json_format.ParseDict(got[2], engine_pb2.EvalCompleted()) == evals


def test_records_append_to_one_file_per_job_across_restarts(tmp_path, registry):
    first = MetricsLogger(tmp_path, registry=registry)
    first.on_step_completed(step(step=1))
    first.on_step_completed(step(job_id="other", step=1))
    first.close()
    second = MetricsLogger(tmp_path, registry=CollectorRegistry())
    second.on_step_completed(step(step=2))
    second.close()
    assert [g["step"] for g in lines(tmp_path)] == [1, 2]
    assert [g["job_id"] for g in lines(tmp_path, "other")] == ["other"]


def test_prometheus_series_follow_the_last_record_per_job_and_rank(logger, registry):
    logger.on_step_completed(step(rank=0, step=1, loss=3.5, tokens=100, skipped=True, loss_scale=1024.0))
    logger.on_step_completed(
        step(
            rank=0,
            step=2,
            loss=3.25,
            tokens=100,
            forward_seconds=0.02,
            backward_seconds=0.04,
            step_seconds=0.1,
            tokens_per_second=1000.0,
            grad_norm=0.5,
            epoch=1,
        )
    )
    logger.on_step_completed(step(rank=1, step=2, loss=3.0))
    logger.on_eval_completed(engine_pb2.EvalCompleted(job_id="demo", rank=0, step=2, loss=2.9, seconds=4.0))

    def value(name, rank="0", **labels):
        return registry.get_sample_value(name, {"job": "demo", "rank": rank, **labels})

    assert value("surge_train_loss") == 3.25 and value("surge_train_loss", "1") == 3.0
    assert value("surge_train_steps_total") == 2 and value("surge_train_steps_total", "1") == 1
    assert registry.get_sample_value("surge_train_tokens_total", {"job": "demo"}) == 200  # (rank 0's: the job's)
    assert value("surge_skipped_steps_total") == 1
    assert value("surge_step_phase_seconds", phase="forward") == 0.02
    assert value("surge_step_phase_seconds", phase="backward") == 0.04
    assert value("surge_step_phase_seconds", phase="data_wait") == 0.0
    assert (value("surge_step_seconds"), value("surge_tokens_per_second")) == (0.1, 1000.0)
    assert (value("surge_grad_norm"), value("surge_learning_rate"), value("surge_loss_scale")) == (0.5, 1e-3, 0.0)
    assert (value("surge_train_step"), value("surge_train_epoch")) == (2, 1)
    assert (value("surge_eval_loss"), value("surge_eval_seconds"), value("surge_eval_runs_total")) == (2.9, 4.0, 1)


def test_a_job_id_that_is_not_a_file_name_is_refused_before_anything_is_written(tmp_path, logger, registry):
    with pytest.raises(ValueError, match='job_id "../evil"'):
        logger.on_step_completed(step(job_id="../evil"))
    assert list((tmp_path / "metrics").iterdir()) == []
    assert registry.get_sample_value("surge_train_loss", {"job": "../evil", "rank": "0"}) is None


def test_the_mfu_estimate_is_exported_as_reported(logger, registry):
    logger.on_step_completed(step(mfu=0.0123, flops_per_token=5.2e6))
    labels = {"job": "demo", "rank": "0"}
    assert registry.get_sample_value("surge_mfu_ratio", labels) == pytest.approx(0.0123)
    assert registry.get_sample_value("surge_model_flops_per_token", labels) == pytest.approx(5.2e6)


def test_model_flops_per_token_is_6n_plus_the_attention_term():
    from services.engine.training_loop import model_flops_per_token
    from services.jobspec import JobSpec

    spec = JobSpec.model_validate(
        {
            "name": "m",
            "steps": 10,
            "data": {"dataset": "x@v1", "seq_len": 256},
            "model": {"n_layers": 4, "d_model": 128, "n_heads": 4},
        }
    )
    assert model_flops_per_token(spec, 824_448) == 6 * 824_448 + 12 * 4 * 128 * 256


def test_a_resent_record_is_acknowledged_and_written_once_even_after_a_restart(tmp_path, registry):
    first = MetricsLogger(tmp_path, registry=registry)
    a, b = step(step=1, unix_time=100.5), step(step=2, unix_time=101.5)
    assert [first.on_step_completed(a).records, first.on_step_completed(b).records] == [1, 1]
    assert first.on_step_completed(a).records == 0  # a resend after a reconnect
    assert registry.get_sample_value("surge_train_steps_total", {"job": "demo", "rank": "0"}) == 2
    evals = engine_pb2.EvalCompleted(job_id="demo", rank=0, step=2, loss=2.5, tokens=10, seconds=1.0)
    assert [first.on_eval_completed(evals).records, first.on_eval_completed(evals).records] == [1, 0]
    first.close()
    second = MetricsLogger(tmp_path, registry=CollectorRegistry())  # a store restart
    assert second.on_step_completed(b).records == 0
    replayed = step(step=2, unix_time=205.0)  # the same step run again after a recovery: a new record
    assert second.on_step_completed(replayed).records == 1
    second.close()
    assert [(g["type"], g["step"]) for g in lines(tmp_path)] == [("step", 1), ("step", 2), ("eval", 2), ("step", 2)]


def test_the_tail_read_back_after_a_restart_skips_a_partial_first_line(tmp_path, monkeypatch):
    from services.store import metrics_logger as ml

    first = MetricsLogger(tmp_path, registry=CollectorRegistry())
    recs = [step(step=i, unix_time=float(i)) for i in range(1, 40)]
    for r in recs:
        first.on_step_completed(r)
    first.close()
    monkeypatch.setattr(ml, "RECENT_TAIL_BYTES", 2000)  # the tail starts mid-line
    second = MetricsLogger(tmp_path, registry=CollectorRegistry())
    assert second.on_step_completed(recs[-1]).records == 0
    assert second.on_step_completed(recs[0]).records == 1  # beyond the tail read back: written again
    second.close()


def _job_series(registry: CollectorRegistry, job: str) -> set[tuple[str, str]]:
    """(sample name, rank) of every per-rank sample labelled ``job`` (the job's own series,
    ``surge_job_tokens_per_second``, is rank 0's: gone with it)."""
    return {
        (s.name, s.labels["rank"])
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("job") == job and "rank" in s.labels
    }


def test_a_rank_s_series_are_removed_a_linger_after_its_loop_ended_unless_a_record_came_since(tmp_path, registry):
    from services.contract import store_pb2

    timers: list[tuple[float, object, tuple]] = []
    logger = MetricsLogger(
        tmp_path, registry=registry, later=lambda s, fn, args: timers.append((s, fn, args)), linger_s=30
    )
    try:
        for rank in (0, 1):
            logger.on_step_completed(step(job_id="done", rank=rank))
        logger.on_eval_completed(engine_pb2.EvalCompleted(job_id="done", rank=0, step=1, loss=2.0, seconds=0.5))
        logger.on_step_completed(step(job_id="other"))
        assert {r for _, r in _job_series(registry, "done")} == {"0", "1"}
        assert registry.get_sample_value("surge_job_tokens_per_second", {"job": "done"}) is not None
        for rank in (0, 1):
            logger.stop_log_collection(store_pb2.StopLogCollection(job_id="done", rank=rank))
        assert [s for s, _, _ in timers] == [30, 30]  # nothing removed before the linger
        assert {r for _, r in _job_series(registry, "done")} == {"0", "1"}

        logger.on_step_completed(step(job_id="done", rank=1, step=2))  # rank 1 resumed before its removal
        for _, fn, args in timers:
            fn(*args)  # the linger is over
        assert {r for _, r in _job_series(registry, "done")} == {
            "1"
        }  # rank 0's gone, evaluations and the job's included
        assert registry.get_sample_value("surge_train_loss", {"job": "other", "rank": "0"}) == 3.0

        logger.on_step_completed(step(job_id="done", rank=0, step=3))  # a record after the removal: back
        assert registry.get_sample_value("surge_train_step", {"job": "done", "rank": "0"}) == 3
    finally:
        logger.close()
    assert len(lines(tmp_path, "done")) == 5  # the JSONL file keeps every record


def test_a_sample_is_a_line_of_its_own_kind_and_no_series(tmp_path, logger, registry):
    sample = engine_pb2.SampleGenerated(
        job_id="demo", rank=0, step=20, prompt_index=1, prompt="Once", text=" upon a\n time", tokens=8, seconds=0.05
    )
    assert logger.on_sample_generated(sample).records == 1
    assert logger.on_sample_generated(sample).records == 0  # a resend after a reconnect: written once
    (line,) = lines(tmp_path)
    assert line["type"] == "sample"
    assert (line["step"], line["prompt_index"], line["prompt"], line["text"]) == (20, 1, "Once", " upon a\n time")
    assert not [m for m in registry.collect() if "sample" in m.name]


def test_l1_1_s_retire_removes_every_rank_s_series_of_the_job_after_the_linger_unless_it_records(tmp_path, registry):
    """A rank killed without its loop's end sends no StopLogCollection: L1-1's RetireMetricSeries
    (the job's end, a relaunch) retires the job's series, each kept by a record of its rank."""
    from services.contract import store_pb2

    timers: list[tuple[float, object, tuple]] = []
    logger = MetricsLogger(
        tmp_path, registry=registry, later=lambda s, fn, args: timers.append((s, fn, args)), linger_s=30
    )
    try:
        for rank in (0, 1, 2):
            logger.on_step_completed(step(job_id="killed", rank=rank))
        logger.on_step_completed(step(job_id="other"))
        ack = logger.retire_metric_series(store_pb2.RetireMetricSeries(job_id="killed", reason="relaunch"))
        assert ack.records == 0
        assert [s for s, _, _ in timers] == [30, 30, 30]  # one per rank of the job, none of the other job
        assert {r for _, r in _job_series(registry, "killed")} == {"0", "1", "2"}  # nothing before the linger
        logger.on_step_completed(step(job_id="killed", rank=0, step=2))  # the new generation's rank 0
        for _, fn, args in timers:
            fn(*args)
        assert {r for _, r in _job_series(registry, "killed")} == {"0"}
        assert registry.get_sample_value("surge_train_step", {"job": "killed", "rank": "0"}) == 2
        assert registry.get_sample_value("surge_train_loss", {"job": "other", "rank": "0"}) == 3.0

        # The job's end: every series goes, even one whose rank recorded once more before its
        # kill landed (seen on a real stack: rank 0's last steps kept its series).
        timers.clear()
        logger.retire_metric_series(store_pb2.RetireMetricSeries(job_id="killed", reason="FAILED", ended=True))
        logger.retire_metric_series(store_pb2.RetireMetricSeries(job_id="unknown", reason="FAILED", ended=True))
        assert len(timers) == 1  # (a job with no series: nothing to retire)
        logger.on_step_completed(step(job_id="killed", rank=0, step=3))  # a straggler of the killed rank
        for _, fn, args in timers:
            fn(*args)
        assert _job_series(registry, "killed") == set()
        logger.on_step_completed(step(job_id="killed", rank=0, step=4))  # a resumed job: back at its next record
        assert registry.get_sample_value("surge_train_step", {"job": "killed", "rank": "0"}) == 4
    finally:
        logger.close()
    assert len(lines(tmp_path, "killed")) == 6  # the JSONL file keeps every record


def test_a_job_gone_to_the_queue_loses_its_series_after_the_linger_and_gets_them_back_when_it_runs(tmp_path, registry):
    """Session 35: a preempted job queued for 14 minutes still exported its tokens/s and step.
    L1-1's RetireMetricSeries ``queued`` removes them after the linger whatever came (a killed
    rank's straggler step included); its next record after it runs again brings them back."""
    from services.contract import store_pb2

    timers: list[tuple[float, object, tuple]] = []
    logger = MetricsLogger(
        tmp_path, registry=registry, later=lambda s, fn, args: timers.append((s, fn, args)), linger_s=30
    )
    try:
        for rank in (0, 1):
            logger.on_step_completed(step(job_id="low", rank=rank))
        logger.retire_metric_series(store_pb2.RetireMetricSeries(job_id="low", reason="queued", queued=True))
        assert [s for s, _, _ in timers] == [30, 30]
        logger.on_step_completed(step(job_id="low", rank=1, step=2))  # a straggler before its kill landed
        assert {r for _, r in _job_series(registry, "low")} == {"0", "1"}  # nothing before the linger
        for _, fn, args in timers:
            fn(*args)
        assert _job_series(registry, "low") == set()
        logger.on_step_completed(step(job_id="low", rank=0, step=9))  # placed again: back at its record
        assert registry.get_sample_value("surge_train_step", {"job": "low", "rank": "0"}) == 9
    finally:
        logger.close()


def test_a_rank_that_never_evaluated_exports_no_evaluation_series(logger, registry):
    # A last held-out loss of 0 nats would read as a perfect model on a dashboard.
    logger.on_step_completed(step(rank=0, step=1, loss=3.0))
    labels = {"job": "demo", "rank": "0"}
    assert registry.get_sample_value("surge_train_loss", labels) == 3.0
    assert [registry.get_sample_value(n, labels) for n in ("surge_eval_loss", "surge_eval_seconds")] == [None, None]
    assert registry.get_sample_value("surge_eval_runs_total", labels) is None
    logger.on_eval_completed(engine_pb2.EvalCompleted(job_id="demo", rank=0, step=1, loss=2.5, seconds=1.0))
    assert registry.get_sample_value("surge_eval_loss", labels) == 2.5


def test_the_jobs_throughput_is_one_series_from_rank_0_never_a_sum_over_ranks(tmp_path, logger, registry):
    """Every rank reports the all-rank tokens/s of its step: on each rank's
    ``surge_tokens_per_second`` a dashboard's ``sum by (job)`` read it world-size times.
    ``surge_job_tokens_per_second{job}`` is the job's one series, rank 0's figure."""
    for rank, tps in ((0, 1000.0), (1, 990.0), (2, 1010.0)):
        logger.on_step_completed(step(rank=rank, tokens_per_second=tps))
    job_series = [
        (s.labels, s.value) for f in registry.collect() for s in f.samples if s.name == "surge_job_tokens_per_second"
    ]
    assert job_series == [({"job": "demo"}, 1000.0)]
    per_rank = {s.labels["rank"] for f in registry.collect() for s in f.samples if s.name == "surge_tokens_per_second"}
    assert per_rank == {"0", "1", "2"}  # (kept: each rank's figure as it reported it)
    logger.on_step_completed(step(rank=1, step=2, tokens_per_second=500.0))  # another rank's: not the job's
    assert registry.get_sample_value("surge_job_tokens_per_second", {"job": "demo"}) == 1000.0


def test_the_jobs_tokens_are_counted_once_never_once_per_rank(tmp_path, logger, registry):
    """Every rank reports its step's all-rank tokens: ``surge_train_tokens_total{job,rank}``
    counted the job's tokens on each rank, so a sum over ranks read world-size times the
    tokens trained. Now one counter per job, from rank 0's records."""
    for s in (1, 2):
        for rank in (0, 1, 2):
            logger.on_step_completed(step(rank=rank, step=s, tokens=4096))
    counted = [
        (s.labels, s.value) for f in registry.collect() for s in f.samples if s.name == "surge_train_tokens_total"
    ]
    assert counted == [({"job": "demo"}, 8192.0)]  # two steps of 4096 tokens, all ranks together
    assert registry.get_sample_value("surge_train_steps_total", {"job": "demo", "rank": "2"}) == 2  # (per rank, kept)
