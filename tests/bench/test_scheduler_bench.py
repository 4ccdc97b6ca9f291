"""bench/scheduler_bench.py on a small simulated cluster (seconds): a decision is timed, and a
day of submissions runs under FIFO and fair share with every job accounted for."""

from __future__ import annotations

import random

import pytest

from bench import scheduler_bench as sb

pytestmark = pytest.mark.timeout(120)


def test_the_scheduler_bench_times_decisions_and_simulates_a_day_under_both_policies():
    rng = random.Random(1)
    times, cpu = sb.decision_times(rng, slots=64, decisions=3)
    assert len(times) == len(cpu) == 3 and all(0 < t < 5 for t in times) and all(0 <= c < 5 for c in cpu)
    book = sb.team_book(random.Random(1), 64)
    subs = sb.submissions(rng, 64, load=0.8)
    assert 100 < len(subs) < 2000 and all(0 <= t < sb.DAY_S and size in sb.SIZES for t, _, size, _, _ in subs)
    for fifo in (True, False):
        day = sb.simulate(subs, 64, book, fifo=fifo)
        assert 0.5 < day["utilisation"] <= 1.0, day["utilisation"]
        assert sum(len(w) for w in day["waits"].values()) == len(subs)
        s = sb.summary(day)
        assert s["wait_p50_min_all"] <= s["wait_p99_min_all"]
    teams = sb.offered(subs, book, 64)
    assert set(teams) == {team for _, team, *_ in subs}
    assert sum(v["weight_share"] for v in teams.values()) <= 1.0 + 1e-3
    assert sum(v["offered_share"] for v in teams.values()) == pytest.approx(
        sum(size * min(d, sb.DAY_S - t) for t, _, size, d, _ in subs) / (64 * sb.DAY_S), abs=1e-3
    )


def test_the_scheduler_bench_with_two_device_kinds_reports_each_kind_s_utilisation():
    rng = random.Random(2)
    times, _ = sb.decision_times(rng, slots=64, decisions=2, gpu_fraction=0.25)
    assert len(times) == 2
    book = sb.team_book(random.Random(2), 64, 0.25)
    q = book.get("team-00")
    assert q.per_kind and sum(book.get(t).nominal["gpu"] for t in book.teams) == 16
    assert sum(book.get(t).nominal["cpu"] for t in book.teams) == 48 and q.hard_limit == {"gpu": 8, "cpu": 24}
    subs = sb.submissions(rng, 64, load=0.8, gpu_fraction=0.25)
    assert {k for *_, k in subs} == {"gpu", "cpu"}
    for fifo in (True, False):
        day = sb.simulate(subs, 64, book, fifo=fifo, gpu_fraction=0.25)
        assert sum(len(w) for w in day["waits"].values()) == len(subs)
        u = day["utilisation_by_kind"]
        assert set(u) == {"gpu", "cpu"} and all(0.3 < x <= 1.0 for x in u.values()), u
        assert day["utilisation"] == pytest.approx((u["gpu"] * 16 + u["cpu"] * 48) / 64)
