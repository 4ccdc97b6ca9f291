"""bench/gpu.sh's body: a one-command GPU qualification of Surge, through its real services.

    bench/gpu.sh [--spec bench/jobs/llama1b.yaml] [--steps 13] [--warmup 3] [--gpus N]
                 [--compile both|off|on] [--kv-heads 8] [--peak-tflops T] [--budget-s 480]
                 [--gpu-memory-gib G] [--dry-run]

On every GPU of the machine (``--gpus``, >= 1; left out: how many nvidia-smi lists), one
stack (``surgectl up --workers 1``: one node agent offering every GPU, its ranks forked
from its fork server, ``backend: auto`` picks NCCL), jobs submitted as a user submits them
(``surgectl submit``'s code path), each a
~1 B-parameter Llama-shaped model (bench/jobs/llama1b.yaml) at bf16:

* training, tokens/s and MFU, for each layout: DDP (dp = N), FSDP2 (dp = N), TP (tp = the
  largest divisor of N the model takes: its heads and KV heads divisible by it) and FSDP2 x
  TP (dp = N / 2, tp = 2), each with ``operators.compile`` off and on (the compile counted
  apart: it falls in the warm-up steps);
* a save and a restore: the first DDP job saves at its end, after its timed steps
  (asynchronously, as jobs save by default: the loop's stall, the copy off the GPU; the
  write and commit behind it, from the rank logs' ``checkpoint_staged`` /
  ``checkpoint_committed``; synchronous, 16.7 s stall on an H200), then a job ``init_from`` that version
  (weights + optimizer) loads it (the slowest rank's ``checkpoint_loaded``: ask the store,
  read and verify every byte);
* in that same job, once it stepped, ``surgectl profile``'s path: ``PROFILE_STEPS`` steps traced
  on every rank with a CUDA memory snapshot each, stored beside the job's metrics (ranks,
  traces, snapshots and MB in its row);
* in that same job (one start-up for all three), a SIGKILL of rank 1 at step ``KILL_AT_STEP``,
  its policy rebuilding in place (``rank_exit: rebuild``): seconds from the kill to the
  orchestrator's "first step after the recovery" (survivors and the replacement training
  again over a rebuilt NCCL group).

What cannot run here is skipped with its reason in the table: NCCL cannot run two ranks on
one GPU, so with one GPU TP, FSDP2 x TP and the rebuild (which needs a live peer) are
skipped and DDP / FSDP2 run one rank (no gradient exchange); a layout whose estimated memory
per rank (services/memory_estimate.py, what ``submit --dry-run`` prints) exceeds the GPU's;
a layout the model cannot take (the job spec validation's reason); and whatever would
overrun ``--budget-s`` (8 minutes, the stack's start included) by the plan's estimate of
its time (``STACK_S`` ...: one H200 run measured most, the rest guesses; their basis beside them), marked
"skipped: budget" in the plan already. The compile-off runs and the save / restore /
rebuild go first, then the compiled ones.

Tokens/s: rank 0's steps after ``--warmup``, wall time (c.steady_tokens_per_s). MFU =
tokens/s x FLOPs per token / (peak x ranks), FLOPs per token = 6 N + 12 L d T
(services/engine/training_loop/summary.py: model_flops_per_token; the PaLM appendix B count that
nanoGPT and torchtitan use), peak = ``--peak-tflops`` or the dense bf16 peak of the GPU
nvidia-smi names (services/common/device_peaks.py ``PEAK_TFLOPS``: H100 / H200 989, A100 312; vendor data sheets).

``--kv-heads``: grouped-query attention's KV heads (default: the spec's, 8 as Llama 3;
``--kv-heads 32`` is full multi-head attention). ``--dry-run`` (CI: tests/bench/test_bench_tools.py): no GPU; builds
every configuration's job spec for ``--gpus`` (default 8), validates it with the real job
spec validation and memory estimate, and prints the plan (what runs within the budget with
its estimate and the running total, what is skipped and why). ``--help`` and ``--dry-run``
need no CUDA. Results: ``bench/results/gpu.json`` and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from services.common.device_peaks import table_peak  # noqa: E402 (the ranks' own table)

SPEC = c.REPO / "bench/jobs/llama1b.yaml"
KILL_AT_STEP = 5  # the rebuild trial's SIGKILL: the restored job has trained a few steps
RESTORE_STEPS = 8  # a restore with no rebuild after it (one GPU): steps on the loaded state (the profile's among them)
PROFILE_STEPS = 2  # the restored job's `surgectl profile`: a trace and a CUDA memory snapshot per rank
FORKSERVER_ENV = "SURGE_WORKER_RANK_FORKSERVER"  # services/worker/__main__.py: eager = at the agent's start
# The plan's estimates of wall time (seconds), to keep to the budget. Measured on one H200
# (2026-12-04, bench/results/gpu.json, torch 2.11 + CUDA 13, 16 CPUs) where a row says so;
# the rest are guesses until a multi-GPU run measures them:
# - STACK_S: `surgectl up` (control, data, store, one node agent) and the agent's rank fork
#   server's imports (torch with CUDA): the run's total less its rows, 24 s measured.
# - START_S: submit -> first step of an uncompiled job, its ranks forked from the fork server:
#   CUDA context, the seeded init of 1.04 G float32 values, NCCL, the first batch and the
#   first step's warm-up: 15-16 s measured (one rank).
# - COMPILE_S: the first compiled step's extra time, counted apart from the timed steps.
#   Each block compiled in place (services/compute/operator_adapter.compile_regions): first
#   step 28 s, 12 s over uncompiled (the whole model compiled: 150 s). COMPILE_CACHED_S: the
#   same per-rank shapes compiled by an earlier row, Inductor's on-disk caches
#   (TORCHINDUCTOR_CACHE_DIR, shared by the run's rank processes) answering: first step 19 s.
# - SAVE_S / LOAD_S: weights + AdamW state of 1.04 G parameters (12.5 GB in float32) copied
#   off the GPU, written and hashed / asked for, read and verified: 16.7 s stall and 0.3 s
#   commit, 25.4 s load measured (0.75 and 0.5 GB/s, one rank writing and reading alone).
# - REBUILD_S: kill -> survivors and the replacement training again (1.9-4.3 s on CPU,
#   docs/LOG.md), with the replacement's CUDA init, NCCL re-init and a weight copy from a
#   live peer on top (a guess: it needs 2 GPUs).
# - PROFILE_S: `surgectl profile` of PROFILE_STEPS steps on every rank (the trace's export
#   and gzip, the CUDA memory snapshot's dump, their upload to the store): a guess (1.03-1.06x
#   a step traced on CPU, bench/profile_overhead.py; the export is most of it).
# - ASSUMED_MFU: a step's speed (each row's step time = its tokens x FLOPs/token / peak /
#   MFU): 45 % measured uncompiled, 55 % compiled.
STACK_S, START_S, COMPILE_S, COMPILE_CACHED_S = 24.0, 16.0, 12.0, 3.0
SAVE_S, LOAD_S, REBUILD_S, PROFILE_S, ASSUMED_MFU = 17.0, 26.0, 30.0, 15.0, 0.45
NO_SHARED_GPU = "NCCL cannot run two ranks on one GPU"


class UsageError(ValueError):
    pass


@dataclass
class Config:
    """One row of the qualification: a job spec's overrides, or why it does not run here."""

    name: str
    kind: str  # "train" | "restore" (loads the save; with ``rebuild``, then a SIGKILL + rebuild)
    parallel: dict
    compile: bool = False
    save: bool = False  # a train job that saves at its end (what "restore" loads)
    rebuild: bool = False  # a restore job whose rank 1 is then SIGKILLed and rebuilt in place
    skip: str = ""
    ranks: int = 1
    estimate_s: float = 0.0
    checks: dict = field(default_factory=dict)  # params, FLOPs/token, memory per rank


