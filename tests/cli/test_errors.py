"""surgectl's one-line errors: an unreachable service is told from a service that answered
UNAVAILABLE by the typed cause a Surge server sends (trailing metadata), never by the text."""

from __future__ import annotations

import socket
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.cli.errors import from_rpc
from services.contract.failures import CAUSE_METADATA


@pytest.fixture
def answering():
    """A server whose one method answers UNAVAILABLE, saying why (typed) when asked to."""

    def method(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"typed":
            context.set_trailing_metadata(((CAUSE_METADATA, "FAILURE_UNAVAILABLE"),))
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused: socket unavailable")  # words make nothing

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(method)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"M": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=0)


def call(address: str, request: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/t.T/M")(request, timeout=5)
    return e.value


def test_a_service_that_answered_unavailable_is_not_called_unreachable(answering):
    answered = from_rpc(call(answering, b"typed"), "control", answering)
    assert not answered.unreachable and str(answered) == "connection refused: socket unavailable"


def test_a_service_that_cannot_be_reached_is_unreachable(answering):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
        gone = from_rpc(call(closed, b""), "control", closed)
    assert gone.unreachable and str(gone).startswith(f"control unreachable at {closed} ")
    # An UNAVAILABLE without a Surge server's typed answer (a proxy, a dying process): unreachable.
    assert from_rpc(call(answering, b""), "control", answering).unreachable


def test_a_call_the_server_does_not_know_says_it_runs_an_older_surge(answering):
    with grpc.insecure_channel(answering) as ch, pytest.raises(grpc.RpcError) as e:
        ch.unary_unary("/t.T/Newer")(b"", timeout=5)  # (gRPC's own answer: "Method not found!")
    older = from_rpc(e.value, "store", answering)
    assert not older.unreachable and older.code == 1
    assert str(older).startswith(f"store at {answering} does not know this call: it runs an older Surge")


@pytest.mark.parametrize(
    "argv,names",
    [
        (["resume", "j", "--dp", "0"], "--dp"),
        (["resume", "j", "--grad-accum", "abc"], "--grad-accum"),
        (["frobnicate"], "frobnicate"),
        (["jobs"], "`surgectl status` lists the jobs"),  # another tool's word: the hint names ours
        (["submit"], "spec"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_option_and_exit_2(argv, names, tmp_path):
    """A bad option value, an unknown command or a missing argument: one line on stderr
    naming it, exit 2, nothing on stdout (not click's framed box)."""
    _one_usage_line(argv, names, tmp_path)


@pytest.mark.parametrize(
    "argv,names",
    [
        (["status", "--watch", "--interval", "nan"], "'--interval': 'nan' is not a number"),  # (had a max)
        (["evaluate", "j", "--command", "x", "--timeout", "inf"], "'--timeout': 'inf' is not a number"),  # (a min)
        (["team", "set", "vision", "--weight", "-inf"], "'--weight': '-inf' is not a number"),  # (no bound)
        (["status", "--interval", "5000"], "'--interval': must be <= 3600, got 5000"),
    ],
)
def test_a_number_option_given_nan_or_inf_says_it_is_not_a_number_not_a_bound(argv, names, tmp_path):
    """typer's own range check answered `nan` with the bound it failed ("Input should be less
    than or equal to 3600"), let `inf` through a lower bound and `nan` through no bound."""
    _one_usage_line(argv, names, tmp_path)


def _one_usage_line(argv: list[str], names: str, tmp_path: Path) -> None:
    """`surgectl ARGV` in its own process: exit 2, one `error: ` line on stderr holding
    ``names``, nothing on stdout."""
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "SURGE_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.surgectl", *argv], capture_output=True, text=True, env=env, timeout=60
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert names in lines[0] and done.stdout == ""
