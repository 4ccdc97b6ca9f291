"""A job's start at scale, in process: how long control takes from its ranks' ready events to
RUNNING, how many journal commits that costs, and how big the launch messages are.

    PYTHONPATH=$PWD .venv/bin/python bench/control_start.py [--nodes 64] [--ranks-per-node 8]
        [--commit-latency-ms 0] [--json OUT] [--launch-sizes 64,512,8192] [--skip-start]

The real control plane (``build()``, a SQLite journal in a temporary directory) with
``--nodes`` node agent sessions of ``--ranks-per-node`` slots each, one job over every slot.
Each rank's ``TrainingLoopStarted`` is handed to control's event applier as the gRPC server
hands it (a sequenced ``WorkerEvent`` per rank, ``EventApplier.event``), all at once, as a
start's ready events arrive. Measured (issue 28, session 29's ``startprof``: 512 ready events
11.5 s to RUNNING, 9.7 s of it waiting on commits):

- ``to_running_s``: first ready event queued -> the job's view RUNNING;
- ``acked_s``: -> every session's ack covers its last ready event (durable);
- ``journal_commits``: SQLite transactions committed meanwhile (``surge_control_journal_commits_total``);
- ``waiting_on_commits_s``: seconds the applier's threads spent in ``Future.result`` (waiting
  for a journal write's commit), summed over the threads;
- ``launch_bytes``: for each world size in ``--launch-sizes`` (8 ranks per node), the bytes of
  the LaunchRanks commands the allocator sends (all agents together, and the largest one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _commits() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("surge_control_journal_commits_total") or 0.0


def _waits() -> tuple[dict[str, float], object]:
    """Time spent in ``Future.result`` per thread name (patched in: a bench's instrument)."""
    spent: dict[str, float] = defaultdict(float)
    real = Future.result

    def timed(self, timeout=None):  # noqa: ANN001 - Future.result's own signature
        t0 = time.perf_counter()
        try:
            return real(self, timeout)
        finally:
            spent[threading.current_thread().name] += time.perf_counter() - t0

    Future.result = timed
    return spent, real


def start(nodes: int, per_node: int, commit_latency_ms: float = 0.0) -> dict:
    """One job of nodes x per_node ranks started (see the module docstring); each journal
    transaction made ``commit_latency_ms`` slower (a disk whose fsync takes that long)."""
    from services.contract import Module, control_pb2, engine_pb2, store_pb2, worker_pb2
    from services.contract.relay import pack
    from services.control.__main__ import build
    from services.control.job_store import JobStore
    from services.control.orchestrator.job import JobState
    from services.control.store_relay import StoreRelay
    from tests.control.conftest import Plane, drain, registration, stop_plane

    # (no store runs: every verification answers "no version", as the control tests' fixture)
    StoreRelay.verify_checkpoints = lambda self, msg, payload=None: store_pb2.CheckpointVerification(job_id=msg.job_id)
    world = nodes * per_node
    with tempfile.TemporaryDirectory() as tmp:
        journal = JobStore(Path(tmp) / "control.db")
        control = build(journal, data_address="d:1", store_address="s:1", persist_interval_s=1.0)
        if commit_latency_ms:
            writer = journal._writer  # (a bench's instrument: the transaction, then the "fsync")
            transaction = writer._transaction

            def slow(writes):  # noqa: ANN001, ANN202
                transaction(writes)
                time.sleep(commit_latency_ms / 1000)

            writer._transaction = slow
        plane = Plane(control)
        try:
            sessions = {}
            for i in range(nodes):
                reg = registration(f"node-{i:04d}", per_node)
                reg.incarnation = f"i{i}"
                sessions[reg.worker_id] = control.sessions.open(reg)
            job_id = plane.submit(dp=world, steps=10).job_id
            ranks: dict[str, list[int]] = {}
            deadline = time.monotonic() + 120
            while sum(len(r) for r in ranks.values()) < world:
                assert time.monotonic() < deadline, "not launched in 120 s"
                for w, s in sessions.items():
                    for cmd in drain(s):
                        if cmd.WhichOneof("command") == "launch":
                            ranks.setdefault(w, []).extend(a.rank for a in cmd.launch.ranks)
                time.sleep(0.01)
            applier = control.servicer.applier
            spent, real = _waits()
            commits0 = _commits()
            t0 = time.monotonic()
            try:
                for w, rs in ranks.items():
                    s = sessions[w]
                    for seq, rank in enumerate(rs, start=1):
                        msg = engine_pb2.TrainingLoopStarted(job_id=job_id, rank=rank, worker_id=w)
                        ev = worker_pb2.RankEvent(job_id=job_id, rank=rank, routed=pack(msg, Module.L2_TRAINING_LOOP))
                        applier.event(s, control_pb2.WorkerEvent(rank_event=ev, seq=seq))
                running = None
                while running is None:
                    if plane.get(job_id).state == JobState.RUNNING:
                        running = time.monotonic() - t0
                    elif time.monotonic() - t0 > 600:
                        raise AssertionError("not RUNNING in 600 s")
                    else:
                        time.sleep(0.005)
                while any(s.durable < len(ranks[w]) for w, s in sessions.items()):
                    assert time.monotonic() - t0 < 600, "not acked in 600 s"
                    time.sleep(0.005)
                acked = time.monotonic() - t0
                commits = _commits() - commits0
            finally:
                Future.result = real
            waiting = sum(v for k, v in spent.items() if k.startswith("event-applier"))
            return {
                "nodes": nodes,
                "commit_latency_ms": commit_latency_ms,
                "ranks_per_node": per_node,
                "world": world,
                "to_running_s": round(running, 3),
                "acked_s": round(acked, 3),
                "journal_commits": int(commits),
                "waiting_on_commits_s": round(waiting, 3),
            }
        finally:
            stop_plane(control)


def launch_bytes(world: int, per_node: int = 8) -> dict:
    """The LaunchRanks the allocator sends for one job of ``world`` ranks on world/per_node nodes."""
    from services.contract import control_pb2, engine_pb2
    from services.control.resource_allocator import ResourceAllocator
    from services.jobspec import parse_job_spec, spec_to_json
    from tests.control.conftest import registration, spec_yaml

    sent: list[control_pb2.LaunchRanks] = []

    def hardware(msg, payload=None):  # noqa: ANN001, ANN202 - a command port
        if isinstance(msg, control_pb2.LaunchRanks):
            sent.append(msg)

    allocator = ResourceAllocator(hardware=hardware, emit=lambda msg, payload=None: None)
    for i in range(world // per_node):
        allocator.on_worker_registration(registration(f"node-{i:04d}", per_node))
    spec = parse_job_spec(spec_yaml(dp=world))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(spec))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    sizes = [m.ByteSize() for m in sent]
    init_bytes = init.ByteSize()
    return {
        "world": world,
        "agents": len(sent),
        "total_bytes": sum(sizes),
        "largest_bytes": max(sizes),
        "total_bytes_without_init": sum(sizes) - len(sent) * init_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--commit-latency-ms", type=float, default=0.0, help="each journal commit made this much slower")
    ap.add_argument("--launch-sizes", default="64,512,8192", help="world sizes whose LaunchRanks are measured")
    ap.add_argument("--skip-start", action="store_true", help="measure the launch sizes only")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out: dict = {}
    if not args.skip_start:
        out["start"] = start(args.nodes, args.ranks_per_node, args.commit_latency_ms)
        print(json.dumps(out["start"]), flush=True)
    out["launch"] = [launch_bytes(int(w)) for w in args.launch_sizes.split(",") if w]
    for row in out["launch"]:
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
