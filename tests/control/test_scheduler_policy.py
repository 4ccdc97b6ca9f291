"""The scheduler's pure policy (services/control/scheduler/, issue 30 items 1 and 4): the quota
file and its one-line errors, admission table (nominal, borrowing, hard limits), reclaim
victims, the fair order, and fair share over a simulated window within 10 % of the weights."""

from __future__ import annotations

import random

import pytest

from services.control.scheduler import (
    DEFAULT_QUOTA,
    QuotaBook,
    QuotaFileError,
    Running,
    TeamQuota,
    Waiting,
    admit,
    fair_order,
    reclaim_victims,
    schedule,
)
from services.control.scheduler.fair_share import NO_ROOM, STARTED
from services.control.scheduler.quotas import DEFAULT_MAX_WAIT_MIN, parse_quota_text, quota_from_fields

pytestmark = pytest.mark.timeout(60)

BOOK = QuotaBook(
    {
        "vision": TeamQuota(nominal=4, borrow_limit=2, hard_limit=8, weight=2, cohort="research"),
        "nlp": TeamQuota(nominal=4, cohort="research"),
        "capped": TeamQuota(hard_limit=3),
        "solo": TeamQuota(nominal=2, cohort="alone"),
    }
)


@pytest.mark.parametrize(
    ("usage", "team", "slots", "kind", "borrowed"),
    [
        ({}, "vision", 4, "admitted", 0),  # within nominal
        ({"vision": 2}, "vision", 2, "admitted", 0),  # exactly nominal
        ({"vision": 4}, "vision", 2, "admitted", 2),  # borrows nlp's idle nominal
        ({"vision": 3}, "vision", 2, "admitted", 1),  # one own slot, one borrowed
        ({"vision": 4}, "vision", 3, "borrow_limit", 0),  # 3 beyond nominal > borrow limit 2
        ({"vision": 4, "nlp": 3}, "vision", 2, "cohort_full", 0),  # nlp uses its nominal
        ({"vision": 6}, "vision", 2, "borrow_limit", 0),
        ({}, "vision", 9, "beyond_hard_limit", 0),  # alone beyond the hard limit: refused at submit
        ({"nlp": 4}, "nlp", 4, "admitted", 4),  # nlp (no borrow limit) borrows vision's idle 4
        ({"nlp": 4}, "nlp", 5, "cohort_full", 0),
        ({}, "capped", 3, "admitted", 0),  # unlimited nominal, hard limit 3
        ({"capped": 1}, "capped", 3, "hard_limit", 0),  # idle cluster or not: never beyond 3
        ({}, "capped", 4, "beyond_hard_limit", 0),
        ({"solo": 2}, "solo", 1, "cohort_full", 0),  # a cohort of one has nothing to lend
        ({"whoever": 10_000}, "whoever", 512, "admitted", 0),  # no entry: the default, unlimited
        ({}, "vision", 6, "admitted", 2),  # nominal 4 + borrow limit 2: the most it may ever hold
        ({}, "vision", 7, "beyond_hard_limit", 0),  # beyond nominal + borrow limit: never, idle or not
        ({"nlp": 4}, "vision", 7, "beyond_hard_limit", 0),
        ({}, "nlp", 8, "admitted", 4),  # all of its cohort's nominal (vision's idle 4)
        ({}, "nlp", 9, "beyond_hard_limit", 0),  # beyond what cohort research owns: never
        ({}, "solo", 3, "beyond_hard_limit", 0),  # a cohort of one: never beyond its own nominal
    ],
)
def test_admission_by_nominal_borrowing_and_hard_limit(usage, team, slots, kind, borrowed):
    a = admit(BOOK, usage, team, slots)
    assert (a.kind, a.borrowed) == (kind, borrowed), a.reason
    assert bool(a.reason) == (kind != "admitted")


