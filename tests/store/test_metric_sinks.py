"""L5-2's sinks: TensorBoard event files and an offline W&B run hold the JSONL's raw values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.contract import Module, engine_pb2, route_pb2, store_pb2
from services.store.metric_sinks import EVAL_FIELDS, STEP_FIELDS
from services.store.metrics_logger import MetricsLogger
from tests.sink_readers import tensorboard_scalars, wandb_history

JOB = "sinks"


@pytest.fixture(autouse=True)
def _no_network(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def config(**kw) -> store_pb2.LogCollectionConfig:
    return store_pb2.LogCollectionConfig(job_id=JOB, **kw)


def step(n: int, rank: int = 0, **kw) -> engine_pb2.StepCompleted:
    base = dict(
        job_id=JOB,
        rank=rank,
        step=n,
        loss=2.718281828459045 / n,
        learning_rate=3.0000000000000004e-07 * n,
        grad_norm=0.1 + 0.2 * n,
        tokens=4096 + n,
        tokens_per_second=98765.4321 + n,
        step_seconds=0.1 + 0.2,
        loss_scale=65536.0,
        mfu=1e-7 / 3,
        flops_per_token=1.5e6,
        epoch=1,
        unix_time=1767225600.123456 + n,
    )
    return engine_pb2.StepCompleted(**{**base, **kw})


def jsonl(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "metrics" / f"{JOB}.jsonl").read_text().splitlines()]


def expected(root: Path, rank: int = 0) -> dict[str, list[tuple[int, float]]]:
    """The JSONL's values of ``rank``, by sink tag: (step, value) in order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in jsonl(root):
        if line["rank"] != rank:
            continue
        prefix, fields = ("train", STEP_FIELDS) if line["type"] == "step" else ("eval", EVAL_FIELDS)
        for f in fields:
            out.setdefault(f"{prefix}/{f}", []).append((line["step"], float(line[f])))
    return out


def same(v: float) -> object:
    """A value compared exactly, NaN equal to NaN."""
    return "NaN" if math.isnan(v) else v


def test_tensorboard_and_wandb_hold_the_jsonl_values(tmp_path):
    emitted = []
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry(), emit=emitted.append)
    try:
        assert (
            logger.log_collection_config(
                config(tensorboard=True, wandb_project="surge-tests", wandb_mode="offline")
            ).records
            == 0
        )
        for n in (1, 2, 3):
            logger.on_step_completed(step(n))
            logger.on_step_completed(step(n, rank=1, loss=9.0))  # another rank: Prometheus and JSONL only
        assert logger.on_step_completed(step(3)).records == 0  # a resend: not written again
        logger.on_step_completed(step(4, loss=float("nan"), skipped=True, skip_reason="non_finite_loss"))
        logger.on_eval_completed(
            engine_pb2.EvalCompleted(job_id=JOB, rank=0, step=4, loss=1.25, tokens=999, seconds=0.5)
        )
        assert logger.stop_log_collection(store_pb2.StopLogCollection(job_id=JOB, rank=0)).records == 0
        assert logger._sinks._open == {}  # the event file closed, the W&B run finished
    finally:
        logger.close()
    assert emitted == []
    want = expected(tmp_path)
    assert len(want["train/loss"]) == 4 and want["eval/loss"] == [(4, 1.25)]

    base = tmp_path / "metrics" / JOB
    got = tensorboard_scalars(base / "tensorboard")
    assert set(got) == set(want)
    for tag, points in want.items():
        assert len(got[tag]) == len(points), tag
        for (s, v), (gs, gv) in zip(points, got[tag]):  # bit-exact (float64), NaN included
            assert gs == s and same(gv) == same(v), (tag, s, v, gv)
    assert got["train/skipped"][-1] == (4, 1.0)

    rows = wandb_history(base)
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag in want:
            if tag in row:
                by_tag.setdefault(tag, []).append((row["_step"], row[tag]))
    for tag, points in want.items():
        assert [(s, same(v)) for s, v in by_tag[tag]] == [(s, same(v)) for s, v in points], tag


def test_the_config_outlives_a_store_restart(tmp_path):
    first = MetricsLogger(tmp_path, registry=CollectorRegistry())
    first.log_collection_config(config(tensorboard=True))
    first.on_step_completed(step(1))
    first.close()
    kept = json.loads((tmp_path / "metrics" / JOB / "sinks.json").read_text())
    assert kept == {"tensorboard": True, "wandb_project": "", "wandb_mode": ""}
    again = MetricsLogger(tmp_path, registry=CollectorRegistry())  # no config pushed since the restart
    again.on_step_completed(step(2))
    again.close()
    assert [s for s, _ in tensorboard_scalars(tmp_path / "metrics" / JOB / "tensorboard")["train/loss"]] == [1, 2]


