"""`surgectl submit` refuses a ``model.freeze`` that matches nothing or freezes everything
before it asks any service (no stack here): exit 2, one line naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = """\
name: ft
steps: 4
data: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 2}
model: {n_layers: 1, d_model: 32, n_heads: 2, freeze: ['blocks.0.attn.*', 'block.*']}
"""


def test_submit_of_a_freeze_matching_nothing_exits_2_with_one_line(tmp_path):
    spec = tmp_path / "ft.yaml"
    spec.write_text(JOB)
    env = {**os.environ, "SURGE_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    r = subprocess.run(
        [sys.executable, "-m", "services.cli.surgectl", "submit", str(spec)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{spec}: model.freeze[1]: 'block.*' matches no parameter" in lines[0], r.stderr
