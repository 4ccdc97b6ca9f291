"""Warm spare rank processes (services/worker/warm_spares.py, spare_rank.py): a spare pays for
the interpreter and the rank's imports before any rank is needed, then becomes the rank it is
told, with that rank's arguments, environment and log file. Real processes."""

from __future__ import annotations

import os
import time

import pytest

from services.worker.rank_process import REPO_ROOT
from services.worker.warm_spares import WarmSpares

pytestmark = pytest.mark.timeout(120)


def spare_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def test_a_spare_becomes_the_rank_it_is_told_with_its_arguments_environment_and_log(tmp_path):
    spares = WarmSpares(spare_env(), REPO_ROOT, tmp_path / "spares.log", size=1)
    try:
        spares.keep_warm()
        time.sleep(0.5)  # (taken while it may still import: the order waits on its stdin)
        log = tmp_path / "rank.log"
        proc = spares.take(["--help"], {**spare_env(), "SURGE_TEST_MARK": "1"}, log)
        assert proc is not None
        assert proc.wait(timeout=90) == 0
        assert "usage: python -m services.rank" in log.read_text()
        assert spares.take(["--help"], spare_env(), log) is None  # one spare, now used
    finally:
        spares.close()


def test_retired_spares_end_and_none_starts_after_close(tmp_path):
    spares = WarmSpares(spare_env(), REPO_ROOT, tmp_path / "spares.log", size=2)
    spares.keep_warm()
    procs = spares.processes
    assert len(procs) == 2
    spares.retire()
    assert all(p.wait(timeout=30) is not None for p in procs)
    spares.close()
    spares.keep_warm()
    assert spares.take(["--help"], spare_env(), tmp_path / "x.log") is None


def test_a_refill_after_a_launch_waits_and_a_retire_cancels_it(tmp_path):
    # The refill's import must not compete with the ranks a launch just started
    # (warm_spares.py): nothing starts before the delay, one spare after it, none once retired.
    spares = WarmSpares(spare_env(), REPO_ROOT, tmp_path / "spares.log", size=1)
    try:
        spares.keep_warm(after=0.6)
        time.sleep(0.3)
        assert spares.processes == []
        deadline = time.monotonic() + 10
        while not spares.processes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(spares.processes) == 1
        spares.retire()
        spares.keep_warm(after=0.3)
        spares.retire()  # before it is due
        time.sleep(0.8)
        assert spares.processes == []
    finally:
        spares.close()
