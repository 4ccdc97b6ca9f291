"""``python -m services.rank`` as a process, against an in-test node agent and data
service (gRPC servers in this process): the RankSession protocol end to end. Each rank is
forked as the node agent's fork server forks it (its ``main(argv)`` in a child of a process
that imported torch and the rank's modules: tests/rank_forks.py), not a new interpreter."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from rank_fakes import corpus_bytes, free_port, tiny_spec

from services.contract import (
    Module,
    audit_pb2,
    data_pb2,
    data_pb2_grpc,
    engine_pb2,
    store_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.contract.audit import abort_with_violation
from services.contract.bus import BoundaryViolation
from services.contract.relay import pack, unpack
from services.jobspec import spec_to_json
from services.worker.rank_session import unbatched
from tests.rank_forks import RankProcess

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


# Set-up and stream-end facts a rank sends up (routed to L1) that these tests do not follow.
UNFOLLOWED = {"ParallelReady", "DataExhausted"}


def kind(ev: worker_pb2.RankEvent) -> str:
    """A routed event's message name (``StepCompleted``), else its field (``hello``)."""
    which = ev.WhichOneof("event")
    return ev.routed.type.rsplit(".", 1)[-1] if which == "routed" else which


def body(ev: worker_pb2.RankEvent):
    """The message a routed event carries (services/contract/relay.py)."""
    return unpack(ev.routed)


class FakeAgent(worker_pb2_grpc.WorkerServiceServicer):
    """Sends what it is told to, records what the rank sends."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.commands: queue.Queue = queue.Queue()
        self.heartbeats: list[worker_pb2.RankHeartbeat] = []  # kept apart: they come every second
        self.messages: list[list[str]] = []  # per stream message, what it carried (RankEvent.more)

    def RankSession(self, requests, context):
        def read():
            try:
                for ev in (ev for message in requests for ev in self._parts(message)):
                    if ev.WhichOneof("event") == "heartbeat":
                        self.heartbeats.append(ev.heartbeat)
                        continue
                    if ev.WhichOneof("event") == "metrics":  # as if the store wrote it at once
                        self.commands.put(worker_pb2.RankCommand(metrics_ack=store_pb2.MetricsAck(seq=ev.metrics.seq)))
                        continue
                    if kind(ev) in UNFOLLOWED:
                        continue
                    self.events.put(ev)
            except grpc.RpcError:
                pass
            self.events.put(None)
            self.commands.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (cmd := self.commands.get()) is not None:
            yield cmd

    def _parts(self, message: worker_pb2.RankEvent) -> list[worker_pb2.RankEvent]:
        parts = unbatched(message)
        self.messages.append(
            [f"{kind(p)}:{p.metrics.WhichOneof('record')}" if kind(p) == "metrics" else kind(p) for p in parts]
        )
        return parts

    def next_event(self, timeout: float = 60.0) -> worker_pb2.RankEvent | None:
        return self.events.get(timeout=timeout)


class FakeDataService(data_pb2_grpc.DataServiceServicer):
    """Byte windows of real text; Mount knows one dataset, corpus@v1."""

    def __init__(self):
        self._data = np.frombuffer(corpus_bytes(200_000), dtype=np.uint8).astype(np.int32)

    def Mount(self, request, context):
        if request.name == "forbidden":  # as the data service answers a send its bus refused
            error = BoundaryViolation(Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER)
            abort_with_violation(context, error, "data")
        if request.name != "corpus":
            context.abort(grpc.StatusCode.NOT_FOUND, f"dataset {request.name}@{request.version} not found")
        return data_pb2.DatasetReady(name=request.name, version=request.version, vocab_size=256, tokenizer="bytes")

    def Stream(self, request, context):
        self.Mount(request.mount, context)
        B, T = request.packer.micro_batch_size, request.packer.seq_len
        rng = np.random.default_rng(request.packer.rank)  # the dp rank of the deal
        n = 0
        while context.is_active() and (request.max_batches == 0 or n < request.max_batches):
            starts = rng.integers(0, len(self._data) - T - 1, size=B)
            rows = np.stack([self._data[s : s + T + 1] for s in starts])
            n += 1
            yield data_pb2.MicroBatch(
                input_ids=rows[:, :-1].astype("<i4").tobytes(),
                labels=rows[:, 1:].astype("<i4").tobytes(),
                batch_size=B,
                seq_len=T,
                tokens=B * T,
                next=data_pb2.DataPosition(row=n),
            )


@pytest.fixture
def services(tmp_path):
    agent, data = FakeAgent(), FakeDataService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(agent, server)
    data_pb2_grpc.add_DataServiceServicer_to_server(data, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    procs: list[RankProcess] = []
    yield agent, f"127.0.0.1:{port}", (procs, tmp_path)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        p.log.close()
    server.stop(0)


def start_rank(address: str, procs: tuple, job: str = "job-1", env: dict | None = None) -> RankProcess:
    """``python -m services.rank`` as its node agent's fork server starts it: its ``main(argv)``
    in a process forked with torch and the rank's modules imported (tests/rank_forks.py)."""
    started, logs = procs
    argv = ["--session", address, "--job", job, "--rank", "0"]
    log = logs / f"rank-{len(started)}.log"
    p = RankProcess(None, argv, log, REPO, {**os.environ, **(env or {})}, module="services.rank.__main__")
    started.append(p)
    return p


