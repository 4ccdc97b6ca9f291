"""The scheduler bench (issue 30 item 7, `make bench-scheduler`): the pure policy of
services/control/scheduler/ on a simulated cluster, no processes.

1. Decision time: 1,000 queued jobs across 50 teams (weights 1-4, nominal quotas in
   proportion summing to the cluster, one cohort, borrowing unlimited, hard limit half the
   cluster) and a cluster of ``--slots`` slots 90 % held by
   running jobs: one scheduling pass (``schedule``: the fair order, admission of each job,
   the fit check) timed ``--decisions`` times over random queue states. Goal: p99 <= 100 ms.
2. A simulated day (discrete events: arrivals and ends; a pass after each): Poisson arrivals
   at a rate that offers ``--load`` x the cluster's slot-seconds; the submitting team drawn
   by a Zipf law (s = 1.1: a few teams submit most jobs, as on shared clusters); sizes 1, 2,
   4, 8, 16, 32 slots with probabilities .35 .25 .18 .12 .07 .03; durations log-normal,
   median 20 min, sigma 1.2, at most 8 h. The same submissions run under plain FIFO (every
   job in one queue, strict head-of-line, as Surge's queue before issue 30) and under fair
   share with quotas. Utilisation: slot-seconds held over the day / the cluster's; waits: p50
   and p99 per team (submit to start), jobs still waiting at the end counted as waiting
   until the end.

Two device kinds (quotas per kind, issue 30 item 1): ``--gpu-fraction`` of the ``--slots``
are GPU slots, the rest CPU slots (0: one kind, every job ``any``, as the bench before kinds).
Each job is a gpu job with that probability (each kind offered the same load), else a cpu
job; each team's nominal is per kind (its weight's share of each kind's slots), its hard limit
half of each kind. FIFO keeps the kinds (one queue, head-of-line per kind: a job waiting for
GPUs does not hold CPU slots idle, as the allocator now places by kind). The day reports the
utilisation of each kind.

The starvation bound (fair_share.py): ``--max-wait`` minutes (default the book's, 120; 0: none,
the fair order alone as before session 30). The day reports, beside every team's p99, the worst
p99 and the longest wait of the busy teams asking no more than their weighted share (what a
bound promises; a team asking beyond it waits in the fair order). The decision's queued jobs
have waited 30 min on average (exponential), so some are past the bound.

Flags: --slots, --gpu-fraction, --decisions, --load, --seed, --max-wait. Results in
bench/results/scheduler.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script: the repo's services)

from services.control.scheduler import QuotaBook, Running, TeamQuota, Waiting, schedule  # noqa: E402
from services.control.scheduler.fair_share import NO_ROOM, STARTED  # noqa: E402
from services.control.scheduler.quotas import DEFAULT_MAX_WAIT_MIN  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES, SIZE_P = (1, 2, 4, 8, 16, 32), (0.35, 0.25, 0.18, 0.12, 0.07, 0.03)
DAY_S = 86_400.0
TEAMS = 50


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def kinds_of(slots: int, gpu_fraction: float) -> dict[str, int]:
    """The cluster's slots per kind ({} for one kind: ``gpu_fraction`` 0)."""
    gpu = round(slots * gpu_fraction)
    return {"gpu": gpu, "cpu": slots - gpu} if gpu else {}


def _shares(slots: int, weights: dict[str, float]) -> dict[str, int]:
    """``slots`` divided in proportion to ``weights`` by largest remainders (they sum to it:
    a cohort lends only nominal slots)."""
    total = sum(weights.values())
    exact = {t: slots * w / total for t, w in weights.items()}
    nominal = {t: int(x) for t, x in exact.items()}
    for t in sorted(exact, key=lambda t: nominal[t] - exact[t])[: slots - sum(nominal.values())]:
        nominal[t] += 1
    return nominal


