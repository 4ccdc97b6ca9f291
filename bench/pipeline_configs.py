"""Step time of the pipeline-parallel configs on this machine, and their loss parity.

    .venv/bin/python bench/pipeline_configs.py [--steps 30] [--out bench/results/pipeline_configs.json]

Same harness, model and global batch as bench/parallel_configs.py (2 layers, d_model 64,
4 heads, seq 32, 8 rows per step with random padding, fp32, gloo, one thread per rank,
Surge's real rank wiring), with untied embeddings, which pipeline parallelism requires; the
reference is the single process with the same untied model. Step time: the median of rank
0's ``StepCompleted.step_seconds`` after two warm-up steps. Parity: the largest relative
difference of the reported loss from the reference, over all steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))
from harness import run_config  # noqa: E402

UNTIED = {"tie_embeddings": False}
CONFIGS = {
    "single (untied)": {},
    "pp=2 gpipe, 4 mb": {"pp": 2, "pipeline_schedule": "gpipe", "microbatches": 4},
    "pp=2 1f1b, 4 mb": {"pp": 2, "pipeline_schedule": "1f1b", "microbatches": 4},
    "pp=2 1f1b, 2 mb": {"pp": 2, "pipeline_schedule": "1f1b", "microbatches": 2},
    "ddp dp=2 x pp=2 gpipe": {"dp": 2, "pp": 2, "pipeline_schedule": "gpipe", "microbatches": 2},
    "ddp dp=2 x pp=2 1f1b": {"dp": 2, "pp": 2, "pipeline_schedule": "1f1b", "microbatches": 2},
    "fsdp2 dp=2 x pp=2 1f1b": {"dp": 2, "pp": 2, "data_parallel": "fsdp2", "pipeline_schedule": "1f1b", "microbatches": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="bench/results/pipeline_configs.json")
    args = ap.parse_args()
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in CONFIGS.items():
            t0 = time.perf_counter()
            res = run_config({"model": UNTIED, **cfg, "steps": args.steps}, Path(tmp) / name.replace(" ", "_"), timeout=900)[0]
            ref = ref or res["losses"]
            row = {
                "config": name,
                "ranks": cfg.get("dp", 1) * cfg.get("pp", 1),
                "median_step_seconds": statistics.median(res["step_seconds"][2:]),
                "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref)),
                "wall_seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(f"{name:24s} ranks {row['ranks']}  step {row['median_step_seconds'] * 1e3:7.1f} ms  "
                  f"max rel loss diff {row['max_rel_loss_diff']:.2e}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "unix_time": time.time(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
