"""Shared fixtures: an isolated SURGE_HOME and process hygiene."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (read from /proc, no extra packages)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(d.name) != os.getpid():
            pids.append(int(d.name))
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def surge_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "surge"
    home.mkdir()
    monkeypatch.setenv("SURGE_HOME", str(home))
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS", "SURGE_DATA_ROOT", "SURGE_STORE_ROOT"):
        monkeypatch.delenv(var, raising=False)
    return home
