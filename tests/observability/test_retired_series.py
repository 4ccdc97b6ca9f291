"""Issue 31 item 6 on a real stack (its own: two workers, the store's series linger cut to 5 s):
a rank SIGKILLed mid-run never sends its loop's StopLogCollection, and the job's end, decided by
control (FAILED here: no restart allowed), retires the job's series: none of them is left on
the store's /metrics once the linger is over (before L1-1's RetireMetricSeries they stayed
until the store restarted)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sysconfig
import time

import pytest

from tests.conftest import down_and_reap, processes_with
from tests.observability.conftest import cli, scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = """\
name: killed
steps: 100000
model: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}
parallel: {dp: 2}
checkpoint: {every_steps: 0}
eval: {every_steps: 0, at_end: false}
fault_policy: {max_restarts: 0}
"""


def _until(read, ok, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_a_sigkilled_rank_s_series_leave_the_store_s_metrics_once_control_ends_the_job(tmp_path):
    home = tmp_path / "home"
    src = home / "corpus"
    shutil.copytree(
        sysconfig.get_paths()["stdlib"] + "/json", src / "json", ignore=shutil.ignore_patterns("__pycache__")
    )
    prep = cli(
        home, "dataset", "prepare", "--name", "tiny", "--version", "v1", "--source", str(src), "--val-fraction", "0.2"
    )
    assert prep.returncode == 0, prep.stderr
    try:
        up = cli(home, "up", "--workers", "2", env={"SURGE_STORE_SERIES_LINGER_SECONDS": "5"}, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        store = json.loads((home / "run" / "stack.json").read_text())["services"]["store"]["metrics_port"]
        spec = home / "job.yaml"
        spec.write_text(JOB)
        run = cli(home, "submit", str(spec))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr
        job = run.stdout.split("submitted ", 1)[1].split()[0]

        def series() -> list[str]:
            return [ln for ln in scrape(store).splitlines() if f'job="{job}"' in ln and ln.startswith("surge_")]

        # Both ranks' series are on the store's /metrics while the job runs ...
        live = _until(series, lambda s: any('rank="1"' in ln for ln in s) and any('rank="0"' in ln for ln in s), 120)
        assert any('rank="1"' in ln for ln in live), live
        # ... rank 1 dies without its loop's end (no StopLogCollection) ...
        (pid,) = processes_with(f"--job {job} --rank 1")
        os.kill(pid, signal.SIGKILL)

        def state() -> dict:
            got = cli(home, "status", job, "-o", "json")
            listed = json.loads(got.stdout) if got.returncode == 0 else []
            return listed[0] if listed else {}

        ended = _until(state, lambda s: s.get("state") == "TERMINATED", 90)
        assert (ended.get("state"), ended.get("outcome")) == ("TERMINATED", "FAILED"), ended
        # ... and control's end of the job retires every series of it (the linger is 5 s).
        left = _until(series, lambda s: not s, 30)
        assert left == [], left[:5]
        # The records stay in the job's file.
        lines = (home / "store" / "metrics" / f"{job}.jsonl").read_text().splitlines()
        assert {json.loads(x)["rank"] for x in lines if json.loads(x).get("type") == "step"} == {0, 1}
    finally:
        down_and_reap(home, cli)
