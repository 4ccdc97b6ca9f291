"""`surgectl delete dataset`: L4-1 removes one prepared version, refused while a stream of
it is open (the servicer counts the streams and tells L4-1)."""

from __future__ import annotations

import shutil
import time

import grpc
import pytest

from services.contract import Module, data_pb2
from services.contract.bus import Bus
from services.data.dataset_versions import DatasetVersions
from services.data.errors import DatasetInUse, DatasetNotFound

from .helpers import open_stream
from .test_service_process import code_and_details, service  # noqa: F401 - the real service's fixture

pytestmark = pytest.mark.timeout(60)


def registry(root) -> DatasetVersions:
    bus = Bus()
    return DatasetVersions(root, bus.emitter(Module.L4_DATASET_VERSIONS), lambda *a, **k: None)


def test_a_version_goes_with_its_directory_and_a_read_one_is_refused(dataset, root):
    shutil.copytree(dataset.path, root / "tiny" / "v2")
    for version in ("v1", "v2"):  # their sample indices (sample_index.py), next to them
        (root / ".index" / "tiny" / version / "k" / "epoch-0").mkdir(parents=True)
    versions = registry(root)
    with pytest.raises(DatasetInUse, match="tiny@v2 is in use: 1 stream of it open"):
        versions.delete_dataset(data_pb2.DeleteDataset(name="tiny", version="v2"), 1)
    assert (root / "tiny" / "v2").is_dir()
    done = versions.delete_dataset(data_pb2.DeleteDataset(name="tiny", version="v2"), 0)
    assert (done.name, done.version) == ("tiny", "v2") and done.bytes_freed > 0
    assert not (root / "tiny" / "v2").exists() and (root / "tiny" / "v1").is_dir()
    assert not (root / ".index" / "tiny" / "v2").exists() and (root / ".index" / "tiny" / "v1").is_dir()
    listed = versions.dataset_query(data_pb2.DatasetQuery()).datasets
    assert [(d.name, d.version) for d in listed] == [("tiny", "v1")]
    versions.delete_dataset(data_pb2.DeleteDataset(name="tiny", version="v1"), 0)
    assert not (root / "tiny").exists()  # the name's directory went with its last version
    with pytest.raises(DatasetNotFound, match="dataset tiny@v1 not found"):
        versions.delete_dataset(data_pb2.DeleteDataset(name="tiny", version="v1"), 0)


@pytest.mark.integration
def test_delete_through_the_real_service_waits_for_its_streams(service, dataset, root):  # noqa: F811
    _, stub = service
    call = stub.Stream(open_stream(repeat=True), timeout=30)
    next(call)  # a rank reads tiny@v1
    code, details = code_and_details(lambda: stub.Delete(data_pb2.DeleteDataset(name="tiny", version="v1"), timeout=30))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "in use" in details
    call.cancel()
    for _ in range(100):  # the server sees the hang-up a moment later
        try:
            done = stub.Delete(data_pb2.DeleteDataset(name="tiny", version="v1"), timeout=30)
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
            time.sleep(0.05)
    assert done.version == "v1" and not (root / "tiny" / "v1").exists()
    assert stub.List(data_pb2.DatasetQuery(), timeout=30).datasets == []
