"""Step time of each parallel config on this machine, and its loss parity with one process.

    .venv/bin/python bench/parallel_configs.py [--steps 30] [--out bench/results/parallel_configs.json]

Same model and global batch as the parity tests (tests/parallel/harness.py: 2 layers,
d_model 64, 4 heads, seq 32, 8 rows per step with random padding, fp32, gloo, one thread
per rank). Step time: the median of rank 0's ``StepCompleted.step_seconds`` after the first
two steps (warm-up). Parity: the largest relative difference of the reported loss from
the single-process run, over all steps.
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

CONFIGS = {
    "single": {},
    "ddp dp=2": {"dp": 2},
    "fsdp2 dp=2": {"dp": 2, "data_parallel": "fsdp2"},
    "fsdp2 dp=2 + act. ckpt": {"dp": 2, "data_parallel": "fsdp2", "activation_checkpointing": True},
    "tp=2": {"tp": 2},
    "fsdp2 dp=2 x tp=2": {"dp": 2, "tp": 2, "data_parallel": "fsdp2"},
    "single, accum 4": {"grad_accum": 4},
    "fsdp2 dp=2, accum 4": {"dp": 2, "data_parallel": "fsdp2", "grad_accum": 4},
}


def run_all(configs: dict[str, dict], default_out: str, base: dict | None = None) -> None:
    """Run each config of ``configs`` (``base`` merged under it) for ``--steps`` steps, the
    first being the loss reference; print a line per config and write the rows to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args()
    rows, ref = [], None
    width = max(map(len, configs)) + 2
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs.items():
            t0 = time.perf_counter()
            res = run_config(
                {**(base or {}), **cfg, "steps": args.steps}, Path(tmp) / name.replace(" ", "_"), timeout=900
            )[0]
            ref = ref or res["losses"]
            row = {
                "config": name,
                "ranks": cfg.get("dp", 1) * cfg.get("tp", 1) * cfg.get("pp", 1),
                "median_step_seconds": statistics.median(res["step_seconds"][2:]),
                "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref)),
                "wall_seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"{name:{width}s}ranks {row['ranks']}  step {row['median_step_seconds'] * 1e3:7.1f} ms  "
                f"max rel loss diff {row['max_rel_loss_diff']:.2e}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": args.steps, "unix_time": time.time(), "rows": rows}, indent=1))


if __name__ == "__main__":
    run_all(CONFIGS, "bench/results/parallel_configs.json")
