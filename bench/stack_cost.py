"""The stack's own CPU per training step (issue 28 item 3: "stack CPU beyond the ranks <= 1 %
of a step"), measured from outside on a real stack.

    .venv/bin/python bench/stack_cost.py [--warmup 20] [--window 60] [--out bench/results/stack_cost.json]

Runs the demo model of ``make bench`` (bench/jobs/throughput.yaml: dp 2, gloo, two node
agents) on the real stack (control, store, data, two node agents with their rank fork
servers) and reads, from ``/proc``, the CPU time (the scheduler's ns run time, ``schedstat``;
utime + stime where a kernel lacks it) of every thread of every
process of the stack (the services ``surgectl up`` started and all their descendants) at
two points of the job: after ``--warmup`` steps and about ``--window`` steps later (rank 0's
``status.step``). The harness asks control for the step (a GetJob, which control's CPU would
count) every 0.5 s before the window and, inside it, only at its end (it sleeps the window's
estimated length, then asks once a second). What is the stack's:

* every process that is not a rank: control, store, data (and any child), the node agents,
  their rank fork servers and any spare;
* a rank's threads other than its compute: the threads the rank's Python code starts
  (heartbeat, session reader, data pump, memory copies, gRPC pools: named to the OS by
  services/common/thread_names.py) and gRPC's own native threads. A rank's compute is its
  main thread (the training loop), the threads that inherit its name (torch's pools) and
  torch.distributed's own (``pt_*``, ``gloo*``: the collectives' transport and TCPStore),
  which plain torchrun + DDP runs too.

Reported: CPU-seconds per step and as % of a step's wall time (of one core), by process
kind and by thread name, with the step time, the ranks' own CPU per step and the load
average (the machine may be shared: CPU-seconds are what count, wall time stretches with
load). A process that starts and ends inside the window is not seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"
GOAL_PERCENT = 1.0
_HZ = os.sysconf("SC_CLK_TCK")
_COMPUTE_THREADS = re.compile(r"^(pt_|gloo)")  # torch.distributed's own threads (torchrun + DDP has them)
_RANK = re.compile(r"services\.rank\b(?!\.).*--rank (\d+)")  # a rank's title, not the fork server's


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _stat(path: str) -> tuple[int, float]:
    """(ppid, utime + stime in seconds) from a /proc stat file."""
    fields = _read(path).rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _HZ


def _wakeups(task: str) -> int:
    """A thread's voluntary context switches (``status``): each time it blocked and was woken
    again. What the stack's cost is made of (a message costs a wake-up of every thread it
    crosses), and, unlike CPU time, hardly moved by the machine's load."""
    try:
        for line in _read(f"{task}/status").splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _thread_cpu(task: str) -> float:
    """A thread's CPU seconds (``task``: its /proc/PID/task/TID directory): the scheduler's
    run time in ns (``schedstat``'s first field) where the kernel has it, else utime + stime
    in clock ticks. Why: at 100 ticks a second a window of 60 steps of the stack's ~8 ms saw
    about 50 ticks in all, a thread's share of a step moved by 0.17 ms per tick."""
    try:
        return int(_read(f"{task}/schedstat").split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return _stat(f"{task}/stat")[1]


def kind_of(cmdline: str) -> str:
    """What a process of the stack is, from its command line."""
    if m := _RANK.search(cmdline):
        return f"rank {m.group(1)}"
    for needle, kind in (
        ("services.rank.forkserver", "rank fork server"),
        ("services.control", "control"),
        ("services.store", "store"),
        ("services.data", "data"),
        ("services.worker", "node agent"),
    ):
        if needle in cmdline:
            return kind
    return "other: " + cmdline[:60]


def snapshot(roots: list[int]) -> dict[int, dict]:
    """Every process descending from ``roots`` (and the roots): its kind, and each thread's
    (name, CPU seconds), keyed by pid."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = _stat(f"/proc/{entry}/stat")[0]
            except (OSError, ValueError, IndexError):
                continue  # gone
    ours = set(roots)
    grew = True
    while grew:  # the stack's tree (ranks are adopted by their node agent: a subreaper)
        grew = False
        for pid, ppid in parent.items():
            if ppid in ours and pid not in ours:
                ours.add(pid)
                grew = True
    out: dict[int, dict] = {}
    for pid in ours:
        try:
            cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
            threads, wakeups = {}, {}
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    name = _read(f"/proc/{pid}/task/{tid}/comm").strip()
                    threads[int(tid)] = (name, _thread_cpu(f"/proc/{pid}/task/{tid}"))
                    wakeups[int(tid)] = _wakeups(f"/proc/{pid}/task/{tid}")
                except (OSError, ValueError, IndexError):
                    continue  # a thread that ended
        except OSError:
            continue
        out[pid] = {"kind": kind_of(cmdline), "threads": threads, "wakeups": wakeups}
    return out


# The threads gRPC's Python code starts without a name, as the OS sees them (15 bytes):
# ``Thread-N (_run)`` is a ``cygrpc.ForkManagedThread`` (its wrapper is ``_run``): a channel's
# spin thread (grpc/_channel.py ``_run_channel_spin_thread``: polls the channel's completion
# queue, waking every 0.2 s and per call event), or a stream call's request consumer
# (``_consume_request_iterator``: runs our request generator, e.g. a rank's
# ``Session._requests``); ``Thread-N (_serve)`` a sync server's completion-queue thread;
# ``Thread-N (_poll_wrapper)`` an aio server's poller. Identified with py-spy dump (session 26).
_GRPC_THREADS = (
    (re.compile(r"^Thread-\d+ \(_run"), "gRPC spin/request (Thread-N (_run))"),
    (re.compile(r"^Thread-\d+ \(_serv"), "gRPC server (Thread-N (_serve))"),
    (re.compile(r"^Thread-\d+ \(_poll"), "gRPC aio poller (Thread-N (_poll_wrapper))"),
)


def _thread_group(name: str) -> str:
    """A thread's name without its pool index (``data-io_3`` -> ``data-io``); gRPC's unnamed
    threads by what they are."""
    for pattern, group in _GRPC_THREADS:
        if pattern.match(name):
            return group
    return re.sub(r"[_-]?\d+$", "", name) or name


def cost(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """CPU seconds spent between two snapshots: the stack's (by process kind; a rank's side
    threads by name) and the ranks' compute. A thread seen only at ``b`` counts from 0."""
    stack: dict[str, float] = defaultdict(float)
    threads: dict[str, float] = defaultdict(float)  # "kind: thread" -> CPU, of the stack's processes
    rank_side: dict[str, float] = defaultdict(float)
    wakeups: dict[str, int] = defaultdict(int)  # the stack's threads' (a rank's side threads: "ranks' side")
    thread_wakeups: dict[str, int] = defaultdict(int)  # by "kind: thread" (a rank's side: "ranks' side: thread")
    compute = 0.0
    ranks = 0
    for pid, proc in b.items():
        before = a.get(pid, {"threads": {}})["threads"]
        woken_before = a.get(pid, {}).get("wakeups", {})
        main_name = proc["threads"].get(pid, ("", 0.0))[0]
        is_rank = re.fullmatch(r"rank \d+", proc["kind"]) is not None  # (not "rank fork server")
        ranks += is_rank and pid in a
        for tid, (name, cpu) in proc["threads"].items():
            spent = cpu - before.get(tid, (name, 0.0))[1]
            woken = proc.get("wakeups", {}).get(tid, 0) - woken_before.get(tid, 0)
            if not is_rank:
                stack[proc["kind"]] += spent
                threads[f"{proc['kind']}: {'main' if tid == pid else _thread_group(name)}"] += spent
                wakeups[proc["kind"]] += woken
                thread_wakeups[f"{proc['kind']}: {'main' if tid == pid else _thread_group(name)}"] += woken
            elif tid == pid or name == main_name or _COMPUTE_THREADS.match(name):
                compute += spent  # the training loop, its pools, torch.distributed's transport
            else:
                rank_side[_thread_group(name)] += spent
                wakeups["ranks' side threads"] += woken
                thread_wakeups[f"ranks' side: {_thread_group(name)}"] += woken
    return {
        "wakeups": dict(wakeups),
        "thread_wakeups": dict(thread_wakeups),
        "stack": dict(stack),
        "stack_threads": dict(threads),
        "rank_side_threads": dict(rank_side),
        "rank_compute": compute,
        "ranks": ranks,
        "processes": {str(pid): proc["kind"] for pid, proc in sorted(b.items())},
    }


