"""A job's start, pause and finish at scale, in process: how long control takes from its
ranks' ready (paused, finished) events to RUNNING (PAUSED, FINISHED), how many journal commits
that costs, and how big the launch and rebuild messages are.

    PYTHONPATH=$PWD .venv/bin/python bench/control_start.py [--nodes 64] [--ranks-per-node 8]
        [--commit-latency-ms 0] [--phases start,pause,finish] [--json OUT]
        [--launch-sizes 64,512,8192] [--rebuild-sizes 64,512,8192] [--sizes-per-node 8] [--skip-start]

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

``--phases`` (session 31) goes on with the same job: ``pause`` is the operator's pause (no
checkpoint), then every rank's ``TrainingLoopPaused``, timed to the view's PAUSED (``to_state_s``)
and to every ack; ``finish`` (after an operator resume if it paused) every rank's
``TrainingLoopFinished`` then its clean ``RankExited`` (as a node agent reports a rank's end),
timed to TERMINATED. ``rebuild_bytes``: for each world size in ``--rebuild-sizes``, one rebuild
in place of one lost rank (its replacement on its own node): the bytes of its
``RebuildParallelGroup`` as each node agent of the job receives it (a ``WorkerCommand``), all
agents together, and of every command of the rebuild (kill, launch, probe peers, rendezvous).
"""

from __future__ import annotations

import argparse
import json
import resource
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


def _event(msg, seq: int):  # noqa: ANN001, ANN202 - a rank's loop event as its node agent sends it
    from services.contract import Module, control_pb2, worker_pb2
    from services.contract.relay import pack

    ev = worker_pb2.RankEvent(job_id=msg.job_id, rank=msg.rank, routed=pack(msg, Module.L2_TRAINING_LOOP))
    return control_pb2.WorkerEvent(rank_event=ev, seq=seq)


def start(nodes: int, per_node: int, commit_latency_ms: float = 0.0, phases: tuple[str, ...] = ("start",)) -> dict:
    """One job of nodes x per_node ranks started (see the module docstring), then paused and
    finished as ``phases`` says; each journal transaction made ``commit_latency_ms`` slower (a
    disk whose fsync takes that long). Returns the start's figures, with each later phase's
    under its name."""
    from services.contract import control_pb2, engine_pb2, store_pb2
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
            seqs = {w: 0 for w in ranks}

            def phase(events, state: int, outcome: int | None = None) -> dict:
                """Every rank's events (``events(w, rank, seq)`` -> [WorkerEvent]) queued at once;
                timed to the view's ``state`` and to every ack."""
                spent, real = _waits()
                commits0 = _commits()
                t0 = time.monotonic()
                try:
                    for w, rs in ranks.items():
                        for rank in rs:
                            for ev in events(w, rank, seqs[w] + 1):
                                seqs[w] = ev.seq
                                applier.event(sessions[w], ev)
                    reached = None
                    while reached is None:
                        if plane.get(job_id).state == state:
                            reached = time.monotonic() - t0
                        elif time.monotonic() - t0 > 600:
                            raise AssertionError(f"not {JobState.Name(state)} in 600 s")
                        else:
                            time.sleep(0.005)
                    while any(s.durable < seqs[w] for w, s in sessions.items()):
                        assert time.monotonic() - t0 < 600, "not acked in 600 s"
                        time.sleep(0.005)
                    acked = time.monotonic() - t0
                    commits = _commits() - commits0
                finally:
                    Future.result = real
                if outcome is not None:
                    assert plane.get(job_id).outcome == outcome, plane.get(job_id)
                waiting = sum(v for k, v in spent.items() if k.startswith("event-applier"))
                return {
                    "to_state_s": round(reached, 3),
                    "acked_s": round(acked, 3),
                    "journal_commits": int(commits),
                    "waiting_on_commits_s": round(waiting, 3),
                }

            def ready(w: str, rank: int, seq: int) -> list:
                return [_event(engine_pb2.TrainingLoopStarted(job_id=job_id, rank=rank, worker_id=w), seq)]

            started = phase(ready, JobState.RUNNING)
            print(json.dumps({"start": started}), file=sys.stderr, flush=True)  # (a long run's progress)
            out = {
                "nodes": nodes,
                "commit_latency_ms": commit_latency_ms,
                "ranks_per_node": per_node,
                "world": world,
                "to_running_s": started["to_state_s"],
                "acked_s": started["acked_s"],
                "journal_commits": started["journal_commits"],
                "waiting_on_commits_s": started["waiting_on_commits_s"],
            }
            if "pause" in phases:
                plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))

                def paused(w: str, rank: int, seq: int) -> list:
                    return [_event(engine_pb2.TrainingLoopPaused(job_id=job_id, rank=rank, step=5), seq)]

                out["pause"] = phase(paused, JobState.PAUSED)
                print(json.dumps({"pause": out["pause"]}), file=sys.stderr, flush=True)  # (a long run's progress)
                plane.user(control_pb2.ResumeJobRequest(job_id=job_id))  # (the ranks go on: RUNNING)
            if "finish" in phases:

                def finished(w: str, rank: int, seq: int) -> list:
                    end = control_pb2.RankExited(job_id=job_id, rank=rank, worker_id=w, exit_code=0)
                    return [
                        _event(engine_pb2.TrainingLoopFinished(job_id=job_id, rank=rank, step=10), seq),
                        control_pb2.WorkerEvent(rank_exited=end, seq=seq + 1),
                    ]

                out["finish"] = phase(finished, JobState.TERMINATED, control_pb2.JobOutcome.FINISHED)
            return out
        finally:
            stop_plane(control)


