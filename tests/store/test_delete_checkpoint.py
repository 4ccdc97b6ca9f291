"""`surgectl delete checkpoint`: L5-1 removes one version (catalog first, then its files and
the chunks only it held), and refuses one in use."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.contract import store_pb2, store_pb2_grpc
from services.store.checkpoint_manager import CheckpointManager, CheckpointNotFound, CheckpointRejected
from tests.callers import any_caller_channel

from .conftest import save, stage, versions
from .test_store_service import store  # noqa: F401 - the real service's fixture

pytestmark = pytest.mark.timeout(60)


def delete(manager: CheckpointManager, version: str, job_ended: bool = False) -> store_pb2.CheckpointDeleted:
    return manager.delete_checkpoint(store_pb2.DeleteCheckpoint(version=version, job_ended=job_ended))


def test_a_version_is_removed_from_the_catalog_and_the_disk_and_a_restart_agrees(manager, tmp_path):
    for step in (1, 2, 3):
        save(manager, "j", step)
    old = tmp_path / "checkpoints" / "j" / "1"
    assert old.is_dir()
    done = delete(manager, "j:1")
    assert done.version == "j:1" and done.bytes_freed > 0
    assert versions(manager, "j") == ["j:2", "j:3"] and not old.exists()
    assert versions(CheckpointManager(tmp_path), "j") == ["j:2", "j:3"]  # the catalog on disk says so too


def test_the_newest_ok_version_of_a_job_not_ended_is_refused_and_kept(manager):
    for step in (1, 2):
        save(manager, "j", step)
    with pytest.raises(CheckpointRejected, match="j:2 is in use: the newest ok version of j"):
        delete(manager, "j:2")
    assert versions(manager, "j") == ["j:1", "j:2"]
    delete(manager, "j:2", job_ended=True)  # the job ended: nothing resumes from it
    assert versions(manager, "j") == ["j:1"]


def test_a_version_of_a_job_with_a_save_in_flight_is_refused(manager):
    save(manager, "j", 1)
    save(manager, "j", 2)
    stage(manager, "j", 3, {".metadata": b"m"})  # a save begun, not committed
    with pytest.raises(CheckpointRejected, match="save of j is in flight"):
        delete(manager, "j:1", job_ended=True)
    assert versions(manager, "j") == ["j:1", "j:2"]


def test_unknown_and_malformed_versions(manager):
    save(manager, "j", 1)
    with pytest.raises(CheckpointNotFound, match=r"checkpoint j:7 not found \(have: j:1\)"):
        delete(manager, "j:7")
    with pytest.raises(
        CheckpointNotFound, match=r"^checkpoint nosuch:1 not found \(job nosuch has no checkpoint versions\)$"
    ):
        delete(manager, "nosuch:1")
    with pytest.raises(ValueError, match="version: expected '<job>:<n>'"):
        delete(manager, "latest")


@pytest.mark.integration
def test_delete_through_the_real_service(store):  # noqa: F811 - the fixture
    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        for step in (1, 2):
            staged = Path(
                stub.BeginSave(store_pb2.SaveCheckpoint(job_id="it", step=step, rank=0), timeout=10).staging_path
            )
            (staged / "__0_0.distcp").write_bytes(b"x" * 100)
            (staged / ".metadata").write_bytes(b"meta")
            stub.CommitSave(
                store_pb2.CommitCheckpoint(job_id="it", step=step, world_size=1, spec_json="{}"), timeout=10
            )
        with pytest.raises(grpc.RpcError) as e:
            stub.Delete(store_pb2.DeleteCheckpoint(version="it:9"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            stub.Delete(store_pb2.DeleteCheckpoint(version="it:2"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use" in e.value.details()
        assert stub.Delete(store_pb2.DeleteCheckpoint(version="it:1"), timeout=10).version == "it:1"
        listed = stub.List(store_pb2.CheckpointQuery(job_id="it"), timeout=10).checkpoints
        assert [c.version for c in listed] == ["it:2"]


def test_a_job_s_checkpoint_series_go_with_its_last_version(tmp_path):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    manager = CheckpointManager(tmp_path, registry=registry)
    for job, step in (("j", 1), ("j", 2), ("k", 1)):
        save(manager, job, step)

    def series(job: str) -> set[str]:
        return {s.name for f in registry.collect() for s in f.samples if s.labels.get("job") == job}

    assert {"surge_checkpoint_bytes", "surge_checkpoint_commits_total"} <= series("j")
    delete(manager, "j:1")
    assert "surge_checkpoint_bytes" in series("j")  # a version left: its series stay
    delete(manager, "j:2", job_ended=True)
    assert series("j") == set()
    assert {"surge_checkpoint_bytes", "surge_checkpoint_commits_total"} <= series("k")
