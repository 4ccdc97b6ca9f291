"""The node agent's choice of gloo's interface (services/worker/hardware.py gloo_interface):
the interface holding the address the agent advertises, so its ranks offer their peers that
address and not what the machine's name resolves to."""

from __future__ import annotations

import sys

import pytest

from services.worker.hardware import gloo_interface
from tests.multihost.netns import Bed, available


def test_loopback_for_a_single_machine_and_none_for_a_name_that_does_not_resolve():
    assert gloo_interface("127.0.0.1") == "lo"
    assert gloo_interface("no-such-host.invalid") is None


def test_a_namespaced_host_gets_the_interface_of_its_own_address(tmp_path):
    if available():
        pytest.skip(f"namespace test bed: {available()}")
    with Bed(tmp_path, ["node-1"], isolate_files=False) as bed:
        node = bed.hosts["node-1"]
        probe = f"from services.worker.hardware import gloo_interface as g; print(g({node.ip!r}), g('127.0.0.1'))"
        done = bed.run("node-1", f"{sys.executable} -c {probe!r}", {"PATH": "/usr/bin:/bin"}, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["eth0", "lo"]
