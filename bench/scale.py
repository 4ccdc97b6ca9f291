"""The scale test bed (issue 27 item 7): 64, 128 and 256 simulated ranks through the real
control, data and store services, on this machine.

    .venv/bin/python bench/scale.py [--world-sizes 64,128,256] [--steps 30] [--every 10]
        [--step-time 0.5] [--shard-bytes 65536] [--slots 16] [--hogs 0] [--out PATH]   # `make bench-scale`

Per world size W: a fresh stack (``surgectl up``: control, data, store and ceil(W / slots)
node agents of ``--slots`` rank slots each, on loopback) under its own SURGE_HOME
(.surge/bench-scale), then one job of W simulated ranks (job spec ``simulate:``;
services/rank/simulated/: torch-free rank processes speaking the real RankSession, data
and store protocols, a sleep of ``--step-time`` in place of the model's compute, a real
shard of ``--shard-bytes`` per rank at every save). The job trains ``--steps`` steps with a
checkpoint every ``--every`` steps, submitted as a user would; it must end within its
deadline (set-up allowance plus steps x step time x 4), else it is stopped (StopJob) and
what happened until then is reported. The stack is brought down and every process it
started is killed by PID before the next size. ``--hogs N``: N busy-loop processes run
beside the job, from its submission to its end (killed by PID): a machine loaded by other
work, which must make the store slow, never absent (every save still commits).

Measured per world size (from the simulated ranks' log lines, control's job status, the
store's catalog and /proc):
- streams started (ranks whose first micro-batch came) and stream start latency (the
  rank's OpenStream -> first micro-batch), p50 / max;
- batch latency: the time a rank waited for each micro-batch after the first step, p50 / p99;
- save -> commit: rank 0's time from its BeginSave to CommitSave's reply, p50 / max, and
  the share of saves committed (versions in the store's catalog / saves the job asked for);
- data and store service: peak RSS (VmHWM) and CPU seconds (utime + stime) over the run;
- the machine's 1-minute load average, at the job's start and its peak during the run;
- the job's outcome as control reports it, and its wall time.

Results: bench/results/scale.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import surge_root  # noqa: E402  (after the path above)

HOME = surge_root() / "bench-scale"  # under the operator's SURGE_HOME (default: the clone's .surge)
RESULTS = REPO / "bench" / "results"
SURGECTL = [sys.executable, "-m", "services.cli.surgectl"]
DATASET = "scale@v1"
CORPUS_PACKAGES = ("json", "email", "logging", "asyncio")  # a small corpus: the cliff, not the corpus, is measured


def job_spec(name: str, world: int, steps: int, every: int, step_time: float, shard_bytes: int) -> dict:
    """An ordinary job spec with a ``simulate:`` section. Liveness is relaxed for hundreds of
    processes on 2 cores (beats every 2 s, silent after 60 s while the process runs)."""
    return {
        "name": name,
        "steps": steps,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256},
        "data": {"dataset": DATASET, "seq_len": 64, "micro_batch_size": 2, "prefetch": {"threads": 1}},
        "parallel": {"dp": world},
        "checkpoint": {"every_steps": every, "keep_last": 0, "at_end": True},  # keep all: the catalog counts them
        "eval": {"every_steps": 0, "at_end": False},
        "metrics": {"log_every": 0},
        "liveness": {
            "heartbeat_interval_seconds": 2.0,
            "heartbeat_timeout_seconds": 10.0,
            "heartbeat_timeout_running_seconds": 60.0,
            "stall_min_seconds": 120.0,
        },
        "simulate": {"step_time_s": step_time, "shard_bytes": shard_bytes},
    }


def cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SURGECTL, *args], cwd=REPO, env=stack_env(), capture_output=True, text=True, timeout=timeout
    )


def stack_env(slots: int = 16) -> dict:
    env = {**os.environ, "SURGE_HOME": str(HOME), "PYTHONPATH": str(REPO), "SURGE_LOG_FORMAT": "json"}
    env["SURGE_WORKER_SLOTS"] = str(slots)
    env["SURGE_WORKER_RANK_FORKSERVER"] = "off"  # simulated ranks: no torch-importing fork server
    env["SURGE_WORKER_MEMORY_CHECK_SECONDS"] = "0"
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS", "SURGE_DATA_ROOT"):
        env.pop(var, None)
    return env


def prepare_corpus() -> None:
    if (HOME / "datasets" / "scale" / "v1").exists():
        return
    src = HOME / "corpus"
    shutil.rmtree(src, ignore_errors=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in CORPUS_PACKAGES:
        shutil.copytree(stdlib / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    r = cli("dataset", "prepare", "--name", "scale", "--version", "v1", "--source", str(src), "--val-fraction", "0.1")
    if r.returncode != 0:
        raise SystemExit(f"dataset prepare failed: {r.stderr.strip()[-500:]}")


# ------------------------------------------------------------------ /proc


def proc_sample(pid: int) -> dict:
    """CPU seconds (utime + stime) and peak RSS (VmHWM, bytes) of ``pid``; {} once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return {"cpu_s": (int(fields[11]) + int(fields[12])) / tick, "hwm": hwm, "rss": rss}


