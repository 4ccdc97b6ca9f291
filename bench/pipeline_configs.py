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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel_configs import run_all  # noqa: E402

UNTIED = {"tie_embeddings": False}
CONFIGS = {
    "single (untied)": {},
    "pp=2 gpipe, 4 mb": {"pp": 2, "pipeline_schedule": "gpipe", "microbatches": 4},
    "pp=2 1f1b, 4 mb": {"pp": 2, "pipeline_schedule": "1f1b", "microbatches": 4},
    "pp=2 1f1b, 2 mb": {"pp": 2, "pipeline_schedule": "1f1b", "microbatches": 2},
    "ddp dp=2 x pp=2 gpipe": {"dp": 2, "pp": 2, "pipeline_schedule": "gpipe", "microbatches": 2},
    "ddp dp=2 x pp=2 1f1b": {"dp": 2, "pp": 2, "pipeline_schedule": "1f1b", "microbatches": 2},
    "fsdp2 dp=2 x pp=2 1f1b": {
        "dp": 2,
        "pp": 2,
        "data_parallel": "fsdp2",
        "pipeline_schedule": "1f1b",
        "microbatches": 2,
    },
}


if __name__ == "__main__":
    run_all(CONFIGS, "bench/results/pipeline_configs.json", base={"model": UNTIED})