def test_a_job_beyond_what_its_team_may_ever_hold_is_told_the_field_and_the_bound():
    assert admit(BOOK, {}, "vision", 9).reason == "needs 9 slots; team vision may hold at most 8 (hard_limit)"
    assert admit(BOOK, {}, "vision", 7).reason == (
        "needs 7 slots; team vision may hold at most 6 (nominal 4 + borrow_limit 2)"
    )
    assert admit(BOOK, {}, "nlp", 9).reason == (
        "needs 9 slots; team nlp may hold at most 8 (cohort research's nominal: what its teams own together)"
    )
    per_kind = QuotaBook({"v": TeamQuota(nominal={"gpu": 2}, borrow_limit={"gpu": 1}, hard_limit={"cpu": 4})})
    assert admit(per_kind, {}, "v", 4, "gpu").reason == (
        "needs 4 gpu slots; team v may hold at most 3 (nominal.gpu 2 + borrow_limit.gpu 1)"
    )
    assert admit(per_kind, {}, "v", 5, "cpu").reason == "needs 5 cpu slots; team v may hold at most 4 (hard_limit.cpu)"
    # The default cohort takes in every team with no entry as it comes: no fixed bound there.
    assert admit(QuotaBook({"x": TeamQuota(nominal=1)}), {}, "x", 100).ok


def test_a_hard_limit_holds_on_an_idle_cluster_and_the_reason_says_so():
    started = []
    p = schedule(
        [Waiting("a", "capped", 2, seq=1), Waiting("b", "capped", 2, seq=2), Waiting("c", "nlp", 1, seq=3)],
        [],
        BOOK,
        capacity=100,
        try_start=lambda w, a: started.append(w.job_id) or STARTED,
    )
    assert sorted(started) == ["a", "c"] and sorted(s for s, _ in p.started) == ["a", "c"]
    assert p.waits["b"] == ("hard_limit", "team capped at its hard limit (2 of 3 slots held, this job needs 2)")


def test_the_quota_file_and_its_one_line_errors(tmp_path):
    book = parse_quota_text(
        "default: {weight: 0.5}\nteams:\n  vision: {nominal: 8, borrow_limit: 4, hard_limit: 16, weight: 2, cohort: research}\n"
    )
    assert book.get("vision").ceiling == 12 and book.get("other").weight == 0.5
    assert book.get("other").nominal is None and DEFAULT_QUOTA.ceiling == float("inf")
    bad = {
        "teams:\n  vision: {nominal: -1}\n": "q.yaml: teams.vision.nominal: must be 0-1000000, got -1",
        "teams:\n  vision: {nominal: 4, hard_limit: 2}\n": "q.yaml: teams.vision.hard_limit: must be >= nominal (4), got 2",
        "teams:\n  vision: {nominall: 4}\n": "q.yaml: teams.vision.nominall: unknown key",
        "teams:\n  Vision!: {nominal: 4}\n": "q.yaml: teams.team: must match",
        "teams: [1, 2\n": "q.yaml: line",
        "- 1\n": "q.yaml: expected a mapping",
        "teams:\n  vision: {weight: 0}\n": "q.yaml: teams.vision.weight: Input should be greater than 0, got 0",
    }
    for text, start in bad.items():
        with pytest.raises(QuotaFileError) as e:
            parse_quota_text(text, "q.yaml")
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(QuotaFileError, match="^surgectl team set: weight: Input should be a valid number"):
        quota_from_fields({"weight": "x"})


def test_reclaim_names_borrowed_jobs_lowest_priority_then_newest_first_and_nothing_if_not_enough():
    running = [
        Running("v-old", "vision", 1, priority=0, started=100, borrowed=1),
        Running("v-new", "vision", 1, priority=0, started=200, borrowed=1),
        Running("v-low", "vision", 2, priority=-5, started=50, borrowed=2),
        Running("v-own", "vision", 4, priority=-9, started=300, borrowed=0),  # on its own nominal
        Running("x", "solo", 1, priority=-9, started=300, borrowed=1),  # another cohort
    ]
    usage = {"vision": 8, "solo": 1}
    assert reclaim_victims(BOOK, usage, "nlp", 3, 0, running) == ["v-low", "v-new"]
    assert reclaim_victims(BOOK, usage, "nlp", 2, 0, running) == ["v-low"]
    assert reclaim_victims(BOOK, usage, "nlp", 3, 1, running) == ["v-low"]
    assert reclaim_victims(BOOK, usage, "nlp", 5, 0, running) == []  # beyond nlp's nominal 4
    assert reclaim_victims(BOOK, {**usage, "nlp": 2}, "nlp", 3, 0, running) == []  # 2+3 > 4
    assert reclaim_victims(BOOK, usage, "nlp", 2, 2, running) == []  # fits already
    assert reclaim_victims(BOOK, usage, "nlp", 4, 0, running[:2]) == []  # the borrowers free only 2


