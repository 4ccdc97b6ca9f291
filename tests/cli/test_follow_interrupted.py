"""A Ctrl-C of `surgectl events --follow` or `logs --follow` (how a follow is usually ended) says
in one line that the job goes on, exit 130 as `submit --follow` does (was: main's "may have been
cut short after it asked the stack something", for commands that only read; fresh-user trial,
session 39). In this process: the real control plane on loopback gRPC, the follow's stream
interrupted where the terminal's Ctrl-C would land (in its wait for the next item)."""

from __future__ import annotations

import pytest

from services.cli import follow
from services.contract import control_pb2
from tests.control.conftest import registration, served_control, spec_yaml

from .test_queue_cli import run

pytestmark = pytest.mark.timeout(60)


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt
    yield  # (a generator, as the follows are)


@pytest.mark.parametrize("command", ["events", "logs"])
def test_ctrl_c_of_a_follow_says_the_job_goes_on_in_one_line_exit_130(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))
        req = control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="f", dp=1), spec_path="job.yaml")
        job = stub.SubmitJob(req, timeout=10).job_id
        monkeypatch.setattr(follow, "job_events", _interrupted)
        monkeypatch.setattr(follow, "job_logs", _interrupted)
        code, _, err = run(monkeypatch, capsys, command, job, "--follow")
        assert code == 130
        assert err.strip() == f"stopped following; {job} is not affected (`surgectl status {job}`)"
        assert stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=10).state != control_pb2.TERMINATED
