"""What a resize costs when its boundary is a checkpoint step (session 30, scalesave30): every
pause waits for the asynchronous save in flight to be committed before the ranks report
paused, so that the resize that follows never drops it with the replaced group.

    .venv/bin/python bench/resize_save.py [--rounds 2] [--every 1 0] [--label new]

The demo job (examples/jobs/demo.yaml: 0.8 M parameters, dp 2, ~11 MB a checkpoint) on a
real stack of two workers, once per ``--every`` (``checkpoint.every_steps``: 1, every
boundary a save, so every scale pauses with one in flight; 0, none). Each round scales
dp 2 -> 1 and back (`surgectl scale`), a few steps apart. Per scale: control's own figure
(the `scale` event's "X s after it was asked": from the request to every rank of the new
group ready); what rank 0's pause waited for the save in flight (its log line
``saves_settled_for_pause``; none before the change); the gap between rank 0's step records
around the boundary (the end of the boundary step to the end of the first step after it,
wall clock) against the median step interval before the first scale and between the scales
(the first step after each left out); whether the boundary's checkpoint was committed (the
store's versions) or reported dropped. Run it on the code before the change with another
``--label`` to compare (the same machine, the same load: the load is printed). Results in
bench/results/resize_save[-LABEL].json, a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    BENCH_HOME,
    Stack,
    fmt,
    job_events,
    job_status,
    machine,
    save,
    setup_env,
    submit,
    summary,
    surge_steps,
    table,
    write_spec,
)
from services.contract import control_pb2  # noqa: E402

SURGECTL = [sys.executable, "-m", "services.cli.surgectl"]
GAP_STEPS = 5  # steps trained between two scales


def surgectl(*args: str) -> str:
    done = subprocess.run([*SURGECTL, *args], cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"surgectl {' '.join(args)}: exit {done.returncode}: {done.stdout}{done.stderr}")
    return done.stdout


def wait_step(job_id: str, step: int, timeout_s: float = 300) -> None:
    end = time.time() + timeout_s
    while job_status(job_id).step < step:
        if time.time() > end:
            raise TimeoutError(f"{job_id} did not reach step {step}")
        time.sleep(0.1)


def one_job(every: int, rounds: int) -> list[dict]:
    spec = write_spec(
        REPO / "examples" / "jobs" / "demo.yaml",
        f"rzsave-every{every}",
        steps=5000,
        checkpoint={"every_steps": every, "keep_last": 0, "at_end": False},
        eval={"every_steps": 0, "batches": 8, "at_end": False},
    )
    job, _ = submit(spec)
    wait_step(job, 10)
    scales = []
    for _ in range(rounds):
        for dp, was in ((1, 2), (2, 1)):
            out = surgectl("scale", job, "--dp", str(dp))
            said = f"scale by the operator done: dp {was} -> {dp} at step "
            tail = out.split(said)[1]
            step = int(tail.split()[0].rstrip(";:,"))
            seconds = float(tail.split(" s after it was asked")[0].rsplit(" ", 1)[1])
            scales.append({"dp": f"{was}->{dp}", "step": step, "control_s": seconds})
            wait_step(job, step + GAP_STEPS)
    surgectl("stop", job, "--no-checkpoint")
    end = time.time() + 120
    while job_status(job).state != control_pb2.TERMINATED and time.time() < end:
        time.sleep(0.2)
    records = {r["step"]: r for r in surge_steps(job).get(0, [])}  # (the last record of a step wins)
    first = scales[0]["step"]
    intervals = [records[s]["unix_time"] - records[s - 1]["unix_time"] for s in range(3, first) if s - 1 in records]
    step_s = statistics.median(intervals)
    after = [  # the steps between scales, the first after each boundary left out (its gap is the resize's)
        records[s]["unix_time"] - records[s - 1]["unix_time"]
        for sc in scales
        for s in range(sc["step"] + 2, sc["step"] + GAP_STEPS + 1)
        if s in records and s - 1 in records
    ]
    saved = {v["step"] for v in json.loads(surgectl("checkpoints", job, "-o", "json"))}
    dropped = [e.message for e in job_events(job) if "dropped with the replaced group" in e.message]
    waited = rank_log_waits(job)
    for s in scales:
        b = s["step"]
        s["pause_waited_s"] = waited.get(b)  # (absent before the change: nothing waited)
        s["gap_s"] = (
            records[b + 1]["unix_time"] - records[b]["unix_time"] if b + 1 in records and b in records else None
        )
        s["committed"] = b in saved
    return [
        {
            "every": every,
            "job": job,
            "step_interval_s": step_s,
            "step_interval_after_s": statistics.median(after) if after else None,
            "scales": scales,
            "dropped": dropped,
        }
    ]


def rank_log_waits(job_id: str) -> dict[int, float]:
    """step -> the seconds rank 0's pause at that step waited for the save in flight (its
    ``saves_settled_for_pause`` log line)."""
    path = BENCH_HOME / "run" / "logs" / f"{job_id}.rank0.log"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if '"saves_settled_for_pause"' in line:
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["seconds"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    setup_env()
    result = {"machine": machine(), "jobs": []}
    with Stack(workers=2):
        for every in args.every:
            result["jobs"] += one_job(every, args.rounds)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for j in result["jobs"]:
        control = summary([s["control_s"] for s in j["scales"]])
        gaps = summary([s["gap_s"] for s in j["scales"] if s["gap_s"] is not None])
        kept = sum(s["committed"] for s in j["scales"])
        waits = summary([s["pause_waited_s"] for s in j["scales"] if s["pause_waited_s"] is not None])
        rows.append(
            (
                f"every {j['every']}",
                fmt(control, " s"),
                fmt(gaps, " s"),
                f"{j['step_interval_s']:.2f} s / {j['step_interval_after_s'] or float('nan'):.2f} s",
                fmt(waits, " s", 3),
                f"{kept}/{len(j['scales'])}" if j["every"] else "-",
                str(len(j["dropped"])),
            )
        )
    header = (
        "checkpoint",
        "scale, control (median, min-max)",
        "boundary gap",
        "step interval before / after",
        "pause waited for the save",
        "kept",
        "dropped",
    )
    print(table(rows, header))
    print(f"load at start {result['machine']['loadavg_at_start']}, at end {result['machine']['loadavg_at_end']}")
    print(f"saved to {save('resize_save' + (f'-{args.label}' if args.label else ''), result)} (home {BENCH_HOME})")


if __name__ == "__main__":
    main()
