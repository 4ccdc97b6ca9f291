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
    assert control_bench.rates(before, after, 10.0) == {
        "journal_writes_per_s": 2.0,
        "messages_in_per_s": 3.0,  # (20 beats + 10 steps) / 10 s: a kind first seen in `after` counts whole
        "messages_out_per_s": 2.0,
        "bytes_in_per_s": 250.0,
        "bytes_out_per_s": 40.0,
        "datagrams_read_per_s": 500.0,
        "datagrams_dropped": 3.0,
        "beat_on_session_in_window": 4.0,
        "beat_on_session_total": 7.0,
        "datagrams_resumed_total": 4.0,
        "datagram_rank_beats_per_s": 200.0,
        "flips_deferred_total": 6.0,
    }
