"""Red lines of kind (c): a receiver cannot alter a reported event (DESIGN.md law 5).

The bus hands every receiver its own copy (tests/contract/test_bus.py shows it on stand-in
handlers); here the receivers are the real modules: a receiver that scribbles on its copy of
a step summary changes neither what the metrics logger persists nor what the orchestrator
records, and what the orchestrator replies is a snapshot its caller cannot write through.
"""

from __future__ import annotations

import json
import math
import textwrap

from google.protobuf import json_format

from services.contract import Module, control_pb2, engine_pb2
from services.contract.bus import Bus
from services.store.metrics_logger import MetricsLogger


def _vandal(msg, payload=None):
    """A receiver that rewrites everything it is given (what law 5 forbids to matter)."""
    msg.loss, msg.step, msg.job_id, msg.learning_rate = -1.0, 999, "tampered", 1e9


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_receiver_mutating_its_step_event_does_not_change_what_the_metrics_logger_persists(tmp_path):
    bus = Bus()
    logger = MetricsLogger(tmp_path)
    bus.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.StepCompleted, _vandal)  # delivered first
    bus.subscribe(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, logger.on_step_completed)
    sent = engine_pb2.StepCompleted(job_id="j", rank=0, step=7, loss=2.5, learning_rate=3e-4, tokens=64)
    assert bus.publish(Module.L2_TRAINING_LOOP, sent) == 2
    logger.close()
    (line,) = _lines(tmp_path / "metrics" / "j.jsonl")
    line.pop("type")
    assert json_format.ParseDict(line, engine_pb2.StepCompleted()) == sent
    assert sent.loss == 2.5 and sent.job_id == "j"  # the sender's message is untouched too


def test_the_metrics_logger_stores_raw_values_unsmoothed_and_uncorrected(tmp_path):
    logger = MetricsLogger(tmp_path)
    losses = [5.5, math.nan, math.inf, 0.1, 1e-300, -0.0]  # a spike, a NaN, a denormal: as sent
    sent = [engine_pb2.StepCompleted(job_id="r", rank=1, step=i + 1, loss=v) for i, v in enumerate(losses)]
    for msg in sent:
        logger.on_step_completed(msg)
    logger.close()
    got = []
    for line in _lines(tmp_path / "metrics" / "r.jsonl"):
        line.pop("type")
        got.append(json_format.ParseDict(line, engine_pb2.StepCompleted()))
    assert [g.step for g in got] == [1, 2, 3, 4, 5, 6]
    for g, s in zip(got, sent):
        assert (math.isnan(g.loss) and math.isnan(s.loss)) or (
            g.loss == s.loss and math.copysign(1, g.loss) == math.copysign(1, s.loss)
        )


def _shut(control) -> None:
    """Stop what can still fire (liveness deadlines, recovery retries, store answers) before
    the journal closes, in the order control's own ``main`` stops them."""
    control.detector.close()
    control.orchestrator.close()
    control.store.close()
    control.journal.close()


def _control(tmp_path, liveness: str = "{}"):
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    control = build(JobStore(tmp_path / "c.db"), data_address="127.0.0.1:1", store_address="127.0.0.1:2")
    control.sessions.open(
        control_pb2.WorkerRegistration(
            worker_id="w", host="127.0.0.1", address="127.0.0.1:0", memory_bytes=1 << 30, cpu_count=2, slots=1
        )
    )
    spec = (
        textwrap.dedent("""\
        name: ro
        steps: 5
        model: {n_layers: 1, d_model: 16, n_heads: 2}
        data: {dataset: x@v1, seq_len: 8, micro_batch_size: 2}
        optimizer: {warmup_steps: 0}
        """)
        + f"liveness: {liveness}\n"
    )
    status = control.bus.command(
        Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.SubmitJobRequest(spec_yaml=spec, spec_path="job.yaml")
    ).message
    return control, status.job_id


def test_a_receiver_mutating_its_step_event_does_not_change_what_the_orchestrator_records(tmp_path):
    control, job = _control(tmp_path)
    bus = control.bus
    bus.subscribe(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, _vandal)  # the other receiver
    bus.publish(Module.L2_TRAINING_LOOP, engine_pb2.TrainingLoopStarted(job_id=job, rank=0))
    bus.publish(Module.L2_TRAINING_LOOP, engine_pb2.StepCompleted(job_id=job, rank=0, step=3, loss=1.25, tokens=16))
    status = bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job)).message
    assert (status.job_id, status.step, status.train_loss) == (job, 3, 1.25)
    _shut(control)


def test_the_orchestrators_reply_is_a_snapshot_its_receiver_cannot_write_through(tmp_path):
    control, job = _control(tmp_path)
    user = lambda msg: control.bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, msg).message  # noqa: E731
    mine = user(control_pb2.JobQuery(job_id=job))
    mine.state, mine.step, mine.message = control_pb2.TERMINATED, 999, "tampered"
    again = user(control_pb2.JobQuery(job_id=job))
    assert again.state == control_pb2.WARMING_UP and again.step == 0 and again.message != "tampered"
    _shut(control)
