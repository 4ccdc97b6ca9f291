"""How fast the data service streams micro-batches when nothing else limits it.

    .venv/bin/python bench/data_drain.py [--seconds 20] [--streams 1]

Starts a real `data` service on the prepared stdlib@v1, opens ``--streams`` training streams
exactly as a rank of ``bench/jobs/throughput.yaml`` does (same OpenStream: shuffle, filter,
pack, 8 x 256) and drains them as fast as the client can for ``--seconds`` (after a 2 s
warm-up that is not counted). Reports batches/s, MB/s (input_ids + labels bytes on the
wire) and tokens per batch, and the data service's CPU seconds per batch (/proc), as one
JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc (Linux), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_request(rank: int, world: int):
    from services.contract import data_pb2
    from services.jobspec import load_job_spec

    d = load_job_spec(c.REPO / "bench/jobs/throughput.yaml").data
    return data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name=d.name, version=d.version),
        prefetch=data_pb2.SetPrefetch(watermark=d.prefetch.watermark, threads=d.prefetch.threads),
        shuffle=data_pb2.ShufflePlan(seed=d.shuffle_seed, enabled=d.shuffle),
        filter=data_pb2.FilterRules(
            min_tokens=d.filter.min_tokens, max_tokens=d.filter.max_tokens, banned_bytes=d.filter.banned_bytes.encode()
        ),
        packer=data_pb2.PackerConfig(
            seq_len=d.seq_len,
            micro_batch_size=d.micro_batch_size,
            pad_id=d.pad_id,
            mode=data_pb2.PACK,
            separator_id=0,
            rank=rank,
            world_size=world,
        ),
        split="train",
        repeat=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=1)
    args = ap.parse_args()
    c.setup_env()
    import grpc

    from services.common.grpc_server import channel
    from services.contract import Module, data_pb2_grpc

    port = free_port()
    svc = subprocess.Popen(
        [
            c.PY,
            "-m",
            "services.data",
            "--port",
            str(port),
            "--metrics-port",
            str(free_port()),
            "--data-root",
            str(c.DATA_ROOT),
        ],
        cwd=c.REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ch = channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)], module=Module.L2_TRAINING_LOOP
        )  # streams as a rank would
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = data_pb2_grpc.DataServiceStub(ch)
        counts = [[0, 0, 0] for _ in range(args.streams)]  # batches, bytes, tokens (counted window)
        counting = threading.Event()
        stop = threading.Event()

        def drain(i: int) -> None:
            call = stub.Stream(open_request(i, args.streams))
            for mb in call:
                if counting.is_set():
                    n = counts[i]
                    n[0] += 1
                    n[1] += len(mb.input_ids) + len(mb.labels)
                    n[2] += mb.batch_size * mb.seq_len
                if stop.is_set():
                    call.cancel()
                    return

        threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(args.streams)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        cpu0, t0 = cpu_seconds(svc.pid), time.perf_counter()
        counting.set()
        time.sleep(args.seconds)
        counting.clear()
        wall, cpu = time.perf_counter() - t0, cpu_seconds(svc.pid) - cpu0
        stop.set()
        batches = sum(n[0] for n in counts)
        out = {
            "streams": args.streams,
            "seconds": wall,
            "batches": batches,
            "batches_per_s": batches / wall,
            "mb_per_s": sum(n[1] for n in counts) / wall / 1e6,
            "tokens_per_batch": sum(n[2] for n in counts) / max(batches, 1),
            "data_service_cpu_s_per_batch": cpu / max(batches, 1),
            "data_service_cpu_percent": 100 * cpu / wall,
        }
        print(json.dumps(out))
    finally:
        svc.terminate()
        svc.wait(timeout=15)


if __name__ == "__main__":
    main()