def measure(warmup: int, window: int, timeout_s: float, overrides: dict | None = None) -> dict:
    from services.contract import control_pb2

    c.setup_env()
    # The agents' rank fork servers start with them and are waited for below (as on a cluster
    # whose agents have been up a while; lazy, the default, would start them with the job).
    os.environ["SURGE_WORKER_RANK_FORKSERVER"] = "eager"
    with c.Stack(workers=2) as stack:
        c.wait_forkservers_warm(2)
        roots = [p.pid for p in stack.procs.values()]
        spec = c.write_spec(  # (room for a window longer than estimated)
            SPEC, "stackcost", steps=warmup + 2 * window + 10, **(overrides or {})
        )
        job, _ = c.submit(spec)
        deadline = time.time() + timeout_s

        def at_step(target: int, every_s: float) -> tuple[int, float, dict]:
            while time.time() < deadline:
                status = c.job_status(job)
                if status.step >= target:
                    return status.step, time.time(), snapshot(roots)
                if status.state == control_pb2.TERMINATED:
                    raise RuntimeError(f"job {job} ended at step {status.step}: {status.outcome}")
                time.sleep(every_s)
            raise TimeoutError(f"job {job} did not reach step {target} in {timeout_s:.0f} s")

        first, t_first, _ = at_step(1, 0.5)
        load0 = os.getloadavg()
        s0, t0, a = at_step(warmup, 0.5)
        step_estimate = (t0 - t_first) / max(1, s0 - first)
        time.sleep(max(0.0, min(window * step_estimate * 0.8, deadline - time.time())))  # no GetJob inside
        s1, t1, b = at_step(warmup + window, 1.0)
        load1 = os.getloadavg()
        # The job's remaining steps are not waited for: the stack's `down` (workers first,
        # they stop their ranks) ends it (on a loaded machine they were half the run's time).
    steps, wall = s1 - s0, t1 - t0
    spent = cost(a, b)
    if spent["ranks"] == 0:
        raise RuntimeError("no rank lived through the window (the job ended inside it?): measure again")
    step_s = wall / steps
    per_step = {k: v / steps for k, v in spent["stack"].items()}
    side = {k: v / steps for k, v in spent["rank_side_threads"].items()}
    total = sum(per_step.values()) + sum(side.values())
    return {
        "steps": steps,
        "from_step": s0,
        "seconds": round(wall, 2),
        "step_seconds": round(step_s, 4),
        "ranks": spent["ranks"],
        "stack_cpu_seconds_per_step": round(total, 5),
        "stack_percent_of_step": round(100 * total / step_s, 3),
        # The same CPU against what the ranks' compute used (their training threads).
        "stack_percent_of_rank_compute": round(100 * total * steps / max(spent["rank_compute"], 1e-9), 3),
        "rank_compute_cpu_seconds_per_step": round(spent["rank_compute"] / steps, 4),
        "by_process_cpu_seconds_per_step": {k: round(v, 5) for k, v in sorted(per_step.items())},
        # Voluntary context switches of the stack's threads (a rank's side threads included),
        # per step and per second: the wake-ups its messages and timers cost (load-independent).
        "wakeups_per_step": round(sum(spent["wakeups"].values()) / steps, 2),
        "wakeups_per_second": round(sum(spent["wakeups"].values()) / wall, 2),
        "by_process_wakeups_per_step": {k: round(v / steps, 2) for k, v in sorted(spent["wakeups"].items())},
        # Which threads wake: per second, the largest first (a timer's period shows here whatever the step).
        "by_thread_wakeups_per_second": {
            k: round(v / wall, 2) for k, v in sorted(spent["thread_wakeups"].items(), key=lambda x: -x[1]) if v > 0
        },
        "by_thread_cpu_seconds_per_step": {
            k: round(v / steps, 5) for k, v in sorted(spent["stack_threads"].items(), key=lambda x: -x[1]) if v > 0
        },
        "rank_side_threads_cpu_seconds_per_step": {
            k: round(v, 5) for k, v in sorted(side.items(), key=lambda x: -x[1])
        },
        "processes": spent["processes"],
        "loadavg": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in load1]},
        "goal_percent": GOAL_PERCENT,
    }


