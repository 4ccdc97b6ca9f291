"""The control-plane bench's own parts (bench/control_bench.py, bench/control_messages.py):
its one-line refusals and the per-second figures it reads from control's counters. The bench
itself (`make bench-control`) runs minutes of traffic; no speed is asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO))

from bench import control_bench  # noqa: E402


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("control_bench.py", ["--only", "steps,bogus"], "--only: unknown scenario 'bogus'"),
        ("control_bench.py", ["--nodes", "0"], "--nodes: must be >= 1, got 0"),
        ("control_bench.py", ["--seconds", "0"], "--seconds: must be > 0, got 0.0"),
        ("control_messages.py", ["--only", "dp3"], "--only: unknown run 'dp3'"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_flag_and_start_nothing(script, args, named):
    r = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and named in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_rates_are_per_second_between_two_scrapes_by_direction():
    before = {"messages": {"in:RankHeartbeat": 10.0, "out:ack": 4.0}, "bytes": {"in:RankHeartbeat": 1000.0}}
    after = {
        "messages": {"in:RankHeartbeat": 30.0, "in:StepCompleted": 10.0, "out:ack": 24.0},
        "bytes": {"in:RankHeartbeat": 3000.0, "in:StepCompleted": 500.0, "out:ack": 400.0},
    }
    before["journal_commits"], after["journal_commits"] = 5.0, 25.0
    # The liveness datagrams' counters (udp36): read/s and dropped in the window, fallbacks both
    # in it and since control started, resumes since control started; absent before: from 0.
    before.update(datagrams_read=1000.0, datagrams_dropped=2.0, beat_on_session=3.0)
    after.update(datagrams_read=6000.0, datagrams_dropped=5.0, beat_on_session=7.0, datagrams_resumed=4.0)
    # hb37: the ranks' beats that rode the datagrams (per s in the window), flips deferred (since start)
    before.update(datagram_rank_beats=100.0)
    after.update(datagram_rank_beats=2100.0, flips_deferred=6.0)
    # the kernel's drops in control's full socket (session 41), one of the dropped: in the window
    before.update(datagrams_socket_full=1.0)
    after.update(datagrams_socket_full=3.0)
    assert control_bench.rates(before, after, 10.0) == {
        "journal_writes_per_s": 2.0,
        "messages_in_per_s": 3.0,  # (20 beats + 10 steps) / 10 s: a kind first seen in `after` counts whole
        "messages_out_per_s": 2.0,
        "bytes_in_per_s": 250.0,
        "bytes_out_per_s": 40.0,
        "datagrams_read_per_s": 500.0,
        "datagrams_dropped": 3.0,
        "datagrams_dropped_socket_full": 2.0,
        "beat_on_session_in_window": 4.0,
        "beat_on_session_total": 7.0,
        "datagrams_resumed_total": 4.0,
        "datagram_rank_beats_per_s": 200.0,
        "flips_deferred_total": 6.0,
    }


class _Agent:
    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"a{self.i}"


def test_schedule_beats_each_agent_once_a_second_at_its_own_phase_and_a_late_look_skips_what_it_missed():
    # (session 41: one ticker per agent process instead of a sleep per agent)
    agents = [_Agent(i) for i in range(4)]
    s = control_bench.Schedule(agents, {"mode": "heartbeats", "nodes": 4}, now=100.5)
    a0, a1, a2, a3 = ((a, False) for a in agents)
    assert s.due(100.99) == []  # the first beats from the next whole second, each at i / nodes
    assert s.due(101.0) == [a0]
    assert s.due(101.6) == [a1, a2]  # (a look that comes late acts on what is due, in time order)
    assert s.due(101.6) == []  # (twice at once: nothing twice)
    assert s.due(101.75) == [a3]
    assert s.next_at() == 102.0
    # Behind by seconds: each agent once (not once per second missed), then on at its own phase.
    late = s.due(105.8)
    assert sorted(late, key=lambda e: e[0].i) == [a0, a1, a2, a3], late
    assert s.next_at() == 106.0
    assert s.due(106.5) == [a0, a1, a2]
    assert s.due(106.75) == [a3]


def test_schedule_in_steps_gives_each_agent_its_step_boundary_within_the_spread():
    agents = [_Agent(i) for i in range(3)]
    s = control_bench.Schedule(agents, {"mode": "steps", "nodes": 3, "step_spread": 0.05}, now=7.5)
    first = s.due(8.0499)
    # Agent 0: its beat and its step boundary both at 8.0 (the beat first); the others' boundaries
    # within the spread; their beats (at 1/3 and 2/3 of the second) not yet.
    assert first[:2] == [(agents[0], False), (agents[0], True)], first
    assert sorted((a.i, is_step) for a, is_step in first) == [(0, False), (0, True), (1, True), (2, True)]
    assert [(a.i, is_step) for a, is_step in s.due(9.0)] == [(1, False), (2, False), (0, False), (0, True)]
