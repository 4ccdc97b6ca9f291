"""A job page's events from control's journal at the size of a long job: the newest 200 of a
job of N events (step events are sampled about once a second: 10^5 is a day), read from a real
``JobStore`` (SQLite on disk) as WatchJob reads them.

    PYTHONPATH=$PWD .venv/bin/python bench/event_tail.py [--events 100000] [--reads 3]
        [--json OUT] [--work DIR]

The job's events: type "step" but each 100th a "checkpoint" and each 1,000th a "fault"; each
carries the status after it (a RUNNING status of 8 ranks with a slow-rank entry and tags, about
the size control journals). Written in transactions of 1,000 (``save_statuses``).

Measured, each ``--reads`` times (median and all, seconds; the 1-min load average beside):
``whole``, the read before JobQuery.tail: ``events(job)`` (every row, every status
deserialised) then its last 200 kept in Python; ``tail``, ``events(job, tail=200)``;
``tail_faults``, ``events(job, tail=200, types=["fault"])``; ``all_faults``, ``events(job,
types=["fault"])``. Runs against any commit's JobStore: one without ``tail`` measures only
``whole`` (the figures before the change came from this file run in a worktree of it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

from services.contract import Module, control_pb2
from services.control.job_store import JobStore

JOB = "long-job"
TAIL = 200


def status_at(step: int) -> control_pb2.JobStatus:
    return control_pb2.JobStatus(
        job_id=JOB,
        name="long",
        state=control_pb2.RUNNING,
        step=step,
        total_steps=10**6,
        train_loss=2.0 + 1.0 / (1 + step),
        tokens_seen=step * 65536,
        tokens_per_second=41234.5,
        world_size=8,
        dp=8,
        message=f"step {step}",
        slow_ranks=[control_pb2.SlowRank(rank=3)],
        tags={"team": "research", "run": "baseline"},
    )


def kind_of(seq: int) -> str:
    return "fault" if seq % 1000 == 0 else "checkpoint" if seq % 100 == 0 else "step"


def fill(store: JobStore, n: int) -> None:
    first = status_at(0)
    store.create_job(first, '{"name": "long"}')
    batch = []
    for seq in range(1, n + 1):
        st = status_at(seq)
        ev = control_pb2.JobEvent(
            job_id=JOB, seq=seq, unix_time=1.7e9 + seq, source=Module.L1_ORCHESTRATOR, type=kind_of(seq), status=st
        )
        ev.message = f"step {seq}: loss {st.train_loss:.4f}"
        batch.append((st, ev, None, None))
        if len(batch) == 1000:
            store.save_statuses(batch)
            batch = []
    if batch:
        store.save_statuses(batch)


def timed(read, reads: int) -> dict:
    seconds, loads, got = [], [], None
    for _ in range(reads):
        t0 = time.perf_counter()
        got = read()
        seconds.append(round(time.perf_counter() - t0, 4))
        loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
    return {"median_s": statistics.median(seconds), "seconds": seconds, "load": loads, "events": len(got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--reads", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench/results/event_tail.json"))
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        store = JobStore(Path(work) / "control.db")
        t0 = time.perf_counter()
        fill(store, args.events)
        written = time.perf_counter() - t0
        size = (Path(work) / "control.db").stat().st_size
        reads = {"whole": lambda: store.events(JOB)[-TAIL:]}
        if "tail" in inspect.signature(store.events).parameters:
            reads["tail"] = lambda: store.events(JOB, tail=TAIL)
            reads["tail_faults"] = lambda: store.events(JOB, tail=TAIL, types=["fault"])
            reads["all_faults"] = lambda: store.events(JOB, types=["fault"])
        results = {name: timed(read, args.reads) for name, read in reads.items()}
        store.close()
    out = {"events": args.events, "write_s": round(written, 2), "db_bytes": size, "reads": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.events:,} events written in {written:.1f} s, db {size / 2**20:.1f} MiB")
    for name, r in results.items():
        print(f"{name:>12}: {r['events']:>6} events, median {r['median_s']:.4f} s of {r['seconds']}, load {r['load']}")


if __name__ == "__main__":
    main()
