"""The dashboard at the scale users train at (issue 31): a job page and a 2-job compare page
of a job of N steps x R ranks, read through a real store.

    PYTHONPATH=$PWD .venv/bin/python bench/dashboard_scale.py [--sizes 10000x8,100000x64]
        [--loads 3] [--json OUT] [--work DIR]

For each size: a synthetic metrics file (``<store root>/metrics/<job>.jsonl``, the metrics
logger's exact line format, about 600 bytes a step record: every field of StepCompleted;
a loss that falls with noise and a spike every 7,919 steps, an evaluation record every 1,000
steps and a sample every 5,000) written whole, not rotated (``SURGE_STORE_METRICS_MAX_BYTES=0``:
the worst case; the default bound keeps a job's files under 5 x 128 MiB); the compare page's
second job is a symlink to the first's file (the same bytes read twice: no second write).
The real ``python -m services.store`` process on loopback serves it; the dashboard is this
process (``Dashboard`` over ``Sources``, the pages drawn as the HTTP server draws them, without
the socket), its control calls answered from canned messages (one RUNNING job of world size
R, no events, no log lines): this bench measures the records' path, not control's.

Measured per page, each of ``--loads`` loads (the first is cold: the store's scan and the chart
cache start empty; the later ones are reloads of the unchanged job; the compare page's first
job is the job page's, read already): bytes of the page, seconds, the store's and this
process's peak RSS during the load (``VmHWM`` after writing ``5`` to ``/proc/PID/clear_refs``, which resets it), the points
the loss chart draws (``data-points``: 0 when the page drew no curve, e.g. the store's read
missed its deadline), and the load average (``/proc/loadavg``) beside each. Results in
bench/results/dashboard_scale.json, a table on stdout. Runs against any commit's dashboard
(the same ``Sources`` / ``Dashboard`` calls): the figures before the fix came from this file
run in a worktree of the commit before it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.contract import control_pb2  # noqa: E402
from services.dashboard.server import Dashboard  # noqa: E402
from tests.dashboard.synthetic_records import StoreOnlySources, write_job  # noqa: E402
from tests.ports import free_ports  # noqa: E402

RESULTS = REPO / "bench" / "results" / "dashboard_scale.json"


def peak_reset(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def measure(page, store_pid: int, loads: int) -> dict:
    """Load ``page`` (a callable returning the page) ``loads`` times (module docstring)."""
    runs = []
    for _ in range(loads):
        peak_reset(os.getpid())
        peak_reset(store_pid)
        load = load_average()
        t0 = time.perf_counter()
        try:
            text, error = page(), ""
        except Exception as e:  # noqa: BLE001 - a page that fails is a figure too
            text, error = "", f"{type(e).__name__}: {e}"[:200]
        seconds = time.perf_counter() - t0
        m = re.search(r'id="chart-loss" data-points="(\d+)"', text)
        runs.append(
            {
                "bytes": len(text.encode()),
                "seconds": round(seconds, 3),
                "store_peak_mib": round(peak_mib(store_pid), 1),
                "dashboard_peak_mib": round(peak_mib(os.getpid()), 1),
                "loss_points": int(m.group(1)) if m else 0,
                "load_1m": load,
                "error": error,
            }
        )
    rest = runs[1:] or runs
    return {
        "first": runs[0],
        "median_seconds": round(statistics.median(r["seconds"] for r in rest), 3),
        "seconds_each": [r["seconds"] for r in runs],
        "bytes": rest[-1]["bytes"],
        "store_peak_mib": max(r["store_peak_mib"] for r in runs),
        "dashboard_peak_mib": max(r["dashboard_peak_mib"] for r in runs),
        "loss_points": rest[-1]["loss_points"],
        "load_1m": [r["load_1m"] for r in runs],
        "errors": sorted({r["error"] for r in runs if r["error"]}),
    }


def start_store(root: Path) -> tuple[subprocess.Popen, int]:
    port, metrics_port = free_ports(2)
    env = {**os.environ, "SURGE_HOME": str(root / "home"), "SURGE_STORE_METRICS_MAX_BYTES": "0"}
    log = open(root / "store.log", "wb")  # noqa: SIM115 - the process's, closed with it
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.store", "--host", "127.0.0.1", "--port", str(port)]
        + ["--metrics-port", str(metrics_port), "--root", str(root / "store")],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000x8,100000x64", help="STEPSxRANKS,...")
    ap.add_argument("--loads", type=int, default=3, help="loads of each page (the first is cold)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--work", type=Path, default=None, help="where the store's files go (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="surge-dash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    proc, port = start_store(work)
    results = []
    try:
        for size in args.sizes.split(","):
            steps, ranks = (int(v) for v in size.lower().split("x"))
            job, other = f"big-{steps}x{ranks}", f"big-{steps}x{ranks}-b"
            metrics = work / "store" / "metrics"
            t0 = time.perf_counter()
            written = write_job(metrics / f"{job}.jsonl", job, steps, ranks)
            (metrics / f"{other}.jsonl").unlink(missing_ok=True)
            (metrics / f"{other}.jsonl").symlink_to(f"{job}.jsonl")
            wrote_s = time.perf_counter() - t0
            statuses = {
                j: control_pb2.JobStatus(
                    job_id=j,
                    name=j,
                    state=control_pb2.RUNNING,
                    step=steps,
                    total_steps=steps,
                    world_size=ranks,
                    dp=ranks,
                )
                for j in (job, other)
            }
            sources = StoreOnlySources(f"127.0.0.1:{port}", statuses)
            dash = Dashboard(sources)
            try:
                row = {
                    "steps": steps,
                    "ranks": ranks,
                    "file_bytes": written,
                    "write_seconds": round(wrote_s, 1),
                    "job_page": measure(lambda d=dash, j=job: d.job(j, {}), proc.pid, args.loads),
                    "compare_page": measure(
                        lambda d=dash, pair=[job, other]: d.compare({"job": pair}), proc.pid, args.loads
                    ),
                }
            finally:
                sources.close()
            results.append(row)
            print(json.dumps(row), flush=True)
            (metrics / f"{job}.jsonl").unlink()
            (metrics / f"{other}.jsonl").unlink()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"results": results}, indent=1) + "\n")
    print(
        f"\n{'size':>12} {'file MB':>8} {'page':>8} {'KB':>8} {'s each load':>22} {'store MiB':>9} {'dash MiB':>9} {'points':>7} load"
    )
    for r in results:
        for name in ("job_page", "compare_page"):
            m = r[name]
            print(
                f"{r['steps']}x{r['ranks']:<6} {r['file_bytes'] / 1e6:8.0f} {name[:-5]:>8} {m['bytes'] / 1e3:8.0f} "
                f"{' '.join(f'{x:.2f}' for x in m['seconds_each']):>22} {m['store_peak_mib']:9.0f} {m['dashboard_peak_mib']:9.0f} "
                f"{m['loss_points']:7d} {m['load_1m']}" + (f"  errors: {m['errors']}" if m["errors"] else "")
            )
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
