"""The data plane against corpus size: a synthetic 20 GB token corpus against a 100 MB one.

    .venv/bin/python bench/data_plane.py [--big-gb 20] [--small-mb 100] [--streams 8]
                                         [--batches 200] [--root DIR] [--keep]

For each corpus (written directly as a dataset version: uint16 tokens, documents of 1..4095
tokens, ``tests/data/synthetic.py``; deleted afterwards unless ``--keep``) a real ``data``
service is started (MALLOC_ARENA_MAX=2, as the RLIMIT_AS test runs it) and measured:

* ``first_batch_cold_s``: the first batch of the first stream, the sample index not built
  yet (it includes the index build of epoch 0);
* ``index_build_s``: that build alone (``first_batch_cold_s`` minus a warm first batch);
* ``first_batch_cold_cpu_s``: the service's CPU seconds (all threads) over the cold first
  batch: on a shared machine, what the wall-clock figures would be with the CPUs free (a
  lower bound on one core; the build runs two threads);
* ``first_batch_s``: a new stream's first batch once the index exists (median of 5);
* ``batch_p50_ms`` / ``batch_p99_ms``: the gaps between consecutive batches of ``--streams``
  streams (ranks 0..S-1 of a dp S job) drained together, ``--batches`` each;
* ``next_epoch_ready_after_s``: how long after the cold first batch epoch 1's index was
  complete on disk (built ahead in the background; null: not built ahead);
* ``epoch_boundary_s``: the longest wait for a batch of a stream opened a few rounds before
  epoch 0's last row (``OpenStream.start``) and drained into epoch 1, once epoch 1's index
  is ready (a job spends hours in an epoch of this size, the bench seconds);
* ``rss_peak_mb``: the service's peak resident set (VmHWM, /proc) over all of it.

The sample index is removed before each corpus's run (cold). ``--keep`` keeps the corpora
for another run (which reuses them: ``corpus_write_s`` null).

Job shape: seq_len 2048, micro-batch 4, PACK with separator 0, shuffle on, min_tokens 16.
Writes bench/results/data_plane.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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

RESULTS = REPO / "bench" / "results" / "data_plane.json"


def request(rank: int, world: int, max_batches: int, start: tuple[int, int] | None = None) -> data_pb2.OpenStream:
    req = data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name="synth", version="v1"),
        prefetch=data_pb2.SetPrefetch(watermark=64, threads=4),
        shuffle=data_pb2.ShufflePlan(seed=1234, enabled=True),
        filter=data_pb2.FilterRules(min_tokens=16),
        packer=data_pb2.PackerConfig(
            seq_len=2048, micro_batch_size=4, mode=data_pb2.PACK, separator_id=0, rank=rank, world_size=world
        ),
        split="train",
        repeat=True,
        max_batches=max_batches,
    )
    if start is not None:
        req.start.CopyFrom(data_pb2.DataPosition(epoch=start[0], row=start[1]))
        req.shuffle.epoch = start[0]
    return req


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmPeak"):
            out[key] = int(value.split()[0]) // 1024  # MiB
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) the process has used: on a shared machine the
    wall-clock figures wait for CPUs other work holds, these do not."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_batch(stub, rank: int = 0, world: int = 8) -> float:
    started = time.perf_counter()
    call = stub.Stream(request(rank, world, 1), timeout=600)
    next(call)
    elapsed = time.perf_counter() - started
    call.cancel()
    return elapsed


def drain(stub, streams: int, batches: int) -> list[float]:
    gaps: list[float] = []
    lock = threading.Lock()

    def one(rank: int) -> None:
        mine, last = [], time.perf_counter()
        for _ in stub.Stream(request(rank, streams, batches), timeout=600):
            now = time.perf_counter()
            mine.append(now - last)
            last = now
        with lock:
            gaps.extend(mine[1:])  # (the first is the stream's start, measured apart)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gaps


def next_epoch_ready(root: Path, since: float, timeout_s: float = 120) -> float | None:
    """Seconds from ``since`` (time.time()) until epoch 1's index was complete on disk
    (its meta.json, written last), waiting for it up to ``timeout_s``; None: not built ahead
    (a service that builds an epoch only when a stream reaches it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list((root / ".index" / "synth" / "v1").glob("*/epoch-1/meta.json"))
        if found:
            return found[0].stat().st_mtime - since
        time.sleep(0.1)
    return None


def epoch_boundary(stub, root: Path, world: int = 8, rounds: int = 24) -> float:
    """The longest wait for a batch of a stream that crosses from epoch 0 into epoch 1
    (opened ``rounds`` rounds of the deal before epoch 0's end: more than the service
    assembles ahead, so that the boundary falls after the stream's first batch)."""
    (meta,) = (root / ".index" / "synth" / "v1").glob("*/epoch-0/meta.json")
    rows = json.loads(meta.read_text())["rows"]
    req = request(0, world, rounds + 8, start=(0, rows - rounds * world * 4))
    gaps, last = [], time.perf_counter()
    epochs = set()
    for batch in stub.Stream(req, timeout=600):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        epochs.add(batch.next.epoch)
    assert epochs == {0, 1}, epochs  # (it did cross)
    return max(gaps[1:])  # (the first is the stream's start)


def measure(root: Path, label: str, tokens: int, streams: int, batches: int) -> dict:
    started = time.perf_counter()
    if (root / "synth" / "v1" / "manifest.json").is_file():  # kept from a run with --keep
        written = None
    else:
        write_corpus(root, "synth", "v1", tokens)
        written = round(time.perf_counter() - started, 1)
    shutil.rmtree(root / ".index", ignore_errors=True)  # cold: no sample index yet
    port = free_port()
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "SURGE_HOME": str(root.parent / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.data", "--port", str(port), "--data-root", str(root)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ch = any_caller_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = data_pb2_grpc.DataServiceStub(ch)
        load = os.getloadavg()[0]  # (a shared machine: the figures below mean little under load)
        cpu = cpu_s(proc.pid)
        cold = first_batch(stub)
        cold_end = time.time()
        cold_cpu = cpu_s(proc.pid) - cpu
        warm = statistics.median(first_batch(stub, rank=r) for r in range(5))
        gaps = sorted(drain(stub, streams, batches))
        # A job spends hours in an epoch of this size, the bench seconds: the stream crosses
        # once the next epoch's index is ready, and how long that took after the first batch
        # is reported (an epoch shorter than that would still wait at its end).
        ready = next_epoch_ready(root, cold_end)
        boundary = epoch_boundary(stub, root)
        peak = status(proc.pid)
    finally:
        ch.close()
        proc.kill()
        proc.wait(timeout=30)
    q = statistics.quantiles(gaps, n=100)
    return {
        "corpus": label,
        "train_tokens": tokens,
        "corpus_bytes": tokens * 2,
        "corpus_write_s": written,
        "first_batch_cold_s": round(cold, 3),
        "index_build_s": round(cold - warm, 3),
        "first_batch_cold_cpu_s": round(cold_cpu, 2),
        "first_batch_s": round(warm, 3),
        "streams": streams,
        "batches_per_stream": batches,
        "batch_p50_ms": round(q[49] * 1000, 2),
        "batch_p99_ms": round(q[98] * 1000, 2),
        "next_epoch_ready_after_s": None if ready is None else round(ready, 2),
        "epoch_boundary_s": round(boundary, 3),
        "rss_peak_mb": peak["VmHWM"],
        "load_avg_1m": round(load, 1),
        "cpus": os.cpu_count(),
        "vm_peak_mb": peak["VmPeak"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big-gb", type=float, default=20.0)
    p.add_argument("--small-mb", type=float, default=100.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--root", type=Path, default=REPO / ".surge" / "bench-data-plane")
    p.add_argument(
        "--keep", action="store_true", help="keep the corpora, and reuse kept ones (default: delete each after its run)"
    )
    args = p.parse_args()
    runs = []
    for label, size in ((f"{args.small_mb:g} MB", args.small_mb * 1e6), (f"{args.big_gb:g} GB", args.big_gb * 1e9)):
        root = args.root / label.replace(" ", "") / "datasets"
        if not args.keep:
            shutil.rmtree(root.parent, ignore_errors=True)
        try:
            runs.append(measure(root, label, int(size // 2), args.streams, args.batches))
            print(json.dumps(runs[-1]), flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(root.parent, ignore_errors=True)
    result = {
        "bench": "data_plane",
        "command": "python bench/data_plane.py " + " ".join(sys.argv[1:]),
        "goals": {"rss_peak_mb": "< 1024", "first_batch_s": "<= 2", "first_batch_cold_s": "<= 2"},
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
