"""Checkpoint save and load throughput (MB/s) of the store's three deployments (issue 17 part 2).

    .venv/bin/python bench/checkpoint_backends.py [--mib 256] [--repeats 2] [--tensors 16]

One rank (this process) saves a model state of ``--mib`` MiB (``--tensors`` float32
tensors, random: every chunk new) through the rank's real checkpoint relay
(``services/rank/store_client.py``: BeginSave, DCP through the chunk writer, CommitSave)
and loads it back (Load, every chunk's SHA-256 checked as read), against a real `store`
process on 127.0.0.1 deployed three ways:

* ``path``: ``--transfer path`` (the default): the rank writes the store root's directories
  itself (a filesystem both see; here the same local disk);
* ``stream``: ``--transfer stream``: chunks and index stream to the store over gRPC and back;
* ``s3``: ``--backend s3`` against moto's S3 server (``moto_server``, its own process on
  127.0.0.1, objects in its memory): chunks are objects the rank PUTs and GETs through s3fs.

Per run: ``write_s`` (the rank's DCP write: for stream and s3 that includes the transfer),
``commit_s`` (the store's commit: hashes every new chunk, from its disk or from S3),
``save_MBps`` = bytes / (write + commit), ``write_MBps`` = bytes / write,
``load_MBps`` = bytes / (Load + read + verify). MB = 10^6 bytes. The best of ``--repeats``
runs is reported, every run is kept. Results: bench/results/checkpoint_backends.json.
On this 2-core machine the rank, the store and moto share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from services.contract import store_pb2  # noqa: E402
from services.rank.store_client import StoreClient  # noqa: E402

RESULTS = REPO / "bench" / "results" / "checkpoint_backends.json"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port}")


def start_store(root: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "services.store", "--port", str(port), "--metrics-port", str(metrics)]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*argv, "--root", str(root), *extra], cwd=REPO, stdout=out, stderr=out)
    wait_port(port, proc, "store")
    time.sleep(0.5)
    return proc, f"127.0.0.1:{port}"


def state_for(seed: int, mib: int, tensors: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = mib * 262144 // tensors
    return {
        "model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)},
        "train": {"step": torch.tensor(seed)},
    }


def one_run(address: str, job: str, step: int, mib: int, tensors: int) -> dict:
    events: list = []
    client = StoreClient(address, lambda msg, payload=None: events.append(msg))
    try:
        state = state_for(step, mib, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
        t0 = time.perf_counter()
        staged = client.save_checkpoint(
            store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0, write_async=False), state
        )
        t1 = time.perf_counter()
        done = client.commit_checkpoint(store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json="{}"))
        t2 = time.perf_counter()
        assert done is not None and done.step == step, done
        back = {
            "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "train": {"step": torch.tensor(0)},
        }
        t3 = time.perf_counter()
        info = client.load_checkpoint(store_pb2.LoadCheckpoint(version=done.version), back).info
        t4 = time.perf_counter()
        exact = all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
        assert exact and info.step == step, "load not bit-exact"
        write_s, commit_s, load_s = t1 - t0, t2 - t1, t4 - t3
        return {
            "version": done.version,
            "transfer": store_pb2.TransferMode.Name(staged.transfer),
            "bytes": nbytes,
            "write_s": round(write_s, 3),
            "commit_s": round(commit_s, 3),
            "load_s": round(load_s, 3),
            "write_MBps": round(nbytes / write_s / 1e6, 1),
            "save_MBps": round(nbytes / (write_s + commit_s) / 1e6, 1),
            "load_MBps": round(nbytes / load_s / 1e6, 1),
            "bit_exact": exact,
        }
    finally:
        client.close(timeout=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", nargs="*", default=["path", "stream", "s3"])
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(S3_ENV)  # moto's and every client's credentials (never sent by the store)
    work = Path(tempfile.mkdtemp(prefix="surge-ckpt-bench-"))
    procs: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    try:
        for backend in args.only:
            root = work / f"store-{backend}"
            extra = {"path": ["--transfer", "path"], "stream": ["--transfer", "stream"]}.get(backend)
            if backend == "s3":
                port = free_port()
                moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
                with open(work / "moto.log", "ab") as out:
                    m = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out)
                procs.append(m)
                wait_port(port, m, "moto_server")
                import s3fs

                endpoint = f"http://127.0.0.1:{port}"
                s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("surge-bench")
                extra = ["--backend", "s3", "--s3-url", "s3://surge-bench/ckpt", "--s3-endpoint", endpoint]
            store, address = start_store(root, extra, work / f"store-{backend}.log")
            procs.append(store)
            runs = []
            for i in range(args.repeats):
                run = one_run(address, f"bench-{backend}", i + 1, args.mib, args.tensors)
                runs.append(run)
                print(f"{backend:6s} run {i + 1}: {json.dumps(run)}", flush=True)
            best = {
                "save_MBps": max(r["save_MBps"] for r in runs),
                "write_MBps": max(r["write_MBps"] for r in runs),
                "load_MBps": max(r["load_MBps"] for r in runs),
            }
            results[backend] = {"store_args": extra, "best": best, "runs": runs}
            store.send_signal(signal.SIGTERM)
            store.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "bench": "checkpoint_backends",
        "command": "python bench/checkpoint_backends.py " + " ".join(sys.argv[1:]),
        "state_mib": args.mib,
        "state_bytes": args.mib * 1048576,
        "tensors": args.tensors,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "notes": "one rank (this process) and the store (and moto for s3) on one 2-core host over 127.0.0.1; "
        "MB = 1e6 bytes; save = DCP write (incl. the transfer) + the store's commit (hashes every new chunk); "
        "load = Load + read + SHA-256 check of every chunk; moto keeps objects in its memory (no disk)",
        "results": results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| backend | save MB/s (write+commit) | write MB/s | load MB/s |\n| --- | --- | --- | --- |")
    for backend, r in results.items():
        b = r["best"]
        print(f"| {backend} | {b['save_MBps']} | {b['write_MBps']} | {b['load_MBps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
