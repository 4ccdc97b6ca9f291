"""Two `surgectl up` of one SURGE_HOME at once (an operator's trial, 0.3 s apart): the second read
the first's half-written stack.json and said "the running stack has 0 workers, not 3 (`surgectl
down` then ...)", advice that would stop the stack the first was starting. Now the second sees
the first's lock (services/cli/up_lock.py), names its pid, exit 1, and changes nothing; `down`
and `restart` meanwhile are refused the same way; the first goes on to a whole stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, down_and_reap
from tests.integration.test_end_to_end import cli

pytestmark = pytest.mark.timeout(180)


def started(surge_home, *args: str) -> subprocess.Popen:
    """`surgectl ARGS` running in its own session (stopped and continued by the test)."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli.surgectl", *args],
        cwd=REPO,
        env={**os.environ, "SURGE_HOME": str(surge_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_second_up_while_one_starts_the_stack_names_it_and_changes_nothing(surge_home):
    stack_json = surge_home / "run" / "stack.json"
    first = started(surge_home, "up", "--workers", "1", "--no-dashboard")
    stopped, down = False, None
    try:
        deadline = time.monotonic() + 90
        while not stack_json.exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.02)
        # Hold the first `up` mid-way (store and data spawned, no worker yet: the window the
        # trial hit by chance), whatever the machine's load.
        os.kill(first.pid, signal.SIGSTOP)
        stopped = True
        half = json.loads(stack_json.read_text())["services"]
        assert first.poll() is None and not any(n.startswith("worker") for n in half), half

        second = cli(surge_home, "up", "--workers", "1", "--no-dashboard", timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        line = second.stderr.strip()
        assert line.splitlines() == [line] and f"a `surgectl up` (pid {first.pid}) is starting this stack now" in line
        assert "changed nothing" in line and "surgectl down" not in line, line
        for refused in (["down"], ["restart", "store"]):
            r = cli(surge_home, *refused, timeout=60)
            assert r.returncode == 1 and f"(pid {first.pid}) is starting this stack now" in r.stderr, r.stderr
        assert json.loads(stack_json.read_text())["services"] == half  # nothing stopped, nothing started

        os.kill(first.pid, signal.SIGCONT)
        stopped = False
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0 and "stack is up" in out, out + err
        assert set(json.loads(stack_json.read_text())["services"]) == {"store", "data", "control", "worker-0"}
        again = cli(surge_home, "up", "--no-dashboard", timeout=60)  # (the lock went with the first)
        assert again.returncode == 0 and "already up" in again.stdout, again.stdout + again.stderr

        # A `down` holds it too (an operator's trial: an `up` during a `down`'s drain undid the
        # drain and, during its stop, left a second control on the journal): held mid-way, an
        # `up` and a `restart` are refused naming it, and change nothing.
        down = started(surge_home, "down")
        lock = surge_home / "run" / "up.lock"
        deadline = time.monotonic() + 60
        while lock.read_text().split() != [str(down.pid), "down"]:
            assert down.poll() is None and time.monotonic() < deadline, lock.read_text()
            time.sleep(0.01)
        os.kill(down.pid, signal.SIGSTOP)
        held = json.loads(stack_json.read_text()) if stack_json.exists() else None
        try:
            for refused in (["up", "--no-dashboard"], ["restart", "store"]):
                r = cli(surge_home, *refused, timeout=60)
                assert r.returncode == 1, r.stdout + r.stderr
                assert f"a `surgectl down` (pid {down.pid}) is stopping this stack now" in r.stderr, r.stderr
                assert "changed nothing" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
            assert (json.loads(stack_json.read_text()) if stack_json.exists() else None) == held  # (untouched)
        finally:
            os.kill(down.pid, signal.SIGCONT)
        out, err = down.communicate(timeout=120)
        assert down.returncode == 0 and "stopped" in out, out + err
        after = cli(surge_home, "up", "--workers", "1", "--no-dashboard", timeout=120)  # (released at its end)
        assert after.returncode == 0 and "stack is up" in after.stdout, after.stdout + after.stderr
    finally:
        if stopped:
            os.kill(first.pid, signal.SIGCONT)
        for proc in (first, down):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        down_and_reap(surge_home, cli)
