"""services/control/ack_pacer.py: a node agent's session gets at most one ack per interval;
the first after a quiet interval goes at once, one due sooner waits for the interval's end
and covers every commit since (the ack is built as it is sent: the latest journaled seq)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from services.control.ack_pacer import AckPacer


@dataclass(eq=False)
class Session:  # the fields of AgentSession the pacer reads
    name: str
    ack_queued: bool = False
    closed: bool = False
    acked_at: float = float("-inf")


def pacer(interval_s: float) -> tuple[AckPacer, list[tuple[float, str]]]:
    lock, sent = threading.Lock(), []

    def put(sessions):  # the hub's put_all, then its command(): the marker is consumed
        for s in sessions:
            with lock:
                s.ack_queued = False
            sent.append((time.monotonic(), s.name))

    return AckPacer(lock, put, interval_s), sent


def test_one_ack_per_session_per_interval_the_first_at_once_the_rest_coalesced_at_its_end():
    acks, sent = pacer(0.5)
    a, b = Session("a"), Session("b")
    t0 = time.monotonic()
    acks.queue([a, b])  # quiet before: at once, both in one put
    assert [n for _, n in sent] == ["a", "b"] and sent[-1][0] - t0 < 0.1
    for _ in range(5):  # five more commits of `a` within its interval: one ack, held
        acks.queue([a])
        time.sleep(0.02)
    assert [n for _, n in sent] == ["a", "b"] and acks.held == 1
    deadline = time.monotonic() + 3
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [n for _, n in sent] == ["a", "b", "a"]
    assert 0.45 <= sent[2][0] - sent[0][0] < 1.0  # at the interval's end, not per commit
    time.sleep(0.6)  # `b` was quiet for an interval: at once again
    acks.queue([b])
    assert [n for _, n in sent][-1] == "b" and acks.held == 1


def test_a_held_ack_of_a_session_that_closed_meanwhile_is_not_sent():
    acks, sent = pacer(0.3)
    s = Session("s")
    acks.queue([s])
    acks.queue([s])  # held
    s.closed = True
    time.sleep(0.6)
    assert [n for _, n in sent] == ["s"]
    acks.queue([Session("closed", closed=True)])
    assert [n for _, n in sent] == ["s"]


def test_interval_zero_acks_every_commit_at_once():
    acks, sent = pacer(0.0)
    s = Session("s")
    for _ in range(3):
        acks.queue([s])
    assert [n for _, n in sent] == ["s", "s", "s"] and acks.held == 0
