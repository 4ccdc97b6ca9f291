"""Shared pieces of the benchmarks: a private SURGE_HOME, the local stack, a Surge job run
to its end, a torchrun run, per-step records, statistics and the results file.

Everything a benchmark starts lives under ``$SURGE_HOME/bench`` (its own SURGE_HOME), datasets
under ``$SURGE_HOME/datasets`` (shared with `make demo`, prepared once, ~2 s); SURGE_HOME unset:
the clone's ``.surge``, as for every surgectl command (README: all state lives under SURGE_HOME). Times are wall-clock
``time.time()`` seconds unless a name says otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BENCH_ROOT_ENV = "SURGE_BENCH_ROOT"  # the root setup_env chose, for the children it starts


def surge_root() -> Path:
    """Where the benches keep their state: the operator's SURGE_HOME (default: the clone's
    ``.surge``). A bench's child (multiprocessing, a subprocess) runs with SURGE_HOME set to
    the bench's own home below it, so the root :func:`setup_env` chose is handed down apart."""
    home = os.environ.get(BENCH_ROOT_ENV) or os.environ.get("SURGE_HOME")
    return Path(home).expanduser().absolute() if home else REPO / ".surge"


BENCH_HOME = surge_root() / "bench"
DATA_ROOT = surge_root() / "datasets"
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")


def setup_env() -> None:
    """Point every Surge client and service this process starts at the bench home, and
    prepare the stdlib dataset if it is missing."""
    os.environ[BENCH_ROOT_ENV] = str(BENCH_HOME.parent)
    os.environ["SURGE_HOME"] = str(BENCH_HOME)
    os.environ["SURGE_DATA_ROOT"] = str(DATA_ROOT)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("SURGE_LOG_FORMAT", "json")
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        os.environ.pop(var, None)
    BENCH_HOME.mkdir(parents=True, exist_ok=True)
    if not (DATA_ROOT / "stdlib" / "v1" / "manifest.json").exists():
        from services.data.prepare import default_stdlib_source, prepare_dataset

        prepare_dataset(default_stdlib_source(), "stdlib", "v1", DATA_ROOT)


def write_spec(base: Path, name: str, **overrides) -> Path:
    """A copy of job spec ``base`` with top-level keys replaced (``steps=60``) and nested
    ones given as ``section__key`` (``liveness__stall_min_seconds=10``)."""
    from services.jobspec import read_spec_mapping

    spec = read_spec_mapping(base.read_text(), str(base))  # (as jobspec reads a job file: 5.0e5 a float)
    spec["name"] = name
    for key, value in overrides.items():
        if "__" in key:
            section, sub = key.split("__", 1)
            spec.setdefault(section, {})[sub] = value
        else:
            spec[key] = value
    out = BENCH_HOME / "jobs" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


class Stack:
    """`surgectl up` / `down` for the bench home (a context manager)."""

    def __init__(self, workers: int = 2):
        self.workers = workers

    def __enter__(self) -> Stack:
        from services.cli import stack

        if stack.read_stack() is not None:
            stack.down()
        # A fresh control database per benchmark: jobs of an earlier run (or an older
        # schema) must not be restored into this one.
        for f in BENCH_HOME.glob("control.db*"):
            f.unlink()
        self.procs = stack.up(num_workers=self.workers)
        return self

    def __exit__(self, *exc) -> None:
        from services.cli import stack

        stack.down()

    def pid(self, service: str) -> int:
        return self.procs[service].pid

    def log(self, service: str) -> Path:
        return Path(self.procs[service].log)


def wait_forkservers_warm(count: int, timeout_s: float = 120.0) -> float:
    """Block until ``count`` rank fork servers have finished their imports (their
    ``forkserver_ready`` lines in the node agents' fork server logs): a job submitted to agents that
    have been up a while, not to ones still starting. Returns the seconds waited.
    Raises TimeoutError."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        logs = (BENCH_HOME / "run" / "logs").glob("forkserver-*.log")
        ready = sum(f.read_text().count('"forkserver_ready"') for f in logs)
        if ready >= count:
            return time.time() - t0
        time.sleep(0.2)
    raise TimeoutError(f"{count} rank fork servers not ready after {timeout_s:.0f} s")


def submit(spec_path: Path):
    """Submit through surgectl's own code path; returns (job_id, submit unix time)."""
    from services.cli.jobs import submit_job

    t = time.time()
    status = submit_job(spec_path)
    return status.job_id, t


