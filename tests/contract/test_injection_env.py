"""A malformed ``SURGE_FAULT_INJECT_HANDLER`` is one line where a service would use it: the
service refuses to start with it; importing the bus (surgectl does) never fails on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
BAD = "handler:L9_NOPE:Foo"
LINE = "error: SURGE_FAULT_INJECT_HANDLER: 'handler:L9_NOPE:Foo': unknown module 'L9_NOPE'"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SURGE_FAULT_INJECT_HANDLER": BAD, "SURGE_HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100, check=False
    )


def test_importing_the_bus_and_surgectl_does_not_fail_on_it(tmp_path):
    done = _run(["-c", "import services.contract.bus, services.cli.surgectl; print('ok')"], tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_service_refuses_to_start_with_one_line(tmp_path):
    done = _run(["-m", "services.store", "--port", "0", "--metrics-port", "0", "--root", str(tmp_path)], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == LINE


def test_surgectl_up_refuses_with_one_line_and_other_commands_run(tmp_path):
    up = _run(["-m", "services.cli.surgectl", "up"], tmp_path)
    assert up.returncode == 2, up.stderr
    assert up.stderr.strip().splitlines() == [LINE], up.stderr
    helped = _run(["-m", "services.cli.surgectl", "--help"], tmp_path)
    assert helped.returncode == 0 and "Traceback" not in helped.stderr, helped.stderr
