"""`surgectl submit` sends one request id per invocation and, when the call failed in a way
that may have lost the reply (UNAVAILABLE: control restarting; DEADLINE_EXCEEDED: the answer
did not come back), sends it again with the same id a bounded number of times
(services/cli/jobs.py ``send_submit`` through ``clients.call``'s retries). Against control's
real plane and servicer on real gRPC, behind a servicer that loses replies as scripted: the
retries make one job."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from services.cli import jobs
from services.cli.errors import CliError
from services.contract import control_pb2, control_pb2_grpc
from services.control.__main__ import build
from services.control.job_store import JobStore
from tests.control.conftest import spec_yaml, stop_plane

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode


class Lossy(control_pb2_grpc.ControlServiceServicer):
    """Control's servicer, whose SubmitJob fails as scripted (one code per call, then none):
    DEADLINE_EXCEEDED after control created the job (its reply lost), UNAVAILABLE before
    control saw the call (it was restarting). Records every SubmitJobRequest it got."""

    def __init__(self, real, lose: list[Code]):
        self.real, self.lose = real, list(lose)
        self.requests: list[control_pb2.SubmitJobRequest] = []

    def SubmitJob(self, request, context):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        code = self.lose.pop(0) if self.lose else None
        if code == Code.DEADLINE_EXCEEDED:
            self.real.SubmitJob(request, context)
        if code is not None:
            context.abort(code, f"{code.name} (scripted by the test)")
        return self.real.SubmitJob(request, context)


@contextmanager
def lossy_control(tmp_path, monkeypatch, lose: list[Code]) -> Iterator[tuple[Lossy, object]]:
    """The real control plane (no worker: a submitted job waits queued) served through
    ``Lossy``, SURGE_CONTROL_ADDRESS set to it; the retries wait no time."""
    monkeypatch.setattr(jobs, "SUBMIT_RETRY_DELAYS_S", (0.0,) * len(jobs.SUBMIT_RETRY_DELAYS_S))
    plane = build(JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    lossy = Lossy(plane.servicer, lose)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    control_pb2_grpc.add_ControlServiceServicer_to_server(lossy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", f"127.0.0.1:{port}")
    try:
        yield lossy, plane
    finally:
        server.stop(grace=0)
        stop_plane(plane)


def job_ids(plane) -> list[str]:
    return sorted(j.status.job_id for j in plane.journal.load_jobs())


def test_a_lost_reply_is_sent_again_with_the_same_request_id_and_makes_one_job(tmp_path, monkeypatch, capsys):
    with lossy_control(tmp_path, monkeypatch, [Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE]) as (lossy, plane):
        status = jobs.send_submit(spec_yaml(name="retry", dp=1), "job.yaml")
        ids = {r.request_id for r in lossy.requests}
        assert len(lossy.requests) == 3 and len(ids) == 1
        uuid.UUID(ids.pop())  # (a uuid per invocation)
        assert job_ids(plane) == [status.job_id]  # the first call's job, answered to the third
        assert status.state == control_pb2.JobState.STANDBY
    err = capsys.readouterr().err
    assert "DEADLINE_EXCEEDED; trying again in 0 s (the call is safe to repeat)" in err, err
    assert "UNAVAILABLE; trying again" in err, err


def test_each_invocation_sends_its_own_request_id(tmp_path, monkeypatch):
    with lossy_control(tmp_path, monkeypatch, []) as (lossy, plane):
        a = jobs.send_submit(spec_yaml(name="twice", dp=1), "job.yaml").job_id
        b = jobs.send_submit(spec_yaml(name="twice", dp=1), "job.yaml").job_id
        assert a != b and job_ids(plane) == sorted([a, b])
        assert len({r.request_id for r in lossy.requests}) == 2


def test_the_retries_are_bounded_and_the_last_failure_is_said(tmp_path, monkeypatch):
    with lossy_control(tmp_path, monkeypatch, [Code.UNAVAILABLE] * 10) as (lossy, plane):
        with pytest.raises(CliError, match="^control unreachable at 127.0.0.1:"):
            jobs.send_submit(spec_yaml(name="gone", dp=1), "job.yaml")
        assert len(lossy.requests) == 1 + len(jobs.SUBMIT_RETRY_DELAYS_S)
        assert len({r.request_id for r in lossy.requests}) == 1 and job_ids(plane) == []


def test_a_request_id_reused_with_another_spec_is_refused_once_exit_2_naming_it_and_the_job(tmp_path, monkeypatch):
    rid = uuid.UUID(int=7)
    monkeypatch.setattr(jobs.uuid, "uuid4", lambda: rid)  # (two invocations that share an id: a bug elsewhere)
    with lossy_control(tmp_path, monkeypatch, []) as (lossy, plane):
        first = jobs.send_submit(spec_yaml(name="one", dp=1), "job.yaml").job_id
        assert jobs.send_submit(spec_yaml(name="one", dp=1), "job.yaml").job_id == first  # same text: same job
        with pytest.raises(CliError) as refused:
            jobs.send_submit(spec_yaml(name="one", dp=1, steps=9), "other.yaml")
        assert refused.value.code == 2 and refused.value.status == Code.INVALID_ARGUMENT
        assert str(refused.value) == (
            f"other.yaml: request id {rid} already submitted job {first} with another spec; "
            "a new submit needs a new request id"
        )
        assert len(lossy.requests) == 3 and job_ids(plane) == [first]  # a refusal is not sent again
