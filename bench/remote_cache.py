"""A remote dataset version's token reads: MB/s from a local S3-compatible server (moto) with a
cold block cache, then with a warm one.

    .venv/bin/python bench/remote_cache.py [--mb 256] [--block-mb 8] [--threads 8] [--root DIR]

A synthetic version (``tests/data/synthetic.py``, ``--mb`` of uint16 train tokens) is pushed
with ``surgectl dataset push``'s code to moto on loopback, deleted locally, mounted through
``RemoteVersions`` (manifest and small files fetched and checked) and its train split read
whole through the prefetcher's ``TokenReader`` (``chunks`` of 1 Mi tokens, ``--threads``
reads in flight on a pool) twice: cold (every block a ranged GET) and warm (every block on
local disk). The cache's bound holds the whole split, so the second pass is all hits.
Prints one JSON line and writes bench/results/remote_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from services.cli import dataset_transfer  # noqa: E402
from services.data.block_cache import CACHE_DIR, BlockCache  # noqa: E402
from services.data.documents import TokenStore  # noqa: E402
from services.data.prefetcher import TokenReader  # noqa: E402
from services.data.remote_versions import RemoteVersions  # noqa: E402
from tests.data.synthetic import write_corpus  # noqa: E402
from tests.ports import free_port  # noqa: E402

RESULTS = REPO / "bench" / "results" / "remote_cache.json"
URL = "s3://bench/corpora"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="train split size in MB (default 256)")
    p.add_argument("--block-mb", type=int, default=8, help="cache block size in MiB (default 8)")
    p.add_argument("--threads", type=int, default=8, help="reads in flight (default 8)")
    p.add_argument("--root", type=Path, default=None, help="data root (default: a temp dir, removed)")
    args = p.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request

    for k, v in {"AWS_ACCESS_KEY_ID": "b", "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    root = args.root or Path(tempfile.mkdtemp(prefix="remote-cache-"))
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("bench")
        path = write_corpus(root, "synth", "v1", args.mb * 1_000_000 // 2)
        t = time.perf_counter()
        dataset_transfer.push(root, "synth@v1", URL, endpoint)
        push_s = time.perf_counter() - t
        shutil.rmtree(path)

        block = args.block_mb << 20
        size = args.mb * 1_000_000
        cache = BlockCache(root / CACHE_DIR, block, (size // block + 2) * block)
        remote = RemoteVersions(URL, root, cache, endpoint)
        local, manifest = remote.mount("synth", "v1", verify=False)
        cached = remote.token_file("synth", "v1", manifest, "train")
        bounds = np.load(local / manifest["splits"]["train"]["index_file"], mmap_mode="r")
        store = TokenStore("synth@v1", "train", local / "train.bin", np.dtype("<u2"), bounds, "bytes", remote=cached)
        pool = ThreadPoolExecutor(args.threads)
        passes = {}
        for label in ("cold", "warm"):
            reader = TokenReader(store, pool, args.threads, 64)
            t = time.perf_counter()
            n = sum(len(tokens) for _, tokens in reader.chunks(1 << 20))
            elapsed = time.perf_counter() - t
            passes[label] = round(n * 2 / 1e6 / elapsed, 1)
        out = {
            "train_mb": round(cached.file.size / 1e6, 1),
            "block_mib": args.block_mb,
            "threads": args.threads,
            "push_s": round(push_s, 2),
            "cold_mb_s": passes["cold"],
            "warm_mb_s": passes["warm"],
            "ranged_gets": cache.fetches,
        }
        print(json.dumps(out))
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    finally:
        server.stop()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