def team_book(
    rng: random.Random, slots: int, gpu_fraction: float = 0.0, max_wait_s: float | None = DEFAULT_MAX_WAIT_MIN * 60
) -> QuotaBook:
    """50 teams, weights 1-4, nominal in proportion to weight (summing to about the cluster,
    per kind with two kinds), one cohort, borrowing unlimited, a hard limit of half the cluster
    (of each kind); the starvation bound ``max_wait_s`` (None: none)."""
    weights = {f"team-{i:02d}": float(rng.randint(1, 4)) for i in range(TEAMS)}
    kinds = kinds_of(slots, gpu_fraction)
    if not kinds:
        nominal = _shares(slots, weights)
        return QuotaBook(
            {
                t: TeamQuota(nominal=nominal[t], hard_limit=slots // 2, weight=w, cohort="all")
                for t, w in weights.items()
            },
            max_wait_s=max_wait_s,
        )
    per_kind = {k: _shares(n, weights) for k, n in kinds.items()}
    return QuotaBook(
        {
            t: TeamQuota(
                nominal={k: per_kind[k][t] for k in kinds},
                hard_limit={k: max(1, n // 2) for k, n in kinds.items()},
                weight=w,
                cohort="all",
            )
            for t, w in weights.items()
        },
        max_wait_s=max_wait_s,
    )


def _try_start(free: dict[str, int], capacity: dict[str, int]):
    """A pass's ``try_start`` over ``free`` slots per kind ("any": one kind)."""

    def try_start(w, a):
        kind = w.kind if w.kind in free else "any"
        if w.slots > capacity[kind]:
            return "beyond_cluster"
        if w.slots > free[kind]:
            return NO_ROOM
        free[kind] -= w.slots
        return STARTED

    return try_start


def decision_times(
    rng: random.Random,
    slots: int,
    decisions: int,
    gpu_fraction: float = 0.0,
    max_wait_s: float | None = DEFAULT_MAX_WAIT_MIN * 60,
) -> tuple[list[float], list[float]]:
    """Seconds per scheduling pass over 1,000 queued jobs (module docstring, part 1): wall
    clock, and this thread's CPU time (what the pass costs, whatever else the machine runs:
    on a shared 2-core machine the wall clock measured mostly the wait for a core)."""
    book = team_book(rng, slots, gpu_fraction, max_wait_s)
    teams = list(book.teams)
    ages = random.Random(len(teams))  # (its own draws: the day's submissions stay those of before the bound)
    capacity = kinds_of(slots, gpu_fraction) or {"any": slots}
    times, cpu = [], []
    for _ in range(decisions):
        waiting = [
            Waiting(
                f"w{i}",
                rng.choice(teams),
                rng.choices(SIZES, SIZE_P)[0],
                rng.randint(-2, 2),
                i,
                kind=_kind(rng, gpu_fraction),
                queued=-ages.expovariate(1 / 1800),  # (waited 30 min on average: some past the bound)
            )
            for i in range(1000)
        ]
        running, free = [], {}
        for kind, n in capacity.items():
            held = 0
            while held < 0.9 * n:
                size = rng.choices(SIZES, SIZE_P)[0]
                running.append(Running(f"r{len(running)}", rng.choice(teams), size, 0, 0.0, 0, kind))
                held += size
            free[kind] = n - held
        try_start = _try_start(free, capacity)
        t0, c0 = time.perf_counter(), time.thread_time()
        schedule(waiting, running, book, capacity if gpu_fraction else slots, try_start, now=0.0)
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
    return times, cpu


def _kind(rng: random.Random, gpu_fraction: float) -> str:
    """A job's device kind: gpu with probability ``gpu_fraction`` (no draw at 0: any)."""
    if not gpu_fraction:
        return "any"
    return "gpu" if rng.random() < gpu_fraction else "cpu"


def submissions(
    rng: random.Random, slots: int, load: float, gpu_fraction: float = 0.0
) -> list[tuple[float, str, int, float, str]]:
    """A day of (time, team, slots, duration s, device kind), sorted by time (module
    docstring, part 2)."""
    mean_size = sum(s * p for s, p in zip(SIZES, SIZE_P, strict=True))
    mu, sigma = math.log(20 * 60), 1.2
    mean_duration = min(math.exp(mu + sigma**2 / 2), 8 * 3600)
    rate = load * slots / (mean_size * mean_duration)  # jobs per second
    zipf = [1 / (i + 1) ** 1.1 for i in range(TEAMS)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= DAY_S:
            return out
        team = f"team-{rng.choices(range(TEAMS), zipf)[0]:02d}"
        size = rng.choices(SIZES, SIZE_P)[0]
        duration = min(rng.lognormvariate(mu, sigma), 8 * 3600.0)
        out.append((t, team, size, duration, _kind(rng, gpu_fraction)))


def simulate(
    subs: list[tuple[float, str, int, float, str]],
    slots: int,
    book: QuotaBook,
    fifo: bool,
    gpu_fraction: float = 0.0,
) -> dict:
    """Run a day's submissions through passes of ``schedule``; FIFO: every job in one team
    with no quota. Returns utilisation (all slots, and per kind with two), waits per team and
    the number of passes."""
    events: list[tuple[float, int, str, int]] = []  # (time, kind 0=end 1=arrival, job id, index)
    for i, (t, *_) in enumerate(subs):
        events.append((t, 1, f"j{i}", i))
    heapq.heapify(events)
    waiting: dict[str, Waiting] = {}
    running: dict[str, Running] = {}
    started_at: dict[str, float] = {}
    capacity = kinds_of(slots, gpu_fraction) or {"any": slots}
    free = dict(capacity)
    used_slot_s = dict.fromkeys(capacity, 0.0)
    last_t, passes = 0.0, 0
    fifo_book = QuotaBook(max_wait_s=None)
    while events:
        t = events[0][0]
        for kind, n in capacity.items():
            used_slot_s[kind] += (n - free[kind]) * (min(t, DAY_S) - min(last_t, DAY_S))
        last_t = t
        while events and events[0][0] == t:
            _, event, job_id, i = heapq.heappop(events)
            if event == 0:
                r = running.pop(job_id)
                free[r.kind if r.kind in free else "any"] += r.slots
            else:
                _, team, size, _, kind = subs[i]
                waiting[job_id] = Waiting(job_id, "fifo" if fifo else team, size, 0, i, kind=kind, queued=t)
        room = dict(free)
        p = schedule(
            waiting.values(),
            running.values(),
            fifo_book if fifo else book,
            capacity if gpu_fraction else slots,
            _try_start(room, capacity),
            now=t,
        )
        passes += 1
        for job_id, borrowed in p.started:
            w = waiting.pop(job_id)
            i = int(job_id[1:])
            running[job_id] = Running(job_id, w.team, w.slots, 0, t, borrowed, w.kind)
            started_at[job_id] = t
            free[w.kind if w.kind in free else "any"] -= w.slots
            heapq.heappush(events, (t + subs[i][3], 0, job_id, i))
    waits: dict[str, list[float]] = {}
    for i, (t, team, *_) in enumerate(subs):
        start = started_at.get(f"j{i}", DAY_S)
        waits.setdefault(team, []).append(max(0.0, min(start, DAY_S) - t))
    return {
        "utilisation": sum(used_slot_s.values()) / (slots * DAY_S),
        "utilisation_by_kind": {k: used_slot_s[k] / (n * DAY_S) for k, n in capacity.items() if k != "any"},
        "never_started": sum(1 for i in range(len(subs)) if f"j{i}" not in started_at),
        "passes": passes,
        "waits": waits,
    }


def offered(subs: list[tuple[float, str, int, float, str]], book: QuotaBook, slots: int) -> dict:
    """Per team: the share of the day's cluster slot-time its submissions ask for (each job's
    slots x its duration, cut at the day's end) and its share of the weights. A team that asks
    for many times its weighted share waits under fair share whenever teams below theirs have
    work: that, not a fault of the order, is the worst team's p99 (docs/LOG.md session 29)."""
    asked: dict[str, float] = {}
    for t, team, size, duration, _ in subs:
        asked[team] = asked.get(team, 0.0) + size * min(duration, DAY_S - t)
    weights = sum(q.weight for q in book.teams.values())
    return {
        team: {
            "offered_share": round(a / (slots * DAY_S), 4),
            "weight_share": round(book.get(team).weight / weights, 4),
        }
        for team, a in sorted(asked.items())
    }


def summary(result: dict) -> dict:
    """Per-team p50/p99 waits (minutes) and their spread across teams."""
    per_team = {
        t: {"jobs": len(w), "p50_min": pct(w, 50) / 60, "p99_min": pct(w, 99) / 60}
        for t, w in sorted(result["waits"].items())
    }
    everyone = [x for w in result["waits"].values() for x in w]
    busy = [t for t, v in per_team.items() if v["jobs"] >= 20]  # teams with enough jobs for a p99
    return {
        "utilisation": round(result["utilisation"], 4),
        "utilisation_by_kind": {k: round(u, 4) for k, u in result.get("utilisation_by_kind", {}).items()},
        "never_started": result["never_started"],
        "passes": result["passes"],
        "wait_p50_min_all": round(pct(everyone, 50) / 60, 2),
        "wait_p99_min_all": round(pct(everyone, 99) / 60, 2),
        "team_p50_min_median": round(statistics.median(per_team[t]["p50_min"] for t in busy), 2),
        "team_p50_min_worst": round(max(per_team[t]["p50_min"] for t in busy), 2),
        "team_p99_min_median": round(statistics.median(per_team[t]["p99_min"] for t in busy), 2),
        "team_p99_min_worst": round(max(per_team[t]["p99_min"] for t in busy), 2),
        "small_teams_p50_min_median": round(
            statistics.median(v["p50_min"] for t, v in per_team.items() if t not in busy and v["jobs"]), 2
        ),
        "per_team": {t: {k: round(x, 2) for k, x in v.items()} for t, v in per_team.items()},
        "waits_min": {t: [x / 60 for x in w] for t, w in result["waits"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=512, help="the simulated cluster's slots")
    ap.add_argument(
        "--gpu-fraction", type=float, default=0.25, help="of the slots, GPU slots (the rest CPU; 0: one kind)"
    )
    ap.add_argument("--decisions", type=int, default=200, help="scheduling passes timed")
    ap.add_argument("--load", type=float, default=0.95, help="offered slot-seconds / the cluster's")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument(
        "--max-wait",
        type=float,
        default=DEFAULT_MAX_WAIT_MIN,
        help="fair share's starvation bound in minutes (0: none, the fair order alone)",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    if not 0 <= args.gpu_fraction < 1:
        ap.error(f"--gpu-fraction: must be in [0, 1), got {args.gpu_fraction}")
    g = args.gpu_fraction
    if args.max_wait < 0:
        ap.error(f"--max-wait: must be >= 0 minutes, got {args.max_wait}")
    bound = args.max_wait * 60 or None
    times, cpu = decision_times(rng, args.slots, args.decisions, g, bound)
    book = team_book(random.Random(args.seed), args.slots, g, bound)
    subs = submissions(rng, args.slots, args.load, g)
    t0 = time.perf_counter()
    fifo = summary(simulate(subs, args.slots, book, fifo=True, gpu_fraction=g))
    fair = summary(simulate(subs, args.slots, book, fifo=False, gpu_fraction=g))
    out = {
        "args": vars(args),
        "decision_ms": {
            "queued": 1000,
            "teams": TEAMS,
            "slots_by_kind": kinds_of(args.slots, g),
            "p50": round(pct(times, 50) * 1e3, 2),
            "p99": round(pct(times, 99) * 1e3, 2),
            "max": round(max(times) * 1e3, 2),
            "cpu_p50": round(pct(cpu, 50) * 1e3, 2),
            "cpu_p99": round(pct(cpu, 99) * 1e3, 2),
            "load_average_1m": round(os.getloadavg()[0], 1),
        },
        "day": {
            "jobs": len(subs),
            "sim_wall_s": round(time.perf_counter() - t0, 1),
            "fifo": fifo,
            "fair_share": fair,
            "teams": offered(subs, book, args.slots),
        },
    }
    for result in (fifo, fair):  # the starvation measure: teams asking no more than their weighted share
        within = [
            t
            for t, v in result["per_team"].items()
            if v["jobs"] >= 20 and out["day"]["teams"][t]["offered_share"] <= out["day"]["teams"][t]["weight_share"]
        ]
        result["within_share_teams"] = len(within)
        result["within_share_team_p99_min_worst"] = max(result["per_team"][t]["p99_min"] for t in within)
        result["within_share_wait_min_max"] = round(max(max(result["waits_min"][t]) for t in within), 2)
        del result["waits_min"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scheduler.json").write_text(json.dumps(out, indent=1) + "\n")
    d = out["decision_ms"]
    kinds = ", ".join(f"{n} {k}" for k, n in kinds_of(args.slots, g).items()) or "one kind"
    print(
        f"one decision, 1,000 queued jobs, 50 teams, {args.slots} slots ({kinds}): p50 {d['p50']} ms, "
        f"p99 {d['p99']} ms "
        f"(CPU p50 {d['cpu_p50']} ms, p99 {d['cpu_p99']} ms; load average {d['load_average_1m']})"
    )
    print(f"\na simulated day: {len(subs)} jobs, load {args.load}, {args.slots} slots\n")
    rows = [
        ("utilisation", "utilisation"),
        ("jobs never started", "never_started"),
        ("wait p50, all jobs (min)", "wait_p50_min_all"),
        ("wait p99, all jobs (min)", "wait_p99_min_all"),
        ("per-team p50 wait, median over teams (min)", "team_p50_min_median"),
        ("per-team p50 wait, worst team (min)", "team_p50_min_worst"),
        ("per-team p99 wait, median over teams (min)", "team_p99_min_median"),
        ("per-team p99 wait, worst team (min)", "team_p99_min_worst"),
        ("per-team p99 wait, worst team asking <= its weighted share (min)", "within_share_team_p99_min_worst"),
        ("longest wait of a job of such a team (min)", "within_share_wait_min_max"),
        ("p50 wait of the small teams (< 20 jobs), median (min)", "small_teams_p50_min_median"),
    ]
    print("| | FIFO | fair share + quotas |\n|---|---|---|")
    for label, key in rows:
        print(f"| {label} | {fifo[key]} | {fair[key]} |")
    for kind in fair["utilisation_by_kind"]:
        print(f"| utilisation, {kind} | {fifo['utilisation_by_kind'][kind]} | {fair['utilisation_by_kind'][kind]} |")
    busy = [t for t, v in fair["per_team"].items() if v["jobs"] >= 20]
    worst = max(busy, key=lambda t: fair["per_team"][t]["p99_min"])
    o = out["day"]["teams"][worst]
    print(
        f"\nfair share's worst p99: {worst} ({fair['per_team'][worst]['jobs']} jobs) asks for "
        f"{o['offered_share']:.1%} of the day's slot-time with {o['weight_share']:.2%} of the weights "
        f"({o['offered_share'] / o['weight_share']:.1f}x its weighted share)"
    )


if __name__ == "__main__":
    main()
