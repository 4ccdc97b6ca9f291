"""Real service processes for the checkpoint tests: the `data` and `store` services, rank
processes (``python -m services.rank``), and an in-test node agent that plays the
agent's side of ``WorkerService.RankSession`` (the orchestrator's decisions are the test's).

Every process started here is killed by PID when the test ends.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from services.contract import Module, engine_pb2, store_pb2, store_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.contract.relay import pack, unpack
from services.jobspec import JobSpec, spec_to_json
from services.worker.metric_stream import MetricStreams
from services.worker.rank_session import unbatched
from tests.callers import any_caller_channel
from tests.conftest import free_ports
from tests.rank_forks import RankProcess

REPO = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def wait_ready(address: str, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    """Block until the gRPC server at ``address`` accepts connections (or ``proc`` died)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        ready = grpc.channel_ready_future(ch)
        while time.monotonic() < deadline:
            try:
                ready.result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if proc.poll() is not None:
                    break
    raise RuntimeError(f"{what} at {address} did not come up (exit {proc.poll()})")


class Processes:
    """Starts processes with their output in files under ``logs``; kills them all at the end."""

    def __init__(self, logs: Path):
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        self.procs.append(proc)
        return proc

    def start_rank(self, name: str, argv: list[str]) -> RankProcess:
        """The product's rank (``python -m services.rank *argv``), forked as the node agent's
        fork server forks it: ``main(argv)`` in a child of a process that has imported torch
        and the rank's modules (tests/rank_forks.py), not a new interpreter importing them."""
        proc = RankProcess(None, argv, self.logs / f"{name}.log", REPO, child_env(), module="services.rank.__main__")
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if isinstance(p, RankProcess):
                p.log.close()  # (the test process's handle on a forked rank's log)


def start_store(procs: Processes, root: Path, name: str = "store") -> tuple[subprocess.Popen, str]:
    port, metrics = free_ports(2)
    proc = procs.start(
        name,
        [
            sys.executable,
            "-m",
            "services.store",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics),
            "--root",
            str(root),
        ],
    )
    address = f"127.0.0.1:{port}"
    wait_ready(address, proc, "store")
    return proc, address


def start_data(procs: Processes, root: Path) -> tuple[subprocess.Popen, str]:
    (port,) = free_ports(1)
    proc = procs.start(
        "data",
        [sys.executable, "-m", "services.data", "--host", "127.0.0.1", "--port", str(port), "--data-root", str(root)],
    )
    address = f"127.0.0.1:{port}"
    wait_ready(address, proc, "data")
    return proc, address


# ---------------------------------------------------------------------- the node agent's side


@dataclass
class RankLink:
    commands: queue.Queue = field(default_factory=queue.Queue)
    events: queue.Queue = field(default_factory=queue.Queue)


class Agent(worker_pb2_grpc.WorkerServiceServicer):
    """The node agent's end of every rank's RankSession: routes each rank's events to its
    (job, rank) link and sends the test's commands down; the ranks' metric records go, as a
    node agent sends them, on the real metric stream to the store at ``store_address``, each
    ack back to its rank."""

    def __init__(self, store_address: str):
        self._links: dict[tuple[str, int], RankLink] = {}
        self._lock = threading.Lock()
        self._store_address = store_address
        # (at once: this stand-in does not flush at a rank's boundaries as the node agent does)
        self.metrics = MetricStreams(structlog.get_logger("agent"), linger_s=0)

    def link(self, job: str, rank: int) -> RankLink:
        with self._lock:
            return self._links.setdefault((job, rank), RankLink())

    def RankSession(self, requests, context):
        first, *behind = unbatched(next(requests))  # (RankEvent.more: what the rank queued with it)
        link = self.link(first.job_id, first.rank)
        link.events.put(first)

        def ack(ack: store_pb2.MetricsAck) -> None:
            link.commands.put(worker_pb2.RankCommand(metrics_ack=ack))

        def read():
            try:
                for ev in itertools.chain(behind, (ev for message in requests for ev in unbatched(message))):
                    if ev.WhichOneof("event") == "metrics":
                        self.metrics.submit(self._store_address, ev.metrics, ack)
                        continue
                    link.events.put(ev)
            except grpc.RpcError:
                pass
            link.events.put(None)  # the stream closed: the rank is gone
            link.commands.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (cmd := link.commands.get()) is not None:
            yield cmd


