"""`surgectl status --watch` rides a service that stops answering (found by an operator's trial:
the watch exited 1 at the first redraw during `surgectl restart control`, where `events --follow`
reconnected): the view says the service's one line until it answers again. A refusal still ends
the watch, and so does a stack that is not up when the watch starts."""

from __future__ import annotations

import re

import pytest

from services.cli import cmd_jobs
from services.cli.errors import CliError
from services.contract import control_pb2

UNREACHABLE = CliError("control unreachable at 127.0.0.1:1 (is the stack up? run `surgectl up`)", unreachable=True)


def watched(monkeypatch, answers: list) -> None:
    """Run the watch (piped: one view after another) over ``answers``, one per draw (a
    CliError is raised), then the operator's Ctrl-C."""
    draws = iter(answers)

    def status_of(job):
        answer = next(draws)
        if isinstance(answer, CliError):
            raise answer
        return answer

    sleeps = iter(range(len(answers) - 1))

    def sleep(_seconds):
        if next(sleeps, None) is None:
            raise KeyboardInterrupt

    monkeypatch.setattr(cmd_jobs, "_status_of", status_of)
    monkeypatch.setattr(cmd_jobs.time, "sleep", sleep)
    cmd_jobs.status(job=None, output="table", watch=True, interval=0.5)


def jobs(name: str) -> tuple[list, list, str, str]:
    job = control_pb2.JobStatus(job_id=name, name=name, world_size=1)
    return [job], [], "", ""


def test_a_watch_shows_controls_outage_and_goes_on_once_it_answers(monkeypatch, capsys):
    watched(monkeypatch, [jobs("before-1"), UNREACHABLE, UNREACHABLE, jobs("after-1")])
    out = capsys.readouterr().out
    views = re.split(r"(?m)^-- \d\d:\d\d:\d\d$", out)[1:]  # (each view under its time)
    assert len(views) == 4, out
    assert "before-1" in views[0] and "after-1" in views[3], out
    for outage in (" ".join(v.split()) for v in views[1:3]):  # (wrapped at the console's width)
        assert "control unreachable at 127.0.0.1:1" in outage and "tried again every 0.5 s" in outage, outage


def test_a_refusal_during_the_watch_ends_it_with_its_error(monkeypatch):
    refused = CliError("job gone-1: not found", code=2)
    with pytest.raises(CliError) as e:
        watched(monkeypatch, [jobs("gone-1"), refused])
    assert e.value is refused


def test_a_watch_of_a_stack_not_up_ends_at_once_with_its_line(monkeypatch, capsys):
    with pytest.raises(CliError) as e:
        watched(monkeypatch, [UNREACHABLE])
    assert e.value is UNREACHABLE and capsys.readouterr().out == ""
