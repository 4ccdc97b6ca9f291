"""Messages and bytes per training step at control (issue 28 item 3), on a real stack.

    .venv/bin/python bench/control_messages.py [--only dp2,sim64] [--warmup 10] [--window 30]
        [--out bench/results/control_messages.json]

Reads control's ``surge_control_messages_total{direction,kind}`` and
``surge_control_bytes_total{direction,kind}`` (every message of the node agents'
WorkerSession streams, in and out, by the message it carries: services/control/metrics.py)
from its /metrics at two points of a running job, and divides by the steps rank 0 completed
between them (the job's ``status.step``):

* ``dp2``: the demo model (bench/jobs/throughput.yaml) at dp 2 on two node agents, real
  rank processes (torch, gloo), under .surge/bench;
* ``sim64``: 64 simulated ranks (services/rank/simulated: torch-free processes speaking the
  real RankSession, data and store protocols; a sleep for the compute) on four node agents
  of 16 slots, as bench/scale.py runs them, under .surge/bench-scale.

The window starts after ``--warmup`` steps (set-up traffic excluded) and lasts ``--window``
steps. Results: bench/results/control_messages.json (a run's entry replaced, the others kept) and a
table on stdout (per step, in and
out, the kinds that make up most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from bench.control_bench import scrape  # noqa: E402


def job_step(job_id: str) -> tuple[int, int]:
    """(rank 0's last completed step, JobState) of the job."""
    status = c.job_status(job_id)
    return int(status.step), int(status.state)


def measure(job_id: str, metrics_port: int, warmup: int, window: int, timeout_s: float) -> dict:
    """Counters at step >= ``warmup`` and at ``warmup + window`` (or the job's end), per step."""
    from services.contract import control_pb2

    deadline = time.time() + timeout_s

    def wait_step(target: int) -> tuple[int, dict, float]:
        while time.time() < deadline:
            step, state = job_step(job_id)
            if step >= target or state == control_pb2.TERMINATED:
                return step, scrape(metrics_port), time.time()
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} did not reach step {target} in {timeout_s:.0f} s")

    s0, a, t0 = wait_step(warmup)
    s1, b, t1 = wait_step(warmup + window)
    steps = s1 - s0
    if steps <= 0:
        raise RuntimeError(f"job {job_id}: no step completed in the window (step {s0} -> {s1})")
    out: dict = {
        "steps": steps,
        "from_step": s0,
        "seconds": round(t1 - t0, 2),
        "step_seconds": round((t1 - t0) / steps, 3),
    }
    for direction in ("in", "out"):
        msgs = {
            k.split(":", 1)[1]: v - a["messages"].get(k, 0.0)
            for k, v in b["messages"].items()
            if k.startswith(direction + ":")
        }
        size = {
            k.split(":", 1)[1]: v - a["bytes"].get(k, 0.0)
            for k, v in b["bytes"].items()
            if k.startswith(direction + ":")
        }
        out[f"messages_{direction}_per_step"] = round(sum(msgs.values()) / steps, 2)
        out[f"bytes_{direction}_per_step"] = round(sum(size.values()) / steps, 1)
        out[f"by_kind_{direction}"] = {
            k: {"messages": round(msgs[k] / steps, 2), "bytes": round(size.get(k, 0.0) / steps, 1)}
            for k in sorted(msgs, key=lambda k: -msgs[k])
            if msgs[k] > 0
        }
    out["journal_commits_per_step"] = round((b["journal_commits"] - a["journal_commits"]) / steps, 2)
    return out


def dp2(args) -> dict:
    c.setup_env()
    spec = c.write_spec(
        c.REPO / "bench/jobs/throughput.yaml",
        "control-messages-dp2",
        steps=args.warmup + args.window + 20,
        parallel={"dp": 2, "backend": "auto", "threads_per_rank": 1},
    )
    with c.Stack(workers=2) as stack:
        job_id, _ = c.submit(spec)
        out = {"job": "demo model, dp 2, two node agents", "ranks": 2, "node_agents": 2}
        out.update(measure(job_id, stack.procs["control"].metrics_port, args.warmup, args.window, args.timeout))
        return out


def sim64(args) -> dict:
    import yaml

    from bench import scale

    scale.HOME.mkdir(parents=True, exist_ok=True)
    scale.prepare_corpus()
    for f in scale.HOME.glob("control.db*"):
        f.unlink()
    env = scale.stack_env(16)
    up = subprocess.run(
        [*scale.SURGECTL, "up", "--workers", "4"], cwd=c.REPO, env=env, capture_output=True, text=True, timeout=300
    )
    if up.returncode != 0:
        return {"error": f"surgectl up: {(up.stdout + up.stderr).strip()[-500:]}"}
    pids = scale.stack_pids()
    try:
        os.environ["SURGE_HOME"] = str(scale.HOME)
        for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
            os.environ.pop(var, None)
        steps = args.warmup + args.window + 20
        spec = scale.job_spec("control-messages-sim64", 64, steps, steps, args.step_time, 64 << 10)
        path = scale.HOME / "jobs" / "control-messages-sim64.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        r = scale.cli("submit", str(path))
        if r.returncode != 0:
            return {"error": f"submit: {r.stderr.strip()[-500:]}"}
        job_id = r.stdout.split("submitted ", 1)[1].split()[0]
        metrics_port = json.loads((scale.HOME / "run" / "stack.json").read_text())["services"]["control"][
            "metrics_port"
        ]
        out = {
            "job": f"64 simulated ranks (step {args.step_time} s), four node agents of 16",
            "ranks": 64,
            "node_agents": 4,
        }
        out.update(measure(job_id, metrics_port, args.warmup, args.window, args.timeout))
        return out
    finally:
        scale.kill_stack(pids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="dp2,sim64", help="comma-separated: dp2, sim64")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the window (set-up excluded)")
    ap.add_argument("--window", type=int, default=30, help="steps measured")
    ap.add_argument("--step-time", type=float, default=0.5, help="sim64: simulate.step_time_s")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take to reach the window's end")
    ap.add_argument("--out", default=str(c.RESULTS / "control_messages.json"))
    args = ap.parse_args()
    runs = {"dp2": dp2, "sim64": sim64}
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if any(s not in runs for s in only):
        sys.exit(f"--only: unknown run {next(s for s in only if s not in runs)!r} (dp2, sim64)")
    if args.warmup < 1 or args.window < 1:
        sys.exit("--warmup and --window: must be >= 1")
    results = {}
    for name in only:
        print(f"[control messages] {name} ...", flush=True)
        results[name] = {**runs[name](args), "machine": c.machine(), "args": vars(args)}
        print(json.dumps(results[name]), flush=True)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["results"] = {**doc.get("results", {}), **results}  # the runs not run now keep their last figures
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append((name, r["error"][:80], "", "", "", ""))
            continue
        top = ", ".join(f"{k} {v['messages']:g}" for k, v in list(r["by_kind_in"].items())[:4])
        rows.append(
            (
                f"{name} ({r['ranks']} ranks, {r['node_agents']} agents)",
                f"{r['messages_in_per_step']:g} / {r['bytes_in_per_step']:.0f}",
                f"{r['messages_out_per_step']:g} / {r['bytes_out_per_step']:.0f}",
                f"{r['journal_commits_per_step']:g}",
                top,
                f"{r['steps']} steps, {r['step_seconds']} s/step",
            )
        )
    print(
        c.table(
            rows,
            (
                "run",
                "in: msgs / bytes per step",
                "out: msgs / bytes per step",
                "journal commits/step",
                "in by kind (msgs/step)",
                "window",
            ),
        )
    )
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
