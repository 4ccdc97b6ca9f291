"""Control's per-kind message and byte counters of the node agents' WorkerSession streams
(``surge_control_messages_total`` / ``surge_control_bytes_total``, services/control/metrics.py):
the kind each message is counted as, and the counters read from a real control's /metrics
after a real loopback session."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.contract import control_pb2, worker_pb2
from services.control.metrics import command_kind, event_kind
from tests.ports import free_port

from .test_event_applier import Agent, control  # noqa: F401 - the fixture
from .test_worker_events import step_event

pytestmark = pytest.mark.timeout(90)


def beat(job_id: str, rank: int, seq: int) -> control_pb2.WorkerEvent:
    hb = worker_pb2.RankHeartbeat(job_id=job_id, rank=rank, step=1, stepping=True, step_seconds=1.0)
    return control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id=job_id, rank=rank, heartbeat=hb), seq=seq)


def test_each_stream_message_is_counted_as_the_message_it_carries():
    assert event_kind(step_event("j", 1, 1)) == "StepCompleted"  # a rank's routed event: by its name
    assert event_kind(beat("j", 3, 2)) == "RankHeartbeat"
    assert event_kind(control_pb2.WorkerEvent(rank_exited=control_pb2.RankExited(job_id="j"))) == "rank_exited"
    assert event_kind(control_pb2.WorkerEvent(register=control_pb2.WorkerRegistration(worker_id="w"))) == "register"
    assert event_kind(control_pb2.WorkerEvent()) == "empty"
    assert command_kind(control_pb2.WorkerCommand(ack=control_pb2.EventAck(seq=4))) == "ack"
    assert command_kind(control_pb2.WorkerCommand(launch=control_pb2.LaunchRanks(job_id="j"))) == "launch"


def _samples(port: int) -> dict[tuple[str, str, str], float]:
    """(metric, direction, kind) -> value, of control's message counters."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("surge_control_messages_total", "surge_control_bytes_total"):
                out[(s.name, s.labels["direction"], s.labels["kind"])] = s.value
    return out


def test_a_real_sessions_messages_and_bytes_are_counted_by_direction_and_kind(control):  # noqa: F811
    metrics_port = free_port()
    c = control("--metrics-port", str(metrics_port))
    events = [beat("nojob", 0, 1), beat("nojob", 1, 2), step_event("nojob", 1, 3)]

    async def run() -> int:
        async with grpc.aio.insecure_channel(c.address) as ch:
            agent = Agent(ch, "wa")
            await agent.registered()
            for ev in events:
                agent.outgoing.put_nowait(ev)
            acked = 0
            while acked < events[-1].seq:  # every event applied before the session closes (acks are cumulative)
                acked = await asyncio.wait_for(agent.next_ack(), 30)
            agent.outgoing.put_nowait(None)
            return acked

    assert asyncio.run(run()) == events[-1].seq
    deadline = time.monotonic() + 15
    while (got := _samples(metrics_port)).get(("surge_control_messages_total", "in", "StepCompleted"), 0) < 1:
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    assert got[("surge_control_messages_total", "in", "register")] == 1
    assert got[("surge_control_messages_total", "in", "RankHeartbeat")] == 2
    assert got[("surge_control_bytes_total", "in", "RankHeartbeat")] == events[0].ByteSize() + events[1].ByteSize()
    assert got[("surge_control_bytes_total", "in", "StepCompleted")] == events[2].ByteSize()
    assert got[("surge_control_messages_total", "out", "ack")] >= 1  # the acknowledgement went down
    assert got[("surge_control_bytes_total", "out", "ack")] > 0