def output(proc: RankProcess) -> str:
    """What the rank wrote to its stdout and stderr so far."""
    return Path(proc.log.name).read_text(errors="replace")


def push_setup(agent: FakeAgent, address: str, spec, device: str = "cpu") -> None:
    unused = free_port()  # no store listens here (metrics go to the fake agent, which acks them)
    agent.commands.put(
        worker_pb2.RankCommand(
            init=engine_pb2.InitJob(
                job_id="job-1", spec_json=spec_to_json(spec), data_address=address, store_address=f"127.0.0.1:{unused}"
            )
        )
    )
    agent.commands.put(
        worker_pb2.RankCommand(
            assignment=engine_pb2.RankAssignment(
                rank=0,
                world_size=1,
                master_addr="127.0.0.1",
                master_port=free_port(),
                backend="gloo",
                device=device,
                num_threads=1,
            )
        )
    )


def released(agent: FakeAgent, proc: RankProcess) -> None:
    """A rank that reported its failure waits for L1 (heartbeats go on) until released: here,
    its agent ends the session; then it exits 1."""
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(1.0)
    agent.commands.put(None)
    assert proc.wait(30) == 1


def test_a_rank_says_hello_reports_started_waits_for_start_and_exits_0_after_finished(services):
    agent, address, procs = services
    spec = tiny_spec(steps=4, eval={"at_end": True, "batches": 2})
    proc = start_rank(address, procs)
    hello = agent.next_event()
    assert hello.WhichOneof("event") == "hello"
    assert (hello.job_id, hello.rank, hello.hello.pid) == ("job-1", 0, proc.pid)
    push_setup(agent, address, spec)
    started = agent.next_event()
    assert kind(started) == "TrainingLoopStarted", started
    assert started.routed.sender == Module.L2_TRAINING_LOOP
    assert body(started).start_step == 0 and body(started).num_parameters > 0
    with pytest.raises(queue.Empty):
        agent.next_event(timeout=0.5)  # nothing happens before StartTraining
    agent.commands.put(
        worker_pb2.RankCommand(
            routed=pack(engine_pb2.StartTraining(job_id="job-1"), Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)
        )
    )
    events = []
    while (ev := agent.next_event()) is not None:
        events.append(ev)
    kinds = [kind(e) for e in events]
    assert kinds == ["StepCompleted"] * 4 + ["EvalCompleted", "audit", "TrainingLoopFinished"], kinds
    assert [body(e).step for e in events[:4]] == [1, 2, 3, 4]
    assert all(e.job_id == "job-1" and e.rank == 0 for e in events)
    assert body(events[3]).tokens == 8 * 64 and body(events[4]).tokens == 2 * 8 * 64
    assert not body(events[6]).stopped
    # Before the end, the rank's final route counts: e.g. one RunForward per micro-batch.
    final = events[5].audit
    counts = {(Module.Name(c.sender), c.message, Module.Name(c.receiver)): c.count for c in final.routes}
    assert counts[("L2_TRAINING_LOOP", "surge.v1.RunForward", "L3_FORWARD_UNIT")] >= 4
    assert final.process == "rank 0 of job job-1" and list(final.violations) == []
    assert proc.wait(30) == 0, output(proc)[-3000:]
    # A step's StepCompleted and its metric record are queued together: one message (usually:
    # a loaded machine may wake the session's sender between the two).
    steps = [m for m in agent.messages if "StepCompleted" in m]
    assert sum(m == ["StepCompleted", "metrics:step"] for m in steps) >= 1, agent.messages


