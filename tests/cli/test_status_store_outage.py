"""`surgectl status` names a store that does not answer, with the command that brings it back
as the local stack is (was: nothing said, while control's and the data service's outages are)."""

from __future__ import annotations

import os
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.contract import control_pb2, control_pb2_grpc
from tests.ports import free_port

from .test_housekeeping import run_cli
from .test_stack_hints import dead_pid

pytestmark = pytest.mark.timeout(60)


class Control(control_pb2_grpc.ControlServiceServicer):
    def ListJobs(self, request, context):
        return control_pb2.JobList(jobs=[control_pb2.JobStatus(job_id="j", state=control_pb2.RUNNING)])


@pytest.fixture
def control():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServiceServicer_to_server(Control(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # (stands for the store too)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def write_stack(control_port: int, store_pid: int, store_port: int, data: tuple[int, int] | None = None) -> None:
    import json

    from services.cli import stack

    services = {
        "store": {"name": "store", "pid": store_pid, "port": store_port, "log": "x"},
        "control": {"name": "control", "pid": os.getpid(), "port": control_port, "log": "x"},
    }
    if data is not None:  # (pid, port)
        services["data"] = {"name": "data", "pid": data[0], "port": data[1], "log": "x"}
    stack.stack_file().parent.mkdir(parents=True, exist_ok=True)
    stack.stack_file().write_text(json.dumps({"services": services}))


def test_status_names_a_store_that_is_down_and_the_command_that_brings_it_back(
    surge_home, control, monkeypatch, capsys
):
    monkeypatch.setenv("COLUMNS", "400")
    write_stack(control, dead_pid(), free_port())  # its process gone
    code, out, _ = run_cli(["status"], monkeypatch, capsys)
    assert code == 0 and "store at 127.0.0.1:" in out and "is down" in out and "`surgectl up` starts it" in out, out
    assert "checkpoints are not saved" in out and "RUNNING" in out  # the jobs still shown

    write_stack(control, os.getpid(), free_port())  # its process runs, nothing answers: hung
    code, out, _ = run_cli(["status"], monkeypatch, capsys)
    assert code == 0 and "although its process runs; `surgectl restart store`" in out, out

    write_stack(control, os.getpid(), control)  # it answers its health check: nothing said
    code, out, _ = run_cli(["status"], monkeypatch, capsys)
    assert code == 0 and "store" not in out, out


def test_status_names_a_data_service_that_is_down_while_a_job_runs(surge_home, control, monkeypatch, capsys):
    # (was: nothing said until a rank's read-ahead ran dry, ~30 s later, in the job's message)
    monkeypatch.setenv("COLUMNS", "400")
    write_stack(control, os.getpid(), control, data=(dead_pid(), free_port()))  # the store answers
    code, out, _ = run_cli(["status"], monkeypatch, capsys)
    assert code == 0 and "data at 127.0.0.1:" in out and "is down" in out and "`surgectl up` starts it" in out, out
    assert "read-ahead" in out and "RUNNING" in out and "store" not in out, out

    write_stack(control, os.getpid(), control, data=(os.getpid(), control))  # it answers: nothing said
    code, out, _ = run_cli(["status"], monkeypatch, capsys)
    assert code == 0 and "data" not in out.lower().replace("data_wait", ""), out
