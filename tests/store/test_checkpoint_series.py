"""L5-1 retires a job's own Prometheus series at the job's end (RetireCheckpointSeries, issue 31
item 6, session 33): every ``surge_checkpoint_*`` label set of that job goes after the linger,
another job's stay, the versions stay, and a later commit (a resumed job) makes them again."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.contract import store_pb2
from services.store.checkpoint_manager import CheckpointManager, CheckpointRejected

from .conftest import load, save, versions


def _series(reg: CollectorRegistry, job: str) -> list[str]:
    return [
        ln
        for ln in generate_latest(reg).decode().splitlines()
        if not ln.startswith("#") and f'job="{job}"' in ln and ln.startswith("surge_checkpoint_")
    ]


def _manager(tmp_path: Path, later=None) -> tuple[CheckpointManager, CollectorRegistry]:
    reg = CollectorRegistry()
    return CheckpointManager(tmp_path, registry=reg, later=later, linger_s=7.0), reg


def _retire(manager: CheckpointManager, job: str) -> store_pb2.CheckpointSeriesRetired:
    return manager.retire_checkpoint_series(store_pb2.RetireCheckpointSeries(job_id=job, reason="FINISHED"))


def test_a_job_s_end_removes_every_series_of_that_job_after_the_linger_and_no_other(tmp_path):
    timers: list[tuple[float, object, tuple]] = []
    manager, reg = _manager(tmp_path, later=lambda s, fn, args: timers.append((s, fn, args)))
    for step in (5, 10):
        save(manager, "done", step)
    save(manager, "other", 5)
    # A refused commit (its staging empty) is counted per job too.
    manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id="done", step=99, rank=0))
    with pytest.raises(CheckpointRejected):
        manager.commit_checkpoint(store_pb2.CommitCheckpoint(job_id="done", step=99, world_size=1))
    held = _series(reg, "done")
    names = {ln.split("{", 1)[0] for ln in held}
    assert {
        "surge_checkpoint_commits_total",
        "surge_checkpoint_commit_seconds",
        "surge_checkpoint_bytes",
        "surge_checkpoint_written_bytes",
        "surge_checkpoint_rejected_total",
    } <= names, names

    reply = _retire(manager, "done")
    # Five per-job label sets (commits, seconds, bytes, written, rejected{op=commit}); nothing
    # goes before the linger: the last values are still there for Prometheus to read.
    assert (reply.job_id, reply.series) == ("done", 5)
    assert [s for s, _, _ in timers] == [7.0]
    assert _series(reg, "done") == held

    _, fn, args = timers.pop()
    fn(*args)  # the linger is over
    assert _series(reg, "done") == []
    assert any(ln.startswith("surge_checkpoint_commits_total") for ln in _series(reg, "other"))
    # Its versions are untouched: only the series went.
    assert versions(manager, "done") == ["done:1", "done:2"]
    assert load(manager, "done:latest").version == "done:2"


def test_a_resumed_job_s_commit_after_its_end_makes_its_series_again(tmp_path):
    manager, reg = _manager(tmp_path)  # no timer: removed at once
    save(manager, "j", 5)
    assert _retire(manager, "j").series == 4
    assert _series(reg, "j") == []
    save(manager, "j", 10)
    assert 'surge_checkpoint_commits_total{job="j"} 1.0' in _series(reg, "j")
    # A second end, and an end of a job that never committed, remove what is there and no more.
    assert _retire(manager, "j").series == 4
    assert _retire(manager, "never").series == 0
    assert _series(reg, "j") == []


def test_a_job_id_that_is_not_a_safe_name_is_refused(tmp_path):
    manager, _ = _manager(tmp_path)
    with pytest.raises(ValueError):
        _retire(manager, "../x")
