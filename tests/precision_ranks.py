"""Launcher for ``tests/engine/precision_harness.py``: two real gloo rank processes of one
job spec, with fault injections, returning each rank's saved results."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from services.jobspec import JobSpec, spec_to_json
from tests.conftest import free_ports
from tests.rank_forks import run_ranks_to_end

REPO = Path(__file__).resolve().parents[1]
ENGINE_TESTS = REPO / "tests" / "engine"
HARNESS = ENGINE_TESTS / "precision_harness.py"


def run_two_ranks(spec: JobSpec, out: Path, ckpt: Path, inject: str, resume: str = "") -> list[dict[str, Any]]:
    """Run ranks 0 and 1 of ``spec`` (DP=2, gloo on loopback) to the end; ``inject`` is a
    ``SURGE_FAULT_INJECT`` value, ``resume`` a checkpoint version under ``ckpt``.

    Returns the two ranks' result dicts (see ``precision_harness.main``).
    Raises AssertionError with the ranks' output tails when either exits non-zero."""
    out.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    env = {**os.environ, "SURGE_FAULT_INJECT": inject, "SURGE_HOME": str(out / "home"), "PYTHONPATH": str(REPO)}
    run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
        [[str(HARNESS), str(r), "2", str(port), str(out), str(ckpt), spec_to_json(spec), resume] for r in (0, 1)],
        timeout=240,
        cwd=ENGINE_TESTS,
        env=env,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
