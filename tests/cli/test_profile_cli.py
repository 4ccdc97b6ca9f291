"""`surgectl profile` against the real control plane (served on loopback in this process):
a profile whose rank is killed while the CLI waits ends with control's word that it is lost
(one line, exit 1), not a silent wait until --wait-seconds; `status -o json` says it lost."""

from __future__ import annotations

import json
import threading
import time

import pytest

from services.contract import engine_pb2
from tests.cli.test_queue_cli import run
from tests.control.conftest import Plane, drain, served_control, store_with_no_versions  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(60)


def test_a_profile_whose_rank_dies_is_lost_and_the_cli_says_so_exit_1(
    tmp_path,
    monkeypatch,
    capsys,
    store_with_no_versions,  # noqa: F811 - (the recovery's store answers at once)
):
    monkeypatch.setenv("SURGE_HOME", str(tmp_path))
    with served_control(tmp_path / "control.db", monkeypatch) as (control, _):
        plane = Plane(control)
        sessions = {w: plane.register(w) for w in ("wa", "wb")}
        job_id = plane.submit(dp=2, steps=20).job_id
        for rank, w in enumerate(sessions):
            plane.rank_event(sessions[w], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
        for s in sessions.values():
            drain(s)

        def kill_rank_0_once_asked():  # (SIGKILL of rank 0 after "asked", as its node agent reports it)
            deadline = time.monotonic() + 30
            while not plane.get(job_id).profiles and time.monotonic() < deadline:
                time.sleep(0.05)
            plane.rank_exited(sessions["wa"], job_id, 0, exit_code=-9)

        killer = threading.Thread(target=kill_rank_0_once_asked, daemon=True)
        killer.start()
        started = time.monotonic()
        code, out, err = run(monkeypatch, capsys, "profile", job_id, "--steps", "100", "--wait-seconds", "50")
        killer.join(timeout=10)
        assert time.monotonic() - started < 40  # (the old code: waited the whole 50 s, then "reported nothing")
        lines = err.strip().splitlines()
        assert code == 1 and lines == ["error: profile #1 lost: ranks relaunched (rank_exit of rank 0)"], (code, err)
        (asked,) = out.strip().splitlines()  # (no empty table of recorded ranks before the error)
        assert asked.startswith(f"{job_id}: profile #1 of the next 100 steps asked of 2 ranks"), out
        code, out, _ = run(monkeypatch, capsys, "status", job_id, "-o", "json")
        (shown,) = json.loads(out)
        assert code == 0 and shown["profiles"][0]["lost"] == "ranks relaunched (rank_exit of rank 0)"
