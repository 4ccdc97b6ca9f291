"""`surgectl up` survives losing a port to another process between probe and bind."""

from __future__ import annotations

import socket

import pytest

from services.cli import stack
from services.cli.errors import CliError
from tests.conftest import kill_all

pytestmark = pytest.mark.timeout(120)


def test_a_service_that_loses_its_port_is_restarted_on_a_fresh_one(surge_home, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = stack.free_port
    handed = iter([taken])  # the very first port handed out (store's gRPC port) is taken
    monkeypatch.setattr(stack, "free_port", lambda: next(handed, None) or real())
    procs = {}
    try:
        procs = stack.up(num_workers=1, timeout_s=60)
        assert procs["store"].port != taken
        assert set(procs) == {"store", "data", "control", "worker-0"}
        assert "in use" in open(procs["store"].log).read()  # the first attempt did lose it
    finally:
        stack.down()
        kill_all([p.pid for p in procs.values()])
        squatter.close()


def test_a_bad_fixed_port_is_one_line_naming_the_variable_and_starts_nothing(surge_home, monkeypatch):
    monkeypatch.setenv("SURGE_CONTROL_PORT", "http")
    with pytest.raises(CliError) as e:
        stack.up(num_workers=1)
    assert str(e.value) == "SURGE_CONTROL_PORT: expected a port number 1-65535, got 'http'" and e.value.code == 2
    assert stack.read_stack() is None  # nothing was started


def test_restart_without_a_stack_or_of_an_unknown_service_is_one_line(surge_home):
    with pytest.raises(CliError, match="no local stack is running"):
        stack.restart("control")
    stack.stack_file().parent.mkdir(parents=True)
    stack._write({"control": stack.ServiceProc("control", pid=2 ** 22 + 1, port=1, log="x")})
    with pytest.raises(CliError) as e:
        stack.restart("contorl")
    assert "SERVICE: no service 'contorl'" in str(e.value) and "(one of: control)" in str(e.value)
    assert e.value.code == 2
    with pytest.raises(CliError, match="does not record its command line"):
        stack.restart("control")  # an old stack.json entry whose process is gone
