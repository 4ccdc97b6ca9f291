"""The shuffles' fast permutation is exactly the stable argsort it replaces (permutation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from services.data.permutation import argsort_keys


def _keys(rng, n: int, kind: str) -> np.ndarray:
    raw = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    if kind == "random":
        return raw
    if kind == "high bits tie":  # few distinct high parts: long runs ordered by their low bits
        return (rng.integers(0, 4, size=n).astype(np.uint64) << np.uint64(62)) | (raw >> np.uint64(40))
    return (raw >> np.uint64(60)) << np.uint64(60)  # "whole keys tie": index order must hold


@pytest.mark.parametrize("kind", ["random", "high bits tie", "whole keys tie"])
def test_the_fast_permutation_is_the_stable_argsort(kind):
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, 3, 7, 64, 1000, 100_003):
        keys = _keys(rng, n, kind)
        before = keys.copy()
        got = argsort_keys(keys)
        assert got.dtype == np.int64 and np.array_equal(got, np.argsort(keys, kind="stable")), (kind, n)
        assert np.array_equal(keys, before)  # the caller's keys are left alone


def test_pcg64_keys_of_a_corpus_sized_epoch_tie_in_their_high_bits_and_still_match():
    # 2**22 keys leave 42 high bits: a few pairs share them, which the index order alone gets wrong.
    keys = np.random.PCG64(np.random.SeedSequence([1234, 0])).random_raw(1 << 22)
    high = np.sort(keys >> np.uint64(22))
    assert np.count_nonzero(high[1:] == high[:-1]) > 0
    assert np.array_equal(argsort_keys(keys), np.argsort(keys, kind="stable"))