def job_status(job_id: str):
    from services.cli import clients
    from services.contract import control_pb2

    return clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=job_id), timeout=10))


def wait_job(job_id: str, timeout_s: float):
    """Block until the job is TERMINATED (polled every 0.5 s: a harness, not Surge).
    Raises TimeoutError."""
    from services.contract import control_pb2

    end = time.time() + timeout_s
    while time.time() < end:
        s = job_status(job_id)
        if s.state == control_pb2.TERMINATED:
            return s
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f} s")


def job_events(job_id: str) -> list:
    """The job's event log (control's history: state, fault, decision, ...)."""
    from services.cli import clients
    from services.contract import control_pb2

    with clients.stub("control") as s:
        return list(s.WatchJob(control_pb2.JobQuery(job_id=job_id, follow=False), timeout=30))


def surge_steps(job_id: str) -> dict[int, list[dict]]:
    """Per rank, the StepCompleted records the store's metrics logger wrote, in order."""
    path = BENCH_HOME / "store" / "metrics" / f"{job_id}.jsonl"
    out: dict[int, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("type") == "step":
                out.setdefault(int(rec.get("rank", 0)), []).append(rec)
    return out


@dataclass
class TorchrunRun:
    log: Path
    t_launch: float
    proc: subprocess.Popen | None = None
    records: list[dict] = field(default_factory=list)

    def read(self) -> list[dict]:
        self.records = (
            [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()] if self.log.exists() else []
        )
        return self.records

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if "step" in r]


def torchrun(
    spec_path: Path,
    *,
    steps: int = 0,
    extra: list[str] = (),
    torchrun_args: list[str] = (),
    wait: bool = True,
    timeout_s: float = 900.0,
    device: str = "cpu",
    nproc: int = 2,
) -> TorchrunRun:
    """``torchrun --standalone --nproc-per-node N bench/torchrun_ddp.py`` on ``spec_path``."""
    log = Path(tempfile.mkstemp(prefix="torchrun-", suffix=".jsonl", dir=BENCH_HOME)[1])
    log.unlink()
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        *torchrun_args,
        str(REPO / "bench/torchrun_ddp.py"),
        "--spec",
        str(spec_path),
        "--data-root",
        str(DATA_ROOT),
        "--step-log",
        str(log),
        "--device",
        device,
    ]
    if steps:
        cmd += ["--steps", str(steps)]
    cmd += list(extra)
    run = TorchrunRun(log=log, t_launch=time.time())
    run.proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(str(log) + ".err", "w"), start_new_session=True
    )
    if wait:
        try:
            rc = run.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(run.proc)
            raise
        if rc != 0:
            raise RuntimeError(f"torchrun exited {rc}: {Path(str(log) + '.err').read_text()[-2000:]}")
        run.read()
    return run


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group a benchmark started (start_new_session=True)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def steady_tokens_per_s(records: list[dict], warmup: int) -> float:
    """Tokens / wall seconds from the end of step ``warmup`` to the end of the last step
    (every gap between steps is counted: event emission, logging, data waits)."""
    recs = sorted(records, key=lambda r: r["step"])
    base = next(r for r in recs if r["step"] == warmup)
    tail = [r for r in recs if r["step"] > warmup]
    return sum(r["tokens"] for r in tail) / (tail[-1]["unix_time"] - base["unix_time"])


def summary(values: list[float]) -> dict:
    """median and min-max (the form every table prints)."""
    v = [float(x) for x in values]
    return (
        {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v), "values": v}
        if v
        else {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0, "values": []}
    )


def fmt(s: dict, unit: str = "", digits: int = 2) -> str:
    if not s.get("n"):
        return "n/a"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def machine() -> dict:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "quick": QUICK,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)
    return path


def report(name: str, result: dict, out: Path | None) -> None:
    """Print ``result`` as JSON and keep it: at ``out`` if given, else as ``name``'s result."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
    else:
        save(name, result)


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
