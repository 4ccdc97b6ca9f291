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
    newest = {r["rank"]: r["step"] for r in history if r["type"] == "step"}  # each rank's newest step: kept
    whole_from = json.loads(files[1].read_text().splitlines()[0])["step"]  # (the oldest file kept whole)
    assert set(newest.values()) <= {whole_from - 1, whole_from}, (newest, whole_from)  # the history ends there
    thinned = [r for r in history if r["type"] == "step" and r["step"] != newest[r["rank"]]]
    steps = sorted({r["step"] for r in thinned})
    assert steps[0] == 1  # the run's first step is kept
    steps = steps[1:]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    # Thinned: every k-th step, k a power of two, coarser the older (each compaction re-thins:
    # a stride at one compaction may be coarser than the next's, a gap then no power of two).
    finest = min(gaps)
    assert finest > 1 and finest & (finest - 1) == 0 and all(s % finest == 0 for s in steps), steps
    assert gaps == sorted(gaps, reverse=True), steps
    stride = gaps[0]
    assert all({r["rank"] for r in thinned if r["step"] == s} == {0, 1} for s in steps)
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


def test_a_rank_whose_records_come_after_another_ranks_newer_ones_keeps_its_last_step(tmp_path):
    """ci8 (test_footprint_live, 4 KiB files, 1 backup): each node's agent sends its ranks'
    records on its own stream, so rank 1's reached the store ~12 steps behind rank 0's; rank
    0's steps 33-40 were written before rank 1's 29-40, rotated out first and thinned away at
    a stride of 32 (the history kept rank 0's steps 1 and 32; `plot` drew "2 of steps 1-32").
    Each rank's newest step record survives every compaction."""
    bound = MetricFileBound(max_bytes=4096, backups=1)
    m = logger(tmp_path, bound)
    lag = 12  # rank 1's records arrive this many steps after rank 0's of the same step
    try:
        for n in range(1, 41):
            m.on_step_completed(live_sized(step(n)))
            if n > lag:
                m.on_step_completed(live_sized(step(n - lag, rank=1)))
        for n in range(41 - lag, 41):
            m.on_step_completed(live_sized(step(n, rank=1)))
    finally:
        m.close()
    path = tmp_path / "metrics" / f"{JOB}.jsonl"
    files = rotated_paths(path)
    seen = {f.name: [(r["rank"], r["step"]) for r in map(json.loads, f.read_text().splitlines())] for f in files}
    for rank in (0, 1):
        assert 40 in {s for f in seen.values() for r, s in f if r == rank}, seen  # (old code: rank 0's 33-40 thinned)
        h = observe.history_from_jsonl(path, rank=rank)
        assert (h.steps[0], h.steps[-1]) == (1, 40) and h.steps == sorted(h.steps), (rank, h.steps, seen)
    assert sum(f.stat().st_size for f in files) <= (bound.backups + 2) * bound.max_bytes + 4 * 800  # still bounded


def live_sized(msg: engine_pb2.StepCompleted) -> engine_pb2.StepCompleted:
    """A step record the size of a real rank's (~700 bytes a line: its timings set)."""
    msg.grad_norm, msg.learning_rate, msg.tokens, msg.epoch = 1.25, 3e-4, 4096 * msg.step, 1
    msg.data_wait_seconds, msg.forward_seconds, msg.backward_seconds = 0.0012, 0.0345, 0.0678
    msg.reduction_seconds, msg.optimizer_seconds, msg.step_seconds = 0.0123, 0.0045, 0.1234
    return msg