def test_the_fair_order_with_one_team_is_the_old_queue_order():
    jobs = [Waiting(i, "default", 1, p, s) for i, p, s in (("a", 0, 1), ("b", 5, 2), ("c", 0, 3), ("d", 5, 4))]
    jobs.append(Waiting("e", "default", 1, -1, 5, first=True))
    assert [w.job_id for w in fair_order(jobs, {}, QuotaBook(), 8)] == ["e", "b", "d", "a", "c"]


def test_the_fair_order_interleaves_teams_by_weighted_share():
    book = QuotaBook({"a": TeamQuota(weight=2), "b": TeamQuota(weight=1)})
    jobs = [Waiting(f"a{i}", "a", 1, seq=i) for i in range(8)] + [
        Waiting(f"b{i}", "b", 1, seq=10 + i) for i in range(6)
    ]
    order = [w.job_id for w in fair_order(jobs, {"a": 0, "b": 2}, book, 10)][:9]
    # b holds 2 of 10: its next job would make its share 0.3; a's k-th job makes a's 0.05 k,
    # so a goes six times (the sixth ties, and a's job is older), then they alternate 2:1
    assert order == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "a6", "a7"]


def test_a_job_whose_ranks_do_not_fit_holds_back_everyone_behind_it_but_one_beyond_the_cluster_none():
    free = [3]

    def try_start(w, a):
        if w.slots > 10:
            return "beyond_cluster"
        if w.slots > free[0]:
            return NO_ROOM
        free[0] -= w.slots
        return STARTED

    jobs = [Waiting("huge", "a", 11, seq=1), Waiting("big", "b", 4, seq=2), Waiting("small", "c", 1, seq=3)]
    # fair order: huge (share 11/10/10), big (4/10), small (c holds 5: 6/10)
    p = schedule(jobs, [Running("r", "c", 5)], QuotaBook({"a": TeamQuota(weight=10)}), 10, try_start)
    assert p.order == ["huge", "big", "small"]
    assert p.started == [] and p.waits["huge"][0] == "beyond_cluster" and p.waits["big"][0] == NO_ROOM
    assert p.waits["small"][0] == "fair_share" and "job big is next" in p.waits["small"][1]


def _window(book: QuotaBook) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Three always-backlogged teams (20 jobs queued each) on a 60-slot cluster, jobs of 1-4
    slots lasting 5-30 ticks of a minute, 3,000 ticks: each team's slot-ticks after a warm-up
    of 200, and its jobs' waits (minutes)."""
    rng = random.Random(30)
    capacity, seq = 60, 0
    waiting: list[Waiting] = []
    running: dict[str, tuple[Running, int]] = {}
    got = {t: 0 for t in book.teams}
    waits: dict[str, list[float]] = {t: [] for t in book.teams}
    durations = {}
    for tick in range(3000):
        now = tick * 60.0
        for t in book.teams:  # every team keeps 20 jobs queued
            while sum(1 for w in waiting if w.team == t) < 20:
                seq += 1
                waiting.append(Waiting(f"{t}-{seq}", t, rng.randint(1, 4), seq=seq, queued=now))
                durations[f"{t}-{seq}"] = rng.randint(5, 30)
        for job_id, (_, end) in list(running.items()):
            if end <= tick:
                del running[job_id]
        free = [capacity - sum(r.slots for r, _ in running.values())]

        def try_start(w, a, free=free):
            if w.slots > free[0]:
                return NO_ROOM
            free[0] -= w.slots
            return STARTED

        p = schedule(waiting, [r for r, _ in running.values()], book, capacity, try_start, now=now)
        started = {j for j, _ in p.started}
        for w in [w for w in waiting if w.job_id in started]:
            running[w.job_id] = (Running(w.job_id, w.team, w.slots), tick + durations[w.job_id])
            waits[w.team].append((now - w.queued) / 60)
        waiting = [w for w in waiting if w.job_id not in started]
        if tick >= 200:  # after the warm-up
            for r, _ in running.values():
                got[r.team] += r.slots
    return got, waits


