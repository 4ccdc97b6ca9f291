"""An evaluation job takes no training steps: `status` shows it as one, and `evaluate --wait`
follows it with a spinner, not a step bar with loss and tokens/s."""

from __future__ import annotations

import json

from services.cli import render
from services.contract import control_pb2


def _job(job_id: str, spec: dict) -> control_pb2.JobStatus:
    return control_pb2.JobStatus(job_id=job_id, total_steps=400, step=0, spec_json=json.dumps(spec))


EVAL = {"name": "eval-demo", "evaluation": {"source_job": "demo-1", "version": "demo-1:2", "command": ["x"]}}


def test_status_names_an_evaluation_job_instead_of_its_source_jobs_steps(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    render.console.print(render.jobs_table([_job("eval-1", EVAL), _job("demo-1", {"name": "demo"})]))
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "-1 " in line}
    assert "evaluation" in rows["eval-1"] and "0/400" not in rows["eval-1"]
    assert "0/400" in rows["demo-1"]
    assert not render.is_evaluation(control_pb2.JobStatus(spec_json="not json"))


def _events(status: control_pb2.JobStatus):
    yield control_pb2.JobEvent(type="state", message="state RUNNING", status=status)


def test_follow_of_an_evaluation_shows_no_step_bar():
    with render.console.capture() as got:
        render.follow(_events(_job("eval-1", EVAL)), training=False)
    with render.console.capture() as trained:
        render.follow(_events(_job("demo-1", {"name": "demo"})))
    assert "tok/s" not in got.get() and "0/400" not in got.get() and "eval-1" in got.get()
    assert "tok/s" in trained.get() and "0/400" in trained.get()


def test_status_as_listed_without_specs_shows_an_evaluation_job_as_one(monkeypatch, capsys):
    """`status` gets no spec_json: a finished evaluation showed "0/60" and 0 tokens/s."""
    monkeypatch.setenv("COLUMNS", "200")
    done = control_pb2.JobStatus(job_id="eval-2", total_steps=60, evaluation=True, state=control_pb2.TERMINATED)
    render.console.print(render.jobs_table([done]))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "eval-2" in line]
    cells = [c.strip() for c in row.split("│")]
    assert "evaluation" in cells and "0/60" not in row and "0" not in cells, cells
    with render.console.capture() as shown:
        render.console.print(render.summary_table(done, render.History()))
    assert "0/60" not in shown.get() and "evaluation" in shown.get()
