"""`make demo` / `surgectl demo` interrupted (a Ctrl-C, a failure) while its job is live stops
the job before it stops the stack it started (services/cli/demo.py ``stop_live_job``): the next
`surgectl up` found the job RUNNING without its ranks (a worker_lost fault, a restart spent, and
the job trained again unasked; fresh-user trial, session 39). In this process: the real control
plane served on loopback gRPC (tests/control/conftest.py), one registered worker."""

from __future__ import annotations

import pytest

from services.cli.demo import stop_live_job
from services.contract import control_pb2
from tests.control.conftest import registration, served_control, spec_yaml

pytestmark = pytest.mark.timeout(60)


def test_an_interrupted_demos_live_job_is_stopped_and_one_that_ended_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (plane, stub):
        plane.sessions.open(registration("wa"))
        req = control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="demo", dp=1), spec_path="job.yaml")
        job = stub.SubmitJob(req, timeout=10).job_id
        assert stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=10).state != control_pb2.TERMINATED
        said = stop_live_job(job)
        s = stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=10)
        assert (s.state, s.outcome) == (control_pb2.TERMINATED, control_pb2.STOPPED), s
        assert said == f"{job}: stopped at step 0, before its first checkpoint"
        assert stop_live_job(job) == ""  # (ended: nothing to stop, nothing said)
    # Control gone (the stack already down): one line saying so, nothing raised.
    said = stop_live_job(job)
    assert said.startswith(f"{job}: not stopped (") and said.endswith(
        "control decides about it at the next `surgectl up`"
    )