def test_fair_share_over_a_window_is_within_ten_percent_of_the_weights():
    """Teams of weights 1, 2, 3 (``_window``) under the default starvation bound (120 min),
    which t1's jobs reach (without it they wait up to 141 min): the slot-ticks each team gets
    over the window, normalised, are within 10 % of its weight's share, and no job waited
    beyond the bound plus the longest job (the time its slots take to free up)."""
    weights = {"t1": 1.0, "t2": 2.0, "t3": 3.0}
    book = QuotaBook({t: TeamQuota(weight=w) for t, w in weights.items()})
    assert book.max_wait_s == DEFAULT_MAX_WAIT_MIN * 60
    got, waits = _window(book)
    total, wsum = sum(got.values()), sum(weights.values())
    for t, w in weights.items():
        assert abs(got[t] / total - w / wsum) <= 0.1 * w / wsum, (got, t)
    assert max(waits["t1"]) >= DEFAULT_MAX_WAIT_MIN  # (the bound was in play)
    assert max(x for v in waits.values() for x in v) <= DEFAULT_MAX_WAIT_MIN + 30, {t: max(v) for t, v in waits.items()}


def test_a_large_job_of_a_small_share_team_behind_a_stream_of_small_jobs_starts_within_the_bound():
    """Issue 30 item 4, session 29's gap 4: a 32-slot cluster kept full by three weight-4 teams'
    stream of 1-2 slot jobs (each keeps 10 queued, 5-30 ticks of a minute); team "lab" (weight
    1, nothing else queued, nothing running) submits one 32-slot job. Its share counting the job
    (32/32/1) is beyond every other team's next, so the fair order alone never tries it first
    and, without backfill, it never starts. With a bound of 60 min it goes ahead of the fair
    order once it has waited 60 min, holds back the others while slots drain, and starts
    within the bound plus the longest job."""

    def big_job_start(bound: float | None) -> float | None:
        rng = random.Random(4)
        teams = {"a": 4.0, "b": 4.0, "c": 4.0, "lab": 1.0}
        book = QuotaBook({t: TeamQuota(weight=w) for t, w in teams.items()}, max_wait_s=bound)
        waiting = [Waiting("big", "lab", 32, seq=0, queued=30 * 60.0)]
        running: dict[str, tuple[Running, int]] = {}
        seq = 0
        for tick in range(600):
            now = tick * 60.0
            for t in "abc":
                while sum(1 for w in waiting if w.team == t) < 10:
                    seq += 1
                    waiting.append(Waiting(f"{t}{seq}", t, rng.randint(1, 2), seq=seq, queued=now))
            running = {j: (r, end) for j, (r, end) in running.items() if end > tick}
            free = [32 - sum(r.slots for r, _ in running.values())]

            def try_start(w, a, free=free):
                if w.slots > free[0]:
                    return NO_ROOM
                free[0] -= w.slots
                return STARTED

            visible = [w for w in waiting if w.queued <= now]  # (big arrives at minute 30)
            p = schedule(visible, [r for r, _ in running.values()], book, 32, try_start, now=now)
            for job_id, _ in p.started:
                if job_id == "big":
                    return now
                w = next(w for w in waiting if w.job_id == job_id)
                running[job_id] = (Running(job_id, w.team, w.slots), tick + rng.randint(5, 30))
            started = {j for j, _ in p.started}
            waiting = [w for w in waiting if w.job_id not in started]
        return None

    assert big_job_start(None) is None  # the fair order alone: never, in 10 h
    start = big_job_start(60 * 60.0)
    assert start is not None and 30 * 60 + 60 * 60 <= start <= 30 * 60 + (60 + 30) * 60, start


