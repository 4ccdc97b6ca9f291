"""`make bench-faults` (second part): does the time from a fault to the first new step grow
with the number of checkpoint versions kept, and what does a store outage during the
recovery cost (issue 12)?

    .venv/bin/python bench/recovery_versions.py [--kept 1 5 20] [--models demo 100m]

For each model and each number of versions kept N, a fresh job (dp=2, a checkpoint every
step or two, ``keep_last: 0``) trains until N versions are committed, then rank 1 is
SIGKILLed. Measured from the signal: the orchestrator's decision event (detection), the
relaunch event (verification and placement done: what used to re-hash every kept version
on control's event path), and the "first step after the recovery" event (first new step).
Models: ``demo`` (bench/jobs/throughput.yaml: 4 layers, d_model 128, 0.8 M parameters) and
``100m`` (bench/jobs/gpt125m.yaml's shape: 12 layers, d_model 768, 85 M parameters; seq 64,
one row per micro-batch, so a CPU step stays in seconds; ~1 GB per version with AdamW).

Then ``store-stopped``: the demo model with 5 versions; the store is SIGSTOPped at the
fault and SIGCONTed 30 s later: the job waits (FAULT_FROZEN, nothing struck) and resumes
from its newest version. Results: ``bench/results/recovery_versions.json`` and a table.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from bench.faults import _watch, pids_with  # noqa: E402

MODELS = {
    "demo": (c.REPO / "bench" / "jobs" / "throughput.yaml", {}, 2),
    "100m": (
        c.REPO / "bench" / "jobs" / "gpt125m.yaml",
        {
            "data": {
                "dataset": "stdlib@v1",
                "seq_len": 64,
                "micro_batch_size": 1,
                "shuffle_seed": 1234,
                "pack": "pack",
                "prefetch": {"watermark": 64, "threads": 1},
            },
            "parallel": {"dp": 2, "backend": "gloo", "threads_per_rank": 1},
            "precision": "fp32",
        },
        1,
    ),
}
STORE_STOP_S = 30.0


def trial(model: str, kept: int, name: str, *, stop_store: bool = False, bound_s: float = 600.0) -> dict:
    from services.cli import clients, stack
    from services.contract import control_pb2

    base, overrides, every = MODELS[model]
    spec = c.write_spec(
        base,
        name,
        steps=100_000,
        checkpoint={"every_steps": every, "keep_last": 0, "at_end": False},
        fault_policy={"max_restarts": 10},
        eval={"every_steps": 0, "batches": 1, "at_end": False},
        **overrides,
    )
    job, _ = c.submit(spec)
    events: list = []
    threading.Thread(target=_watch, args=(job, events), daemon=True).start()
    try:

        def saves() -> list:
            return [e for e in list(events) if e.type == "checkpoint" and " bytes, " in e.message]

        deadline = time.time() + bound_s
        while len(saves()) < kept and time.time() < deadline:
            time.sleep(0.1)
        assert len(saves()) >= kept, f"{job}: only {len(saves())} versions committed"
        version_bytes = int(saves()[-1].message.split("(")[1].split(" bytes")[0])
        (pid,) = pids_with(f"--job {job} --rank 1")
        store_pid = stack.read_stack()["store"].pid if stop_store else None
        t_fault = time.time()
        if store_pid:
            os.kill(store_pid, signal.SIGSTOP)
            threading.Timer(STORE_STOP_S, os.kill, (store_pid, signal.SIGCONT)).start()
        os.kill(pid, signal.SIGKILL)

        def first_step() -> list:
            return [e for e in list(events) if e.type == "recovery" and e.message.startswith("first step")]

        deadline = time.time() + bound_s
        while time.time() < deadline and not first_step():
            time.sleep(0.05)
        decided = [e for e in list(events) if e.type == "decision" and " after " in e.message]
        relaunch = [e for e in list(events) if e.type == "recovery" and e.message.startswith("ranks killed")]
        struck = [e.message for e in list(events) if "fails verification" in e.message or "never loaded" in e.message]
        recov = first_step()
        return {
            "model": model,
            "kept": kept,
            "job": job,
            "store_stopped_s": STORE_STOP_S if stop_store else 0.0,
            "versions_committed": len(saves()),
            "version_bytes": version_bytes,
            "decide_s": decided[0].unix_time - t_fault if decided else None,
            "relaunch_s": relaunch[0].unix_time - t_fault if relaunch else None,
            "first_new_step_s": recov[0].unix_time - t_fault if recov else None,
            "resumed_from": relaunch[0].message.split("resume from ")[1].split(";")[0] if relaunch else None,
            "struck": struck,
        }
    finally:
        try:
            clients.call(
                "control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job, no_checkpoint=True), timeout=10)
            )
            c.wait_job(job, 120)
        except Exception:  # noqa: BLE001 - a job that will not stop: kill its ranks
            for p in pids_with(f"--job {job} "):
                os.kill(p, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kept", type=int, nargs="+", default=[1, 5] if c.QUICK else [1, 5, 20])
    ap.add_argument("--models", nargs="+", default=["demo"] if c.QUICK else ["demo", "100m"], choices=list(MODELS))
    ap.add_argument("--no-store-stop", action="store_true", help="skip the store-stopped trial")
    args = ap.parse_args()
    c.setup_env()
    t0 = time.time()
    stamp = int(time.time()) % 100000
    rows, trials = [], []
    result = {"machine": c.machine(), "command": "make bench-faults (bench/recovery_versions.py)"}
    with c.Stack(workers=2):
        for model in args.models:
            for kept in args.kept:
                t = trial(model, kept, f"rv{model}{kept}x{stamp}")
                trials.append(t)
                print(f"  {model} kept {kept}: {t}", flush=True)
                c.save("recovery_versions", {**result, "trials": trials})
        if not args.no_store_stop:
            t = trial("demo", 5, f"rvstore{stamp}", stop_store=True)
            trials.append(t)
            print(f"  demo store stopped {STORE_STOP_S:.0f} s: {t}", flush=True)
    result["trials"], result["total_seconds"] = trials, time.time() - t0
    path = c.save("recovery_versions", result)
    for t in trials:
        fmt = lambda v: f"{v:.2f}" if v is not None else "not recovered"  # noqa: E731
        what = f"{t['model']}, {t['kept']} kept" + (
            f", store stopped {t['store_stopped_s']:.0f} s" if t["store_stopped_s"] else ""
        )
        rows.append(
            (
                what,
                f"{t['version_bytes'] / 2**20:.1f}",
                fmt(t["decide_s"]),
                fmt(t["relaunch_s"]),
                fmt(t["first_new_step_s"]),
                t["resumed_from"] or "-",
                str(len(t["struck"])),
            )
        )
    print(
        c.table(
            rows,
            (
                "trial",
                "MiB per version",
                "fault -> decision s",
                "fault -> relaunch s",
                "fault -> first new step s",
                "resumed from",
                "versions struck",
            ),
        )
    )
    print(f"{path.relative_to(c.REPO)}; {result['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
