"""A dataset version pinned by its shards' digests (issue 29 item 7): a shard whose bytes
change under a stream is found at the stream's next read, or at the next open (a resume),
as DatasetCorrupt (FAILURE_DATA_CORRUPT) naming the version and the shard; an unchanged
shard is hashed once per process."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.contract import data_pb2, route_pb2
from services.data import manifest as mf
from services.data.dataset_versions import DatasetVersions
from services.data.errors import DatasetCorrupt
from services.data.prefetcher import TokenReader

from .helpers import open_stream

CHANGED = r"^dataset tiny@v1: shard train\.bin changed since it was prepared \(sha256 [0-9a-f]{12}…, manifest [0-9a-f]{12}…\)$"


def opened(root):
    """A split opened by L4-1 (the store it hands the prefetcher), the events it published,
    and a reader on it (the prefetcher's handle)."""
    events, stores = [], []
    versions = DatasetVersions(root, lambda msg, payload=None: events.append(msg), lambda msg, p: stores.append(p))
    versions.open_stream(open_stream())
    store = stores[-1]
    return store, events, TokenReader(store, ThreadPoolExecutor(2), 2, 8)


def rewrite_in_place(path) -> None:
    """Flip one byte, keeping the file (its inode) and its size: what a tool that edits in
    place, or a bad copy over it, does."""
    with open(path, "r+b") as f:
        f.seek(0)
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def test_a_shard_rewritten_in_place_under_a_stream_fails_its_next_read_naming_version_and_shard(dataset, root):
    store, events, reader = opened(root)
    assert store.tokens_sha256 and store.verified is not None
    before = reader.read(0, 8)
    rewrite_in_place(dataset.path / "train.bin")
    with pytest.raises(DatasetCorrupt, match=CHANGED):
        reader.read(0, 8)
    with pytest.raises(DatasetCorrupt, match=CHANGED):  # and every read after it
        reader.read_many([(0, 4), (4, 4)])
    assert DatasetCorrupt.failure_cause == route_pb2.FAILURE_DATA_CORRUPT
    assert len(before) == 8 and events == []
    reader.close()


def test_a_shard_replaced_by_rename_is_found_though_the_open_descriptor_reads_the_old_bytes(dataset, root):
    _, _, reader = opened(root)
    path = dataset.path / "train.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    (dataset.path / "train.bin.new").write_bytes(bytes(data))
    os.replace(dataset.path / "train.bin.new", path)
    with pytest.raises(DatasetCorrupt, match=CHANGED):
        reader.read(0, 8)
    reader.close()


def test_a_changed_shard_is_refused_at_the_next_open_as_a_typed_unavailable_event(dataset, root):
    # A resume (a new stream of the same version) after the change: same size, so only the
    # digest sees it, though the stream asked no verification (the loop never does).
    opened(root)[2].close()
    rewrite_in_place(dataset.path / "train.bin")
    with pytest.raises(DatasetCorrupt, match=CHANGED):
        opened(root)
    events = []
    versions = DatasetVersions(root, lambda msg, payload=None: events.append(msg), lambda msg, p: None)
    with pytest.raises(DatasetCorrupt):
        versions.open_stream(open_stream())
    [event] = events
    assert isinstance(event, data_pb2.DatasetUnavailable) and (event.name, event.version) == ("tiny", "v1")
    assert event.failure.cause == route_pb2.FAILURE_DATA_CORRUPT
    assert "shard train.bin changed" in event.failure.detail


def test_an_unchanged_shard_is_hashed_once_per_process_and_a_touch_changes_nothing(dataset, root, monkeypatch):
    hashed = []
    real = mf.sha256_file
    monkeypatch.setattr(mf, "sha256_file", lambda p: (hashed.append(p.name), real(p))[1])
    monkeypatch.setattr(mf, "_digests", {})
    for _ in range(3):
        opened(root)[2].close()
    assert sorted(hashed) == ["train.bin", "train.idx.npy"]
    _, _, reader = opened(root)
    os.utime(dataset.path / "train.bin")  # (same bytes, new mtime and ctime: hashed again, no fault)
    assert len(reader.read(0, 8)) == 8
    assert len(reader.read(8, 8)) == 8
    assert sorted(hashed) == ["train.bin", "train.bin", "train.idx.npy"]
    reader.close()


def test_a_removed_version_directory_is_no_change_of_bytes_for_an_open_stream(dataset, root):
    # The descriptor still reads the checked file; the next mount names the missing directory.
    _, _, reader = opened(root)
    expected = reader.read(0, 8).copy()
    shutil.rmtree(dataset.path)
    assert (reader.read(0, 8) == expected).all()
    reader.close()