def test_an_overdue_job_goes_ahead_of_the_fair_order_but_not_ahead_of_its_own_team_s_order():
    book = QuotaBook({"big": TeamQuota(weight=4), "small": TeamQuota(weight=1)}, max_wait_s=3600.0)
    jobs = [
        Waiting("s-old", "small", 8, seq=1, queued=0.0),
        Waiting("s-new", "small", 1, seq=5, queued=3000.0),
        Waiting("b1", "big", 1, seq=2, queued=100.0),
        Waiting("b2", "big", 1, seq=3, queued=200.0),
        Waiting("first", "big", 1, seq=9, first=True, queued=3500.0),
    ]

    def order(now, usage, book=book, jobs=jobs):
        return [w.job_id for w in fair_order(jobs, usage, book, 10, now)]

    # small holds 1 of 10 slots: weighted share 0.1, below its entitlement 1 / (4 + 1) = 0.2.
    # Below the bound: the fair order (small with s-old would hold 9/10/1; big 1/10/4 ...)
    assert order(3599.0, {"small": 1}) == ["first", "b1", "b2", "s-old", "s-new"]
    assert order(None, {"small": 1}) == order(3599.0, {"small": 1})
    # s-old has waited 3,600 s: ahead of the fair order (behind the drained job's resume only);
    # its slots count as its team's, so s-new stays behind big's jobs
    assert order(3600.0, {"small": 1}) == ["first", "s-old", "b1", "b2", "s-new"]
    # b1 overdue too (big holds nothing): the overdue jobs by priority, then submission order
    assert order(3700.0, {"small": 1}) == ["first", "s-old", "b1", "b2", "s-new"]
    # a team at or above its entitlement (small holds 2 of 10: 0.2) gets no promotion: its
    # jobs wait in the fair order, however long (the bound is for teams below their share)
    assert order(1e9, {"small": 2}) == ["first", "b1", "b2", "s-old", "s-new"]
    unbounded = QuotaBook(book.teams, max_wait_s=None)
    assert [w.job_id for w in fair_order(jobs, {"small": 1}, unbounded, 10, 1e9)] == order(None, {"small": 1})
    # within a team the order stays priority, then age: an old low-priority job does not pass
    # its team's newer high-priority head (with one team: the queue's order, overdue or not)
    one = [Waiting("old", "default", 1, 0, 1, queued=0.0), Waiting("urgent", "default", 1, 5, 2, queued=9e3)]
    assert [w.job_id for w in fair_order(one, {}, QuotaBook(), 8, 1e4)] == ["urgent", "old"]


def test_an_overdue_gpu_job_that_does_not_fit_holds_back_gpu_and_any_jobs_only():
    free = {"gpu": 2, "cpu": 4}

    def try_start(w, a):
        kind = "cpu" if w.kind == "any" else w.kind
        if w.slots > free[kind]:
            return NO_ROOM
        free[kind] -= w.slots
        return STARTED

    book = QuotaBook({"lab": TeamQuota(), "a": TeamQuota(weight=4)}, max_wait_s=60.0)
    jobs = [
        Waiting("big-gpu", "lab", 4, seq=1, kind="gpu", queued=0.0),
        Waiting("a-gpu", "a", 1, seq=2, kind="gpu", queued=50.0),
        Waiting("a-cpu", "a", 1, seq=3, kind="cpu", queued=50.0),
        Waiting("a-any", "a", 1, seq=4, queued=50.0),
    ]
    caps = {"gpu": 4, "cpu": 8}
    p = schedule(jobs, [Running("r", "a", 2, kind="gpu")], book, caps, try_start, now=60.0)
    assert p.order[0] == "big-gpu" and p.waits["big-gpu"][0] == NO_ROOM
    assert [j for j, _ in p.started] == ["a-cpu"]
    assert p.waits["a-gpu"][0] == "fair_share" and p.waits["a-any"][0] == "fair_share"


