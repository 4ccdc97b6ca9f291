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
