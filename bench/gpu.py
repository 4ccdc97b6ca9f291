"""bench/gpu.sh's body: a one-command GPU qualification of Surge, through its real services.

    bench/gpu.sh [--spec bench/jobs/llama1b.yaml] [--steps 30] [--warmup 10] [--gpus N]
                 [--compile both|off|on] [--kv-heads 8] [--peak-tflops T] [--budget-s 480]
                 [--gpu-memory-gib G] [--dry-run]

On every GPU of the machine (``--gpus``: how many nvidia-smi lists), one stack
(``surgectl up --workers 1``: one node agent offering every GPU, ``backend: auto`` picks
NCCL), jobs submitted as a user submits them (``surgectl submit``'s code path), each a
~1 B-parameter Llama-shaped model (bench/jobs/llama1b.yaml) at bf16:

* training, tokens/s and MFU, for each layout: DDP (dp = N), FSDP2 (dp = N), TP (tp = N)
  and FSDP2 x TP (dp = N / 2, tp = 2), each with ``operators.compile`` off and on;
* a SIGKILL of rank 1 of a DDP job whose policy rebuilds in place (``rank_exit: rebuild``):
  seconds from the kill to the orchestrator's "first step after the recovery" (survivors
  and the replacement training again over a rebuilt NCCL group);
* a save and a restore: the first DDP job saves at its end, after its timed steps
  (synchronously: the loop's stall and rank 0's commit, from the rank logs'
  ``checkpoint_staged`` / ``checkpoint_committed``), then a job ``init_from`` that version
  (weights + optimizer) loads it (the slowest rank's ``checkpoint_loaded``: ask the store,
  read and verify every byte).

What cannot run here is skipped with its reason in the table: NCCL cannot run two ranks on
one GPU, so with one GPU TP, FSDP2 x TP and the rebuild (which needs a live peer) are
skipped and DDP / FSDP2 run one rank (no gradient exchange); a layout whose estimated memory
per rank (services/memory_estimate.py, what ``submit --dry-run`` prints) exceeds the GPU's;
and whatever would overrun ``--budget-s`` (8 minutes) by the plan's estimate of its time.
The compile-off runs, the rebuild and the save / restore go first, then the compiled ones.

Tokens/s: rank 0's steps after ``--warmup``, wall time (c.steady_tokens_per_s). MFU =
tokens/s x FLOPs per token / (peak x ranks), FLOPs per token = 6 N + 12 L d T
(services/engine/training_loop.py: model_flops_per_token; the PaLM appendix B count that
nanoGPT and torchtitan use), peak = ``--peak-tflops`` or the dense bf16 peak of the GPU
nvidia-smi names (``PEAK_TFLOPS``: H100 / H200 989, A100 312; vendor data sheets).

``--kv-heads``: grouped-query attention's KV heads (default: the spec's, 8 as Llama 3;
``--kv-heads 32`` is full multi-head attention). ``--dry-run`` (CI: tests/bench/test_bench_tools.py): no GPU; builds
every configuration's job spec for ``--gpus`` (default 8), validates it with the real job
spec validation and memory estimate, and prints the plan (what runs, what is skipped and
why, the estimated time). Results: ``bench/results/gpu.json`` and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s (NVIDIA data sheets; SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}
SPEC = c.REPO / "bench/jobs/llama1b.yaml"
KILL_AT_STEP = 10  # the rebuild trial's SIGKILL, after warm-up
RESTORE_STEPS = 3
# The plan's guesses of a job's wall time on an H100-class GPU (seconds), to keep to the
# budget: submit -> first step without compile (process start, imports, a 1 B model built
# and moved, NCCL rendezvous, data stream), the compile of forward and backward on top, a
# rebuild's recovery, and the MFU a step is assumed to reach.
START_S, COMPILE_S, REBUILD_S, SAVE_S, ASSUMED_MFU = 45.0, 75.0, 30.0, 30.0, 0.35
NO_SHARED_GPU = "NCCL cannot run two ranks on one GPU"


class UsageError(ValueError):
    pass


@dataclass
class Config:
    """One row of the qualification: a job spec's overrides, or why it does not run here."""

    name: str
    kind: str  # "train" | "rebuild" | "restore"
    parallel: dict
    compile: bool = False
    save: bool = False  # a train job that saves at its end (what "restore" loads)
    skip: str = ""
    ranks: int = 1
    estimate_s: float = 0.0
    checks: dict = field(default_factory=dict)  # params, FLOPs/token, memory per rank


