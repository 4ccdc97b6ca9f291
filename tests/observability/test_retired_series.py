"""Issue 31 item 6 on a real stack (its own: two workers, the store's series linger cut to 5 s;
one stack for this file's two tests).

* A rank SIGKILLed mid-run never sends its loop's StopLogCollection, and the job's end, decided
  by control (FAILED here: no restart allowed), retires the job's series: none of them is left
  on the store's /metrics once the linger is over (before L1-1's RetireMetricSeries they stayed
  until the store restarted).
* A job that finishes with checkpoints: once the linger is over no series labelled with the
  job is left on the store's /metrics (L5-2's per-rank series, and L5-1's surge_checkpoint_*
  through RetireCheckpointSeries: before session 33 these stayed) nor on control's (its
  surge_rank_slowdown_ratio{job, rank}, removed when the rank's process ends).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sysconfig
import threading
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


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A stack of two workers whose store removes a retired series 5 s after its end."""
    home = tmp_path_factory.mktemp("retired") / "home"
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
        yield home
    finally:
        down_and_reap(home, cli)


def _metrics_port(home, service: str) -> int:
    return json.loads((home / "run" / "stack.json").read_text())["services"][service]["metrics_port"]


def _submit(home, spec: str) -> str:
    path = home / "job.yaml"
    path.write_text(spec)
    run = cli(home, "submit", str(path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    return run.stdout.split("submitted ", 1)[1].split()[0]


def _state(home, job: str) -> dict:
    got = cli(home, "status", job, "-o", "json")
    listed = json.loads(got.stdout) if got.returncode == 0 else []
    return listed[0] if listed else {}


def _labelled(port: int, job: str) -> list[str]:
    """The series on a /metrics page with a label whose value is ``job`` (``job`` or ``job_id``)."""
    return [
        ln
        for ln in scrape(port).splitlines()
        if not ln.startswith("#") and (f'job="{job}"' in ln or f'job_id="{job}"' in ln)
    ]


def test_a_sigkilled_rank_s_series_leave_the_store_s_metrics_once_control_ends_the_job(home):
    store = _metrics_port(home, "store")
    job = _submit(home, JOB)

    def series() -> list[str]:
        return [ln for ln in scrape(store).splitlines() if f'job="{job}"' in ln and ln.startswith("surge_")]

    # Both ranks' series are on the store's /metrics while the job runs ...
    live = _until(series, lambda s: any('rank="1"' in ln for ln in s) and any('rank="0"' in ln for ln in s), 120)
    assert any('rank="1"' in ln for ln in live), live
    # ... rank 1 dies without its loop's end (no StopLogCollection) ...
    (pid,) = processes_with(f"--job {job} --rank 1")
    os.kill(pid, signal.SIGKILL)

    ended = _until(lambda: _state(home, job), lambda s: s.get("state") == "TERMINATED", 90)
    assert (ended.get("state"), ended.get("outcome")) == ("TERMINATED", "FAILED"), ended
    # ... and control's end of the job retires every series of it (the linger is 5 s).
    left = _until(series, lambda s: not s, 30)
    assert left == [], left[:5]
    # The records stay in the job's file.
    lines = (home / "store" / "metrics" / f"{job}.jsonl").read_text().splitlines()
    assert {json.loads(x)["rank"] for x in lines if json.loads(x).get("type") == "step"} == {0, 1}


FINISHING = """\
name: finishing
steps: 12
model: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}
parallel: {dp: 2}
checkpoint: {every_steps: 4, keep_last: 2}
eval: {every_steps: 6, batches: 1}
"""


def test_a_finished_job_leaves_no_series_of_its_own_on_the_store_s_or_control_s_metrics(home):
    store, control = _metrics_port(home, "store"), _metrics_port(home, "control")
    job = _submit(home, FINISHING)
    seen: set[str] = set()  # the names of the job's series seen while it ran
    done = threading.Event()

    def watch() -> None:  # (its own pace: a `status` of a loaded host can take seconds, the linger is 5 s)
        while not done.wait(0.2):
            with contextlib.suppress(OSError):
                seen.update(ln.split("{", 1)[0] for ln in _labelled(store, job) + _labelled(control, job))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ended = _until(lambda: _state(home, job), lambda s: s.get("state") == "TERMINATED", 180)
    finally:
        done.set()
        watcher.join(10)
    assert (ended.get("state"), ended.get("outcome")) == ("TERMINATED", "FINISHED"), ended
    # L5-1's series of the job were there (its commits): the retire has something to remove.
    seen.update(ln.split("{", 1)[0] for ln in _labelled(store, job))
    assert "surge_checkpoint_commits_total" in seen, sorted(seen)
    # Once the linger (5 s) is over, nothing on either page names the job.
    left = _until(lambda: _labelled(store, job) + _labelled(control, job), lambda s: not s, 60)
    assert left == [], left[:10]