@dataclass
class Outcome:
    """What the ranks of one launch reported (rank 0's step events carry the global loss)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (rank 0)
    epochs: dict[int, int] = field(default_factory=dict)  # step -> epoch after it (rank 0)
    tokens: dict[int, int] = field(default_factory=dict)  # step -> global label tokens (rank 0)
    saved: dict[int, str] = field(default_factory=dict)  # step -> committed version
    start_step: int = -1
    finished: bool = False
    failed: list[engine_pb2.TrainingLoopFailed] = field(default_factory=list)
    snapshot_failed: list[store_pb2.SnapshotFailed] = field(default_factory=list)  # typed store failures
    killed_after_step: int = 0
    # Seconds from the launch (rank processes spawned) until every rank reported
    # TrainingLoopStarted (set up, checkpoint loaded, stream open), and until rank 0's first step.
    started_s: float = 0.0
    first_step_s: float = 0.0


class Cluster:
    """One data service, one store service, the in-test agent, and rank launches."""

    def __init__(self, procs: Processes, data_address: str, store_address: str):
        self.procs = procs
        self.data_address, self.store_address = data_address, store_address
        self.agent = Agent(store_address)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.agent, self._server)
        self.agent_address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()
        self._launches = 0

    def close(self) -> None:
        self._server.stop(0)
        self.agent.metrics.close(timeout=1.0)

    def run(
        self, job: str, spec: JobSpec, *, resume: str = "", kill_after_saved: int = 0, timeout: float = 240.0
    ) -> Outcome:
        """Launch ``spec.world_size`` ranks of ``job`` (loading ``resume`` first), start them
        and follow them to the end. ``kill_after_saved``: SIGKILL every rank as soon as the
        version of that step is committed and rank 0 has stepped past it (mid-run; a later
        save may be in flight)."""
        self._launches += 1
        world = spec.world_size
        (master_port,) = free_ports(1)
        tag = f"{job}-{self._launches}"
        procs = [
            self.procs.start_rank(f"{tag}-rank{r}", ["--session", self.agent_address, "--job", job, "--rank", str(r)])
            for r in range(world)
        ]
        links = [self.agent.link(job, r) for r in range(world)]
        try:
            return self._follow(job, spec, resume, kill_after_saved, procs, links, master_port, tag, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(30)
            for r in range(world):  # the next launch of this job starts with fresh links
                with self.agent._lock:
                    self.agent._links.pop((job, r), None)

    def _follow(self, job, spec, resume, kill_after_saved, procs, links, master_port, tag, timeout) -> Outcome:
        world = spec.world_size
        t_launch = time.monotonic()
        deadline = t_launch + timeout
        out = Outcome()
        merged: queue.Queue = queue.Queue()
        for r, link in enumerate(links):
            threading.Thread(target=_pump, args=(r, link.events, merged), daemon=True).start()
        init = engine_pb2.InitJob(
            job_id=job,
            spec_json=spec_to_json(spec),
            resume_version=resume,
            data_address=self.data_address,
            store_address=self.store_address,
        )
        for r, link in enumerate(links):
            link.commands.put(worker_pb2.RankCommand(init=init))
            link.commands.put(
                worker_pb2.RankCommand(
                    assignment=engine_pb2.RankAssignment(
                        rank=r,
                        world_size=world,
                        master_addr="127.0.0.1",
                        master_port=master_port,
                        backend="gloo",
                        device="cpu",
                        num_threads=1,
                        worker_id="test",
                    )
                )
            )
        started, ended, open_streams = set(), set(), world
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                logs = "\n".join(f"--- rank {r}\n{self.procs.log(f'{tag}-rank{r}')}" for r in range(world))
                raise TimeoutError(f"{tag}: ranks did not end in {timeout:.0f} s\n{logs}")
            try:
                r, ev = merged.get(timeout=left)
            except queue.Empty:
                continue
            if ev is None:
                open_streams -= 1
                continue
            if ev.WhichOneof("event") != "routed":
                continue  # hello, heartbeats, audits: the agent's own
            msg = unpack(ev.routed)  # any routed event, by its name (services/contract/relay.py)
            if isinstance(msg, engine_pb2.TrainingLoopStarted):
                started.add(r)
                out.start_step = msg.start_step
                if len(started) == world:
                    out.started_s = time.monotonic() - t_launch
                    start = pack(engine_pb2.StartTraining(job_id=job), Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)
                    for link in links:
                        link.commands.put(worker_pb2.RankCommand(routed=start))
            elif isinstance(msg, engine_pb2.StepCompleted) and r == 0:
                out.first_step_s = out.first_step_s or time.monotonic() - t_launch
                out.losses[msg.step] = msg.loss
                out.epochs[msg.step] = msg.epoch
                out.tokens[msg.step] = msg.tokens
            elif isinstance(msg, store_pb2.SaveCompleted):
                out.saved[msg.step] = msg.version
            elif isinstance(msg, engine_pb2.TrainingLoopFinished):
                ended.add(r)
                out.finished = len(ended) == world
            elif isinstance(msg, engine_pb2.TrainingLoopFailed):
                out.failed.append(msg)
                links[r].commands.put(None)  # L1's release: a failed rank waits for it, then exits
            elif isinstance(msg, store_pb2.SnapshotFailed):
                out.snapshot_failed.append(msg)
            if (
                kill_after_saved
                and kill_after_saved in out.saved
                and out.losses
                and max(out.losses) > kill_after_saved
                and not out.killed_after_step
            ):
                out.killed_after_step = max(out.losses)
                for p in procs:
                    p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(30)
        return out


def _pump(rank: int, events: queue.Queue, merged: queue.Queue) -> None:
    while True:
        ev = events.get()
        merged.put((rank, ev))
        if ev is None:
            return


# ---------------------------------------------------------------------- store helpers


def store_stub(address: str) -> tuple[grpc.Channel, store_pb2_grpc.StoreServiceStub]:
    ch = any_caller_channel(address)
    return ch, store_pb2_grpc.StoreServiceStub(ch)


def versions_of(address: str, job: str) -> list[store_pb2.CheckpointInfo]:
    ch, stub = store_stub(address)
    with ch:
        return list(stub.List(store_pb2.CheckpointQuery(job_id=job), timeout=30).checkpoints)


def verify(address: str, job: str, rehash: bool = False) -> list[store_pb2.CheckpointVerdict]:
    """The store's verdicts: as recorded, or re-hashed now (and recorded) with ``rehash``."""
    ch, stub = store_stub(address)
    with ch:
        return list(stub.Verify(store_pb2.VerifyCheckpoints(job_id=job, rehash=rehash), timeout=120).versions)


