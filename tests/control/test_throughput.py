"""A job's tokens/s: one definition (tokens over step seconds of its steps but the first),
published by control and shown alike by `surgectl status` and the end-of-run summary."""

from __future__ import annotations

import pytest

from services.cli import render
from services.contract import engine_pb2

from .conftest import drain

pytestmark = pytest.mark.timeout(30)


def test_tokens_per_second_leaves_the_first_step_out_and_status_and_summary_agree(plane, capsys, monkeypatch):
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=10).job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b)

    def step(n: int, tokens: int, seconds: float) -> float:
        done = engine_pb2.StepCompleted(
            step=n, loss=2.0, tokens=tokens, step_seconds=seconds, tokens_per_second=tokens / seconds
        )
        plane.rank_event(a, job_id, 0, step=done)
        return plane.get(job_id).tokens_per_second

    assert step(1, 64, 8.0) == 8.0  # the compiling first step: its own rate until another
    assert step(2, 64, 0.5) == 128.0
    assert step(3, 64, 0.3) == pytest.approx(128 / 0.8)  # not the last step's 213
    status = plane.get(job_id)
    monkeypatch.delenv("COLUMNS", raising=False)
    capsys.readouterr()
    render.console.print(render.jobs_table([status]))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if job_id in line]
    render.console.print(render.summary_table(status, render.History()))
    (summary,) = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    cells = [c.strip() for c in row.split("│")]
    assert cells[6] == "160" and summary.split("│")[2].strip() == "160"  # the tokens/s column; the summary row


def test_mfu_covers_the_same_steps_as_tokens_per_second_not_the_last_step(plane, capsys, monkeypatch):
    # fresh37 #4's demo run: 4,096 tokens a step, 6,519,552 FLOPs per token, 2 ranks on a
    # CPU measured at 0.0783 TFLOP/s each; status showed the last step's 27.9 % beside the
    # run's tokens/s. Each step's MFU as the rank computes it (training_loop/step.py).
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=10).job_id
    for rank, session in ((0, a), (1, b)):
        started = engine_pb2.TrainingLoopStarted(rank=rank, peak_tflops=0.0783, peak_source="measured: cpu")
        plane.rank_event(session, job_id, rank, started=started)
    drain(a), drain(b)
    per_token = 6_519_552 / (0.0783e12 * 2)
    for n, seconds in ((1, 2.988), (2, 1.435), (3, 0.612)):
        done = engine_pb2.StepCompleted(
            step=n, loss=2.0, tokens=4096, step_seconds=seconds, tokens_per_second=4096 / seconds,
            mfu=4096 / seconds * per_token,
        )  # fmt: skip
        plane.rank_event(a, job_id, 0, step=done)
    status = plane.get(job_id)
    assert status.tokens_per_second == pytest.approx(8192 / (1.435 + 0.612))
    # the window's MFU (16.7 %), the one tokens/s implies; not step 3's 27.9 %
    assert status.mfu == pytest.approx(status.tokens_per_second * per_token) and round(100 * status.mfu, 1) == 16.7
    monkeypatch.delenv("COLUMNS", raising=False)
    capsys.readouterr()
    render.console.print(render.summary_table(status, render.History()))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "MFU" in line]
    assert "MFU (steps after the first)" in row and "16.7 % of 0.0783 TFLOP/s" in row


def test_the_throughput_window_is_journaled_so_a_control_restart_goes_on_with_it(plane):
    # fresh37b: after `surgectl down` / `up` the status tokens/s covered only the steps since
    # the resume (10,010 against the job's 6,972).
    import dataclasses
    import json

    from services.control.orchestrator.job_journal import _load_runtime, _runtime

    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=10).job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    for n, seconds in ((1, 8.0), (2, 0.5), (3, 0.3)):
        done = engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64, step_seconds=seconds, mfu=0.1)
        plane.rank_event(a, job_id, 0, step=done)
    job = plane.c.orchestrator._jobs[job_id]
    assert job.throughput == (128, pytest.approx(0.8), pytest.approx(0.08))
    restored = dataclasses.replace(job, throughput=(0, 0.0, 0.0), throughput_warm=False)
    _load_runtime(restored, json.loads(json.dumps(_runtime(job))))  # (as the journal holds it)
    assert restored.throughput == job.throughput and not restored.throughput_warm
