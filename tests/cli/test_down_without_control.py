"""`surgectl down` (not --force) whose control does not answer: refused, nothing stopped (it
stopped every rank unseen and exited 0; the next `up` recovered each job as worker_lost)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from services.cli import stack
from services.contract import control_pb2, control_pb2_grpc
from tests.ports import free_port

from .test_housekeeping import assert_one_line, run_cli
from .test_stack_hints import dead_pid, write_stack

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def agent():
    """A process standing for a live node agent (its own process group, as the stack starts one)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_down_with_control_dead_and_an_agent_running_is_refused_and_stops_nothing(
    surge_home, agent, monkeypatch, capsys
):
    write_stack({"store": dead_pid(), "control": dead_pid(), "worker-0": agent.pid}, free_port())
    code, _, err = run_cli(["down"], monkeypatch, capsys)
    assert_one_line(code, err, 1, "control unreachable", "nothing was stopped", "`surgectl up`, then `surgectl down`")
    assert "`surgectl down --force`" in err
    assert agent.poll() is None and stack.read_stack() is not None  # its ranks still train


def test_down_with_no_agent_left_stops_what_is_recorded(surge_home, monkeypatch, capsys):
    write_stack({"store": dead_pid(), "control": dead_pid(), "worker-0": dead_pid()}, free_port())
    code, out, _ = run_cli(["down"], monkeypatch, capsys)
    assert code in (0, None) and "stopped" in out and stack.read_stack() is None  # no rank to lose


class DiesDuringDrain(control_pb2_grpc.ControlServiceServicer):
    """Lists one running job, then goes away (UNAVAILABLE) when the drain looks at it."""

    def ListJobs(self, request, context):
        return control_pb2.JobList(jobs=[control_pb2.JobStatus(job_id="j", state=control_pb2.RUNNING)])

    def GetJob(self, request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "control stopping")


def test_control_dying_during_down_s_drain_is_refused_the_same_way(surge_home, agent, monkeypatch, capsys):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServiceServicer_to_server(DiesDuringDrain(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        write_stack({"control": os.getpid(), "worker-0": agent.pid}, port)
        monkeypatch.setattr(stack, "_signal_group", lambda pid, sig: pytest.fail(f"signal {sig} sent to {pid}"))
        code, _, err = run_cli(["down"], monkeypatch, capsys)
    finally:
        server.stop(0)
    assert_one_line(code, err, 1, "control unreachable", "nothing was stopped", "`surgectl down --force`")
    assert agent.poll() is None and stack.read_stack() is not None
