"""`surgectl up` over a control that checks tokens, from a shell without an admin
SURGE_AUTH_TOKEN: the drained jobs' resume is refused unauthenticated; the one line names
the token to set and that `up` again resumes them (was: "ListJobs: not authenticated ..."
alone)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from services.cli.cmd_stack import _resume_drained
from services.cli.errors import CliError
from services.contract import control_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Guarded(control_pb2_grpc.ControlServiceServicer):
    """Control's refusal of a caller with no token its tokens file names (services/common/grpc_guards.py)."""

    def ListJobs(self, request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "ListJobs: not authenticated: no token or certificate ...")


def test_up_says_to_set_an_admin_token_and_run_up_again_when_control_refuses_the_resume(surge_home, monkeypatch):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_ControlServiceServicer_to_server(Guarded(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.delenv("SURGE_AUTH_TOKEN", raising=False)
    try:
        with pytest.raises(CliError) as e:
            _resume_drained(5.0)
    finally:
        server.stop(0)
    line = str(e.value)
    assert "\n" not in line and e.value.code == 1
    assert "not resumed" in line and "ListJobs: not authenticated" in line
    assert "set SURGE_AUTH_TOKEN to an admin token" in line and "`surgectl up` again resumes them" in line
