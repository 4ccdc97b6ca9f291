"""Issue 31 item 6 on a real stack (its own: one worker, the store's series linger cut to 5 s,
five of Prometheus's 1 s scrapes, a stack-wide webhook): a short job finishes; the real
Prometheus scrapes control's cluster gauges (jobs by state, queue, slots per worker) and the
data service's throughput and cache;
the webhook receives FINISHED; and the finished job's per-rank series leave the store's
/metrics once the linger is over (Prometheus saw them before)."""

from __future__ import annotations

import json
import shutil
import sysconfig
import time
import urllib.parse
import urllib.request

import pytest

from tests.conftest import down_and_reap
from tests.control.test_cluster_gauges import _Receiver
from tests.observability.conftest import _prometheus_binary, cli, scrape, start_prometheus, stop_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOB = """\
name: gauged
steps: 6
model: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}
parallel: {dp: 1}
checkpoint: {every_steps: 0}
eval: {every_steps: 0, at_end: false}
"""


def _query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    r = json.loads(urllib.request.urlopen(url, timeout=10).read().decode())
    assert r["status"] == "success", r
    return r["data"]["result"]


def _until(read, ok, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_cluster_gauges_webhook_and_finished_series_removal_on_a_real_stack(tmp_path):
    binary, skip = _prometheus_binary()
    if binary is None:
        pytest.skip(skip)
    home = tmp_path / "home"
    src = home / "corpus"
    shutil.copytree(
        sysconfig.get_paths()["stdlib"] + "/json", src / "json", ignore=shutil.ignore_patterns("__pycache__")
    )
    prep = cli(
        home, "dataset", "prepare", "--name", "tiny", "--version", "v1", "--source", str(src), "--val-fraction", "0.2"
    )
    assert prep.returncode == 0, prep.stderr
    hook = _Receiver()
    prom = None
    env = {"SURGE_STORE_SERIES_LINGER_SECONDS": "5", "SURGE_CONTROL_WEBHOOK": hook.url}
    try:
        up = cli(home, "up", "--workers", "1", env=env, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        services = json.loads((home / "run" / "stack.json").read_text())["services"]
        (home / "prom").mkdir()
        prom, url = start_prometheus(binary, home / "prom", services)
        spec = home / "job.yaml"
        spec.write_text(JOB)
        run = cli(home, "submit", str(spec), "--follow")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr
        job = run.stdout.split("submitted ", 1)[1].split()[0]

        # The webhook heard the end.
        _, _, body = hook.got.get(timeout=30)
        assert (body["job_id"], body["name"], body["outcome"], body["step"]) == (job, "gauged", "FINISHED", 6)

        # The real Prometheus scraped control's cluster gauges and the data service's metrics.
        def gauges():
            return {
                "terminated": _query(url, 'surge_jobs{state="TERMINATED"}'),
                "running": _query(url, 'surge_jobs{state="RUNNING"}'),
                "queue": _query(url, "surge_queue_length"),
                "wait": _query(url, "surge_queue_wait_seconds"),
                "used": _query(url, 'sum(surge_slots{kind="used"})'),
                "free": _query(url, 'sum(surge_slots{kind="free"})'),
                "batches": _query(url, 'surge_data_batches_total{dataset="tiny"}'),
                "tokens": _query(url, 'surge_data_tokens_total{dataset="tiny"}'),
                "cache": _query(url, "surge_data_cache_capacity_bytes"),
            }

        def value(result) -> float | None:
            return float(result[0]["value"][1]) if result else None

        got = _until(gauges, lambda g: value(g["terminated"]) == 1 and value(g["used"]) == 0 and all(g.values()))
        values = {k: value(v) for k, v in got.items()}
        assert values["terminated"] == 1 and values["running"] == 0, values
        assert values["queue"] == 0 and values["wait"] == 0, values
        assert values["used"] == 0 and values["free"] >= 1, values
        assert values["batches"] >= 6 and values["tokens"] > 0, values  # six steps of one rank, at least
        assert values["cache"] == 0  # no --remote: no block cache

        # Prometheus saw the job's per-rank series while they lived, to the last step ... (waited
        # for: a scrape during the run may be the latest when the webhook is heard; the next one,
        # at most a scrape interval later and well inside the linger, has the last step. ci27 read
        # the mid-run scrape's step 2 at once.)
        seen = _until(
            lambda: _query(url, f'last_over_time(surge_train_step{{job="{job}"}}[10m])'),
            lambda r: bool(r) and float(r[0]["value"][1]) == 6,
        )
        assert seen and float(seen[0]["value"][1]) == 6, seen
        # ... and the store drops them once the linger (5 s) is over.
        store = services["store"]["metrics_port"]
        left = _until(
            lambda: [ln for ln in scrape(store).splitlines() if f'job="{job}"' in ln and ln.startswith("surge_train")],
            lambda x: not x,
        )
        assert left == []
        assert _until(lambda: _query(url, f'surge_train_step{{job="{job}"}}'), lambda x: not x) == []
        assert hook.got.empty()  # one notice, no retry
    finally:
        if prom is not None:
            stop_process(prom)
        hook.close()
        down_and_reap(home, cli)
