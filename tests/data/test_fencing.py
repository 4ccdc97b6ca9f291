"""Fencing at the data service (issue 29 item 4): the real ``python -m services.data`` refuses
Mount and Stream from an older incarnation of a rank than the newest it was told of."""

from __future__ import annotations

import grpc
import pytest

from services.common.fencing import GENERATION_METADATA
from services.contract import data_pb2, route_pb2
from services.contract.failures import cause_of
from tests.data.test_service_process import service  # noqa: F401 - the real data service (fixture)

from .helpers import open_stream

pytestmark = pytest.mark.timeout(120)


def as_rank(generation: int) -> tuple[tuple[str, str], ...]:
    return ((GENERATION_METADATA, f"job-f/1/{generation}"),)


def test_mount_and_stream_from_a_replaced_incarnation_are_refused_with_a_typed_cause(service):  # noqa: F811
    _, stub = service
    mount = data_pb2.MountDataset(name="tiny", version="v1")
    assert stub.Mount(mount, timeout=30, metadata=as_rank(7)).train_documents > 0  # the newest: served
    for call in (
        lambda: stub.Mount(mount, timeout=30, metadata=as_rank(6)),
        lambda: list(stub.Stream(open_stream(max_batches=2), timeout=30, metadata=as_rank(6))),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert cause_of(e.value) == route_pb2.FailureCause.FAILURE_FENCED  # from the trailers, not the text
        assert "generation 6 was replaced by generation 7" in e.value.details()
    # The newest incarnation, another rank and an unfenced caller (no generation) are served.
    assert len(list(stub.Stream(open_stream(max_batches=2), timeout=30, metadata=as_rank(7)))) == 2
    assert len(list(stub.Stream(open_stream(max_batches=1), timeout=30, metadata=(
        (GENERATION_METADATA, "job-f/0/1"),)))) == 1  # fmt: skip
    assert len(list(stub.Stream(open_stream(max_batches=1), timeout=30))) == 1
