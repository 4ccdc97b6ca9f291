"""A pause and a stop delivered 5 s late to one rank, through the real control (issue 28 item 4).

The stack is the real one (`surgectl up`: control, data, store and 2 node agents of one rank
slot each, on loopback), started with ``SURGE_COMMAND_DELAY`` so that rank 1's session holds
every boundary command 5 s before handing it on (services/rank/command_delay.py); the job's
ranks are simulated (torch-free, services/rank/simulated/: the real session, data and store
protocols, the same boundary agreement in their step's collective round). Control names no
step: the ranks agree on one, rank 0 reports it, and both ranks pause and stop there, with
their checkpoints committed. Every process the stack started is killed by PID at the end.
(The engine's own test, with real gloo ranks and every boundary command kind:
tests/engine/test_boundary_agreement.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import down_and_reap, kill_all, processes_of_home
from tests.ports import free_ports
from tests.scale.test_simulated_ranks import cli, sim_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DELAY_S = 5.0
DELAY = f"PauseTraining+StopTraining:{DELAY_S:g}:rank=1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge")
    src = home / "corpus"
    shutil.copytree(
        Path(sysconfig.get_paths()["stdlib"]) / "json", src / "json", ignore=shutil.ignore_patterns("__pycache__")
    )
    prep = cli(home, "dataset", "prepare", "--name", "tiny", "--version", "v1", "--source", str(src))
    assert prep.returncode == 0, prep.stderr
    ports = free_ports(6)
    names = ("CONTROL", "DATA", "STORE")
    os.environ.update({f"SURGE_{n}_PORT": str(p) for n, p in zip(names, ports[:3], strict=True)})
    os.environ.update({f"SURGE_{n}_METRICS_PORT": str(p) for n, p in zip(names, ports[3:], strict=True)})
    os.environ["SURGE_COMMAND_DELAY"] = DELAY  # inherited by the node agents, so by their ranks
    try:
        up = cli(home, "up", "--workers", "2", timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        yield home
    finally:
        for n in names:
            os.environ.pop(f"SURGE_{n}_PORT", None)
            os.environ.pop(f"SURGE_{n}_METRICS_PORT", None)
        os.environ.pop("SURGE_COMMAND_DELAY", None)
        down_and_reap(home, cli)
        kill_all(processes_of_home(home))  # the ranks too: they inherit the stack's SURGE_HOME


def status(home: Path, job_id: str) -> dict:
    r = cli(home, "status", job_id, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def events(home: Path, job_id: str) -> list[str]:
    r = cli(home, "events", job_id, "-o", "json")
    assert r.returncode == 0, r.stderr
    return [json.loads(line)["message"] for line in r.stdout.splitlines() if line.strip()]


def wait_state(home: Path, job_id: str, state: str, within: float) -> dict:
    deadline = time.monotonic() + within
    while (s := status(home, job_id))["state"] != state and time.monotonic() < deadline:
        time.sleep(1)
    assert s["state"] == state, (s, events(home, job_id))
    return s


def test_a_pause_and_a_stop_5_s_late_to_one_rank_take_effect_at_one_boundary_with_their_checkpoints(stack, tmp_path):
    home = stack
    spec = {
        "name": "late",
        "steps": 100000,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256},
        "data": {"dataset": "tiny@v1", "seq_len": 32, "micro_batch_size": 2, "prefetch": {"threads": 1}},
        "parallel": {"dp": 2},
        "checkpoint": {"every_steps": 0, "at_end": False, "keep_last": 0},
        "eval": {"every_steps": 0, "at_end": False},
        "metrics": {"log_every": 0},
        "simulate": {"step_time_s": 0.05, "shard_bytes": 4096},
    }
    path = tmp_path / "late.yaml"
    path.write_text(yaml.safe_dump(spec))
    sub = cli(home, "submit", str(path))
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = sub.stdout.split("submitted ", 1)[1].split()[0]
    wait_state(home, job_id, "RUNNING", 120)

    t0 = time.monotonic()
    assert cli(home, "pause", job_id).returncode == 0
    paused = wait_state(home, job_id, "PAUSED", 60)
    assert time.monotonic() - t0 >= DELAY_S  # rank 1 held the pause 5 s; rank 0 trained on
    log = events(home, job_id)
    agreed = [m for m in log if m.startswith("pause: every rank agreed on after step ")]
    assert len(agreed) == 1, log
    at = int(agreed[0].rsplit(" ", 1)[1])
    assert f"RUNNING -> PAUSED: all ranks paused after step {at}" in log, log
    assert int(paused["step"]) == at

    assert cli(home, "resume", job_id).returncode == 0
    wait_state(home, job_id, "RUNNING", 30)
    time.sleep(1)
    assert cli(home, "stop", job_id).returncode == 0
    stopped = wait_state(home, job_id, "TERMINATED", 90)
    assert stopped["outcome"] == "STOPPED", stopped
    log = events(home, job_id)
    agreed = [m for m in log if m.startswith("stop: every rank agreed on after step ")]
    assert len(agreed) == 1, log
    end = int(agreed[0].rsplit(" ", 1)[1])
    assert end > at and int(stopped["step"]) == end
    assert not [m for m in log if "fault" in m.lower() and "no fault" not in m.lower()], log

    # Both ranks ended at that step; both checkpoints (the pause's, the stop's) committed.
    reports = sim_lines(home, job_id, "sim_report")
    assert sorted((r["rank"], r["outcome"], r["steps"]) for r in reports) == [(0, "stopped", end), (1, "stopped", end)]
    saves = sim_lines(home, job_id, "sim_save")
    assert sorted((s["step"], s["committed"]) for s in saves) == [(at, True), (end, True)], saves
