"""Time to restored state from the in-memory copies against from the store's files (issue
14, part 3): the demo model or ~100 M parameters, the real `store` service, the rank's real
checkpoint relay (StoreClient with its chunk reader) and three node agents' memory tier
(services/worker/memory_copies.py, each in its own process, serving MemoryCopyService).

    .venv/bin/python bench/memory_restore.py [--model demo|100m] [--rounds 5] [--json]

One rank (this process) saves the model's parameters and AdamW moments (after one update)
once: the store writes its chunks, agent A (the rank's node) keeps them in memory and
replicates them to agent B (its peer). Then, ``rounds`` times each, interleaved, the rank
loads that version into zeroed tensors of the same shapes (``StoreClient.load_checkpoint``:
the store's Load, the manifest check, every chunk fetched and SHA-256 verified, copied into
the tensors) from:

* ``store (page cache)``: the store's chunk files, their pages in the OS cache (the best
  case of a local disk);
* ``store (cold)``: the same, each file's cached pages dropped first
  (``posix_fadvise(DONTNEED)``: what a read from the disk itself costs);
* ``memory (own agent)``: agent A's memory over loopback gRPC;
* ``memory (peer via own agent)``: a rank on a node whose agent holds nothing and asks its
  peer A for each chunk (one gRPC hop with the bytes, loopback here, a network hop between
  nodes in a cluster; the agent keeps the chunk in its shared memory and the rank reads it
  there). A fresh node per round: an agent keeps what it fetched, so its second load is a
  local one. The reader names every chunk of its load first (``prefetch``): the agent opens
  bulk lanes to its peer and hands them to the rank, which receives the chunks itself (no
  round trip per chunk, no gRPC copies); at the same time the reader reads the same list
  from its back from the store's files, their pages dropped first (a cold store), and each
  chunk comes from whichever end reaches it first (``services/state/chunk_race.py``): the
  MB read from each source are printed per load.

Each mode's first load is checked bit-identical to the saved tensors. Medians in seconds.
The store is on this machine's local disk: against a remote store (the case the Gemini
paper, SOSP'23, measures) the memory copy's lead would grow by the network's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"demo": {}, "100m": {"n_layers": 14, "d_model": 768, "n_heads": 12}}
MODES = ("store (page cache)", "store (cold)", "memory (own agent)", "memory (peer via own agent)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port}")


def agent_main(port: int, worker_id: str, peer: str) -> None:
    """A node agent's memory tier in a process of its own (no control session: the peer is
    given here, as LaunchRanks.memory_peer would give it)."""
    import threading

    import structlog

    from services.common.grpc_server import ServiceServer
    from services.contract import control_pb2, worker_pb2_grpc
    from services.worker.memory_chunks import shm_from_env
    from services.worker.memory_copies import MemoryCopies
    from services.worker.memory_copy_service import MemoryCopyServicer

    shm = shm_from_env(f"bench-{worker_id}")
    copies = MemoryCopies(worker_id, structlog.get_logger(), 8 << 30, shm, lane_host="127.0.0.1")
    if peer:
        copies.set_peer("bench", control_pb2.MemoryPeer(worker_id="peer", address=peer))
    server = ServiceServer(worker_id, "127.0.0.1", port)
    worker_pb2_grpc.add_MemoryCopyServiceServicer_to_server(MemoryCopyServicer(copies), server.server)
    server.start(["surge.v1.MemoryCopyService"])
    threading.Event().wait()


def build_state(model_name: str) -> tuple[dict, int]:
    from services.compute.model import build_model, count_parameters
    from services.jobspec import load_job_spec

    spec = load_job_spec(REPO / "examples/jobs/demo.yaml")
    spec = spec.model_copy(update={"model": spec.model.model_copy(update=MODELS[model_name])})
    model = build_model(spec.model, spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (1, 64))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    optim = {}
    for p, st in opt.state.items():
        optim[f"{names[p]}.exp_avg"] = st["exp_avg"]
        optim[f"{names[p]}.exp_avg_sq"] = st["exp_avg_sq"]
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optim": optim}
    return state, count_parameters(model)


def zeroed(state: dict) -> dict:
    return {slot: {k: torch.zeros_like(v) for k, v in items.items()} for slot, items in state.items()}


def identical(a: dict, b: dict) -> bool:
    return all(torch.equal(a[s][k], b[s][k]) for s in a for k in a[s])


def drop_cache(root: Path) -> int:
    n = 0
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--agent", nargs=3, metavar=("PORT", "ID", "PEER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent:
        agent_main(int(args.agent[0]), args.agent[1], args.agent[2] if args.agent[2] != "-" else "")
        return
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    torch.set_num_threads(1)
    from services.contract import store_pb2, worker_pb2, worker_pb2_grpc
    from services.rank.memory_client import MemoryCopyClient
    from services.rank.store_client import StoreClient

    procs: list[subprocess.Popen] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sp, mp_ = free_port(), free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.store", "--port", str(sp), "--metrics-port", str(mp_)]
                    + ["--root", f"{tmp}/store"],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            wait_port(sp, procs[-1], "store")
            pa, pb = free_port(), free_port()
            # C0, C1, ...: one node per round whose agent holds nothing (it keeps what it fetches
            # from its peer, so each round's peer load needs a node that never fetched).
            nodes = [(pa, "A", f"127.0.0.1:{pb}"), (pb, "B", "-")]
            nodes += [(free_port(), f"C{i}", f"127.0.0.1:{pa}") for i in range(args.rounds)]
            agents = {}
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
                agents[wid] = f"127.0.0.1:{port}"
            store = f"127.0.0.1:{sp}"
            state, params = build_state(args.model)
            state_bytes = sum(t.numel() * t.element_size() for items in state.values() for t in items.values())

            plain = StoreClient(store, lambda *a, **k: 1)  # the same save without a memory copy (another job)
            t0 = time.perf_counter()
            plain.save_checkpoint(store_pb2.SaveCheckpoint(job_id="plain", step=1, rank=0, write_async=False), state)
            plain.commit_checkpoint(
                store_pb2.CommitCheckpoint(job_id="plain", step=1, world_size=1, spec_json="{}", keep_last=2)
            )
            plain_save_s = time.perf_counter() - t0
            plain.close(timeout=2)

            copies_a = MemoryCopyClient(agents["A"], "bench", 0)
            saver = StoreClient(store, lambda *a, **k: 1, copies=copies_a)
            t0 = time.perf_counter()
            saver.save_checkpoint(store_pb2.SaveCheckpoint(job_id="bench", step=1, rank=0, write_async=False), state)
            saver.commit_checkpoint(
                store_pb2.CommitCheckpoint(job_id="bench", step=1, world_size=1, spec_json="{}", keep_last=2)
            )
            save_s = time.perf_counter() - t0
            kept = copies_a.wait(300)
            assert kept is not None and kept.missing == 0, kept
            copy_s = time.perf_counter() - t0
            import grpc

            from services.common.grpc_server import channel
            from services.contract import Module

            with channel(agents["B"], module=Module.EXT_HARDWARE) as ch:
                stub = worker_pb2_grpc.MemoryCopyServiceStub(ch)
                deadline = time.monotonic() + 300
                while len(stub.HeldChunks(worker_pb2.HeldQuery(job_id="bench", rank=0, replica=True)).sha256) < (
                    kept.chunks
                ):
                    assert time.monotonic() < deadline, "no replica on B"
                    time.sleep(0.05)
            replica_s = time.perf_counter() - t0
            saver.close(timeout=2)
            del grpc

            clients = {
                "store (page cache)": StoreClient(store, lambda *a, **k: 1),
                "store (cold)": StoreClient(store, lambda *a, **k: 1),
                "memory (own agent)": StoreClient(
                    store, lambda *a, **k: 1, copies=MemoryCopyClient(agents["A"], "bench", 0)
                ),
            }
            peer_clients = [
                StoreClient(store, lambda *a, **k: 1, copies=MemoryCopyClient(agents[f"C{i}"], "bench", 0))
                for i in range(args.rounds)
            ]
            times: dict[str, list[float]] = {m: [] for m in MODES}
            served: dict[str, list[dict]] = {m: [] for m in MODES}  # MB per source, each load
            cpu: dict[str, list[float]] = {m: [] for m in MODES}  # CPU seconds, every process of the bench
            exact: dict[str, bool] = {}
            for round_ in range(args.rounds):
                clients["memory (peer via own agent)"] = peer_clients[round_]
                for mode in MODES:
                    target = zeroed(state)
                    if mode in ("store (cold)", "memory (peer via own agent)"):
                        drop_cache(Path(tmp) / "store")  # (a heal races the store's end: a cold one)
                    t0, c0 = time.perf_counter(), time.process_time() + sum(cpu_seconds(p.pid) for p in procs)
                    loaded = clients[mode].load_checkpoint(store_pb2.LoadCheckpoint(version="bench:latest"), target)
                    times[mode].append(time.perf_counter() - t0)
                    cpu[mode].append(time.process_time() + sum(cpu_seconds(p.pid) for p in procs) - c0)
                    served[mode].append({k: round(v / 1e6) for k, v in sorted(loaded.bytes_from.items())})
                    if mode not in exact:
                        exact[mode] = identical(state, target)
                    del target
            for c in [*clients.values(), *peer_clients]:
                c.close(timeout=1)
        finally:
            for p in procs:
                p.kill()
                p.wait()
            import shutil

            for p in procs[1:]:  # the agents' shared-memory directories (killed: they left them)
                for d in Path("/dev/shm").glob(f"surge-memory-*-{p.pid}"):
                    shutil.rmtree(d, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(
        f"{args.model} model ({params / 1e6:.1f} M parameters; model + AdamW moments "
        f"{state_bytes / 1e6:.0f} MB), 1 rank, {args.rounds} rounds; save (synchronous, first version) "
        f"{save_s:.2f} s with the memory copy, {plain_save_s:.2f} s without; memory copy stored "
        f"{copy_s:.2f} s and replicated {replica_s:.2f} s after the save began"
    )
    cpu_per_gb = {m: statistics.median(v) / (state_bytes / 1e9) for m, v in cpu.items()}
    print(
        f"{'restore from':32} {'median s':>9}  {'MB/s':>6}  {'x vs cold store':>15}  {'CPU s/GB':>8}  "
        "bit-identical  each"
    )
    for m in MODES:
        print(
            f"{m:32} {med[m]:9.3f}  {state_bytes / med[m] / 1e6:6.0f}  {med['store (cold)'] / med[m]:15.2f}  "
            f"{cpu_per_gb[m]:8.2f}  {str(exact[m]):13}  " + " ".join(f"{v:.3f}" for v in times[m])
        )
    print("CPU s/GB: the CPU seconds of every process of the bench (the rank, the agents, the store) per GB restored")
    print("MB read from each source, each load (a heal reads the peer from the front, the store from the back):")
    for m in MODES:
        print(f"  {m:30} " + "  ".join(str(s) for s in served[m]))
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "params": params,
                    "state_bytes": state_bytes,
                    "rounds": args.rounds,
                    "save_s": save_s,
                    "save_without_copy_s": plain_save_s,
                    "memory_copy_stored_s": copy_s,
                    "replicated_s": replica_s,
                    "median_s": med,
                    "median_mb_per_s": {m: state_bytes / v / 1e6 for m, v in med.items()},
                    "bit_identical": exact,
                    "raw_s": times,
                    "mb_from": served,
                    "cpu_s_per_gb": cpu_per_gb,
                }
            )
        )


if __name__ == "__main__":
    main()
