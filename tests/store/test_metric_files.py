"""A job's metric records with a size bound (issue 29 item 8, services/store/metric_files.py):
the JSONL file is rotated at its bound, the file rotated out is thinned into the job's
history (every k-th step, evaluations kept), the files on disk stay within
(backups + 2) x max_bytes, and `surgectl plot`'s reader reads them all, oldest first."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.cli import observe
from services.common.rotated_files import rotated_paths
from services.contract import engine_pb2
from services.store import metric_files
from services.store.metric_files import MetricFileBound
from services.store.metrics_logger import MetricsLogger

JOB = "long-0a1b2c"


def step(n: int, rank: int = 0) -> engine_pb2.StepCompleted:
    return engine_pb2.StepCompleted(
        job_id=JOB, rank=rank, step=n, loss=10.0 / n, tokens_per_second=1000.0 + n, unix_time=1767225600.0 + n
    )


def logger(root: Path, bound: MetricFileBound) -> MetricsLogger:
    return MetricsLogger(root, registry=CollectorRegistry(), bound=bound)


def test_the_metrics_file_rotates_at_its_bound_and_the_rotated_out_file_is_thinned_into_the_history(tmp_path):
    bound = MetricFileBound(max_bytes=20_000, backups=2)
    m = logger(tmp_path, bound)
    try:
        for n in range(1, 2001):
            m.on_step_completed(step(n))
            m.on_step_completed(step(n, rank=1))
            if n % 100 == 0:
                m.on_eval_completed(engine_pb2.EvalCompleted(job_id=JOB, rank=0, step=n, loss=5.0 / n))
    finally:
        m.close()
    path = tmp_path / "metrics" / f"{JOB}.jsonl"
    files = rotated_paths(path)
    assert [f.name for f in files] == [f"{JOB}.jsonl.3", f"{JOB}.jsonl.2", f"{JOB}.jsonl.1", f"{JOB}.jsonl"]
    assert all(f.stat().st_size <= bound.max_bytes + 600 for f in files)  # (a file ends with the line that passed it)
    assert sum(f.stat().st_size for f in files) <= (bound.backups + 2) * bound.max_bytes + 4 * 600
    assert not list(path.parent.glob("*.pending-*"))  # every rotated-out file compacted
    history = [json.loads(line) for line in files[0].read_text().splitlines()]
    steps = sorted({r["step"] for r in history if r["type"] == "step"})
    assert steps[0] == 1  # the run's first step is kept
    steps = steps[1:]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    # Thinned: every k-th step, k a power of two, coarser the older (each compaction re-thins).
    assert all(g > 1 and g & (g - 1) == 0 for g in gaps) and gaps == sorted(gaps, reverse=True)
    stride = gaps[0]
    assert all({r["rank"] for r in history if r["type"] == "step" and r["step"] == s} == {0, 1} for s in steps)
    assert {r["step"] for r in history if r["type"] == "eval"} == set(range(100, steps[-1] + 1, 100))  # evals kept
    # `surgectl plot` reads the history, the rotated files and the current one: the whole run,
    # its start thinned, its newest steps every one.
    h = observe.history_from_jsonl(path)
    assert h.steps[0] == 1 and h.steps[1] <= 2 * stride and h.steps[-1] == 2000 and h.steps == sorted(h.steps)
    full_from = json.loads(files[1].read_text().splitlines()[0])["step"] + 1  # (the oldest file kept whole)
    assert 1900 < full_from and h.steps[h.steps.index(full_from) :] == list(range(full_from, 2001))
    assert h.loss[-1] == 10.0 / 2000 and h.eval_steps == list(range(100, 2001, 100))


def test_zero_max_bytes_never_rotates_and_a_bad_setting_is_one_line(tmp_path):
    m = logger(tmp_path, MetricFileBound(max_bytes=0))
    try:
        for n in range(1, 301):
            m.on_step_completed(step(n))
    finally:
        m.close()
    assert rotated_paths(tmp_path / "metrics" / f"{JOB}.jsonl") == [tmp_path / "metrics" / f"{JOB}.jsonl"]
    assert metric_files.env_problem({"SURGE_STORE_METRICS_MAX_BYTES": "64MiB"}) == (
        "SURGE_STORE_METRICS_MAX_BYTES: expected a whole number >= 0, got '64MiB'"
    )
    assert metric_files.bound_from_env({"SURGE_STORE_METRICS_BACKUPS": "0"}) == MetricFileBound(backups=0)


def test_with_no_backups_the_history_alone_holds_the_past(tmp_path):
    bound = MetricFileBound(max_bytes=10_000, backups=0)
    m = logger(tmp_path, bound)
    try:
        for n in range(1, 1001):
            m.on_step_completed(step(n))
    finally:
        m.close()
    path = tmp_path / "metrics" / f"{JOB}.jsonl"
    assert [f.name for f in rotated_paths(path)] == [f"{JOB}.jsonl.1", f"{JOB}.jsonl"]
    h = observe.history_from_jsonl(path)
    assert h.steps[-1] == 1000 and h.steps == sorted(h.steps) and len(h.steps) < 1000