def test_the_starvation_bound_in_the_quota_file():
    assert parse_quota_text("teams: {}").max_wait_s == DEFAULT_MAX_WAIT_MIN * 60
    book = parse_quota_text("max_wait_minutes: 30\nteams: {a: {weight: 2}}")
    assert book.max_wait_s == 1800.0
    assert book.with_team("b", TeamQuota()).max_wait_s == 1800.0 and book.without("a").max_wait_s == 1800.0
    assert book != parse_quota_text("teams: {a: {weight: 2}}")
    assert parse_quota_text("max_wait_minutes: null").max_wait_s is None
    for text, error in [
        ("max_wait_minutes: 0", "quotas.yaml: max_wait_minutes: Input should be greater than 0, got 0"),
        ("max_wait_minutes: soon", "quotas.yaml: max_wait_minutes: Input should be a valid number, got 'soon'"),
    ]:
        with pytest.raises(QuotaFileError) as e:
            parse_quota_text(text)
        assert str(e.value) == error


def test_a_job_waiting_for_its_cohort_s_idle_slots_holds_back_its_cohort_but_not_another():
    book = QuotaBook(
        {
            "x": TeamQuota(nominal=2, weight=10, cohort="c"),
            "y": TeamQuota(nominal=2, cohort="c"),
            "z": TeamQuota(nominal=2, cohort="other"),
        }
    )
    running = [Running("rx", "x", 3, borrowed=1), Running("ry", "y", 2)]  # the cohort: no idle nominal slot
    jobs = [Waiting("xb", "x", 2, seq=1), Waiting("y1", "y", 1, seq=2), Waiting("z1", "z", 1, seq=3)]
    p = schedule(jobs, running, book, 10, lambda w, a: STARTED)
    assert p.order[0] == "xb" and p.started == [("z1", 0)]
    assert p.waits["xb"][0] == "cohort_full"
    # (y1 would borrow: y holds its nominal. One within its team's nominal goes past xb's wait:
    # test_preemption_claims.py, backfill within nominal.)
    assert p.waits["y1"] == ("cohort", "waits behind job xb, first in line for cohort c's idle slots")


def test_the_dominant_share_is_the_largest_over_the_kinds_and_all_slots():
    book = QuotaBook({"a": TeamQuota(), "b": TeamQuota()})
    jobs = [Waiting("a1", "a", 1, seq=1, kind="cpu"), Waiting("b1", "b", 1, seq=2, kind="cpu")]
    usage = {"a": {"gpu": 2}, "b": {"cpu": 6}}
    # a holds 2 of 4 GPUs (share 0.5); b 6 of 16 CPU slots (with b1: 7/16 = 0.44): b goes first
    assert [w.job_id for w in fair_order(jobs, usage, book, {"gpu": 4, "cpu": 16})] == ["b1", "a1"]
    # with no kinds known (an int capacity: the slot share), a's 3 of 20 goes before b's 7
    assert [w.job_id for w in fair_order(jobs, usage, book, 20)] == ["a1", "b1"]


def test_a_gpu_job_whose_ranks_do_not_fit_holds_back_the_gpu_and_any_jobs_only():
    free = {"gpu": 1, "cpu": 4}

    def try_start(w, a):
        kind = "cpu" if w.kind == "any" else w.kind
        if w.slots > free[kind]:
            return NO_ROOM
        free[kind] -= w.slots
        return STARTED

    jobs = [
        Waiting("g", "a", 2, priority=3, kind="gpu"),
        Waiting("c", "a", 1, priority=2, kind="cpu"),  # free CPU slots: not held back by g
        Waiting("g2", "a", 1, priority=1, kind="gpu"),  # fits the free GPU, but g is first in line
        Waiting("x", "a", 1, priority=0, kind="any"),
    ]
    p = schedule(jobs, [], QuotaBook(), {"gpu": 2, "cpu": 4}, try_start)
    assert p.started == [("c", 0)]
    assert [p.waits[j][0] for j in ("g", "g2", "x")] == [NO_ROOM, "team", "team"]