def peak_for(gpu_name: str) -> float:
    """Dense bf16 peak (TFLOP/s) of a GPU by the name nvidia-smi reports.

    Raises: UsageError for a GPU not in device_peaks.PEAK_TFLOPS (pass --peak-tflops)."""
    if (peak := table_peak(gpu_name)) is not None:
        return peak
    raise UsageError(f"--peak-tflops: unknown GPU {gpu_name!r}; pass its dense bf16 peak in TFLOP/s")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--steps", type=int, default=13, help="steps per run (default 13: 3 warm-up + 10 timed)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (a compile is counted apart)")
    ap.add_argument(
        "--gpus", type=int, default=None, help="GPUs to use, >= 1 (default: every GPU nvidia-smi lists; --dry-run: 8)"
    )
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
    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus: must be >= 1 (leave it out for every GPU nvidia-smi lists), got {args.gpus}")
    if args.kv_heads is not None and args.kv_heads < 1:
        raise UsageError(f"--kv-heads: must be >= 1, got {args.kv_heads}")
    for flag in ("peak_tflops", "budget_s", "gpu_memory_gib"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    if not args.spec.is_file():
        raise UsageError(f"--spec: no such file: {args.spec}")
    return args


def tp_degree(n_gpus: int, spec) -> tuple[int, str]:
    """(the largest tp > 1 dividing ``n_gpus`` that the model of ``spec`` (a JobSpec) takes,
    "") or (0, why none): the job spec's own check (heads, KV heads, width divisible by tp)."""
    from services.jobspec import check_parallel

    if n_gpus == 1:
        return 0, f"needs 2+ GPUs ({NO_SHARED_GPU})"
    for tp in range(n_gpus, 1, -1):
        if n_gpus % tp == 0:
            try:
                check_parallel(spec.model, tp, spec.parallel.model_copy(update={"dp": 1, "tp": tp, "pp": 1}))
                return tp, ""
            except ValueError:
                continue
    m = spec.model
    return 0, (f"no tp > 1 dividing {n_gpus} GPUs divides model.n_heads ({m.n_heads}) and n_kv_heads ({m.kv_heads})")


def layouts(n_gpus: int, spec) -> list[tuple[str, dict, str]]:
    """(name, parallel overrides, skip reason) of the four layouts on ``n_gpus`` GPUs;
    ``spec``: the base JobSpec (its model decides which TP degrees it takes)."""
    one = n_gpus == 1
    out = [
        ("DDP dp=1 (one rank)" if one else f"DDP dp={n_gpus}", {"dp": n_gpus, "data_parallel": "ddp"}, ""),
        ("FSDP2 dp=1 (one rank)" if one else f"FSDP2 dp={n_gpus}", {"dp": n_gpus, "data_parallel": "fsdp2"}, ""),
    ]
    tp, tp_skip = tp_degree(n_gpus, spec)
    # DDP cannot take TP shards (services/jobspec/parallel.py check_parallel): a TP degree below the
    # GPU count leaves GPUs idle in this row (the FSDP2 x TP row uses them all).
    name = f"TP tp={tp}" + (f" ({tp} of {n_gpus} GPUs)" if tp and tp < n_gpus else "") if tp else "TP"
    out.append((name, {"dp": 1, "tp": max(tp, 2), "data_parallel": "ddp"}, tp_skip))
    dp = max(n_gpus // 2, 2)
    mixed_skip = "" if n_gpus >= 4 and n_gpus % 2 == 0 else f"needs an even 4+ GPUs for dp>=2 x tp=2 ({NO_SHARED_GPU})"
    if not mixed_skip:
        try:
            from services.jobspec import check_parallel

            check_parallel(
                spec.model,
                n_gpus,
                spec.parallel.model_copy(update={"dp": dp, "tp": 2, "pp": 1, "data_parallel": "fsdp2"}),
            )
        except ValueError as e:
            mixed_skip = f"the model cannot take tp=2: {e}"
    out.append((f"FSDP2 dp={dp} x TP tp=2", {"dp": dp, "tp": 2, "data_parallel": "fsdp2"}, mixed_skip))
    return out


def plan(args: argparse.Namespace, n_gpus: int, gpu_memory: float, peak: float) -> tuple[dict, list]:
    """Every configuration's job spec, validated with the real job spec validation and
    memory estimate, each with its estimated time and marked skipped where it would overrun
    ``args.budget_s`` (STACK_S first); returns (the base facts, the configurations in
    running order).

    Raises: UsageError naming --spec's file and field (a spec the real validation refuses
    whatever the layout)."""
    from services.jobspec import JobSpecError, parse_job_spec
    from services.memory_estimate import estimate_memory, human_bytes

    base = yaml.safe_load(args.spec.read_text())
    if args.kv_heads:
        base["model"]["n_kv_heads"] = args.kv_heads
    try:
        base_spec = parse_job_spec(yaml.safe_dump(base), str(args.spec))
    except JobSpecError as e:
        raise UsageError(str(e)) from None
    configs: list[Config] = []
    runs = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    for compiled in runs:
        # The compiled runs come last, FSDP2 first (the layout most jobs train with), so a
        # budget spent early costs the least-used rows.
        order = layouts(n_gpus, base_spec)
        if compiled:
            order = [order[1], order[0], *order[2:]]
        for name, parallel, skip in order:
            save = not compiled and parallel["data_parallel"] == "ddp" and parallel.get("tp", 1) == 1
            label = f"{name}, compile {'on' if compiled else 'off'}" + (", then a save" if save else "")
            configs.append(Config(label, "train", parallel, compile=compiled, skip=skip, save=save))
        if not compiled:  # the checkpoint and fault row, before the compiled runs
            # One job: it loads the save, then (2+ GPUs) loses rank 1 to a SIGKILL and
            # rebuilds in place: one start-up for both trials.
            rebuild = n_gpus >= 2
            label = f"restore of that save (DDP dp={n_gpus}), a profile"
            label += ", then SIGKILL rank 1, rebuild in place" if rebuild else " (no rebuild: it needs 2+ GPUs)"
            configs.append(Config(label, "restore", {"dp": n_gpus, "data_parallel": "ddp"}, rebuild=rebuild))
    facts: dict = {"gpus": n_gpus, "gqa": base["model"].get("n_kv_heads", 0), "peak_tflops": peak}
    threads = max(1, (os.cpu_count() or 1) // max(n_gpus, 1))
    compiled_tp: set[int] = set()  # per-rank shapes an earlier row compiled (COMPILE_CACHED_S)
    spent = STACK_S
    saved = False
    for cfg in configs:
        cfg.ranks = cfg.parallel["dp"] * cfg.parallel.get("tp", 1)
        spec_dict = job_spec(base, cfg, args, peak, threads, name="dryrun")
        try:
            spec = parse_job_spec(yaml.safe_dump(spec_dict, sort_keys=False), f"{args.spec} as {cfg.name}")
        except JobSpecError as e:  # this layout only: the row says why, the others still plan
            cfg.skip = cfg.skip or str(e)
            continue
        est = estimate_memory(spec)
        flops = _flops_per_token(spec, est.total_parameters)
        facts["params"], facts["flops_per_token"] = est.total_parameters, flops
        cfg.checks = {"memory_per_rank_bytes": est.total, "memory_per_rank": human_bytes(est.total)}
        if not cfg.skip and est.total > gpu_memory:
            cfg.skip = f"estimated {human_bytes(est.total)} per rank > the GPU's {human_bytes(gpu_memory)}"
        if cfg.kind == "restore" and not cfg.skip and not saved:
            cfg.skip = "no save to restore (the DDP compile-off row does not run)"
        cfg.estimate_s = estimate_s(cfg, spec, flops, peak, args, compiled_tp)
        if not cfg.skip and spent + cfg.estimate_s > args.budget_s:
            cfg.skip = budget_skip(cfg.estimate_s, args.budget_s - spent, args.budget_s)
        if cfg.skip:
            continue
        spent += cfg.estimate_s
        saved = saved or cfg.save
        if cfg.compile:
            compiled_tp.add(cfg.parallel.get("tp", 1))
    return facts, configs


def budget_skip(estimate: float, left: float, budget: float) -> str:
    return f"budget (estimated {estimate:.0f} s, {max(left, 0):.0f} s of the {budget:.0f} s left)"


def estimate_s(cfg: Config, spec, flops: float, peak: float, args: argparse.Namespace, compiled_tp: set[int]) -> float:
    """The row's estimated wall time from the constants above (guesses: see them)."""
    tokens_per_step = spec.data.micro_batch_size * spec.data.seq_len * spec.parallel.dp
    step_s = tokens_per_step * flops / (peak * 1e12 * ASSUMED_MFU * cfg.ranks)
    if cfg.kind == "train":
        t = START_S + args.steps * step_s + (SAVE_S if cfg.save else 0.0)
        if cfg.compile:
            t += COMPILE_CACHED_S if cfg.parallel.get("tp", 1) in compiled_tp else COMPILE_S
        return t
    if cfg.rebuild:  # load, the profile, KILL_AT_STEP steps, the kill and rebuild, 2 steps after it
        return START_S + LOAD_S + PROFILE_S + (KILL_AT_STEP + 2) * step_s + REBUILD_S
    return START_S + LOAD_S + PROFILE_S + RESTORE_STEPS * step_s


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
    if (
        cfg.save
    ):  # the save at the end, asynchronous as a job saves by default: the loop's stall is the copy off the GPU
        spec["checkpoint"] = {"every_steps": 0, "keep_last": 1, "at_end": True, "async": True}
    if cfg.kind == "restore":
        spec.update(steps=RESTORE_STEPS, checkpoint={"every_steps": 0, "at_end": False})
        spec["init_from"] = {"checkpoint": f"{saved_job}:latest", "load": "weights+optimizer"}
    if cfg.rebuild:
        spec["steps"] = 100_000  # stopped once the survivors train again
        spec["fault_policy"] = {"actions": {"rank_exit": "rebuild"}, "max_restarts": 2}
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
        out["save_stall_s"] = max(staged)  # the slowest rank's loop stall: the snapshot's copy off the GPU
        out["commit_s"] = max(committed)  # rank 0: the store hashes and commits the version
        # The write behind the loop: the first rank staged -> the version committed.
        out["save_written_s"] = max(_log_times(logs, job, "checkpoint_committed")) - min(
            _log_times(logs, job, "checkpoint_staged")
        )
    return out


def kill_and_rebuild(job: str) -> dict:
    """SIGKILL rank 1 of running ``job`` once it reached KILL_AT_STEP; seconds from the kill
    to the orchestrator's "first step after the recovery"."""
    from bench.faults import _watch, pids_with

    events: list = []
    threading.Thread(target=_watch, args=(job, events), daemon=True).start()
    deadline = time.time() + 300
    while c.job_status(job).step < KILL_AT_STEP and time.time() < deadline:
        time.sleep(0.05)
    pids = pids_with(f"--job {job} --rank 1")
    if not pids:
        return {"error": f"rank 1 not found at step {c.job_status(job).step}"}
    t_kill = time.time()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.time() + 180
    first = []
    while time.time() < deadline and not first:
        first = [e for e in list(events) if e.type == "recovery" and e.message.startswith("first step")]
        time.sleep(0.05)
    faults = [e for e in list(events) if e.type == "fault"]
    if not first:
        return {"error": "no first step after the recovery within 180 s", "faults": len(faults)}
    return {
        "detect_s": faults[0].unix_time - t_kill if faults else None,
        "kill_to_training_s": first[0].unix_time - t_kill,
        "recovery_event": first[0].message,
    }


def profile_steps(job: str, timeout_s: float = 120.0) -> dict:
    """`surgectl profile`'s path on running ``job`` once it stepped: PROFILE_STEPS steps traced
    on every rank (a CUDA memory snapshot beside each trace), the files stored beside the
    job's metrics; what every rank recorded, or why not."""
    from services.cli import clients
    from services.contract import control_pb2

    deadline = time.time() + timeout_s
    while c.job_status(job).step < 1 and time.time() < deadline:
        time.sleep(0.05)
    asked = clients.call(
        "control",
        lambda s: s.ProfileJob(control_pb2.ProfileJobRequest(job_id=job, steps=PROFILE_STEPS), timeout=10),
    ).profiles[-1]
    info = asked
    while time.time() < deadline:
        info = next((p for p in c.job_status(job).profiles if p.seq == asked.seq), asked)
        if len(info.recorded) >= info.ranks:
            break
        time.sleep(0.5)
    done = [r for r in info.recorded if not r.error]
    files = [f for r in done for f in r.files]
    out = {
        "profile_ranks": f"{len(done)} of {info.ranks}",
        "profile_mb": sum(r.bytes for r in done) / 1e6,
        "profile_s": max((r.seconds for r in done), default=0.0),
        "profile_memory_snapshots": sum(f.endswith(".memory.pickle") for f in files),
        "profile_traces": sum(f.endswith(".trace.json.gz") for f in files),
    }
    if len(done) < info.ranks:
        why = next((r.error for r in info.recorded if r.error), f"not every rank reported within {timeout_s:g} s")
        out["profile_error"] = why[:300]
    return out


def run_restore(cfg: Config, spec_path: Path) -> dict:
    """The job that loads the save and is profiled (`surgectl profile`); with ``cfg.rebuild``,
    then loses rank 1 and rebuilds (stopped once it trains again)."""
    from bench.faults import pids_with
    from services.cli import clients
    from services.contract import control_pb2

    job, _ = c.submit(spec_path)
    out: dict = {"job": job}
    try:
        try:
            out.update(profile_steps(job))
        except Exception as e:  # noqa: BLE001 - the profile's failure is this row's finding, the rest still runs
            out["profile_error"] = f"{type(e).__name__}: {e}"[:300]
        if cfg.rebuild:
            out.update(kill_and_rebuild(job))
        else:
            status = c.wait_job(job, timeout_s=300)
            out["status"] = status.message
    finally:
        if cfg.rebuild:
            try:
                clients.call("control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job), timeout=10))
                c.wait_job(job, 60)
            except Exception:  # noqa: BLE001 - a job that will not stop: end its ranks by PID
                for pid in pids_with(f"--job {job} "):
                    os.kill(pid, signal.SIGKILL)
    logs = c.BENCH_HOME / "run" / "logs"
    asked, read = (_log_values(logs, job, "checkpoint_loaded", k) for k in ("ask_s", "read_verified_s"))
    if not read:
        return {**out, "error": out.get("error") or f"no checkpoint load in the rank logs ({out.get('status', '')})"}
    # The slowest rank: ask the store, read and verify every byte (the first load: a
    # rebuilt rank heals from a peer, it loads nothing).
    return {**out, "restore_s": max(a + b for a, b in zip(asked, read))}


def _log_records(logs: Path, job: str, event: str) -> Iterator[dict]:
    """Every ``event`` line of ``job``'s rank logs, parsed (lines that are not JSON skipped)."""
    for path in logs.glob(f"{job}.rank*.log"):  # the node agent names them <job>.rank<r>.log
        for line in path.read_text(errors="replace").splitlines():
            if f'"{event}"' in line:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def _log_values(logs: Path, job: str, event: str, key: str) -> list[float]:
    """``key`` of every ``event`` line in ``job``'s rank logs."""
    return [float(r.get(key, 0.0)) for r in _log_records(logs, job, event)]


def _log_times(logs: Path, job: str, event: str) -> list[float]:
    """Unix times of every ``event`` line in ``job``'s rank logs (their ISO ``timestamp``)."""
    return [
        datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp()
        for r in _log_records(logs, job, event)
        if "timestamp" in r
    ]


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
        facts, configs = plan(args, n_gpus, memory, peak)
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
    rows = qualify(configs, base, args, peak, facts, n_gpus, threads=max(1, (os.cpu_count() or 1) // n_gpus))
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
    n_gpus: int,
    threads: int,
) -> list[dict]:
    """Run ``configs`` in order on one stack (``surgectl up --workers 1``: one node agent
    offering every GPU), within ``args.budget_s`` counted from before the stack starts; one
    row per configuration (its result, or why not).

    The agent starts its rank fork server at once (SURGE_WORKER_RANK_FORKSERVER=eager: its
    imports done once) and the first job is submitted once it is ready, so no row pays for
    an interpreter and torch's import (START_S's basis)."""
    t0 = time.time()
    rows: list[dict] = []
    saved_job = ""
    os.environ[FORKSERVER_ENV] = "eager"  # read by the node agent `surgectl up` starts
    ready = _forkservers_ready() + 1  # the logs are appended to: earlier runs' lines count
    with c.Stack(workers=1):
        for i, cfg in enumerate(configs):
            left = args.budget_s - (time.time() - t0)
            if cfg.kind == "restore" and not saved_job and not cfg.skip:
                cfg.skip = "no version to restore (the saving DDP row did not save)"
            if not cfg.skip and cfg.estimate_s > left:
                cfg.skip = budget_skip(cfg.estimate_s, left, args.budget_s)
            row = {**asdict(cfg)}
            if cfg.skip:
                rows.append(row)
                continue
            try:  # the fork server has imported (once: it lives as long as the agent)
                c.wait_forkservers_warm(ready, timeout_s=60)
            except TimeoutError:
                pass  # this row's ranks start partly cold: slower, still measured
            spec = job_spec(base, cfg, args, peak, threads, f"gpu{i}-{cfg.kind}", saved_job)
            path = c.BENCH_HOME / "jobs" / f"{spec['name']}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(spec, sort_keys=False))
            t = time.time()
            try:
                res = run_train(cfg, path, args, facts) if cfg.kind == "train" else run_restore(cfg, path)
            except Exception as e:  # noqa: BLE001 - a failed row is reported, the next one runs
                res = {"error": f"{type(e).__name__}: {e}"[:400]}
            rows.append({**row, **res, "wall_s": time.time() - t})
            if cfg.save and "save_stall_s" in res:
                saved_job = res["job"]
            print(f"{cfg.name}: {_cell(rows[-1])}", flush=True)
    return rows


def _forkservers_ready() -> int:
    """``forkserver_ready`` lines in the agents' logs so far (c.wait_forkservers_warm counts them)."""
    logs = (c.BENCH_HOME / "run" / "logs").glob("forkserver-*.log")
    return sum(f.read_text(errors="replace").count('"forkserver_ready"') for f in logs)


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
            cell += (
                f"; async save: loop stalled {r['save_stall_s']:.1f} s, written and committed"
                f" {r.get('save_written_s', 0.0):.1f} s later (commit {r['commit_s']:.1f} s)"
            )
        return cell
    profiled = ""
    if "profile_ranks" in r or "profile_error" in r:
        profiled = (
            f"; profile: {r.get('profile_ranks', '0')} ranks, {r.get('profile_traces', 0)} traces, "
            f"{r.get('profile_memory_snapshots', 0)} memory snapshots, {r.get('profile_mb', 0.0):.1f} MB"
        )
        if r.get("profile_error"):
            profiled += f" ({r['profile_error']})"
    if "kill_to_training_s" in r:
        return f"kill -> training again {r['kill_to_training_s']:.1f} s (detected {r['detect_s'] or 0:.1f} s){profiled}"
    if "restore_s" in r:
        return f"restore (ask, read, verify) {r['restore_s']:.1f} s{profiled}"
    return f"estimated {r.get('estimate_s', 0):.0f} s"


def print_plan(facts: dict, configs: list[Config], args: argparse.Namespace) -> None:
    """The dry run's report: per row whether it runs within the budget (its estimate and the
    running total, the stack's start first) or why it is skipped; the estimated total."""
    print(f"plan: {header(facts, args)}")
    spent = STACK_S
    rows = [("stack start (surgectl up, fork server imported)", "-", "-", f"runs, ~{STACK_S:.0f} s", f"{spent:.0f} s")]
    for cfg in configs:
        if cfg.skip:
            what, at = f"skipped: {cfg.skip}", "-"
        else:
            spent += cfg.estimate_s
            what, at = f"runs, ~{cfg.estimate_s:.0f} s", f"{spent:.0f} s"
        rows.append((cfg.name, str(cfg.ranks), cfg.checks.get("memory_per_rank", "-"), what, at))
    print(c.table(rows, ("configuration", "ranks", "memory/rank (est.)", "plan", "running total (est.)")))
    print(
        f"estimated total {spent:.0f} s, budget {args.budget_s:.0f} s "
        "(the estimates: one H200 run and guesses, bench/gpu.py STACK_S ...)"
    )
    valid = sum(1 for cfg in configs if cfg.checks)
    print(f"validated: {valid} of {len(configs)} job specs (job spec validation and memory estimate), no GPU used")


if __name__ == "__main__":
    sys.exit(main())
