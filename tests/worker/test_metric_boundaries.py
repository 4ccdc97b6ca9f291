"""A node's metric records go to the store once a second (the linger: services/worker/
metric_stream.py), but never wait out the linger at a rank's boundary: any routed event of the
rank but a StepCompleted (a save committed, a pause, a step fault, the loop's end), its session's
end and a ReleaseRanks of its job send what is held at once (the node agent's ``flush``)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import structlog

from services.contract import Module, control_pb2, engine_pb2, store_pb2, worker_pb2
from services.contract.relay import pack
from services.worker.node_agent import NodeAgent
from services.worker.rank_process import RankProcess

pytestmark = pytest.mark.timeout(60)

STORE = "127.0.0.1:7"


class Streams:
    """The agent's metric streams, as calls: what was submitted, and each flush."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def submit(self, address, record, ack, key=None) -> None:
        with self._lock:
            self.calls.append(("submit", address, record.WhichOneof("record")))

    def flush(self, address) -> None:
        with self._lock:
            self.calls.append(("flush", address))

    def close(self, timeout: float = 5.0) -> None:
        pass


@pytest.fixture
def agent(tmp_path):
    streams = Streams()
    up: list[control_pb2.WorkerEvent] = []
    a = NodeAgent("w1", "127.0.0.1:1", tmp_path, emit=up.append, log=structlog.get_logger(), metrics=streams)
    procs: list[subprocess.Popen] = []

    def rank(rank: int) -> RankProcess:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        procs.append(proc)
        r = RankProcess(
            job_id="j",
            rank=rank,
            init=engine_pb2.InitJob(job_id="j", store_address=STORE),
            assignment=engine_pb2.RankAssignment(rank=rank),
            proc=proc,
            log_path=tmp_path / f"r{rank}.log",
        )
        with a._lock:
            a._ranks[("j", rank)] = r
        return r

    yield a, streams, rank, up
    for proc in procs:
        proc.kill()
        proc.wait()


def step(rank: int, n: int) -> list[worker_pb2.RankEvent]:
    """A step's two events of a rank: its StepCompleted (routed) and its metric record."""
    msg = engine_pb2.StepCompleted(job_id="j", rank=rank, step=n)
    return [
        worker_pb2.RankEvent(job_id="j", rank=rank, routed=pack(msg, Module.L2_TRAINING_LOOP)),
        worker_pb2.RankEvent(job_id="j", rank=rank, metrics=store_pb2.MetricRecord(seq=n, step=msg)),
    ]


def routed(rank: int, msg, sender: int = Module.L2_TRAINING_LOOP) -> worker_pb2.RankEvent:
    return worker_pb2.RankEvent(job_id="j", rank=rank, routed=pack(msg, sender))


def flushes(streams: Streams) -> int:
    return sum(1 for c in streams.calls if c[0] == "flush")


def test_steps_linger_and_every_other_routed_event_of_a_rank_is_a_boundary(agent):
    a, streams, rank, up = agent
    r = rank(0)
    for n in (1, 2, 3):
        for e in step(0, n):
            a.relay_event(r, e)
    assert flushes(streams) == 0  # steps linger (once a second to the store)
    assert [c[2] for c in streams.calls] == ["step"] * 3
    assert len(up) == 3  # (rank 0's steps still go up each one)
    boundaries = [
        (store_pb2.SaveCompleted(job_id="j", step=3, version="j:1"), Module.L5_CHECKPOINT_MANAGER),
        (engine_pb2.EvalCompleted(job_id="j", rank=0, step=3), Module.L2_TRAINING_LOOP),
        (engine_pb2.TrainingLoopPaused(job_id="j", rank=0, step=3), Module.L2_TRAINING_LOOP),
        (engine_pb2.StepFaultReported(job_id="j", rank=0, step=4), Module.L2_TRAINING_LOOP),
        (engine_pb2.TrainingLoopFinished(job_id="j", rank=0), Module.L2_TRAINING_LOOP),
    ]
    for i, (msg, sender) in enumerate(boundaries, 1):
        a.relay_event(r, routed(0, msg, sender))
        assert streams.calls[-1] == ("flush", STORE), msg.DESCRIPTOR.name
        assert flushes(streams) == i


def test_a_ranks_session_end_and_a_release_of_its_job_send_what_lingers(agent):
    a, streams, rank, _ = agent
    r0, r1 = rank(0), rank(1)
    for e in step(1, 1):
        a.relay_event(r1, e)
    a.detach(r1)  # its process ended (or closed its session)
    assert streams.calls[-1] == ("flush", STORE) and flushes(streams) == 1
    for e in step(0, 1):
        a.relay_event(r0, e)
    a.release_ranks(control_pb2.ReleaseRanks(job_id="j", kill=True))
    assert streams.calls[-1] == ("flush", STORE) and flushes(streams) == 2
    r0.proc.wait(10)