def rank_memory() -> tuple[int, int]:
    """(simulated rank processes alive, their summed PSS in bytes): what hundreds of rank
    processes cost this machine (shared pages counted once, pro rata)."""
    count = pss = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if b"services.rank.simulated" not in (d / "cmdline").read_bytes():
                continue
            rollup = (d / "smaps_rollup").read_text()
        except OSError:
            continue
        count += 1
        pss += next((int(x.split()[1]) * 1024 for x in rollup.splitlines() if x.startswith("Pss:")), 0)
    return count, pss


class Sampler:
    """Polls the data and store services' /proc every second (their last sample counts:
    CPU is cumulative, VmHWM is the peak), and the simulated ranks' memory every 5 s."""

    def __init__(self, pids: dict[str, int]):
        self.pids, self.last = pids, {name: {} for name in pids}
        self.ranks_peak = (0, 0)  # (processes, PSS bytes) at the largest PSS seen
        self.load_peak = os.getloadavg()[0]  # the 1-minute load average's peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(1.0):
            self.sample()
            n += 1
            if n % 5 == 0:
                self.ranks_peak = max(self.ranks_peak, rank_memory(), key=lambda c: c[1])

    def sample(self) -> None:
        self.load_peak = max(self.load_peak, os.getloadavg()[0])
        for name, pid in self.pids.items():
            s = proc_sample(pid)
            if s:
                self.last[name] = s

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(5)
        self.sample()
        return self.last


# ------------------------------------------------------------------ one world size


def rank_lines(job_id: str) -> list[dict]:
    out = []
    for f in (HOME / "run" / "logs").glob(f"{job_id}.rank*.log"):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"sim_' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def stack_pids() -> dict:
    return {name: s["pid"] for name, s in json.loads((HOME / "run" / "stack.json").read_text())["services"].items()}


