"""`surgectl up` survives losing a port to another process between probe and bind."""

from __future__ import annotations

import socket

import pytest

from services.cli import stack
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
