"""Fencing at the store (issue 29 item 4): the real ``python -m services.store`` refuses
BeginSave, chunk writes, CommitSave and Record from an older incarnation of a rank than the
newest it was told of; a stale rank 0's commit leaves the catalog as it was."""

from __future__ import annotations

import grpc
import pytest

from services.common.fencing import GENERATION_METADATA
from services.contract import route_pb2, store_pb2, store_pb2_grpc
from services.contract.failures import cause_of
from tests.callers import any_caller_channel
from tests.store.test_store_service import store  # noqa: F401 - the real store service (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def as_rank(rank: int, generation: int) -> tuple[tuple[str, str], ...]:
    return ((GENERATION_METADATA, f"fj/{rank}/{generation}"),)


def fenced(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert cause_of(e.value) == route_pb2.FailureCause.FAILURE_FENCED  # typed, from the trailers
    return e.value


def test_a_replaced_incarnation_can_neither_stage_write_commit_nor_record(store):  # noqa: F811
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        begin = [
            stub.BeginSave(store_pb2.SaveCheckpoint(job_id="fj", step=4, rank=r), timeout=10, metadata=as_rank(r, 9))
            for r in (0, 1)
        ]
        with pytest.warns(UserWarning):
            dcp.save({"w": torch.arange(4.0)}, checkpoint_id=begin[0].staging_path)
        commit = store_pb2.CommitCheckpoint(job_id="fj", step=4, world_size=2, spec_json="{}")

        # Generation 8 of rank 0 (replaced by 9) is refused before any handler runs.
        error = fenced(lambda: stub.CommitSave(commit, timeout=10, metadata=as_rank(0, 8)))
        assert "rank 0 of job fj generation 8 was replaced by generation 9" in error.details()
        assert list(stub.List(store_pb2.CheckpointQuery(job_id="fj"), timeout=10).checkpoints) == []
        fenced(lambda: stub.BeginSave(store_pb2.SaveCheckpoint(job_id="fj", step=4, rank=1), metadata=as_rank(1, 3)))
        upload = [store_pb2.CheckpointUpload(header=store_pb2.CheckpointUploadHeader(job_id="fj", step=4, rank=1))]
        fenced(lambda: stub.PutCheckpointFiles(iter(upload), timeout=10, metadata=as_rank(1, 3)))
        record = store_pb2.MetricBatch(records=[store_pb2.MetricRecord(seq=1)])
        fenced(lambda: list(stub.Record(iter([record]), timeout=10, metadata=as_rank(1, 3))))

        # The newest incarnation commits; the catalog holds its version only.
        done = stub.CommitSave(commit, timeout=10, metadata=as_rank(0, 9))
        assert [c.version for c in stub.List(store_pb2.CheckpointQuery(job_id="fj"), timeout=10).checkpoints] == [
            done.version
        ]