def launch_bytes(world: int, per_node: int = 8) -> dict:
    """The LaunchRanks the allocator sends for one job of ``world`` ranks on world/per_node nodes,
    the seconds from the allocation's call to its return (every launch handed to the agents'
    sessions: ``launch_s``) and this process's peak RSS after it (``peak_rss_mb``: the whole
    process's, so measure one size per run)."""
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
    t0 = time.perf_counter()
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    launch_s = time.perf_counter() - t0
    sizes = [m.ByteSize() for m in sent]
    init_bytes = init.ByteSize()
    return {
        "world": world,
        "per_node": per_node,
        "launch_s": round(launch_s, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "agents": len(sent),
        "total_bytes": sum(sizes),
        "largest_bytes": max(sizes),
        "total_bytes_without_init": sum(sizes) - len(sent) * init_bytes,
    }


def rebuild_bytes(world: int, per_node: int = 8) -> dict:
    """One rebuild in place of rank 1 of a job of ``world`` ranks on world/per_node nodes: the
    bytes of its commands as the node agents receive them."""
    from services.contract import Module, control_pb2, engine_pb2
    from services.contract.relay import pack
    from services.control.resource_allocator import ResourceAllocator
    from services.jobspec import parse_job_spec, spec_to_json
    from tests.control.conftest import registration, spec_yaml

    hardware: list[tuple[object, str]] = []
    rebuilds: list[engine_pb2.RebuildParallelGroup] = []
    allocator = ResourceAllocator(
        hardware=lambda msg, payload=None: hardware.append((msg, payload)),
        emit=lambda msg, payload=None: None,
        parallel=lambda msg, payload=None: rebuilds.append(msg),
    )
    for i in range(world // per_node):
        allocator.on_worker_registration(registration(f"node-{i:04d}", per_node))
    spec = parse_job_spec(spec_yaml(dp=world))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(spec))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    agents = {payload for _, payload in hardware}
    hardware.clear()
    ready = allocator.rebuild_communicator(
        control_pb2.RebuildCommunicator(job_id="j", reason="bench", in_place=True, lost_ranks=[1])
    )
    assert isinstance(ready, control_pb2.ResourcesReady), ready
    (rebuild,) = rebuilds
    agents |= set(ready.worker_ids)  # (the session hub queues it on every session of the job)
    routed = control_pb2.WorkerCommand(routed=pack(rebuild, Module.L1_RESOURCE_ALLOCATOR), job_id="j").ByteSize()
    others = 0
    for msg, _ in hardware:
        field = "launch" if isinstance(msg, control_pb2.LaunchRanks) else "release"
        others += control_pb2.WorkerCommand(**{field: msg}).ByteSize()
    return {
        "world": world,
        "agents": len(agents),
        "rebuild_parallel_group_bytes_per_agent": routed,
        "rebuild_parallel_group_bytes": routed * len(agents),
        "all_commands_bytes": routed * len(agents) + others,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--commit-latency-ms", type=float, default=0.0, help="each journal commit made this much slower")
    ap.add_argument("--phases", default="start", help="start, then pause and/or finish the same job")
    ap.add_argument("--launch-sizes", default="64,512,8192", help="world sizes whose LaunchRanks are measured")
    ap.add_argument("--rebuild-sizes", default="", help="world sizes whose rebuild in place is measured")
    ap.add_argument("--sizes-per-node", type=int, default=8, help="ranks per node of --launch-sizes, --rebuild-sizes")
    ap.add_argument("--skip-start", action="store_true", help="measure the message sizes only")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out: dict = {}
    if not args.skip_start:
        phases = tuple(p for p in args.phases.split(",") if p)
        out["start"] = start(args.nodes, args.ranks_per_node, args.commit_latency_ms, phases)
        print(json.dumps(out["start"]), flush=True)
    out["launch"] = [launch_bytes(int(w), args.sizes_per_node) for w in args.launch_sizes.split(",") if w]
    for row in out["launch"]:
        print(json.dumps(row), flush=True)
    out["rebuild"] = [rebuild_bytes(int(w), args.sizes_per_node) for w in args.rebuild_sizes.split(",") if w]
    for row in out["rebuild"]:
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
