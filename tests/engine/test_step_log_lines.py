"""The loop's sampled step lines in the rank log, and its sink choice pushed to L5-2."""

from __future__ import annotations

import pytest
import structlog
from rank_fakes import LocalRank, tiny_spec, torch_threads

from services.contract import engine_pb2, store_pb2
from services.engine.training_loop import step_line

pytestmark = pytest.mark.timeout(120)


def test_every_log_every_th_step_and_the_last_get_a_line_with_the_reported_values(tmp_path):
    spec = tiny_spec(
        steps=5,
        model={"n_layers": 2, "d_model": 32, "n_heads": 2},
        data={"seq_len": 16, "micro_batch_size": 2},
        metrics={"log_every": 2, "tensorboard": True, "wandb": {"project": "surge-tests"}},
    )
    rank = LocalRank(spec, tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    with torch_threads(1), structlog.testing.capture_logs() as logs:
        rank.run()
    assert rank.error is None
    steps = {s.step: s for s in rank.steps()}
    lines = [e for e in logs if e["event"].startswith("step ")]
    assert [e["event"] for e in lines] == [step_line(steps[n]) for n in (2, 4, 5)]
    assert all(e.get("once") for e in lines)  # the same on every rank: rank 0 writes it
    assert rank.store.configs == [  # before the first step, and after the last
        store_pb2.LogCollectionConfig(
            job_id="job", tensorboard=True, wandb_project="surge-tests", wandb_mode="offline", team="default"
        ),
        store_pb2.StopLogCollection(job_id="job", rank=0),
    ]


def test_the_line_reads_like_the_issue_asks():
    done = engine_pb2.StepCompleted(
        step=120, loss=2.31412, learning_rate=2.9e-3, grad_norm=0.84, tokens_per_second=12345.4
    )
    assert step_line(done) == "step 120 loss 2.3141 lr 2.9e-03 grad_norm 0.84 tok/s 12345"
    skipped = engine_pb2.StepCompleted(step=3, loss=float("nan"), skipped=True, skip_reason="non_finite_loss")
    assert step_line(skipped) == "step 3 loss nan lr 0.0e+00 grad_norm 0 tok/s 0 skipped (non_finite_loss)"


def test_log_every_zero_writes_no_step_line(tmp_path):
    spec = tiny_spec(
        steps=2, model={"n_layers": 2, "d_model": 32, "n_heads": 2}, data={"seq_len": 16, "micro_batch_size": 2},
        metrics={"log_every": 0},
    )  # fmt: skip
    rank = LocalRank(spec, tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    with torch_threads(1), structlog.testing.capture_logs() as logs:
        rank.run()
    assert rank.error is None and len(rank.steps()) == 2
    assert not [e for e in logs if e["event"].startswith("step ")]
    assert rank.store.configs == [
        store_pb2.LogCollectionConfig(job_id="job", team="default"),  # (the store learns the job's team)
        store_pb2.StopLogCollection(job_id="job", rank=0),
    ]
