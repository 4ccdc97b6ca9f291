"""What pinning dataset shards by their digests costs (issue 29 item 7).

    python -m bench.shard_digest [--mb 256] [--reads 20000]

Three figures, each the median of a few runs on a file of ``--mb`` MiB written here (page
cache warm, as a stream's first open after prepare finds it):

* the first open's digest (``manifest.verify_shard``): MB/s, against reading the same bytes
  without hashing (what the first read of the file costs anyway when the corpus is read once);
* a later open of the unchanged file: one stat (µs);
* a read with the per-read identity check (a stat) against a plain ``os.pread`` of one row
  (2048 uint16 tokens), both in µs: the check's share of a read;
* a micro-batch's rows (8 rows of 2048 tokens) through the prefetcher's ``TokenReader.read_many``
  (one check per batch) pinned and not pinned: the check's share of a batch's reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from services.data import manifest as mf
from services.data.documents import TokenStore
from services.data.prefetcher import TokenReader


def _median(fn, n: int) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reads", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.bin"
        block = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(block)
        size = path.stat().st_size
        sha = mf.sha256_file(path)

        def first_open() -> None:
            mf._digests.clear()
            mf.verify_shard(path, "train.bin", sha, "bench@v1")

        def read_all() -> None:
            with open(path, "rb") as f:
                while f.read(4 << 20):
                    pass

        hashed, plain = _median(first_open, 3), _median(read_all, 3)
        mf.verify_shard(path, "train.bin", sha, "bench@v1")
        later = _median(lambda: mf.verify_shard(path, "train.bin", sha, "bench@v1"), 200)
        fd = os.open(path, os.O_RDONLY)
        row = 2048 * 2
        offsets = [(i * 7919 * row) % (size - row) for i in range(args.reads)]
        verified = mf.identity(path)

        def preads() -> None:
            for o in offsets:
                os.pread(fd, row, o)

        def checked_preads() -> None:
            for o in offsets:
                assert mf.identity(path) == verified
                os.pread(fd, row, o)

        p, c = _median(preads, 3) / args.reads, _median(checked_preads, 3) / args.reads
        os.close(fd)
        bounds = np.arange(0, size // 2 + 1, 2048, dtype=np.int64)
        pool = ThreadPoolExecutor(2)
        batches = [[(int(o // 2), 2048) for o in offsets[i : i + 8]] for i in range(0, len(offsets), 8)]
        per_batch = {}
        for pinned in (False, True):
            store = TokenStore("bench@v1", "train", path, np.dtype("<u2"), bounds, "bytes",
                               tokens_sha256=sha if pinned else "", verified=verified if pinned else None)  # fmt: skip
            reader = TokenReader(store, pool, 2, 8)

            def batch_reads(reader=reader) -> None:
                for rows in batches:
                    reader.read_many(rows)

            per_batch[pinned] = _median(batch_reads, 3) / len(batches)
            reader.close()
        pool.shutdown()
    mb = size / 1e6
    print(
        f"first open, digest: {mb / hashed:,.0f} MB/s ({hashed:.3f} s for {mb:.0f} MB); "
        f"read without hashing: {mb / plain:,.0f} MB/s ({hashed / plain:.1f}x)"
    )
    print(f"later open, unchanged: {later * 1e6:.1f} µs")
    b0, b1 = per_batch[False], per_batch[True]
    print(f"batch of 8 rows (read_many): {b0 * 1e6:.1f} µs, pinned {b1 * 1e6:.1f} µs (+{(b1 - b0) / b0:.1%})")
    print(f"row read: pread {p * 1e6:.2f} µs, with the identity check {c * 1e6:.2f} µs (+{(c - p) / p:.0%})")


if __name__ == "__main__":
    main()
