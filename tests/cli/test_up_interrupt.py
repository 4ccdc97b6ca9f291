"""Ctrl-C while `surgectl up` starts the stack: it returns within seconds, exit 130, one
line, and no process of the stack is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, kill_all, processes_of_home

pytestmark = pytest.mark.timeout(90)


def test_ctrl_c_during_up_returns_promptly_and_leaves_no_process(surge_home):
    stack_json = surge_home / "run" / "stack.json"
    cli = subprocess.Popen(
        [sys.executable, "-m", "services.cli.surgectl", "up", "--workers", "1"],
        cwd=REPO,
        env={**os.environ, "SURGE_HOME": str(surge_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a shell gives a foreground job
    )
    try:
        deadline = time.monotonic() + 60
        started: dict = {}
        # control spawned: store and data answered their health checks, control's is under
        # way (a gRPC call in progress, where a KeyboardInterrupt used to hang the exit)
        while "control" not in started and time.monotonic() < deadline and cli.poll() is None:
            time.sleep(0.05)
            try:
                started = json.loads(stack_json.read_text())["services"]
            except (OSError, ValueError, KeyError):
                pass
        assert started and cli.poll() is None, "up ended or started nothing within 60 s"
        os.killpg(cli.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        sent = time.monotonic()
        out, err = cli.communicate(timeout=15)
        took = time.monotonic() - sent
        assert cli.returncode == 130 and took < 6, (cli.returncode, took, err)
        assert err.strip().splitlines() == [err.strip()] and err.startswith("interrupted") and "Traceback" not in err
        assert "stack is up" not in out and not stack_json.exists()
        left = processes_of_home(surge_home)
        assert left == [] and not any(_exists(s["pid"]) for s in started.values()), left
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
        kill_all(processes_of_home(surge_home))


def _exists(pid: int) -> bool:
    """Still a process (a zombie waiting for its reaper has ended: it runs nothing)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
