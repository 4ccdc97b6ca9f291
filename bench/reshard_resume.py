"""Resume time at a new data-parallel size (issue 14 part 4): a job checkpointed at dp 2
resumes at dp 1 (grad_accum 2), dp 2 (the same size, for comparison) and dp 4
(micro_batch_size halved), the global batch unchanged.

    .venv/bin/python bench/reshard_resume.py [--models demo 100m] [--reps 2]

Real `data` and `store` services and real rank processes over gloo, driven by the
checkpoint tests' in-process node agent (tests/checkpoint/harness.py: there is no
control-plane command to relaunch a job at another size). For each model: one dp 2 run
saves at step 2; then each resume (alternating sizes, ``--reps`` times) launches its ranks
with ``resume_version`` and runs steps 3 and 4. Measured from the launch: every rank has
reported TrainingLoopStarted (process start, set-up, checkpoint loaded and resharded by DCP,
the data stream opened at the global position), rank 0's first step, and the slowest rank's
checkpoint load (its ``checkpoint_loaded`` log line: ask the store, read, verify and reshard
every byte). The losses of the
resumed steps are checked against the dp 2 run's (1e-5). Models: ``demo`` (the throughput
job's shape, 0.8 M parameters, seq 256, 16 rows per step) and ``100m`` (12 layers, d_model
768, 85 M parameters, seq 64, 4 rows per step: ~1 GB per version with AdamW; FSDP2, so the
DCP load reshards the dp 2 shards to 1 and 4 ranks).
Results: ``bench/results/reshard_resume.json`` and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

STEPS, AT = 4, 2
# name -> (base job, overrides, micro_batch_size at dp 2, data_parallel). The 100m model
# runs FSDP2 (fully_shard: weights, gradients and AdamW moments split over the dp ranks): four
# DDP replicas with their snapshot copies (~4 GB each) do not fit this 23 GB machine.
MODELS = {
    "demo": (c.REPO / "bench" / "jobs" / "throughput.yaml", {}, 8, "ddp"),
    "100m": (
        c.REPO / "bench" / "jobs" / "gpt125m.yaml",
        {"data": {"seq_len": 64, "micro_batch_size": 2, "prefetch": {"watermark": 64, "threads": 1}}},
        2,
        "fsdp2",
    ),
}
SIZES = {"dp1 (grad_accum 2)": (1, 1, 2), "dp2 (same size)": (2, 1, 1), "dp4 (micro_batch / 2)": (4, 2, 1)}


def spec_for(model: str, dp: int, mbs_div: int, accum: int, dataset: str, source: bool = False):
    """The model's job at ``dp`` ranks, micro_batch_size divided by ``mbs_div`` and
    ``grad_accum`` ``accum``: the same global batch as dp 2 x micro_batch_size x 1."""
    from services.jobspec import JobSpec, read_spec_mapping

    base, over, mbs, data_parallel = MODELS[model]
    raw = read_spec_mapping(base.read_text(), str(base))  # (as jobspec reads a job file: 5.0e5 a float)
    for section, values in over.items():
        raw.setdefault(section, {}).update(values)
    raw["name"], raw["steps"], raw["seed"] = f"reshard-{model}", STEPS, 0
    raw["data"].update({"dataset": dataset, "micro_batch_size": mbs // mbs_div, "grad_accum": accum})
    raw["parallel"] = {"dp": dp, "backend": "gloo", "threads_per_rank": 1, "data_parallel": data_parallel}
    raw["precision"] = "fp32"
    raw["optimizer"]["warmup_steps"] = 1
    # The dp 2 run saves at step AT; the resumes save nothing (what is timed is the resume).
    raw["checkpoint"] = {"every_steps": AT if source else 0, "keep_last": 0, "at_end": False}
    raw["eval"] = {"every_steps": 0, "at_end": False, "batches": 1}
    return JobSpec.model_validate(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["demo", "100m"], choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=1 if c.QUICK else 2)
    args = ap.parse_args()
    c.setup_env()
    from tests.checkpoint.harness import Cluster, Processes, start_data, start_store

    home = Path(tempfile.mkdtemp(prefix="reshard-", dir=c.BENCH_HOME))
    procs = Processes(home / "logs")
    results: dict = {"machine": c.machine(), "steps": STEPS, "checkpoint_step": AT, "models": {}}
    try:
        _, data = start_data(procs, c.DATA_ROOT)
        _, store = start_store(procs, home / "store")
        cluster = Cluster(procs, data, store)
        for model in args.models:
            t0 = time.time()
            source = cluster.run(f"{model}-src", spec_for(model, 2, 1, 1, "stdlib@v1", source=True), timeout=1800)
            if not source.finished or source.failed:
                raise RuntimeError(f"{model}: the dp 2 run did not finish: {source.failed}")
            version = source.saved[AT]
            per: dict[str, dict[str, list[float]]] = {
                k: {"started_s": [], "first_step_s": [], "load_s": []} for k in SIZES
            }
            worst = 0.0
            for rep in range(args.reps):
                for label, (dp, div, accum) in SIZES.items():
                    job = f"{model}-{label.split()[0]}-{rep}"
                    out = cluster.run(job, spec_for(model, dp, div, accum, "stdlib@v1"), resume=version, timeout=1800)
                    if not out.finished or out.failed or out.start_step != AT:
                        raise RuntimeError(f"{job}: resume failed: {out.failed}")
                    worst = max(worst, *(abs(out.losses[s] - source.losses[s]) / source.losses[s] for s in out.losses))
                    per[label]["started_s"].append(out.started_s)
                    per[label]["first_step_s"].append(out.first_step_s)
                    per[label]["load_s"].append(load_seconds(procs.logs, job))
                    print(
                        f"  {model} {label} rep {rep + 1}: started {out.started_s:.2f} s, "
                        f"first step {out.first_step_s:.2f} s, load {per[label]['load_s'][-1]:.2f} s",
                        flush=True,
                    )
            results["models"][model] = {
                "source": {"dp": 2, "started_s": source.started_s, "first_step_s": source.first_step_s},
                "resumes": {k: {m: c.summary(v) for m, v in d.items()} for k, d in per.items()},
                "max_relative_loss_difference": worst,
                "seconds": time.time() - t0,
            }
            c.save("reshard_resume", results)
        cluster.close()
    finally:
        procs.close()
        shutil.rmtree(home / "store", ignore_errors=True)
    path = c.save("reshard_resume", results)
    print(render(results))
    print(f"\n{path.relative_to(c.REPO)}")


def load_seconds(logs: Path, job: str) -> float:
    """The slowest rank's checkpoint load of ``job`` (its ``checkpoint_loaded`` log line:
    asking the store + reading, verifying and resharding every byte)."""
    slowest = 0.0
    for path in logs.glob(f"{job}-*-rank*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"checkpoint_loaded"' in line:
                rec = json.loads(line)
                slowest = max(slowest, rec.get("ask_s", 0.0) + rec.get("read_verified_s", 0.0))
    return slowest


def render(results: dict) -> str:
    rows = []
    for model, r in results.get("models", {}).items():
        for label, s in r["resumes"].items():
            rows.append(
                (
                    model,
                    label,
                    c.fmt(s["started_s"], " s"),
                    c.fmt(s["first_step_s"], " s"),
                    c.fmt(s["load_s"], " s"),
                    f"{r['max_relative_loss_difference']:.1e}",
                )
            )
    header = (
        "model",
        "resume of a dp 2 checkpoint at",
        "launch -> loaded, started",
        "launch -> first step",
        "checkpoint load (slowest rank)",
        "loss rel. diff",
    )
    return c.table(rows, header)


if __name__ == "__main__":
    main()