def render(r: dict) -> str:
    step = r["step_seconds"]
    rows = [
        ("step time", f"{step * 1000:.1f} ms ({r['steps']} steps from step {r['from_step']}, {r['ranks']} ranks)"),
        ("ranks' compute CPU per step", f"{r['rank_compute_cpu_seconds_per_step'] * 1000:.1f} ms"),
        (
            "stack CPU per step (goal <= 1 % of a step)",
            f"{r['stack_cpu_seconds_per_step'] * 1000:.2f} ms = {r['stack_percent_of_step']:.2f} % of a step "
            f"({r['stack_percent_of_rank_compute']:.2f} % of the ranks' compute)",
        ),
    ]
    for k, v in r["by_process_cpu_seconds_per_step"].items():
        rows.append((f"  {k}", f"{v * 1000:.2f} ms ({100 * v / step:.2f} %)"))
    if "wakeups_per_step" in r:
        woken = ", ".join(f"{k} {v:.1f}" for k, v in r["by_process_wakeups_per_step"].items() if v)
        rows.append(
            (
                "stack wake-ups per step (voluntary context switches)",
                f"{r['wakeups_per_step']:.1f} ({r['wakeups_per_second']:.1f} per second): {woken}",
            )
        )
    for k, v in r["rank_side_threads_cpu_seconds_per_step"].items():
        rows.append((f"  ranks' thread {k}", f"{v * 1000:.2f} ms ({100 * v / step:.2f} %)"))
    for k, v in list(r["by_thread_cpu_seconds_per_step"].items())[:12]:  # the largest consumers
        rows.append((f"  thread {k}", f"{v * 1000:.2f} ms ({100 * v / step:.2f} %)"))
    for k, v in list(r.get("by_thread_wakeups_per_second", {}).items())[:12]:
        rows.append((f"  wake-ups/s {k}", f"{v:.1f} ({v * step:.1f} per step)"))
    rows.append(("load average (start / end)", f"{r['loadavg']['start']} / {r['loadavg']['end']}"))
    return c.table(rows, ("what", "per step"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=20, help="steps before the window (set-up excluded)")
    ap.add_argument("--window", type=int, default=60, help="steps measured")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole job")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION__KEY=VALUE",
        help="a change to the job spec (repeatable; e.g. data__micro_batch_size=2 for a shorter step: "
        "a loaded machine's steps are longer, and the stack's cost per step depends on the step time)",
    )
    ap.add_argument("--out", type=Path, default=c.RESULTS / "stack_cost.json")
    args = ap.parse_args()
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    result = {"machine": c.machine()} | measure(args.warmup, args.window, args.timeout, overrides)
    result["args"] = {k: str(v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(render(result))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
