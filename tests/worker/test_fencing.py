"""Fencing at the node agent (issue 29 item 4): a real ``python -m services.worker`` refuses
the peer-heal data plane (MemoryCopyService) to an older incarnation of a rank than the newest
it was told of, by a call of a newer one or by control (ReleaseRanks.below_generation); and it
beats (AgentHeartbeat) about once a second, ranks or none."""

from __future__ import annotations

import time

import grpc
import pytest

from services.common.fencing import GENERATION_METADATA
from services.common.grpc_server import channel
from services.contract import Module, control_pb2, route_pb2, worker_pb2, worker_pb2_grpc
from services.contract.failures import cause_of
from tests.worker.test_node_agent import cluster  # noqa: F401 - control servers and real agents (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def as_rank(rank: int, generation: int) -> tuple[tuple[str, str], ...]:
    return ((GENERATION_METADATA, f"hj/{rank}/{generation}"),)


def refused(call) -> bool:
    """Whether ``call`` is refused as a replaced incarnation (FAILED_PRECONDITION, typed)."""
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
        assert cause_of(e) == route_pb2.FailureCause.FAILURE_FENCED
        return True
    return False


def test_peer_heal_calls_of_a_replaced_incarnation_are_refused_and_the_agent_beats(cluster):  # noqa: F811
    control = cluster.control()
    agent = cluster.agent(control.port)
    control.servicer.registration()
    with channel(f"127.0.0.1:{agent.port}", module=Module.L5_CHECKPOINT_MANAGER) as ch:
        stub = worker_pb2_grpc.MemoryCopyServiceStub(ch)
        held = worker_pb2.HeldQuery(job_id="hj", rank=1)
        assert not refused(lambda: stub.HeldChunks(held, timeout=10, metadata=as_rank(1, 5)))  # told of 5
        assert refused(lambda: stub.HeldChunks(held, timeout=10, metadata=as_rank(1, 4)))
        put = [worker_pb2.ChunkPut(header=worker_pb2.SnapshotHeader(job_id="hj", rank=1, step=3))]
        assert refused(lambda: stub.PutChunks(iter(put), timeout=10, metadata=as_rank(1, 4)))
        chunks = worker_pb2.ChunksQuery(job_id="hj", sha256=["00" * 32])
        assert refused(lambda: list(stub.GetChunks(chunks, timeout=10, metadata=as_rank(1, 4))))

        # Control tells the agent of rank 2's newest incarnation with the kill of the old one.
        assert not refused(lambda: stub.HeldChunks(held, timeout=10, metadata=as_rank(2, 10)))
        control.servicer.push(release=control_pb2.ReleaseRanks(job_id="hj", kill=True, ranks=[2], below_generation=11))
        deadline = time.monotonic() + 10
        while not refused(lambda: stub.HeldChunks(held, timeout=10, metadata=as_rank(2, 10))):
            assert time.monotonic() < deadline, "the agent never took control's fence"
            time.sleep(0.05)

    # Its own beat, with no rank at all: one a second (a loaded machine may delay one).
    first = control.servicer.beats.get(timeout=5)
    beats = [first] + [control.servicer.beats.get(timeout=5) for _ in range(2)]
    assert all(b.interval_seconds == 1.0 and b.unix_time > 0 for b in beats)
    assert 1.0 <= beats[-1].unix_time - beats[0].unix_time <= 4.0
