"""The shuffles' permutations: ``argsort`` of a seeded stream of raw PCG64 keys, fast.

Both orders of the data path are ``np.argsort(keys, kind="stable")`` of raw 64-bit PCG64
outputs (stable across NumPy releases, NEP 19): the shuffler's document order
(``epoch_order``) and the packer's row order (``row_order``, Megatron-LM's ``shuffle_idx``).
On a 20 GB corpus (~5 M documents and ~5 M rows) each argsort took ~0.7 s of the first
batch's wait. :func:`argsort_keys` gives the same permutation by sorting *values*, which
NumPy does with its SIMD sort (several times faster than an argsort): each key's low bits
are replaced by its index, so the sorted values carry the permutation; keys whose remaining
high bits tie (a handful among millions: they would be ordered by index, not by key) are
put back in key order afterwards.
"""

from __future__ import annotations

import numpy as np


def argsort_keys(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of uint64 ``keys``, as int64 (exactly: ties in
    the whole key keep index order)."""
    n = len(keys)
    if n < 2:
        return np.arange(n, dtype=np.int64)
    bits = int(n - 1).bit_length()
    low = np.uint64((1 << bits) - 1)
    packed = keys & ~low  # (a new array: the caller's keys are kept for the ties below)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    tied = np.flatnonzero((packed[1:] ^ packed[:-1]) <= low)  # same high bits as the next one
    packed &= low
    perm = packed.view(np.int64)
    if len(tied):
        # Every position in a run of equal high bits, ascending: the runs follow each other
        # in key order already, so one stable sort of their full keys orders each run within
        # itself (and keeps index order where whole keys tie, as the stable argsort does).
        at = np.union1d(tied, tied + 1)
        ids = perm[at]
        perm[at] = ids[np.argsort(keys[ids], kind="stable")]
    return perm