def read_version(info: store_pb2.CheckpointInfo, state: dict) -> None:
    """Load a committed version into ``state`` in this process, as a rank reads it: every
    file (and, for a chunked version, every chunk) checked against the manifest as it is read."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp

    from services.compute.inference import SafeLoadPlanner, safe_load
    from services.state.chunk_reader import ChunkReader
    from services.state.chunk_store import DirectorySource

    digests = {f["path"]: f for f in json.loads((Path(info.path) / "manifest.json").read_bytes())["files"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming single process"
        if info.chunk_path:
            reader = ChunkReader(info.path, [DirectorySource(info.chunk_path)], digests=digests)
            reader.read_metadata()
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        else:
            safe_load(state, info.path, digests=digests, no_dist=True)


def chunk_files(info: store_pb2.CheckpointInfo) -> list[Path]:
    """The chunk files a chunked version references (from its manifest), largest first."""
    import json

    manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
    root = Path(info.chunk_path)
    files = [root / c["sha"][:2] / c["sha"] for c in manifest["chunks"]]
    return sorted(files, key=lambda p: (-p.stat().st_size, p.name))


def own_chunk(info: store_pb2.CheckpointInfo, others: list[store_pb2.CheckpointInfo]) -> Path:
    """The largest chunk of a chunked version that no other version listed references (so
    damaging it strikes that version only)."""
    import json

    shared = set()
    for other in others:
        if other.version != info.version and other.chunk_path == info.chunk_path:
            shared |= {c["sha"] for c in json.loads((Path(other.path) / "manifest.json").read_bytes())["chunks"]}
    return next(p for p in chunk_files(info) if p.name not in shared)


def full_state(info: store_pb2.CheckpointInfo) -> dict:
    """Every key of a committed version, as saved (nested: ``model``, ``optim``, ``train``)."""
    import warnings

    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from services.state.chunk_reader import ChunkReader
    from services.state.chunk_store import DirectorySource

    reader = (
        ChunkReader(info.path, [DirectorySource(info.chunk_path)]) if info.chunk_path else FileSystemReader(info.path)
    )
    state: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
