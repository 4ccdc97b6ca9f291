"""Rank start-up: forked from the node agent's rank fork server vs a new interpreter.

    python -m bench.rank_start [--jobs N]          (make bench-rank-start)

For each mode of ``SURGE_WORKER_RANK_FORKSERVER`` (``off``: every rank a new interpreter;
``lazy``: forked from the fork server, the default) one stack of two one-slot node agents
runs N dp=2 jobs of a few steps one after another, and reports from each job's events:

* submit -> first step (placement, the ranks' processes and imports, model, process group);
* each rank's own start-up as it reports it (``rank N ready ... X s start-up``: from its
  ``main``, after its imports, to ready: model, process group);
* the CPU seconds the whole machine spent from submit to the job's end, per job.

The first job of ``lazy`` includes the fork server's own imports (it starts with the node's
first launch); the later ones show a warm node. Results: bench/results/rank_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

from bench import common as c

BASE = c.REPO / "examples" / "jobs" / "demo.yaml"
RESULTS = c.REPO / "bench" / "results" / "rank_start.json"
START_UP = re.compile(r"rank (\d+) ready at step \d+ \(.*?([\d.]+) s start-up\)")


def busy_cpu_seconds() -> float:
    """CPU seconds the machine has spent (all cores, all processes) since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_job(name: str, steps: int) -> dict:
    spec = c.write_spec(BASE, name, steps=steps, parallel={"dp": 2}, checkpoint={"every_steps": 0, "at_end": False})
    cpu0 = busy_cpu_seconds()
    job, t0 = c.submit(spec)
    c.wait_job(job, timeout_s=600)
    cpu = busy_cpu_seconds() - cpu0
    events = c.job_events(job)
    starts = [float(m.group(2)) for e in events if (m := START_UP.search(e.message))]
    first = next(e.unix_time for e in events if e.type == "step")
    return {"job": job, "rank_start_s": starts, "submit_to_first_step_s": round(first - t0, 2), "cpu_s": round(cpu, 1)}


def run_mode(mode: str, jobs: int, steps: int) -> list[dict]:
    os.environ["SURGE_WORKER_RANK_FORKSERVER"] = mode  # read by the node agents `surgectl up` starts
    rows = []
    with c.Stack(workers=2):
        time.sleep(3.0)  # (the services' own start-up settles)
        for i in range(jobs):
            rows.append(one_job(f"start-{mode}-{i}", steps))
            print(mode, rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="jobs per mode, one after another")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    c.setup_env()
    result = {"jobs": args.jobs, "steps": args.steps, "load_before": os.getloadavg()[0]}
    for mode in ("off", "lazy"):
        rows = run_mode(mode, args.jobs, args.steps)
        warm = rows[1:] or rows
        result[mode] = {
            "rows": rows,
            "first_job_rank_start_s": rows[0]["rank_start_s"],
            "later_rank_start_median_s": statistics.median(s for r in warm for s in r["rank_start_s"]),
            "later_submit_to_first_step_median_s": statistics.median(r["submit_to_first_step_s"] for r in warm),
            "later_cpu_s_median": statistics.median(r["cpu_s"] for r in warm),
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for mode in ("off", "lazy"):
        r = result[mode]
        print(
            f"{mode:>4}: first job's ranks {r['first_job_rank_start_s']} s; later jobs: rank start-up "
            f"{r['later_rank_start_median_s']:.2f} s, submit -> first step {r['later_submit_to_first_step_median_s']:.2f} s, "
            f"machine CPU per job {r['later_cpu_s_median']:.1f} s (medians)"
        )


if __name__ == "__main__":
    main()