def peak_for(gpu_name: str) -> float:
    """Dense bf16 peak (TFLOP/s) of a GPU by the name nvidia-smi reports.

    Raises: UsageError for a GPU not in ``PEAK_TFLOPS`` (pass --peak-tflops)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in gpu_name.upper():
            return PEAK_TFLOPS[key]
    raise UsageError(f"--peak-tflops: unknown GPU {gpu_name!r}; pass its dense bf16 peak in TFLOP/s")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all; --dry-run: 8)")
    ap.add_argument("--compile", choices=("both", "off", "on"), default="both")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--gpu-memory-gib", type=float, default=0.0, help="default: nvidia-smi's; --dry-run: 80")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 1:
        raise UsageError(f"--steps: must be > --warmup + 1 ({args.warmup + 1}), got {args.steps}")
    if args.warmup < 1:
        raise UsageError(f"--warmup: must be >= 1, got {args.warmup}")
    for flag in ("gpus", "kv_heads"):
        if (getattr(args, flag) or 0) < 0:
            raise UsageError(f"--{flag.replace('_', '-')}: must be >= 0, got {getattr(args, flag)}")
    for flag in ("peak_tflops", "budget_s", "gpu_memory_gib"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    if not args.spec.is_file():
        raise UsageError(f"--spec: no such file: {args.spec}")
    return args


def layouts(n_gpus: int, spec: dict) -> list[tuple[str, dict, str]]:
    """(name, parallel overrides, skip reason) of the four layouts on ``n_gpus`` GPUs."""
    heads = spec["model"]["n_heads"]
    one = n_gpus == 1
    out = [
        ("DDP dp=1 (one rank)" if one else f"DDP dp={n_gpus}", {"dp": n_gpus, "data_parallel": "ddp"}, ""),
        ("FSDP2 dp=1 (one rank)" if one else f"FSDP2 dp={n_gpus}", {"dp": n_gpus, "data_parallel": "fsdp2"}, ""),
    ]
    tp_skip = f"needs 2+ GPUs ({NO_SHARED_GPU})" if one else ""
    if not tp_skip and heads % n_gpus:
        tp_skip = f"tp={n_gpus} does not divide model.n_heads ({heads})"
    out.append((f"TP tp={max(n_gpus, 2)}", {"dp": 1, "tp": max(n_gpus, 2), "data_parallel": "ddp"}, tp_skip))
    dp = max(n_gpus // 2, 2)
    mixed_skip = "" if n_gpus >= 4 and n_gpus % 2 == 0 else f"needs an even 4+ GPUs for dp>=2 x tp=2 ({NO_SHARED_GPU})"
    out.append((f"FSDP2 dp={dp} x TP tp=2", {"dp": dp, "tp": 2, "data_parallel": "fsdp2"}, mixed_skip))
    return out


def plan(args: argparse.Namespace, n_gpus: int, gpu_memory: float, peak: float, out_dir: Path) -> tuple[dict, list]:
    """Every configuration's job spec, validated with the real job spec validation and
    memory estimate; returns (the base facts, the configurations in running order).

    Raises: UsageError naming the spec's field (a spec the real validation refuses)."""
    from services.jobspec import JobSpecError
    from services.memory_estimate import estimate_memory, human_bytes

    base = yaml.safe_load(args.spec.read_text())
    if args.kv_heads:
        base["model"]["n_kv_heads"] = args.kv_heads
    configs: list[Config] = []
    runs = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    for compiled in runs:
        # The compiled runs come last, FSDP2 first (the layout most jobs train with), so a
        # budget spent early costs the least-used rows.
        order = layouts(n_gpus, base)
        if compiled:
            order = [order[1], order[0], *order[2:]]
        for name, parallel, skip in order:
            save = not compiled and parallel["data_parallel"] == "ddp" and parallel.get("tp", 1) == 1
            label = f"{name}, compile {'on' if compiled else 'off'}" + (", then a save" if save else "")
            configs.append(Config(label, "train", parallel, compile=compiled, skip=skip, save=save))
        if not compiled:  # the fault and the checkpoint rows, before the compiled runs
            configs.append(
                Config(
                    f"SIGKILL rank 1, rebuild in place (DDP dp={n_gpus})",
                    "rebuild",
                    {"dp": n_gpus, "data_parallel": "ddp"},
                    skip="" if n_gpus >= 2 else f"needs 2+ GPUs (a rebuild heals from a live peer; {NO_SHARED_GPU})",
                )
            )
            configs.append(Config(f"restore of that save (DDP dp={n_gpus})", "restore", {"dp": n_gpus}))
    facts: dict = {"gpus": n_gpus, "gqa": base["model"].get("n_kv_heads", 0), "peak_tflops": peak}
    threads = max(1, (os.cpu_count() or 1) // max(n_gpus, 1))
    for i, cfg in enumerate(configs):
        cfg.ranks = cfg.parallel["dp"] * cfg.parallel.get("tp", 1)
        spec_dict = job_spec(base, cfg, args, peak, threads, name="dryrun")
        path = out_dir / f"{i}-{cfg.kind}.yaml"
        path.write_text(yaml.safe_dump(spec_dict, sort_keys=False))
        try:
            spec = _load(path)
        except JobSpecError as e:
            raise UsageError(f"{cfg.name}: {e}") from None
        est = estimate_memory(spec)
        flops = _flops_per_token(spec, est.total_parameters)
        facts["params"], facts["flops_per_token"] = est.total_parameters, flops
        cfg.checks = {"memory_per_rank_bytes": est.total, "memory_per_rank": human_bytes(est.total)}
        if not cfg.skip and est.total > gpu_memory:
            cfg.skip = f"estimated {human_bytes(est.total)} per rank > the GPU's {human_bytes(gpu_memory)}"
        tokens_per_step = spec.data.micro_batch_size * spec.data.seq_len * spec.parallel.dp
        step_s = tokens_per_step * flops / (peak * 1e12 * ASSUMED_MFU * cfg.ranks)
        if cfg.kind == "train":
            cfg.estimate_s = START_S + (COMPILE_S if cfg.compile else 0.0) + args.steps * step_s
            cfg.estimate_s += SAVE_S if cfg.save else 0.0
        elif cfg.kind == "rebuild":
            cfg.estimate_s = START_S + (KILL_AT_STEP + 5) * step_s + REBUILD_S
        else:
            cfg.estimate_s = START_S + SAVE_S + RESTORE_STEPS * step_s
    return facts, configs


def _load(path: Path):
    from services.jobspec import load_job_spec

    return load_job_spec(path)


def _flops_per_token(spec, params: int) -> float:
    # Not services.engine.training_loop's import chain (torch) in a dry run: the same formula.
    m = spec.model
    return 6.0 * params + 12.0 * m.n_layers * m.d_model * spec.data.seq_len


def job_spec(
    base: dict, cfg: Config, args: argparse.Namespace, peak: float, threads: int, name: str, saved_job: str = "dry-run"
) -> dict:
    """The job spec (a dict, as a YAML file holds it) of ``cfg``."""
    spec = json.loads(json.dumps(base))
    spec["name"] = name
    spec["steps"] = args.steps
    spec["parallel"].update(cfg.parallel, backend="auto", peak_tflops_per_device=peak, threads_per_rank=threads)
    spec.setdefault("operators", {})["compile"] = cfg.compile
    if cfg.kind == "rebuild":
        spec["steps"] = 100_000  # stopped once the survivors train again
        spec["fault_policy"] = {"actions": {"rank_exit": "rebuild"}, "max_restarts": 2}
    if cfg.save:  # the save at the end, synchronous: the loop's whole stall
        spec["checkpoint"] = {"every_steps": 0, "keep_last": 1, "at_end": True, "async": False}
    if cfg.kind == "restore":
        spec.update(steps=RESTORE_STEPS, checkpoint={"every_steps": 0, "at_end": False})
        spec["init_from"] = {"checkpoint": f"{saved_job}:latest", "load": "weights+optimizer"}
    return spec


def gpus() -> list[tuple[str, float]]:
    """(name, memory bytes) of every GPU nvidia-smi lists. Raises UsageError: none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        out = subprocess.CompletedProcess([], 127, "", "")
    rows = [line.rsplit(",", 1) for line in out.stdout.strip().splitlines() if "," in line]
    if out.returncode != 0 or not rows:
        raise UsageError("nvidia-smi found no GPU (bench/gpu.sh needs one; --dry-run checks the set-up without)")
    return [(n.strip(), float(m) * 2**20) for n, m in rows]


# ------------------------------------------------------------------ runs on the stack


def run_train(cfg: Config, spec_path: Path, args: argparse.Namespace, facts: dict) -> dict:
    job, submitted = c.submit(spec_path)
    status = c.wait_job(job, timeout_s=max(240.0, 3 * cfg.estimate_s))
    recs = c.surge_steps(job).get(0, [])
    if len(recs) < args.steps:
        return {"job": job, "error": f"ended ({status.message}) after {len(recs)} of {args.steps} steps"}
    tps = c.steady_tokens_per_s(recs, args.warmup)
    mfu = tps * facts["flops_per_token"] / (facts["peak_tflops"] * 1e12 * cfg.ranks)
    out = {"job": job, "tokens_per_s": tps, "mfu": mfu, "first_step_s": recs[0]["unix_time"] - submitted}
    if cfg.save:
        logs = c.BENCH_HOME / "run" / "logs"
        staged = _log_values(logs, job, "checkpoint_staged", "blocked_s")
        committed = _log_values(logs, job, "checkpoint_committed", "commit_s")
        if not staged or not committed:
            return {**out, "error": f"no save in the rank logs ({status.message})"}
        out["save_stall_s"] = max(staged)  # the slowest rank's loop stall: snapshot copy + the write
        out["commit_s"] = max(committed)  # rank 0: the store hashes and commits the version
    return out


def run_rebuild(cfg: Config, spec_path: Path) -> dict:
    from bench.faults import _watch, pids_with
    from services.cli import clients
    from services.contract import control_pb2

    job, _ = c.submit(spec_path)
    events: list = []
    threading.Thread(target=_watch, args=(job, events), daemon=True).start()
    try:
        deadline = time.time() + 300
        while c.job_status(job).step < KILL_AT_STEP and time.time() < deadline:
            time.sleep(0.05)
        pids = pids_with(f"--job {job} --rank 1")
        if not pids:
            return {"job": job, "error": f"rank 1 not found at step {c.job_status(job).step}"}
        pid = pids[0]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 180
        first = []
        while time.time() < deadline and not first:
            first = [e for e in list(events) if e.type == "recovery" and e.message.startswith("first step")]
            time.sleep(0.05)
        faults = [e for e in list(events) if e.type == "fault"]
        if not first:
            return {"job": job, "error": "no first step after the recovery within 180 s", "faults": len(faults)}
        return {
            "job": job,
            "detect_s": faults[0].unix_time - t_kill if faults else None,
            "kill_to_training_s": first[0].unix_time - t_kill,
            "recovery_event": first[0].message,
        }
    finally:
        try:
            clients.call("control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job), timeout=10))
            c.wait_job(job, 60)
        except Exception:  # noqa: BLE001 - a job that will not stop: end its ranks by PID
            for pid in pids_with(f"--job {job} "):
                os.kill(pid, signal.SIGKILL)


def run_restore(spec_path: Path) -> dict:
    job, _ = c.submit(spec_path)
    status = c.wait_job(job, timeout_s=300)
    logs = c.BENCH_HOME / "run" / "logs"
    asked, read = (_log_values(logs, job, "checkpoint_loaded", k) for k in ("ask_s", "read_verified_s"))
    if not read:
        return {"job": job, "error": f"no checkpoint load in the rank logs ({status.message})"}
    # The slowest rank: ask the store, read and verify every byte.
    return {"job": job, "restore_s": max(a + b for a, b in zip(asked, read))}


def _log_values(logs: Path, job: str, event: str, key: str) -> list[float]:
    """``key`` of every ``event`` line in ``job``'s rank logs."""
    out = []
    for path in logs.glob(f"{job}.rank*.log"):  # the node agent names them <job>.rank<r>.log
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' in line:
                try:
                    out.append(float(json.loads(line).get(key, 0.0)))
                except (ValueError, TypeError):
                    continue
    return out


# ------------------------------------------------------------------ the command


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.dry_run:
            n_gpus, name, memory = args.gpus or 8, "(dry run)", (args.gpu_memory_gib or 80) * 2**30
            peak = args.peak_tflops or 989.0
        else:
            found = gpus()
            n_gpus = args.gpus or len(found)
            if n_gpus > len(found):
                raise UsageError(f"--gpus: {n_gpus} asked, nvidia-smi lists {len(found)}")
            name, memory = found[0]
            memory = args.gpu_memory_gib * 2**30 if args.gpu_memory_gib else memory
            peak = args.peak_tflops or peak_for(name)  # (bench/gpu.sh checked that the venv's torch has CUDA)
        with tempfile.TemporaryDirectory() as tmp:
            facts, configs = plan(args, n_gpus, memory, peak, Path(tmp))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    facts["gpu"] = name
    if args.dry_run:
        print_plan(facts, configs, args)
        return 0
    c.setup_env()
    t0 = time.time()
    base = yaml.safe_load(args.spec.read_text())
    if facts["gqa"]:
        base["model"]["n_kv_heads"] = facts["gqa"]
    rows = qualify(configs, base, args, peak, facts, threads=max(1, (os.cpu_count() or 1) // n_gpus))
    result = {
        "machine": {**c.machine(), "gpu": name, "gpus": n_gpus, "peak_tflops": peak},
        "facts": facts,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "total_seconds": time.time() - t0,
    }
    path = c.save("gpu", result)
    print(header(facts, args))
    print(c.table([(r["name"], str(r["ranks"]), _cell(r)) for r in rows], ("configuration", "ranks", "result")))
    print(f"{path.relative_to(c.REPO)}; {result['total_seconds']:.0f} s")
    return 0


def qualify(
    configs: list[Config],
    base: dict,
    args: argparse.Namespace,
    peak: float,
    facts: dict,
    threads: int,
    workers: int = 1,
) -> list[dict]:
    """Run ``configs`` in order on a stack of ``workers`` node agents (one: it offers every
    GPU), within ``args.budget_s``; one row per configuration (its result, or why not)."""
    t0 = time.time()
    rows: list[dict] = []
    saved_job = ""
    with c.Stack(workers=workers):
        for i, cfg in enumerate(configs):
            left = args.budget_s - (time.time() - t0)
            if cfg.kind == "restore" and not saved_job and not cfg.skip:
                cfg.skip = "no version to restore (the saving DDP row did not save)"
            if not cfg.skip and cfg.estimate_s > left:
                cfg.skip = (
                    f"over the {args.budget_s:.0f} s budget (estimated {cfg.estimate_s:.0f} s, {left:.0f} s left)"
                )
            row = {**asdict(cfg)}
            if cfg.skip:
                rows.append(row)
                continue
            spec = job_spec(base, cfg, args, peak, threads, f"gpu{i}-{cfg.kind}", saved_job)
            path = c.BENCH_HOME / "jobs" / f"{spec['name']}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(spec, sort_keys=False))
            t = time.time()
            try:
                if cfg.kind == "train":
                    res = run_train(cfg, path, args, facts)
                elif cfg.kind == "rebuild":
                    res = run_rebuild(cfg, path)
                else:
                    res = run_restore(path)
            except Exception as e:  # noqa: BLE001 - a failed row is reported, the next one runs
                res = {"error": f"{type(e).__name__}: {e}"[:400]}
            rows.append({**row, **res, "wall_s": time.time() - t})
            if cfg.save and "save_stall_s" in res:
                saved_job = res["job"]
            print(f"{cfg.name}: {_cell(rows[-1])}", flush=True)
    return rows


def header(facts: dict, args: argparse.Namespace) -> str:
    attn = f"GQA {facts['gqa']} KV heads" if facts["gqa"] else "full MHA"
    return (
        f"{facts['gpu']} x {facts['gpus']}, peak {facts['peak_tflops']:.0f} TFLOP/s bf16; "
        f"{facts.get('params', 0) / 1e9:.2f} G parameters ({attn}), {facts.get('flops_per_token', 0) / 1e9:.2f} "
        f"GFLOP/token; {args.steps} steps ({args.warmup} warm-up)"
    )


def _cell(r: dict) -> str:
    if r.get("skip"):
        return f"skipped: {r['skip']}"
    if r.get("error"):
        return f"FAILED: {r['error']}"
    if "tokens_per_s" in r:
        cell = f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f} %, first step {r['first_step_s']:.0f} s"
        if "save_stall_s" in r:
            cell += f"; save: loop stalled {r['save_stall_s']:.1f} s, commit {r['commit_s']:.1f} s"
        return cell
    if "kill_to_training_s" in r:
        return f"kill -> training again {r['kill_to_training_s']:.1f} s (detected {r['detect_s'] or 0:.1f} s)"
    if "restore_s" in r:
        return f"restore (ask, read, verify) {r['restore_s']:.1f} s"
    return f"estimated {r.get('estimate_s', 0):.0f} s"


def print_plan(facts: dict, configs: list[Config], args: argparse.Namespace) -> None:
    """The dry run's report: what would run, what is skipped and why, the estimated time."""
    print(f"plan: {header(facts, args)}")
    rows = []
    for cfg in configs:
        what = f"skipped: {cfg.skip}" if cfg.skip else f"runs, ~{cfg.estimate_s:.0f} s"
        rows.append((cfg.name, str(cfg.ranks), cfg.checks.get("memory_per_rank", "-"), what))
    print(c.table(rows, ("configuration", "ranks", "memory/rank (est.)", "plan")))
    total = sum(cfg.estimate_s for cfg in configs if not cfg.skip)
    over = " (the last ones in order are skipped at run time past it)" if total > args.budget_s else ""
    print(f"estimated total {total:.0f} s, budget {args.budget_s:.0f} s{over}")
    print(f"validated: {len(configs)} job specs (job spec validation and memory estimate), no GPU used")


if __name__ == "__main__":
    sys.exit(main())
