"""What `surgectl profile` costs a running job (issue 31 item 3: "the profiler's overhead"),
measured on a real stack.

    .venv/bin/python bench/profile_overhead.py [--steps 5] [--warmup 20] [--out bench/results/profile_overhead.json]

Runs the demo model of ``make bench`` (bench/jobs/throughput.yaml: dp 2, gloo, two node
agents), asks for a profile of ``--steps`` steps once rank 0 passed ``--warmup`` steps
(through surgectl's own code), and reads every rank's step records from the store's metrics
file: the profiled steps' time against the median of the ``--steps`` x 4 steps before them
(the overhead while tracing), the job's tokens/s without the profiler (those steps) and with
it (the traced steps) and the throughput lost (%), the boundary step after the profile against
the same median (the trace's export and upload, which run at that boundary), and each rank's
trace size. The load average at the start and the end is recorded: on a shared 2-core host the
profiler's threads compete with everything else (session 26: +3-6 %; session 31: +53 %).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"


def measure(steps: int, warmup: int, timeout_s: float) -> dict:
    from services.cli import clients
    from services.contract import control_pb2

    c.setup_env()
    with c.Stack(workers=2):
        spec = c.write_spec(SPEC, "profiled", steps=warmup + 8 * steps + 20)
        job, _ = c.submit(spec)
        deadline = time.time() + timeout_s
        while (status := c.job_status(job)).step < warmup:
            if status.state == control_pb2.TERMINATED or time.time() > deadline:
                raise RuntimeError(f"job {job} ended or stalled at step {status.step}")
            time.sleep(0.5)
        asked = clients.call(
            "control", lambda s: s.ProfileJob(control_pb2.ProfileJobRequest(job_id=job, steps=steps), timeout=10)
        ).profiles[-1]
        while True:
            info = next(p for p in c.job_status(job).profiles if p.seq == asked.seq)
            if len(info.recorded) >= info.ranks:
                break
            if time.time() > deadline:
                raise TimeoutError(f"profile #{asked.seq}: {len(info.recorded)} of {info.ranks} ranks reported")
            time.sleep(0.5)
        c.wait_job(job, timeout_s=max(60.0, deadline - time.time()))
        records = c.surge_steps(job)
    return overhead(steps, list(info.recorded), records)


def overhead(steps: int, recorded: list, records: dict[int, list[dict]]) -> dict:
    """Per rank: its profiled steps' time against the median of the ``4 x steps`` before, the
    step after (its boundary ran the export and upload) and the trace's size. ``recorded``:
    the ranks' ProfileRecorded; ``records``: per rank, its step records (the metrics file's).

    Raises:
        RuntimeError: a rank recorded no profile, or has no step records before it.
    """
    out: dict = {"profiled_steps": steps, "ranks": {}}
    for r in sorted(recorded, key=lambda x: x.rank):
        if r.error:
            raise RuntimeError(f"rank {r.rank}: {r.error}")
        by_step = {int(x["step"]): float(x["step_seconds"]) for x in records.get(r.rank, [])}
        tps = {int(x["step"]): float(x.get("tokens_per_second", 0.0)) for x in records.get(r.rank, [])}
        window_before = range(r.first_step - 4 * steps, r.first_step)
        window_during = range(r.first_step, r.last_step + 1)
        before = [by_step[s] for s in window_before if s in by_step]
        during = [by_step[s] for s in window_during if s in by_step]
        if not before or not during:
            raise RuntimeError(f"rank {r.rank}: no step records around steps {r.first_step}-{r.last_step}")
        after = by_step.get(r.last_step + 1)  # (its boundary's export and upload delay the next step's start)
        base, profiled = statistics.median(before), statistics.median(during)
        # Tokens/s as the job reports it (every rank's tokens over the step's time): without
        # the profiler (the steps before) and with it (the traced steps).
        tps_before = statistics.median([tps[s] for s in window_before if s in tps])
        tps_during = statistics.median([tps[s] for s in window_during if s in tps])
        out["ranks"][r.rank] = {
            "steps": [r.first_step, r.last_step],
            "tokens_per_second_without_profiler_median": round(tps_before, 1),
            "tokens_per_second_profiled_median": round(tps_during, 1),
            "throughput_overhead_percent": round(100 * (1 - tps_during / tps_before), 1) if tps_before else None,
            "step_seconds_before_median": round(base, 4),
            "step_seconds_profiled_median": round(profiled, 4),
            "overhead_percent_while_tracing": round(100 * (profiled / base - 1), 1),
            "step_seconds_after": round(after, 4) if after is not None else None,
            "trace_bytes": r.bytes,
            "profiled_seconds": round(r.seconds, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps to profile")
    ap.add_argument("--warmup", type=int, default=20, help="steps before the profile is asked")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    result = {"machine": c.machine(), **measure(args.steps, args.warmup, args.timeout)}
    result["load_average_1m"] = {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)}
    c.report("profile_overhead", result, args.out)


if __name__ == "__main__":
    main()