def kill_stack(pids: dict) -> None:
    """`surgectl down --force`, then SIGKILL by PID whatever of this stack survived: the
    services and the rank processes of its node agents (their command lines name the
    agent's port)."""
    try:
        cli("down", "--force", timeout=90)
    except subprocess.TimeoutExpired:
        pass
    services = (
        json.loads((HOME / "run" / "stack.json").read_text())["services"]
        if (HOME / "run" / "stack.json").exists()
        else {}
    )
    ports = [s.get("port") for name, s in services.items() if name.startswith("worker")]
    victims = set(pids.values())
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(f"--session 127.0.0.1:{p} " in cmd for p in ports if p):
            victims.add(int(d.name))
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_size(world: int, args) -> dict:
    from services.cli import clients
    from services.contract import control_pb2, store_pb2

    workers = math.ceil(world / args.slots)
    for f in HOME.glob("control.db*"):
        f.unlink()  # a fresh control per size: no job of an earlier run is restored
    shutil.rmtree(HOME / "run" / "logs", ignore_errors=True)
    t_up = time.time()
    up = subprocess.run(
        [*SURGECTL, "up", "--workers", str(workers)], cwd=REPO, env=stack_env(args.slots),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if up.returncode != 0:
        return {"world_size": world, "error": f"surgectl up: {(up.stdout + up.stderr).strip()[-800:]}"}
    pids = stack_pids()
    result: dict = {"world_size": world, "node_agents": workers, "slots_per_agent": args.slots}
    result["stack_up_s"] = round(time.time() - t_up, 1)
    sampler = Sampler({"data": pids["data"], "store": pids["store"]})
    before = {name: proc_sample(pid) for name, pid in (("data", pids["data"]), ("store", pids["store"]))}
    result["load_at_start"] = round(os.getloadavg()[0], 1)
    hogs: list[subprocess.Popen] = []
    try:
        os.environ.update({"SURGE_HOME": str(HOME)})
        for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
            os.environ.pop(var, None)
        spec = job_spec(f"scale-{world}", world, args.steps, args.every, args.step_time, args.shard_bytes)
        path = HOME / "jobs" / f"scale-{world}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        r = cli("submit", str(path))
        if r.returncode != 0:
            result["error"] = f"submit: {r.stderr.strip()[-500:]}"
            return result
        job_id = r.stdout.split("submitted ", 1)[1].split()[0]
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range(args.hogs)
        ]  # the other work on the machine, from the job's start to its end
        t0 = time.time()
        deadline = t0 + 90 + world * 0.5 + args.steps * args.step_time * 4
        status, stopped = None, False
        while True:
            status = clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=30))
            if status.state == control_pb2.TERMINATED:
                break
            if time.time() > deadline and not stopped:
                stopped = True
                result["stopped_at_deadline_s"] = round(time.time() - t0, 1)
                clients.call("control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job_id), timeout=30))
                deadline += 60
            elif time.time() > deadline:
                break
            time.sleep(2.0)
        result["job_wall_s"] = round(time.time() - t0, 1)
        result["job_state"] = control_pb2.JobState.Name(status.state)
        result["job_outcome"] = control_pb2.JobOutcome.Name(status.outcome)
        result["job_message"] = status.message[:300]
        result["job_step"] = int(status.step)
        catalog = clients.call("store", lambda s: s.List(store_pb2.CheckpointQuery(job_id=job_id), timeout=30))
        committed_versions = len(catalog.checkpoints)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        usage = sampler.stop()
        kill_stack(pids)
    lines = rank_lines(job_id)
    starts = [
        x["stream_start_s"]
        for x in lines
        if x.get("event") == "sim_stream_started" and x.get("stream_start_s") is not None
    ]
    waits = [
        w for x in lines if x.get("event") == "sim_step" and x.get("step", 0) > 1 for w in x.get("batch_waits_s", [])
    ]
    saves = [x for x in lines if x.get("event") == "sim_save"]
    commit_s = [x["commit_s"] for x in saves if x.get("committed")]
    asked = len({s for s in range(1, args.steps + 1) if s % args.every == 0} | {args.steps})
    finished = sum(1 for x in lines if x.get("event") == "sim_report" and x.get("outcome") == "finished")
    result.update(
        job_id=job_id,
        ranks_finished=finished,
        streams_started=len(starts),
        stream_start_p50_s=pct(starts, 0.5),
        stream_start_max_s=max(starts) if starts else None,
        batch_wait_p50_ms=None if not waits else round(1000 * pct(waits, 0.5), 3),
        batch_wait_p99_ms=None if not waits else round(1000 * pct(waits, 0.99), 3),
        batch_waits=len(waits),
        saves_asked=asked,
        saves_committed=committed_versions,  # the store's catalog (rank 0's own account: save_outcomes)
        save_outcomes=[{k: v for k, v in x.items() if k in ("step", "committed", "cause", "commit_s")} for x in saves],
        save_commit_p50_s=pct(commit_s, 0.5),
        save_commit_max_s=max(commit_s) if commit_s else None,
    )
    result["saves_committed_share"] = round(min(result["saves_committed"], asked) / asked, 3)
    result["cpu_hogs"] = args.hogs
    result["load_peak"] = round(sampler.load_peak, 1)
    alive, pss = sampler.ranks_peak
    result["rank_processes_at_peak"] = alive
    result["rank_pss_mib_total"] = round(pss / 2**20, 1)
    result["rank_pss_mib_each"] = round(pss / 2**20 / alive, 1) if alive else None
    for name in ("data", "store"):
        u, b = usage.get(name, {}), before.get(name, {})
        result[f"{name}_peak_rss_mib"] = round(u.get("hwm", 0) / 2**20, 1) if u else None
        result[f"{name}_cpu_s"] = round(u["cpu_s"] - b.get("cpu_s", 0.0), 2) if u else None
    return result


def print_table(results: list[dict]) -> None:
    def f(v, digits=2):
        return "n/a" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    header = (
        "ranks", "streams started", "stream start p50/max s", "batch p50/p99 ms", "save->commit p50/max s",
        "saves committed", "data RSS MiB / CPU s", "store RSS MiB / CPU s", "load start/peak (hogs)", "job",
    )  # fmt: skip
    rows = []
    for r in results:
        if "error" in r and "job_id" not in r:
            rows.append((str(r["world_size"]), r["error"][:60], "", "", "", "", "", "", "", ""))
            continue
        rows.append((
            str(r["world_size"]),
            f"{r['streams_started']}/{r['world_size']}",
            f"{f(r['stream_start_p50_s'])}/{f(r['stream_start_max_s'])}",
            f"{f(r['batch_wait_p50_ms'], 1)}/{f(r['batch_wait_p99_ms'], 1)}",
            f"{f(r['save_commit_p50_s'])}/{f(r['save_commit_max_s'])}",
            f"{r['saves_committed']}/{r['saves_asked']} ({100 * r['saves_committed_share']:.0f} %)",
            f"{f(r['data_peak_rss_mib'], 0)} / {f(r['data_cpu_s'], 1)}",
            f"{f(r['store_peak_rss_mib'], 0)} / {f(r['store_cpu_s'], 1)}",
            f"{f(r.get('load_at_start'), 1)}/{f(r.get('load_peak'), 1)} ({r.get('cpu_hogs', 0)})",
            f"{r['job_state']} {r['job_outcome']} step {r['job_step']} in {r['job_wall_s']} s"
            + (" (stopped at deadline)" if "stopped_at_deadline_s" in r else ""),
        ))  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="64,128,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    ap.add_argument("--step-time", type=float, default=0.5, help="simulate.step_time_s")
    ap.add_argument("--shard-bytes", type=int, default=64 << 10, help="simulate.shard_bytes")
    ap.add_argument("--slots", type=int, default=16, help="rank slots per node agent")
    ap.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside the job (a loaded machine)")
    ap.add_argument("--out", default=str(RESULTS / "scale.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.world_sizes.split(",") if x]
    if any(w <= 0 for w in sizes) or args.steps <= 0 or args.every <= 0 or args.slots <= 0 or args.hogs < 0:
        print("error: --world-sizes, --steps, --every and --slots must be positive, --hogs >= 0", file=sys.stderr)
        return 2
    HOME.mkdir(parents=True, exist_ok=True)
    prepare_corpus()
    results = []
    for world in sizes:
        t = time.time()
        print(f"scale: {world} simulated ranks ...", file=sys.stderr, flush=True)
        results.append(run_size(world, args))
        print(f"scale: {world} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    out = {
        "bench": "scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": vars(args),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print_table(results)
    print(f"\n(results: {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
