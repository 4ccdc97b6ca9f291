"""Peer-memory heal throughput (issue 27, item 4): a rank whose node agent holds nothing reads
every chunk of a checkpoint from the peer agent's memory through its own agent, chunk by
chunk (``GetChunk`` per chunk: the path before issue 27), in bulk on gRPC (``GetChunks``: the
reader names every chunk first, the agent pulls them from its peer on parallel streams;
what an agent under TLS does) or in bulk on the agents' bulk lane (``OpenBulkRead``, then
raw bytes on TCP: sendfile from the peer's shared memory, recv_into the asker's), against
the same chunks read from files with their pages dropped (a cold store's disk).

    .venv/bin/python bench/peer_heal.py [--mb 1192] [--rounds 3] [--json]

1192 MB is a 100 M-parameter model with its AdamW moments (fp32: 3 x 4 bytes a parameter),
as bench/memory_restore.py --model 100m saves it, in 1 MiB chunks (the writer's default).
Each agent is a process of its own serving MemoryCopyService on loopback (A: the holder,
with a bulk lane; G: a holder of the same chunks without one, for the gRPC modes; a fresh C
per round and mode: an agent keeps what it fetched). Every mode reads each chunk as the
rank's ChunkReader does (4 threads, each chunk's SHA-256 checked); MB/s = bytes / wall
seconds, medians over the rounds. CPU s/GB: the receiving side's CPU seconds per GB moved
(the receiving agent C's process, from /proc, plus this reading process), the figure that
does not depend on how loaded the machine is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_restore import cpu_seconds, free_port, wait_port  # noqa: E402

JOB = "bench"
CHUNK = 1 << 20
MODES = ("peer, chunk by chunk (GetChunk)", "peer, in bulk (GetChunks)", "peer, in bulk (lane)", "cold files")
LANE_MODE = MODES[2]


def agent_main(port: int, worker_id: str, peer: str) -> None:
    """One node agent's memory tier (the peer given here, as LaunchRanks.memory_peer would);
    agent G opens no bulk lanes (the gRPC modes read from it), the others do."""
    import threading

    import structlog

    from services.common.grpc_server import ServiceServer
    from services.contract import control_pb2, worker_pb2_grpc
    from services.worker.memory_chunks import shm_from_env
    from services.worker.memory_copies import MemoryCopies
    from services.worker.memory_copy_service import MemoryCopyServicer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    lane = None if worker_id == "G" else "127.0.0.1"
    copies = MemoryCopies(worker_id, structlog.get_logger(), 8 << 30, shm_from_env(f"heal-{worker_id}"), lane)
    if peer:
        copies.set_peer(JOB, control_pb2.MemoryPeer(worker_id="holder", address=peer))
    server = ServiceServer(worker_id, "127.0.0.1", port)
    worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(copies), server.server)
    server.start(["surge.v1.MemoryCopyService"])
    threading.Event().wait()


def read_all(get, wanted: dict[str, int]) -> int:
    """Every chunk through ``get`` on 4 threads, each checked as the reader checks it."""

    def one(item: tuple[str, int]) -> int:
        sha, n = item
        data = get(sha, n)
        assert data is not None and len(data) == n and hashlib.sha256(data).hexdigest() == sha, sha
        return n

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, wanted.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1192, help="checkpoint size (MB, decimal)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--agent", nargs=3, metavar=("PORT", "ID", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        agent_main(int(args.agent[0]), args.agent[1], args.agent[2] if args.agent[2] != "-" else "")
        return
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    from services.rank.memory_client import MemoryCopyClient
    from services.state.chunk_store import DirectorySource, chunk_path

    n_chunks = max(1, args.mb * 10**6 // CHUNK)
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # the receiving side's CPU seconds
    with tempfile.TemporaryDirectory() as tmp:
        try:
            pa, pg = free_port(), free_port()
            nodes = [(pa, "A", "-"), (pg, "G", "-")]
            per_round = len(MODES) - 1
            for i in range(per_round * args.rounds):  # a fresh asker per round and peer mode
                nodes.append((free_port(), f"C{i}", f"127.0.0.1:{pg if i % per_round != 2 else pa}"))
            agents, by_id = {}, {}
            for port, wid, peer in nodes:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--agent", str(port), wid, peer],
                        cwd=REPO,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                wait_port(port, procs[-1], f"agent {wid}")
                agents[wid], by_id[wid] = f"127.0.0.1:{port}", procs[-1]
            # The checkpoint: random 1 MiB chunks, in A's memory (as a rank's save puts them)
            # and as files (the store's chunk directory).
            files = Path(tmp) / "chunks"
            holders = [MemoryCopyClient(agents[h], JOB, 0) for h in ("A", "G")]
            sinks = [h.begin(1) for h in holders]
            assert None not in sinks, "an agent keeps no memory copies"
            wanted: dict[str, int] = {}
            seed = os.urandom(CHUNK)
            for i in range(n_chunks):
                data = i.to_bytes(8, "little") + seed[8:]  # distinct chunks without 1 GB of urandom
                sha = hashlib.sha256(data).hexdigest()
                wanted[sha] = len(data)
                for sink in sinks:
                    sink(sha, memoryview(data))
                p = chunk_path(files, sha)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
            for holder in holders:
                holder.end(True)
                kept = holder.wait(600)
                assert kept is not None and kept.chunks == n_chunks, kept
            total = sum(wanted.values())
            store = DirectorySource(files)
            for r in range(args.rounds):
                for mode in MODES:
                    if mode == "cold files":
                        for f in files.rglob("*"):
                            if f.is_file():
                                fd = os.open(f, os.O_RDONLY)
                                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                                os.close(fd)
                        t0, c0 = time.perf_counter(), time.process_time()
                        assert read_all(store.get, wanted) == total
                        times[mode].append(time.perf_counter() - t0)
                        cpu[mode].append(time.process_time() - c0)
                        continue
                    node = f"C{per_round * r + MODES.index(mode)}"
                    client = MemoryCopyClient(agents[node], JOB, 0)
                    peer = client.sources()[1]  # the peer through this node's agent
                    t0, c0, a0 = time.perf_counter(), time.process_time(), cpu_seconds(by_id[node].pid)
                    if mode != MODES[0]:
                        peer.prefetch(wanted)
                    assert read_all(peer.get, wanted) == total
                    times[mode].append(time.perf_counter() - t0)
                    cpu[mode].append(time.process_time() - c0 + cpu_seconds(by_id[node].pid) - a0)
                    client.close()
                    gone = by_id[node]  # its copy of the checkpoint leaves memory with it
                    gone.kill()
                    gone.wait()
                    for d in Path("/dev/shm").glob(f"surge-memory-*-{gone.pid}"):
                        shutil.rmtree(d, ignore_errors=True)
            for holder in holders:
                holder.close()
        finally:
            for p in procs:
                p.kill()
                p.wait()
            for p in procs:  # the agents' shared-memory directories (killed: they left them)
                for d in Path("/dev/shm").glob(f"surge-memory-*-{p.pid}"):
                    shutil.rmtree(d, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    cpu_per_gb = {m: statistics.median(v) / (total / 1e9) for m, v in cpu.items()}
    print(
        f"{total / 1e6:.0f} MB in {n_chunks} chunks of 1 MiB, {args.rounds} rounds, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    print(f"{'read from':34} {'median s':>9}  {'MB/s':>6}  {'CPU s/GB':>8}  each")
    for m in MODES:
        print(
            f"{m:34} {med[m]:9.3f}  {total / med[m] / 1e6:6.0f}  {cpu_per_gb[m]:8.2f}  "
            + " ".join(f"{v:.3f}" for v in times[m])
        )
    if args.json:
        print(
            json.dumps(
                {"bytes": total, "chunks": n_chunks, "median_s": med, "raw_s": times, "cpu_s_per_gb": cpu_per_gb}
            )
        )


if __name__ == "__main__":
    main()