def test_an_unknown_dataset_is_reported_failed_data_unavailable_and_the_rank_waits_to_be_released(services):
    agent, address, procs = services
    proc = start_rank(address, procs)
    assert agent.next_event().WhichOneof("event") == "hello"
    push_setup(agent, address, tiny_spec(data={"dataset": "nope@v9"}))
    assert agent.next_event().WhichOneof("event") == "audit"  # the final counts go first
    ev = agent.next_event()
    assert kind(ev) == "TrainingLoopFailed", ev
    assert body(ev).fault_class == "data_unavailable"
    assert body(ev).detail == "dataset nope@v9 not found"
    released(agent, proc)


def test_a_rank_pins_its_cpus_and_refuses_a_device_it_cannot_see_in_one_typed_line(services):
    agent, address, procs = services
    cpu = min(os.sched_getaffinity(0))
    # As its node agent binds a rank on GPU 3 (services/worker/device_binding.py), in a
    # process without CUDA: told cuda:3, which it cannot see.
    proc = start_rank(address, procs, env={"SURGE_CPU_AFFINITY": str(cpu), "CUDA_VISIBLE_DEVICES": "3"})
    assert agent.next_event().WhichOneof("event") == "hello"
    push_setup(agent, address, tiny_spec(), device="cuda:3")
    assert agent.next_event().WhichOneof("event") == "audit"
    failed = agent.next_event()
    assert kind(failed) == "TrainingLoopFailed", failed
    assert body(failed).fault_class == "config_error"
    assert body(failed).detail == (
        "rank assignment: device 'cuda:3' but this process sees no CUDA device (CUDA_VISIBLE_DEVICES '3')"
    )
    assert os.sched_getaffinity(proc.pid) == {cpu}  # pinned before anything else ran
    released(agent, proc)
    assert "Traceback" not in output(proc)


def test_a_violation_the_data_service_returns_goes_up_before_the_failure_it_causes(services):
    agent, address, procs = services
    proc = start_rank(address, procs)
    assert agent.next_event().WhichOneof("event") == "hello"
    push_setup(agent, address, tiny_spec(data={"dataset": "forbidden@v1"}))
    ev = agent.next_event()
    assert kind(ev) == "BoundaryViolationReported" and ev.routed.sender == Module.EXT_CONTRACT, ev
    v = body(ev)
    assert (v.process, v.sender, v.message, v.receiver) == (
        "data",
        Module.L4_SHUFFLER,
        "surge.v1.FilterRules",
        Module.L4_FILTER,
    )
    assert (v.job_id, v.rank) == ("job-1", 0)
    assert v.detail == "boundary violation: L4_SHUFFLER may not send surge.v1.FilterRules to L4_FILTER"
    final = agent.next_event()
    assert final.WhichOneof("event") == "audit", final
    assert list(final.audit.violations) == []  # the refusal was data's, not this rank's bus
    failed = agent.next_event()
    assert kind(failed) == "TrainingLoopFailed" and "L4_SHUFFLER may not send" in body(failed).detail
    released(agent, proc)


def test_a_rank_answers_its_agents_audit_with_the_route_counts_of_its_bus(services):
    agent, address, procs = services
    proc = start_rank(address, procs)
    assert agent.next_event().WhichOneof("event") == "hello"
    push_setup(agent, address, tiny_spec(steps=10_000))
    assert kind(agent.next_event()) == "TrainingLoopStarted"
    agent.commands.put(worker_pb2.RankCommand(audit=audit_pb2.AuditRequest(id=7)))
    ev = agent.next_event()
    assert ev.WhichOneof("event") == "audit", ev
    assert ev.audit.id == 7 and ev.audit.process == "rank 0 of job job-1"
    counts = {(Module.Name(c.sender), c.message, Module.Name(c.receiver)): c.count for c in ev.audit.routes}
    assert counts[("L1_ORCHESTRATOR", "surge.v1.InitJob", "L2_TRAINING_LOOP")] == 1
    assert counts[("L2_TRAINING_LOOP", "surge.v1.MountDataset", "L4_DATASET_VERSIONS")] >= 1
    agent.commands.put(None)
    assert proc.wait(20) == 3


def test_a_rank_whose_agent_goes_away_exits_promptly(services):
    agent, address, procs = services
    proc = start_rank(address, procs)
    assert agent.next_event().WhichOneof("event") == "hello"
    push_setup(agent, address, tiny_spec(steps=10_000))
    assert kind(agent.next_event()) == "TrainingLoopStarted"
    agent.commands.put(None)  # the agent ends the session
    assert proc.wait(20) == 3
