"""Shared helpers for the store tests: a manager on a temp root and a way to stage files."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.contract import store_pb2
from services.store.checkpoint_manager import CheckpointManager


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path)


def stage(manager: CheckpointManager, job: str, step: int, files: dict[str, bytes], ranks=(0,)) -> Path:
    """BeginSave from every rank (they must all get one directory), then write ``files``."""
    paths = {
        manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=step, rank=r)).staging_path for r in ranks
    }
    assert len(paths) == 1, paths
    path = Path(paths.pop())
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def commit(manager: CheckpointManager, job: str, step: int, keep_last: int = 0, spec_json: str = "{}"):
    return manager.commit_checkpoint(
        store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json=spec_json, keep_last=keep_last)
    )


def save(manager: CheckpointManager, job: str, step: int, keep_last: int = 0) -> store_pb2.SaveCompleted:
    stage(manager, job, step, {"__0_0.distcp": f"{job}@{step}".encode() * 100, ".metadata": b"meta"})
    return commit(manager, job, step, keep_last)


def load(manager: CheckpointManager, version: str) -> store_pb2.CheckpointInfo:
    return manager.load_checkpoint(store_pb2.LoadCheckpoint(version=version)).info


def versions(manager: CheckpointManager, job: str = "") -> list[str]:
    return [c.version for c in manager.checkpoint_query(store_pb2.CheckpointQuery(job_id=job)).checkpoints]
