"""L4-1: registry, mounting, and verification against the manifest (through the real bus)."""

from __future__ import annotations

import json
import shutil

import pytest

from services.contract import Module, data_pb2, route_pb2
from services.data.__main__ import build_registry
from services.data.errors import DatasetCorrupt, DatasetNotFound
from services.data.prepare import prepare_dataset

from .helpers import module_failure

USER, VERSIONS = Module.EXT_USER, Module.L4_DATASET_VERSIONS


CORRUPT = route_pb2.FAILURE_DATA_CORRUPT


def mount(bus, name="tiny", version="v1", verify=True) -> data_pb2.DatasetReady:
    return bus.port(USER, VERSIONS)(data_pb2.MountDataset(name=name, version=version, verify=verify)).message


def flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_mount_reports_the_counts_and_hash_of_the_manifest(dataset, root):
    bus, _ = build_registry(root)
    ready = mount(bus)
    assert (ready.name, ready.version, ready.manifest_sha256) == ("tiny", "v1", dataset.manifest_sha256)
    assert (ready.train_documents, ready.train_tokens) == (dataset.train_documents, dataset.train_tokens)
    assert (ready.val_documents, ready.val_tokens) == (dataset.val_documents, dataset.val_tokens)
    assert (ready.tokenizer, ready.vocab_size) == ("bytes", 256)


def test_an_unknown_name_or_version_names_what_exists(dataset, root):
    bus, _ = build_registry(root)
    with pytest.raises(DatasetNotFound, match=r"^dataset tiny@v9 not found \(have: tiny@v1\)$"):
        mount(bus, version="v9")
    with pytest.raises(DatasetNotFound, match=r"^dataset nope@v1 not found \(have: tiny@v1\)$"):
        mount(bus, name="nope")


def test_verification_catches_one_changed_byte(dataset, root):
    flip_one_byte(dataset.path / "train.bin")
    bus, _ = build_registry(root)
    line = r"^dataset tiny@v1: train\.bin: sha256 mismatch \(manifest [0-9a-f]{12}…, file [0-9a-f]{12}…\)$"
    with module_failure(DatasetCorrupt, line, "DatasetUnavailable", CORRUPT):
        mount(bus, verify=True)
    mount(bus, verify=False)  # same size: only hashing can see it, and it was not asked for


def test_a_copied_version_with_a_changed_file_is_refused_by_hash_first(dataset, root):
    # The operator's mistake the end-to-end test makes: copy v1 to v2 and damage a file.
    shutil.copytree(dataset.path, root / "tiny" / "v2")
    flip_one_byte(root / "tiny" / "v2" / "train.idx.npy")
    bus, _ = build_registry(root)
    with module_failure(DatasetCorrupt, r"tiny@v2: train\.idx\.npy: sha256 mismatch", "DatasetUnavailable", CORRUPT):
        mount(bus, version="v2")


def test_an_edited_manifest_is_caught_by_its_own_hash(dataset, root):
    path = dataset.path / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["train"]["documents"] += 1
    path.write_text(json.dumps(manifest))
    bus, _ = build_registry(root)
    with module_failure(
        DatasetCorrupt, r"^dataset tiny@v1: manifest\.json: sha256 mismatch", "DatasetUnavailable", CORRUPT
    ):
        mount(bus, verify=False)


def test_a_truncated_file_is_caught_by_its_size_without_hashing(dataset, root):
    path = dataset.path / "val.bin"
    path.write_bytes(path.read_bytes()[:-2])
    bus, _ = build_registry(root)
    with module_failure(
        DatasetCorrupt, r"val\.bin: size mismatch \(manifest \d+ bytes, file \d+ bytes\)", "DatasetUnavailable", CORRUPT
    ):
        mount(bus, verify=False)


def test_list_rescans_so_a_version_prepared_later_is_found(dataset, source, root):
    bus, _ = build_registry(root)
    query = bus.port(USER, VERSIONS)
    assert [f"{d.name}@{d.version}" for d in query(data_pb2.DatasetQuery()).message.datasets] == ["tiny@v1"]
    prepare_dataset(source, "other", "v3", root)
    listed = query(data_pb2.DatasetQuery()).message.datasets
    assert [f"{d.name}@{d.version}" for d in listed] == ["other@v3", "tiny@v1"]
    assert mount(bus, "other", "v3").name == "other"


def test_a_failed_mount_is_also_an_event_to_the_training_loop(dataset, root):
    bus, _ = build_registry(root)
    seen = []
    bus.subscribe(Module.L2_TRAINING_LOOP, data_pb2.DatasetUnavailable, lambda m, p: seen.append(m))
    with pytest.raises(DatasetNotFound):
        mount(bus, version="v9")
    assert [(m.name, m.version) for m in seen] == [("tiny", "v9")]
    assert seen[0].reason == f"dataset tiny@v9 not found (have: tiny@v1): {root / 'tiny' / 'v9'} does not exist"


def test_a_version_removed_under_a_job_is_a_typed_failure_naming_its_directory(dataset, root):
    # Issue 29 item 8: the directory of a mounted version removed (an operator's rm -rf under a
    # running job); its next stream mounts it again. The event L1-3 grades carries a typed
    # failure part naming the path (it used to carry none: the relay stamped an empty one and
    # the job failed with "failed handling an event: ").
    bus, _ = build_registry(root)
    mount(bus)
    shutil.rmtree(dataset.path)
    seen = []
    bus.subscribe(Module.L1_FAULT_DETECTOR, data_pb2.DatasetUnavailable, lambda m, p: seen.append(m))
    with pytest.raises(DatasetNotFound):
        mount(bus)
    assert len(seen) == 1, seen
    failure = seen[0].failure
    assert failure.cause == route_pb2.FAILURE_UNAVAILABLE
    assert failure.module == VERSIONS and failure.operation == "surge.v1.MountDataset"
    assert f"{dataset.path} does not exist" in failure.detail, failure.detail
