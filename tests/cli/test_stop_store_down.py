"""`surgectl stop` while the store does not answer: refused, nothing asked of control, when the
stop would checkpoint (a running job, a paused one whose checkpoint is behind its step); sent
when it would not (a drained or checkpointed pause, `--no-checkpoint`). Control is a stand-in
server; the store's address is a port nothing listens on."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from services.contract import control_pb2, control_pb2_grpc
from tests.ports import free_port

from .test_housekeeping import run_cli
from .test_stack_hints import dead_pid
from .test_status_store_outage import write_stack

pytestmark = pytest.mark.timeout(60)


class Control(control_pb2_grpc.ControlServiceServicer):
    def __init__(self):
        self.status = control_pb2.JobStatus(job_id="j", state=control_pb2.RUNNING, step=40, checkpoint_step=30)
        self.stops: list[control_pb2.StopJobRequest] = []

    def GetJob(self, request, context):
        return self.status

    def ListJobs(self, request, context):  # (resolving the job's id or name)
        return control_pb2.JobList(jobs=[self.status])

    def StopJob(self, request, context):
        self.stops.append(request)
        return self.status


@pytest.fixture
def control():
    servicer = Control()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def test_stop_is_refused_while_the_store_is_down_only_where_it_would_checkpoint(
    surge_home, control, monkeypatch, capsys
):
    servicer, port = control
    write_stack(port, dead_pid(), free_port())  # the store's process gone
    code, _, err = run_cli(["stop", "j"], monkeypatch, capsys)
    assert code == 1 and servicer.stops == [], err
    assert "not stopped: j's stop checkpoints its step in the store" in err and "--no-checkpoint" in err, err

    servicer.status.state = control_pb2.PAUSED  # paused after its checkpoint's step: still refused
    assert run_cli(["stop", "j"], monkeypatch, capsys)[0] == 1 and servicer.stops == []

    code, _, err = run_cli(["stop", "j", "--no-checkpoint"], monkeypatch, capsys)
    assert code == 0 and [s.no_checkpoint for s in servicer.stops] == [True], err

    servicer.status.drained = True  # drained by `down`: its checkpoint holds its step
    code, _, err = run_cli(["stop", "j"], monkeypatch, capsys)
    assert code == 0 and [s.no_checkpoint for s in servicer.stops] == [True, False], err
