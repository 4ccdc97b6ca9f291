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
from .test_chunked_versions import save as chunked_save


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
        "surge_checkpoint_last_commit_timestamp_seconds",
        "surge_checkpoint_last_commit_step",
    } <= names, names

    reply = _retire(manager, "done")
    # Seven per-job label sets (commits, seconds, bytes, written, the newest commit's time and
    # step, rejected{op=commit}); nothing
    # goes before the linger: the last values are still there for Prometheus to read.
    assert (reply.job_id, reply.series) == ("done", 7)
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
    assert _retire(manager, "j").series == 6
    assert _series(reg, "j") == []
    save(manager, "j", 10)
    assert 'surge_checkpoint_commits_total{job="j"} 1.0' in _series(reg, "j")
    # A second end, and an end of a job that never committed, remove what is there and no more.
    assert _retire(manager, "j").series == 6
    assert _retire(manager, "never").series == 0
    assert _series(reg, "j") == []


def test_a_job_id_that_is_not_a_safe_name_is_refused(tmp_path):
    manager, _ = _manager(tmp_path)
    with pytest.raises(ValueError):
        _retire(manager, "../x")


def test_deleting_a_version_of_an_ended_job_makes_none_of_its_series_again(tmp_path):
    """Session 35: deleting one version of an ended job (its others kept) brought back a lone
    surge_checkpoint_chunks_swept_total{job}. The job's series describe its checkpointing while
    it runs: gone at its end, a sweep after it (a deletion, known ended from control's word or
    from ``job_ended``, after a store restart too) makes none; a resumed job's commit does."""
    manager, reg = _manager(tmp_path)  # no timer: removed at once
    for step in (5, 10, 15):  # chunked: a baseline and two deltas, each with chunks of its own
        chunked_save(manager, "e", step)
    _retire(manager, "e")
    assert _series(reg, "e") == []
    manager.delete_checkpoint(store_pb2.DeleteCheckpoint(version="e:2", job_ended=True))
    assert versions(manager, "e") == ["e:1", "e:3"]
    assert _series(reg, "e") == []

    again, reg = _manager(tmp_path)  # a store restarted: only the deletion's word says it ended
    again.delete_checkpoint(store_pb2.DeleteCheckpoint(version="e:3", job_ended=True))
    assert versions(again, "e") == ["e:1"]
    assert _series(reg, "e") == []
    save(again, "e", 20)  # resumed: its commit makes its series again
    assert 'surge_checkpoint_commits_total{job="e"} 1.0' in _series(reg, "e")


def test_the_newest_commit_s_time_and_step_come_back_from_the_catalog_at_a_store_restart(tmp_path):
    # fresh36 F4: after a store restart a job's checkpoint series were absent until its next
    # commit, so "no checkpoint for N minutes" saw nothing while every save failed (a full disk).
    # Session 36 brought them back at the job's first save begun; now at the store's start
    # (a job whose saves are refused before they begin had none), for the jobs not ended.
    manager, reg = _manager(tmp_path)
    save(manager, "j", 5)
    save(manager, "j", 10)
    save(manager, "done", 5)
    save(manager, "resumed", 5)
    _retire(manager, "done")
    _retire(manager, "resumed")
    save(manager, "resumed", 10)  # its commit after the end: running again
    before = {ln.split("{", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in _series(reg, "j")}
    assert before["surge_checkpoint_last_commit_step"] == 10
    assert before["surge_checkpoint_last_commit_timestamp_seconds"] > 1.7e9
    restarted, reg2 = _manager(tmp_path)  # a new process over the same catalog, no save begun
    after = {ln.split("{", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in _series(reg2, "j")}
    assert after == {
        "surge_checkpoint_last_commit_step": 10,
        "surge_checkpoint_last_commit_timestamp_seconds": before["surge_checkpoint_last_commit_timestamp_seconds"],
    }
    assert _series(reg2, "done") == []  # ended: none comes back at a restart
    assert 'surge_checkpoint_last_commit_step{job="resumed"} 10.0' in _series(reg2, "resumed")
    restarted.save_checkpoint(store_pb2.SaveCheckpoint(job_id="j", step=15, rank=0))  # (never commits)
    assert {ln.split("{", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in _series(reg2, "j")} == after
    save(restarted, "done", 10)  # resumed after the restart: made again, and kept at the next
    again, reg3 = _manager(tmp_path)
    assert 'surge_checkpoint_last_commit_step{job="done"} 10.0' in _series(reg3, "done")
