"""Data-service CPU for the tensor/pipeline-parallel peers of one data-parallel replica.

    .venv/bin/python bench/data_fanout.py [--tree DIR] [--streams 4] [--batches 300]
                                          [--mb 100] [--root DIR] [--label NAME]

A synthetic token corpus (``tests/data/synthetic.py``, written once and kept under
``--root``) is served by a real ``data`` service started from the code tree ``--tree``
(default: this checkout; another tree, e.g. one before streams shared pipelines, gives the
"before" figure). After a warm-up stream (the sample index built), ``--streams`` byte-
identical streams (rank 0 of a dp 2 job, as the tp peers of one replica open them) drain
``--batches`` each together; the service's CPU seconds (user + system, /proc/PID/stat) over
that drain are reported, with the pipelines the service logged closing and the streams
each served (none logged by a service that builds one per stream).

Job shape: seq_len 2048, micro-batch 4, PACK, shuffle on, min_tokens 16. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from services.contract import data_pb2, data_pb2_grpc  # noqa: E402
from tests.callers import any_caller_channel  # noqa: E402
from tests.data.synthetic import write_corpus  # noqa: E402
from tests.ports import free_port  # noqa: E402


def request(max_batches: int) -> data_pb2.OpenStream:
    return data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name="synth", version="v1"),
        prefetch=data_pb2.SetPrefetch(watermark=64, threads=4),
        shuffle=data_pb2.ShufflePlan(seed=1234, enabled=True),
        filter=data_pb2.FilterRules(min_tokens=16),
        packer=data_pb2.PackerConfig(
            seq_len=2048, micro_batch_size=4, mode=data_pb2.PACK, separator_id=0, rank=0, world_size=2
        ),
        split="train",
        repeat=True,
        max_batches=max_batches,
    )


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=REPO, help="the code tree the service runs from")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--mb", type=float, default=100.0, help="corpus size, MB of tokens")
    p.add_argument("--root", type=Path, default=REPO / ".surge" / "bench-data-fanout" / "datasets")
    p.add_argument("--label", default="")
    args = p.parse_args()
    if not (args.root / "synth" / "v1" / "manifest.json").is_file():
        write_corpus(args.root, "synth", "v1", int(args.mb * 1e6 // 2))
    port = free_port()
    tree = args.tree.resolve()
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONPATH": str(tree), "SURGE_HOME": str(args.root.parent)}
    log = args.root.parent / f"service-{port}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.data", "--port", str(port), "--data-root", str(args.root)],
            cwd=tree,
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
        )
    ch = any_caller_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = data_pb2_grpc.DataServiceStub(ch)
        for _ in stub.Stream(request(2), timeout=600):  # warm-up: the sample index is built
            pass
        got = [0] * args.streams

        def one(i: int) -> None:
            for _ in stub.Stream(request(args.batches), timeout=600):
                got[i] += 1

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
        before, started = cpu_s(proc.pid), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        time.sleep(0.5)  # (the pipelines' close is logged after the last stream ends)
        used = cpu_s(proc.pid) - before
    finally:
        ch.close()
        proc.terminate()
        proc.wait(timeout=30)
    served = [
        json.loads(line).get("consumers")
        for line in log.read_text().splitlines()
        if line.startswith("{") and "stream pipeline closed" in line
    ]
    print(
        json.dumps(
            {
                "bench": "data_fanout",
                "label": args.label or str(tree),
                "command": "python bench/data_fanout.py " + " ".join(sys.argv[1:]),
                "streams": args.streams,
                "batches_per_stream": args.batches,
                "batches_received": sum(got),
                "service_cpu_s": round(used, 2),
                "wall_s": round(wall, 2),
                "pipelines_logged": served[1:],  # (the first is the warm-up's)
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
