"""`make bench-faults`: how fast faults are detected and recovered, Surge against
`torchrun --max-restarts=3`, training the same model on the same data (issue 4).

    .venv/bin/python bench/faults.py [--trials 5] [--collective-timeout 30]

Every trial is a fresh job (Surge: ``bench/jobs/throughput.yaml`` with a checkpoint every
10 steps; torchrun: ``bench/torchrun_ddp.py`` with its own checkpoint every 10 steps and
``--max-restarts=3``), trained to step 15, then one fault hits rank 1:

- ``kill``: SIGKILL of the rank process;
- ``stop``: SIGSTOP of the rank process (alive, silent);
- ``stall`` (Surge only): the rank's main thread blocks before step 15's backward
  (``SURGE_FAULT_INJECT=<job>:hang@15:rank=1``, services/rank/faults.py), its heartbeat
  goes on: the fault detector's stall deadline (``liveness.stall_min_seconds``, set to 10 s
  here; default 30 s) must catch it. torchrun has no notion of it: a hung rank looks like
  SIGSTOP to its peers (they wait for the collective timeout).

Measured per trial, from the moment of the fault (the signal; for a stall, rank 1's last
completed step): Surge: the orchestrator's ``fault`` job event (detection) and its
``recovery`` event, written when the relaunched ranks complete their first step (first new
step). torchrun: the moment its agent has torn down the survivor (rank 0's process is gone:
it noticed and acted) and the first step line written after the restart. A trial that does
not recover within ``--collective-timeout`` + 60 s is reported as ">= that bound".
Results: ``bench/results/faults.json`` and a markdown table (median and max).

Soaks kept out of the suite (25 minutes on CI's 2 cores), run by hand: the blame of a rank
hung in its forward pass holding in every one of 10 runs (issue 12 part 5; the suite runs it
once): ``SURGE_BLAME_RUNS=10 .venv/bin/python -m pytest -p no:xdist -k hung
tests/faults/test_phase_blame.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"
FAULT_STEP = 15
STALL_MIN_S = 10.0


def _proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_with(text: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and text in _cmdline(int(p))]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------ Surge


def surge_trial(kind: str, job_name: str, bound_s: float) -> dict:
    """One fault on a fresh Surge job; the stack is up (SURGE_FAULT_INJECT set for stalls)."""
    from services.cli import clients
    from services.contract import control_pb2

    spec = c.write_spec(
        SPEC,
        job_name,
        steps=100_000,
        checkpoint={"every_steps": 10, "keep_last": 2, "at_end": False},
        liveness={"stall_min_seconds": STALL_MIN_S},
        fault_policy={"max_restarts": 10},
    )
    job, _ = c.submit(spec)
    events: list = []
    threading.Thread(target=_watch, args=(job, events), daemon=True).start()
    try:
        t_fault = None
        if kind == "stall":
            deadline = time.time() + 120
            while not [e for e in list(events) if e.type == "fault"] and time.time() < deadline:
                time.sleep(0.1)
            recs = c.surge_steps(job).get(1, [])
            # The hang starts right after rank 1's last completed step before the fault.
            t_fault = max((r["unix_time"] for r in recs if r["step"] < FAULT_STEP), default=None)
        else:
            deadline = time.time() + 120
            while c.job_status(job).step < FAULT_STEP and time.time() < deadline:
                time.sleep(0.05)
            (pid,) = pids_with(f"--job {job} --rank 1")
            t_fault = time.time()
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        deadline = time.time() + bound_s

        def first_step() -> list:  # the orchestrator's "first step after the recovery" event
            return [e for e in list(events) if e.type == "recovery" and e.message.startswith("first step")]

        while time.time() < deadline and not first_step():
            time.sleep(0.05)
        faults = [e for e in list(events) if e.type == "fault"]
        relaunch = [e for e in list(events) if e.type == "recovery" and not e.message.startswith("first step")]
        recov = first_step()
        # Where the recovery time goes: the relaunched ranks' own start-up (process start,
        # imports, process group, checkpoint load), from their "ready" events.
        ready = [e for e in list(events) if e.type == "rank" and relaunch and e.unix_time > relaunch[0].unix_time]
        startups = [float(m.group(1)) for e in ready if (m := re.search(r"([\d.]+) s start-up", e.message))]
        return {
            "relaunched_rank_startup_s": max(startups) if startups else None,
            "all_ready_s": max(e.unix_time for e in ready) - t_fault if ready and t_fault else None,
            "job": job,
            "kind": kind,
            "detect_s": faults[0].unix_time - t_fault if faults and t_fault else None,
            "first_new_step_s": recov[0].unix_time - t_fault if recov and t_fault else None,
            "relaunch_s": relaunch[0].unix_time - t_fault if relaunch and t_fault else None,
            "bound_s": bound_s,
            "fault_event": faults[0].message if faults else None,
            "relaunch_event": relaunch[0].message if relaunch else None,
            "recovery_event": recov[0].message if recov else None,
        }
    finally:
        try:
            clients.call("control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job), timeout=10))
            c.wait_job(job, 60)
        except Exception:  # noqa: BLE001 - a job that will not stop: kill its ranks
            for pid in pids_with(f"--job {job} "):
                os.kill(pid, signal.SIGKILL)


def _watch(job: str, events: list) -> None:
    from services.cli import clients
    from services.contract import control_pb2

    try:
        with clients.stub("control") as s:
            for ev in s.WatchJob(control_pb2.JobQuery(job_id=job, follow=True)):
                events.append(ev)
    except Exception:  # noqa: BLE001 - the job ended or the stack went down
        pass


# ------------------------------------------------------------------ torchrun


def torchrun_trial(kind: str, timeout_s: float, bound_s: float) -> dict:
    ckpt = c.BENCH_HOME / "torchrun-ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    run = c.torchrun(
        SPEC,
        steps=100_000,
        wait=False,
        torchrun_args=["--max-restarts=3", "--monitor-interval=0.1"],
        extra=["--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--collective-timeout", str(timeout_s)],
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(r.get("step", 0) >= FAULT_STEP for r in run.read()):
            time.sleep(0.05)
        workers = [p for p in pids_with("bench/torchrun_ddp.py") if _proc_env(p).get("RANK") is not None]
        by_rank = {int(_proc_env(p)["RANK"]): p for p in workers if alive(p)}
        starts_before = sum(1 for r in run.read() if r.get("event") == "start")
        t_fault = time.time()
        os.kill(by_rank[1], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        t_detect, t_step = None, None
        deadline = t_fault + bound_s
        while time.time() < deadline:
            if t_detect is None and not alive(by_rank[0]):
                t_detect = time.time()
            recs = run.read()
            starts = [i for i, r in enumerate(recs) if r.get("event") == "start"]
            if len(starts) > starts_before:
                after = [r for r in recs[starts[-1] :] if "step" in r]
                if after:
                    t_step = after[0]["unix_time"]
                    break
            if run.proc.poll() is not None:
                break  # torchrun gave up
            time.sleep(0.01)
        return {
            "kind": kind,
            "detect_s": t_detect - t_fault if t_detect else None,
            "first_new_step_s": t_step - t_fault if t_step else None,
            "bound_s": bound_s,
            "collective_timeout_s": timeout_s,
            "torchrun_exit": run.proc.poll(),
        }
    finally:
        c.kill_group(run.proc)
        for p in pids_with("bench/torchrun_ddp.py"):
            if _proc_env(p).get("RANK") is not None:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# ------------------------------------------------------------------ report


def _stat(trials: list[dict], key: str) -> dict:
    vals = [t[key] for t in trials if t.get(key) is not None]
    missing = len(trials) - len(vals)
    out = c.summary(vals)
    out["not_recovered"] = missing
    if missing:
        out["lower_bound_s"] = max(t["bound_s"] for t in trials)
    return out


def _cell(s: dict) -> str:
    if s.get("not_recovered") and s["n"] == 0:
        return f">= {s['lower_bound_s']:.0f} (none of {s['not_recovered']})"
    text = f"{s['median']:.2f} / {s['max']:.2f}"
    if s.get("not_recovered"):
        text += f" ({s['not_recovered']} not within {s['lower_bound_s']:.0f} s)"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2 if c.QUICK else 5)
    ap.add_argument(
        "--collective-timeout",
        type=float,
        default=30.0,
        help="torchrun side: gloo timeout, seconds (PyTorch's default is 600)",
    )
    args = ap.parse_args()
    c.setup_env()
    t0 = time.time()
    result = {
        "machine": c.machine(),
        "command": "make bench-faults",
        "trials": args.trials,
        "fault_step": FAULT_STEP,
        "surge_stall_min_seconds": STALL_MIN_S,
        "collective_timeout_s": args.collective_timeout,
    }
    name = "faults" if args.trials >= 5 else "faults-quick"  # a short check keeps the real figures
    stamp = int(time.time()) % 100000
    names = {k: [f"f{k}{stamp}x{i}" for i in range(args.trials)] for k in ("kill", "stop", "stall")}
    os.environ["SURGE_FAULT_INJECT"] = ",".join(f"{n}:hang@{FAULT_STEP}:rank=1" for n in names["stall"])
    bound = args.collective_timeout + 60
    surge: dict[str, list] = {"kill": [], "stop": [], "stall": []}
    torch_: dict[str, list] = {"kill": [], "stop": []}
    with c.Stack(workers=2):
        for kind in ("kill", "stop"):  # Surge and torchrun trials alternate
            for i in range(args.trials):
                surge[kind].append(surge_trial(kind, names[kind][i], bound))
                print(
                    f"  surge {kind} {i + 1}: {surge[kind][-1]['detect_s']} / {surge[kind][-1]['first_new_step_s']}",
                    flush=True,
                )
                torch_[kind].append(torchrun_trial(kind, args.collective_timeout, bound))
                print(
                    f"  torchrun {kind} {i + 1}: {torch_[kind][-1]['detect_s']} / {torch_[kind][-1]['first_new_step_s']}",
                    flush=True,
                )
                c.save(name, {**result, "surge": surge, "torchrun": torch_})
        for i in range(args.trials):
            surge["stall"].append(surge_trial("stall", names["stall"][i], bound))
            print(
                f"  surge stall {i + 1}: {surge['stall'][-1]['detect_s']} / {surge['stall'][-1]['first_new_step_s']}",
                flush=True,
            )
    result["surge"], result["torchrun"] = surge, torch_
    result["summary"] = {
        side: {
            kind: {"detect_s": _stat(t, "detect_s"), "first_new_step_s": _stat(t, "first_new_step_s")}
            for kind, t in trials.items()
        }
        for side, trials in (("surge", surge), ("torchrun", torch_))
    }
    result["surge_recovery_breakdown"] = {
        kind: {
            key: c.summary([t[key] for t in trials if t.get(key) is not None])
            for key in ("relaunch_s", "all_ready_s", "relaunched_rank_startup_s", "first_new_step_s")
        }
        for kind, trials in surge.items()
    }
    result["total_seconds"] = time.time() - t0
    path = c.save(name, result)
    rows = []
    for kind, label in (
        ("kill", "SIGKILL rank 1"),
        ("stop", "SIGSTOP rank 1"),
        ("stall", "rank 1 hangs, heartbeat on"),
    ):
        s = result["summary"]["surge"][kind]
        t = result["summary"]["torchrun"].get(kind)
        rows.append(
            (
                label,
                _cell(s["detect_s"]),
                _cell(t["detect_s"]) if t else "not measured (same as SIGSTOP)",
                _cell(s["first_new_step_s"]),
                _cell(t["first_new_step_s"]) if t else "-",
            )
        )
    print(
        c.table(
            rows,
            (
                f"fault (trials: {args.trials})",
                "Surge detect s (median / max)",
                "torchrun detect s",
                "Surge fault -> first new step s",
                "torchrun fault -> first new step s",
            ),
        )
    )
    for kind, b in result["surge_recovery_breakdown"].items():
        print(
            f"Surge {kind}, median s after the fault: relaunch decided {b['relaunch_s']['median']:.2f}, all ranks "
            f"ready {b['all_ready_s']['median']:.2f} (rank start-up {b['relaunched_rank_startup_s']['median']:.2f}), "
            f"first new step {b['first_new_step_s']['median']:.2f}"
        )
    print(
        f"\nSurge: heartbeat timeout 3 s, stall deadline {STALL_MIN_S:.0f} s; torchrun: --max-restarts=3, "
        f"--monitor-interval=0.1, gloo timeout {args.collective_timeout:.0f} s (default 600). "
        f"{path.relative_to(c.REPO)}; {result['total_seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
