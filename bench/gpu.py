"""bench/gpu.sh's body: Surge against torchrun on one NVIDIA GPU (NCCL, bf16), tokens/s and MFU.

    bench/gpu.sh [--spec bench/jobs/gpt125m.yaml] [--steps 120] [--warmup 20] [--reps 2]
                 [--peak-tflops T] [--dry-run]

One GPU, one rank (Surge: ``surgectl up --workers 1``, the node agent offers the GPU and
``backend: auto`` picks NCCL; torchrun: ``--nproc-per-node 1 bench/torchrun_ddp.py
--device cuda``), the same spec, alternating Surge / torchrun ``--reps`` times. Tokens/s
over the steps after ``--warmup``; MFU = tokens/s x FLOPs per token / peak, FLOPs per token
= 6 N + 12 L d T (services/engine/training_loop.py: model_flops_per_token, PaLM appendix
B), peak = ``--peak-tflops`` or the dense bf16 peak of the GPU nvidia-smi names (table
below, vendor data sheets). ``--dry-run`` checks the arguments and the spec and prints the
plan without a GPU (what the tests run). Budget: under 5 minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s (NVIDIA data sheets; SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}


class UsageError(ValueError):
    pass


def peak_for(gpu_name: str) -> float:
    """Dense bf16 peak (TFLOP/s) of a GPU by the name nvidia-smi reports.

    Raises: UsageError for a GPU not in ``PEAK_TFLOPS`` (pass --peak-tflops)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in gpu_name.upper():
            return PEAK_TFLOPS[key]
    raise UsageError(f"--peak-tflops: unknown GPU {gpu_name!r}; pass its dense bf16 peak in TFLOP/s")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, default=c.REPO / "bench/jobs/gpt125m.yaml")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 1:
        raise UsageError(f"--steps: must be > --warmup + 1 ({args.warmup + 1}), got {args.steps}")
    if args.warmup < 1 or args.reps < 1:
        raise UsageError("--warmup and --reps: must be >= 1")
    if args.peak_tflops < 0:
        raise UsageError(f"--peak-tflops: must be > 0, got {args.peak_tflops}")
    return args


def plan(args: argparse.Namespace) -> dict:
    """Validate the spec (one GPU, dp 1, bf16) and compute the model's size and FLOPs/token.

    Raises: UsageError naming the field."""
    import torch

    from services.compute.model import build_model, count_parameters
    from services.engine.training_loop import model_flops_per_token
    from services.jobspec import JobSpecError, load_job_spec

    try:
        spec = load_job_spec(args.spec)
    except JobSpecError as e:
        raise UsageError(str(e)) from None
    if spec.world_size != 1:
        raise UsageError(f"{args.spec}: parallel: one GPU, so world size 1, got {spec.world_size}")
    with torch.device("meta"):
        params = count_parameters(build_model(spec.model, spec.seed, "meta"))
    return {
        "spec": str(args.spec),
        "params": params,
        "flops_per_token": model_flops_per_token(spec, params),
        "tokens_per_step": spec.data.micro_batch_size * spec.data.seq_len * spec.data.grad_accum,
        "precision": str(getattr(spec.precision, "dtype", spec.precision)),
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
    }


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        out = subprocess.CompletedProcess([], 127, "", "")
    if out.returncode != 0 or not out.stdout.strip():
        raise UsageError("nvidia-smi found no GPU (bench/gpu.sh needs one; --dry-run checks the set-up without)")
    return out.stdout.strip().splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        p = plan(args)
        if args.dry_run:
            print(f"plan: {p}")
            return 0
        name = gpu_name()
        peak = args.peak_tflops or peak_for(name)
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"torch {torch.__version__} in this venv cannot use the GPU (a CPU build?): install the CUDA "
                "wheel, e.g. pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
            )
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c.setup_env()
    t0 = time.time()
    surge, torch_, starts = [], [], {"surge": [], "torchrun": []}
    with c.Stack(workers=1):
        for rep in range(args.reps):
            spec = c.write_spec(args.spec, f"gpu{rep}", steps=args.steps, parallel__peak_tflops_per_device=peak)
            job, t_submit = c.submit(spec)
            status = c.wait_job(job, timeout_s=240)
            recs = c.surge_steps(job).get(0, [])
            if len(recs) < args.steps:
                raise SystemExit(f"Surge job {job} ended ({status.message}) after {len(recs)} steps")
            surge.append(c.steady_tokens_per_s(recs, args.warmup))
            starts["surge"].append(recs[0]["unix_time"] - t_submit)
            run = c.torchrun(spec, steps=args.steps, device="cuda", nproc=1, timeout_s=240)
            torch_.append(c.steady_tokens_per_s(run.steps, args.warmup))
            starts["torchrun"].append(run.steps[0]["unix_time"] - run.t_launch)
    mfu = lambda tps: tps * p["flops_per_token"] / (peak * 1e12)  # noqa: E731
    s, t = c.summary(surge), c.summary(torch_)
    result = {
        "machine": {**c.machine(), "gpu": name, "peak_tflops": peak},
        "plan": p,
        "surge_tokens_per_s": s,
        "torchrun_tokens_per_s": t,
        "surge_mfu": mfu(s["median"]),
        "torchrun_mfu": mfu(t["median"]),
        "ratio": c.summary([a / b for a, b in zip(surge, torch_)]),
        "startup_s": {k: c.summary(v) for k, v in starts.items()},
        "total_seconds": time.time() - t0,
    }
    path = c.save("gpu", result)
    print(
        f"{name}, peak {peak:.0f} TFLOP/s bf16; {p['params'] / 1e6:.1f} M parameters, seq {p['tokens_per_step']} "
        f"tokens/step, {p['flops_per_token'] / 1e9:.2f} GFLOP/token, {args.steps} steps ({args.warmup} warm-up) x {args.reps}"
    )
    print(
        c.table(
            [
                (
                    "Surge (full stack, NCCL)",
                    c.fmt(s, "", 0),
                    f"{100 * result['surge_mfu']:.1f} %",
                    c.fmt(result["startup_s"]["surge"], "", 1),
                ),
                (
                    "torchrun",
                    c.fmt(t, "", 0),
                    f"{100 * result['torchrun_mfu']:.1f} %",
                    c.fmt(result["startup_s"]["torchrun"], "", 1),
                ),
                ("ratio Surge / torchrun", c.fmt(result["ratio"], "", 3), "", ""),
            ],
            ("side", "tokens/s median (min-max)", "MFU", "start -> first step s"),
        )
    )
    print(f"{path.relative_to(c.REPO)}; {result['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
