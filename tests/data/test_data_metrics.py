"""The data service's block cache on /metrics (services/data/block_cache.py): hits, misses
(blocks fetched), bytes fetched, evictions, and the bytes held and the bound, read when
scraped. The object store is a stand-in with ``cat_file`` (the cache's only call to it)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.data.block_cache import BlockCache, CachedFile, RemoteFile

pytestmark = pytest.mark.timeout(30)
BLOCK = 1024


class _Objects:
    def __init__(self, data: bytes):
        self.data, self.calls = data, 0

    def cat_file(self, path, start=None, end=None):
        self.calls += 1
        return self.data[start:end]


def value(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_cache_hits_misses_evictions_and_bytes_held_are_exported(tmp_path):
    data = bytes(range(256)) * 16  # 4 blocks
    names = (
        "surge_data_cache_hits_total",
        "surge_data_cache_misses_total",
        "surge_data_cache_fetched_bytes_total",
        "surge_data_cache_evictions_total",
    )
    before = {n: value(n) for n in names}
    cache = BlockCache(tmp_path / "blocks", block_bytes=BLOCK, capacity_bytes=2 * BLOCK)
    f = CachedFile(cache, RemoteFile(_Objects(data), "b/blob", len(data), "a" * 64, "s3://b/blob"))
    assert f.read(0, 10) == data[:10]  # miss: block 0 fetched
    assert f.read(20, 10) == data[20:30]  # hit
    assert f.read(BLOCK, 10) == data[BLOCK : BLOCK + 10]  # miss: block 1
    assert f.read(2 * BLOCK, 10) == data[2 * BLOCK : 2 * BLOCK + 10]  # miss: block 0 evicted
    got = {n: value(n) - before[n] for n in names}
    assert got == {
        "surge_data_cache_hits_total": 1,
        "surge_data_cache_misses_total": 3,
        "surge_data_cache_fetched_bytes_total": 3 * BLOCK,
        "surge_data_cache_evictions_total": 1,
    }
    assert value("surge_data_cache_bytes") == 2 * BLOCK
    assert value("surge_data_cache_capacity_bytes") == 2 * BLOCK