@pytest.mark.parametrize(
    ("usage", "team", "slots", "kind", "answer", "borrowed"),
    [
        ({}, "robotics", 4, "gpu", "admitted", 0),  # within its gpu nominal
        ({"robotics": {"gpu": 4}}, "robotics", 2, "gpu", "admitted", 2),  # borrows lab's idle gpu nominal
        ({"robotics": {"gpu": 4}, "lab": {"gpu": 1}}, "robotics", 2, "gpu", "cohort_full", 0),  # lab lends 1 only
        ({"robotics": {"gpu": 6}}, "robotics", 1, "gpu", "hard_limit", 0),  # gpu hard limit 6, GPUs idle or not
        ({"robotics": {"gpu": 6}}, "robotics", 8, "cpu", "admitted", 0),  # cpu: its own nominal 8
        ({"robotics": {"cpu": 8}}, "robotics", 1, "cpu", "borrow_limit", 0),  # cpu borrow limit 0
        ({}, "robotics", 7, "gpu", "beyond_hard_limit", 0),
        ({}, "robotics", 1, "any", "beyond_hard_limit", 0),  # per-kind quota: a job must name its kind
        ({"lab": {"cpu": 3}}, "lab", 2, "cpu", "admitted", 2),  # lab owns no cpu: borrows robotics' idle
        ({"lab": {"cpu": 3}, "robotics": {"cpu": 4}}, "lab", 1, "cpu", "admitted", 1),
        ({"lab": {"cpu": 3}, "robotics": {"cpu": 4}}, "lab", 2, "cpu", "cohort_full", 0),  # 1 idle cpu left
        ({"lab": {"gpu": 2}, "robotics": {"cpu": 8}}, "lab", 1, "gpu", "admitted", 1),  # robotics' idle gpu
    ],
)
def test_admission_per_device_kind(usage, team, slots, kind, answer, borrowed):
    book = QuotaBook(
        {
            "robotics": TeamQuota(
                nominal={"gpu": 4, "cpu": 8}, borrow_limit={"cpu": 0}, hard_limit={"gpu": 6}, cohort="lab"
            ),
            "lab": TeamQuota(nominal={"gpu": 2}, cohort="lab"),
        }
    )
    a = admit(book, usage, team, slots, kind)
    assert (a.kind, a.borrowed) == (answer, borrowed), a.reason


def test_the_quota_deficit_is_the_fewest_slots_the_team_must_free():
    from services.control.scheduler.admission import quota_deficit

    book = QuotaBook({"lab": TeamQuota(nominal=4, borrow_limit=0, cohort="lab")})
    assert quota_deficit(book, {"lab": {"any": 4}}, "lab", 2) == 2  # (nominal used up, nothing to borrow)
    assert quota_deficit(book, {"lab": {"any": 1}}, "lab", 2) == 0  # (admitted now)
    assert quota_deficit(book, {"lab": {"any": 1}}, "lab", 6) is None  # (beyond what freeing its 1 slot gives)
    hard = QuotaBook({"lab": TeamQuota(hard_limit=3)})
    assert quota_deficit(hard, {"lab": {"cpu": 2}}, "lab", 2, "cpu") == 1
    assert quota_deficit(hard, {}, "lab", 4) is None  # (beyond its hard limit alone)
    per_kind = QuotaBook({"lab": TeamQuota(nominal={"gpu": 2, "cpu": 4}, borrow_limit={"gpu": 0, "cpu": 0})})
    assert quota_deficit(per_kind, {"lab": {"gpu": 2, "cpu": 4}}, "lab", 1, "gpu") == 1


def test_borrowed_slots_per_job_follow_the_team_s_order_and_sum_to_the_team_s():
    from services.control.scheduler.admission import borrowed_by_job

    q = TeamQuota(nominal=4)
    jobs = [("a", {"any": 3}), ("b", {"any": 3}), ("c", {"cpu": 2})]
    assert borrowed_by_job(q, jobs) == {"a": 0, "b": 2, "c": 2}
    assert borrowed_by_job(q, jobs[1:]) == {"b": 0, "c": 1}  # (a ended: b within the nominal)
    per_kind = TeamQuota(nominal={"gpu": 2, "cpu": 1})
    assert borrowed_by_job(per_kind, [("g", {"gpu": 3}), ("c", {"cpu": 2})]) == {"g": 1, "c": 1}
    assert borrowed_by_job(TeamQuota(), jobs) == {"a": 0, "b": 0, "c": 0}  # (no nominal: nothing borrowed)
