"""Shared helpers for the control tests: job specs, an in-process control plane wired by
the real composition root, and node-agent sessions driven from the test."""

from __future__ import annotations

import contextlib
import queue
import textwrap
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.contract import Module, control_pb2, control_pb2_grpc, worker_pb2
from services.contract.relay import pack, unpack
from services.contract.route_table import default_table
from services.control.__main__ import Control, build
from services.control.job_store import JobStore
from services.control.orchestrator import EVENT_LOG


def spec_yaml(
    name: str = "demo", dp: int = 2, steps: int = 3, threads: int = 1, backend: str = "auto", extra: str = ""
) -> str:
    """A small job spec; ``extra`` is more YAML at the top level (e.g. a fault_policy line)."""
    return (
        extra
        + "\n"
        + textwrap.dedent(
            f"""\
        name: {name}
        steps: {steps}
        model: {{n_layers: 1, d_model: 32, n_heads: 2}}
        data: {{dataset: x@v1, seq_len: 16, micro_batch_size: 2}}
        parallel: {{dp: {dp}, backend: {backend}, threads_per_rank: {threads}}}
        optimizer: {{warmup_steps: 0}}
        """
        )
    )


def registration(worker_id: str, slots: int = 1, *, cuda: int = 0, memory: int = 16 << 30, host: str = "127.0.0.1"):
    devices = [control_pb2.Device(kind="cuda", index=i, name="H200", memory_bytes=80 << 30) for i in range(cuda)]
    return control_pb2.WorkerRegistration(
        worker_id=worker_id,
        host=host,
        address=f"{host}:0",
        devices=devices,
        memory_bytes=memory,
        cpu_count=4,
        slots=slots,
    )


class Plane:
    """An in-process control plane (the real build()), driven as the operator and as the
    node agents would drive it over gRPC."""

    def __init__(self, control: Control):
        self.c = control

    def user(self, msg, payload=None):
        return self.c.bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, msg, payload).message

    def submit(self, **spec) -> control_pb2.JobStatus:
        return self.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(**spec), spec_path="job.yaml"))

    def get(self, job_id: str) -> control_pb2.JobStatus:
        return self.user(control_pb2.JobQuery(job_id=job_id))

    def events(self, job_id: str, from_seq: int = 0) -> tuple:
        return self.c.bus.command(
            Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job_id, from_seq=from_seq), EVENT_LOG
        ).payload

    def register(self, worker_id: str, slots: int = 1, **kw):
        return self.c.sessions.open(registration(worker_id, slots, **kw))

    def rank_event(self, session, job_id: str, rank: int, **event) -> None:
        """One event of a rank, as its node agent relays it: a heartbeat as its field, any
        other (``started=TrainingLoopStarted(...)``, the keyword only names it) by its name,
        from its route's one sender."""
        (msg,) = event.values()
        if isinstance(msg, worker_pb2.RankHeartbeat):
            ev = worker_pb2.RankEvent(job_id=job_id, rank=rank, heartbeat=msg)
        else:
            (sender,) = default_table().route(msg).senders
            ev = worker_pb2.RankEvent(job_id=job_id, rank=rank, routed=pack(msg, sender))
        self.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(rank_event=ev))

    def rank_exited(self, session, job_id: str, rank: int, exit_code: int, **kw) -> None:
        ev = control_pb2.RankExited(job_id=job_id, rank=rank, exit_code=exit_code, **kw)
        self.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(rank_exited=ev))


def to_ranks(cmd: control_pb2.WorkerCommand):
    """The command a WorkerCommand carries to a job's ranks (``routed``, by its name)."""
    assert cmd.WhichOneof("command") == "routed" and cmd.job_id, cmd
    return unpack(cmd.routed)


def kinds(cmds: list[control_pb2.WorkerCommand]) -> list[str]:
    """Each command's kind: the message name of a routed one, else its field."""
    return [
        c.routed.type.rsplit(".", 1)[-1] if c.WhichOneof("command") == "routed" else c.WhichOneof("command")
        for c in cmds
    ]


def drain(session) -> list[control_pb2.WorkerCommand]:
    """Every command queued on an in-process session so far (None = session ended)."""
    out = []
    while True:
        try:
            out.append(session.commands.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture
def store_with_no_versions(monkeypatch):
    """The store answers every verification at once (as the gRPC relay does later, on the
    applier thread): the job has no committed version."""
    from services.contract import store_pb2
    from services.control.store_relay import StoreRelay

    monkeypatch.setattr(
        StoreRelay,
        "verify_checkpoints",
        lambda self, msg, payload=None: store_pb2.CheckpointVerification(job_id=msg.job_id),
    )


def stop_plane(control: Control) -> None:
    """Stop an in-process control plane as control's main does when it stops (its deadline
    pools, the store relay, the sessions, then the event applier's thread), then close its
    journal. A plane left running kept its threads after the test: a store call answered
    later (its 10 s deadline) still wrote to the closed journal and logged the failure into
    whatever test the process ran next."""
    control.detector.close()
    control.orchestrator.close()
    control.store.close()
    control.sessions.shutdown()
    control.servicer.applier.stop()
    control.webhooks.close(timeout_s=5.0)
    control.journal.close()


@pytest.fixture
def plane(tmp_path, store_with_no_versions):
    journal = JobStore(tmp_path / "control.db")
    control = build(journal, data_address="127.0.0.1:7001", store_address="127.0.0.1:7002", persist_interval_s=0.0)
    yield Plane(control)
    stop_plane(control)


def settle(read, expected, timeout_s: float = 10.0):
    """``read()`` once it equals ``expected`` (the orchestrator starts queued jobs on its
    deadline pool's thread, not on the caller's); fails with the last value after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected:
        assert time.monotonic() < deadline, f"{value!r} != {expected!r} after {timeout_s} s"
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def served_control(db: Path, monkeypatch) -> Iterator[tuple[Control, control_pb2_grpc.ControlServiceStub]]:
    """The real control plane (build()) journaling to ``db``, served by its real servicer on
    loopback gRPC, SURGE_CONTROL_ADDRESS set to it: (the plane, a stub)."""
    journal = JobStore(db)
    plane = build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    control_pb2_grpc.add_ControlServiceServicer_to_server(plane.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", f"127.0.0.1:{port}")
    try:
        yield plane, control_pb2_grpc.ControlServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    finally:
        server.stop(grace=0)
        stop_plane(plane)


def launched(sessions: dict, count: int, timeout: float = 10.0) -> dict[str, list]:
    """Every command the sessions (worker id -> session) got until ``count`` launches came
    (a relaunch is placed once its release went, after its decision's journal commit: on
    another thread)."""
    got: dict[str, list] = {w: [] for w in sessions}
    deadline = time.monotonic() + timeout
    while True:
        for w, session in sessions.items():
            got[w] += drain(session)
        if sum(c.WhichOneof("command") == "launch" for cmds in got.values() for c in cmds) >= count:
            return got
        assert time.monotonic() < deadline, {w: kinds(c) for w, c in got.items()}
        time.sleep(0.02)