def test_rank_0s_stop_closes_the_sinks_and_a_later_record_opens_them_again(tmp_path):
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry())
    logger.log_collection_config(config(tensorboard=True))
    logger.on_step_completed(step(1))
    logger.stop_log_collection(store_pb2.StopLogCollection(job_id=JOB, rank=1))  # not the sinks' rank
    assert len(logger._sinks._open[JOB]) == 1
    logger.stop_log_collection(store_pb2.StopLogCollection(job_id=JOB, rank=0))
    assert JOB not in logger._sinks._open
    logger.on_step_completed(step(2))  # a resumed job: a new event file beside the first
    logger.close()
    assert len(list((tmp_path / "metrics" / JOB / "tensorboard").iterdir())) == 2
    assert [s for s, _ in tensorboard_scalars(tmp_path / "metrics" / JOB / "tensorboard")["train/loss"]] == [1, 2]


def test_no_config_no_sinks(tmp_path):
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry())
    logger.log_collection_config(config())
    logger.on_step_completed(step(1))
    logger.close()
    assert sorted(p.name for p in (tmp_path / "metrics" / JOB).iterdir()) == ["sinks.json"]
    assert len(jsonl(tmp_path)) == 1


def test_a_failing_sink_is_a_typed_event_and_the_record_is_still_written(tmp_path):
    (tmp_path / "metrics" / JOB).mkdir(parents=True)
    (tmp_path / "metrics" / JOB / "tensorboard").write_text("a file where the event directory goes")
    emitted: list = []
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry(), emit=emitted.append)
    logger.log_collection_config(config(tensorboard=True))
    assert logger.on_step_completed(step(1)).records == 1
    assert logger.on_step_completed(step(2)).records == 1
    logger.close()
    (event,) = emitted  # once, when the sink could not start; the records go on
    assert isinstance(event, store_pb2.LogWriteFailed)
    assert event.path.endswith(f"{JOB}/tensorboard") and event.reason.startswith("open: ")
    assert event.failure.module == Module.L5_METRICS_LOGGER and event.failure.job_id == JOB
    assert event.failure.cause == route_pb2.FAILURE_IO
    assert [x["step"] for x in jsonl(tmp_path)] == [1, 2]


def test_a_write_that_fails_closes_the_sink_once(tmp_path):
    emitted: list = []
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry(), emit=emitted.append)
    logger.log_collection_config(config(tensorboard=True))
    logger.on_step_completed(step(1))
    (sink,) = logger._sinks._open[JOB]

    def broken(*_a):
        raise OSError(28, "No space left on device")

    sink.write = broken
    logger.on_step_completed(step(2))
    logger.on_step_completed(step(3))
    logger.close()
    (event,) = emitted
    assert event.reason.startswith("write: ") and "No space left on device" in event.reason
    assert event.failure.operation == "surge.v1.StepCompleted" and event.failure.cause == route_pb2.FAILURE_IO
    assert [x["step"] for x in jsonl(tmp_path)] == [1, 2, 3]


def test_sink_work_is_deferred_and_its_failure_goes_with_the_jobs_next_record(tmp_path):
    """The service's sink thread (``defer``): a record is acknowledged before any sink work;
    a failure found there is published with the job's next call, which has a caller."""
    (tmp_path / "metrics" / JOB).mkdir(parents=True)
    (tmp_path / "metrics" / JOB / "tensorboard").write_text("a file where the event directory goes")
    queued: list = []
    emitted: list = []
    logger = MetricsLogger(
        tmp_path, registry=CollectorRegistry(), emit=emitted.append, defer=lambda fn, *args: queued.append((fn, args))
    )
    logger.log_collection_config(config(tensorboard=True))
    assert logger.on_step_completed(step(1)).records == 1
    assert [fn.__name__ for fn, _ in queued] == ["configure", "record"] and emitted == []
    for fn, args in queued:  # the sink thread's turn: the event directory cannot be made
        fn(*args)
    queued.clear()
    assert emitted == []  # found outside any call
    logger.on_step_completed(step(1, rank=1))
    (event,) = emitted
    assert event.failure.job_id == JOB and event.reason.startswith("open: ")
    logger.close()
    # (rank 1's record costs the sink thread nothing: the sinks take rank 0's only)
    assert [fn.__name__ for fn, _ in queued] == ["close"]


def test_a_bad_job_id_is_refused(tmp_path):
    logger = MetricsLogger(tmp_path, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="job_id"):
        logger.log_collection_config(store_pb2.LogCollectionConfig(job_id="../x", tensorboard=True))
    logger.close()


