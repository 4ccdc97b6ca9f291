"""A node agent's departure with notice (issue 30 item 5): SIGTERM or SIGUSR1 tells control the
deadline (WorkerDeparting) and keeps the ranks until control releases them or the deadline
passes; the wait itself, on a fake clock."""

from __future__ import annotations

import signal
import time

import pytest

from services.contract import control_pb2
from services.contract.relay import unpack
from services.worker.departure import CONTROL_AWAY, CONTROL_AWAY_SECONDS, DEADLINE, RELEASED, wait_for_release
from tests.worker import test_node_agent
from tests.worker.test_node_agent import alive, gone_within, launch, started_ranks

cluster = test_node_agent.cluster  # (the node agent tests' fixture: a fake control, agents ended by PID)

pytestmark = pytest.mark.timeout(90)


def announced(control) -> tuple[control_pb2.WorkerRegistration, control_pb2.WorkerDeparting]:
    """The departing registration, then the routed WorkerDeparting (other events skipped)."""
    departing = control.registration()
    while departing.departing is False:
        departing = control.registration()
    while True:
        event = control.next_event()
        if event.WhichOneof("event") == "routed" and event.routed.type == "surge.v1.WorkerDeparting":
            return departing, unpack(event.routed)


def test_sigterm_announces_the_deadline_and_keeps_the_ranks_until_control_releases_them(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port, "--departure-seconds", "40")
    control.servicer.registration()
    launch(control.servicer, "keep", ["sleep", "sleep"], world_size=2)
    pids = list(started_ranks(cluster, control.servicer, 2).values())
    signalled = time.time()
    agent.proc.send_signal(signal.SIGTERM)
    reg, departing = announced(control.servicer)
    assert reg.departing and departing.signal == "SIGTERM" and departing.deadline_seconds == 40.0
    assert departing.incarnation == reg.incarnation and abs(departing.unix_time - signalled) < 5.0
    time.sleep(1.0)
    assert all(alive(p) for p in pids) and agent.proc.poll() is None  # (kept: control decides)
    control.servicer.push(release=control_pb2.ReleaseRanks(job_id="keep", kill=True))
    assert agent.proc.wait(timeout=20) == 0, agent.output()
    assert gone_within(pids, 2.0)
    assert "released" in agent.output()


def test_sigusr1_keeps_the_ranks_until_the_deadline_then_stops_them(cluster):
    control = cluster.control()
    agent = cluster.agent(control.port, "--departure-seconds", "2")
    control.servicer.registration()
    launch(control.servicer, "slurm", ["sleep"], world_size=1)
    pids = list(started_ranks(cluster, control.servicer, 1).values())
    agent.proc.send_signal(signal.SIGUSR1)
    _, departing = announced(control.servicer)
    assert departing.signal == "SIGUSR1" and departing.deadline_seconds == 2.0
    assert alive(pids[0])
    assert agent.proc.wait(timeout=20) == 0, agent.output()
    assert gone_within(pids, 2.0)
    assert "deadline" in agent.output()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.mark.parametrize(
    ("ranks_until", "away_from", "deadline", "why", "ended_at"),
    [
        (1.0, None, 30.0, RELEASED, 1.0),  # control released them after a second
        (None, None, 5.0, DEADLINE, 5.0),  # never released: the deadline
        (None, 3.0, 30.0, CONTROL_AWAY, 3.0 + CONTROL_AWAY_SECONDS),  # control went (a stack stopping)
        (None, 3.0, 4.0, DEADLINE, 4.0),  # the deadline first
        (0.0, None, 30.0, RELEASED, 0.0),  # nothing ran here
    ],
)
def test_the_wait_ends_on_release_deadline_or_control_away(ranks_until, away_from, deadline, why, ended_at):
    clock = Clock()
    ranks = (lambda: True) if ranks_until is None else (lambda: clock.now < ranks_until)
    connected = (lambda: True) if away_from is None else (lambda: clock.now < away_from)
    assert wait_for_release(ranks, connected, deadline, clock, clock.sleep) == why
    assert clock.now == pytest.approx(ended_at, abs=0.11)