def test_a_sink_failure_reaches_the_rank_with_the_records_ack(tmp_path):
    """Through the real store relay, the node agent's metric stream and the rank's metrics
    client: the LogWriteFailed rides in the MetricsAck (the stream goes on) and lands on the
    rank's bus, for its session to carry up to L1."""
    import time

    from services.contract.bus import Bus
    from services.contract.relay import L5, RANK, Link
    from tests.redlines.test_state_ownership import store_service

    (tmp_path / "metrics" / JOB).mkdir(parents=True)
    (tmp_path / "metrics" / JOB / "tensorboard").write_text("a file where the event directory goes")
    bus = Bus()
    heard: list = []
    bus.subscribe(Module.L1_FAULT_DETECTOR, store_pb2.LogWriteFailed, lambda msg, payload=None: heard.append(msg))
    with store_service(tmp_path) as address:
        client, stream = metrics_through_an_agent(
            address, on_routed=Link(bus, name="store service", near=RANK, beyond=L5).deliver_each
        )
        try:
            client.log_collection_config(config(tensorboard=True))
            client.on_step_completed(step(1))
            deadline = time.monotonic() + 10
            while (client.held_records or not heard) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            client.close()
            stream.close()
    (event,) = heard
    assert event.failure.module == Module.L5_METRICS_LOGGER and event.failure.cause == route_pb2.FAILURE_IO
    assert event.reason.startswith("open: ") and event.path.endswith(f"{JOB}/tensorboard")
    assert [x["step"] for x in jsonl(tmp_path)] == [1]


def test_the_loops_stop_returns_once_the_store_has_every_record(tmp_path, monkeypatch):
    """A finished rank may be released at once: StopLogCollection returns when the store has
    acknowledged it, so every record before it; with no store, after METRICS_FLUSH_S."""
    import time

    from services.rank import metrics_client
    from tests.redlines.test_state_ownership import store_service

    with store_service(tmp_path) as address:
        client, stream = metrics_through_an_agent(address)
        try:
            client.log_collection_config(config(tensorboard=True))
            for n in (1, 2, 3):
                client.on_step_completed(step(n))
            client.stop_log_collection(store_pb2.StopLogCollection(job_id=JOB, rank=0))
            assert client.held_records == 0
            assert [x["step"] for x in jsonl(tmp_path)] == [1, 2, 3]
        finally:
            client.close()
            stream.close()
    assert tensorboard_scalars(tmp_path / "metrics" / JOB / "tensorboard")["train/loss"][-1][0] == 3

    monkeypatch.setattr(metrics_client, "METRICS_FLUSH_S", 0.3)
    gone, stream = metrics_through_an_agent("127.0.0.1:9")  # nobody there
    try:
        gone.on_step_completed(step(1))
        t0 = time.monotonic()
        gone.stop_log_collection(store_pb2.StopLogCollection(job_id=JOB, rank=0))
        assert 0.3 <= time.monotonic() - t0 < 3 and gone.held_records == 2
    finally:
        gone.close(timeout=0.1)
        stream.close(timeout=0.1)


def metrics_through_an_agent(address: str, on_routed=None):
    """A rank's metrics client whose records go, as through its node agent, on the agent's
    metric stream to the store at ``address`` (the session between them left out)."""
    import structlog

    from services.rank.metrics_client import MetricsClient
    from services.worker.metric_stream import MetricStream

    stream = MetricStream(address, structlog.get_logger(), linger_s=0)  # (no agent here to flush at a boundary)
    client = MetricsClient(lambda record: stream.submit(record, client.acked), on_routed=on_routed)
    return client, stream


def test_a_job_without_sinks_hands_its_sink_thread_nothing_per_record_and_one_with_sinks_everything(tmp_path):
    """Rank 0's records go to the sink thread only for a job whose choice names a sink (pushed,
    or kept from before a restart): a job without sinks cost that thread a wake-up per record
    for nothing (session 36)."""
    queued: list = []

    def logger() -> MetricsLogger:
        return MetricsLogger(tmp_path, registry=CollectorRegistry(), defer=lambda fn, *args: queued.append(fn.__name__))

    plain = logger()
    plain.log_collection_config(config())
    plain.on_step_completed(step(1))
    plain.on_eval_completed(engine_pb2.EvalCompleted(job_id=JOB, rank=0, step=1, loss=2.0))
    assert queued == ["configure"]
    plain.log_collection_config(config(tensorboard=True))  # the choice changed: the records follow it
    plain.on_step_completed(step(2))
    assert queued == ["configure", "configure", "record"]
    for fn, args in [(plain._sinks.configure, (config(tensorboard=True),))]:
        fn(*args)  # (the kept copy the sink thread writes)
    plain.close()
    queued.clear()
    restarted = logger()  # no push since the restart: the kept choice (tensorboard) holds
    restarted.on_step_completed(step(3))
    restarted.close()
    assert queued == ["record", "close"]
    queued.clear()
    other = logger()  # a job never configured here, nothing kept: no sinks
    other.on_step_completed(step(1, job_id="nosinks"))
    other.close()
    assert queued == ["close"]
