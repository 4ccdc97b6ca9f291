"""The slow-rank detector as a table (services/control/slow_ranks.py): beats of simulated
ranks, each beat a number of steps at a compute time per step, with seeded noise."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from services.control.slow_ranks import Finding, SlowRanks, SlowRankSettings

STEP_S = 0.10  # a healthy rank's compute per step (forward, backward, optimizer: 30/60/10 %)
SPLIT = (0.3, 0.6, 0.1)


@dataclass
class _Sim:
    """Ranks beating once per interval of ``beat_s`` seconds (3 s: one sample each),
    ``steps`` steps per interval, in lockstep (data parallel: every rank completes the same
    steps)."""

    world: int
    seed: int = 0
    beat_s: float = 3.0
    step: int = 0
    totals: dict[int, list[float]] = field(default_factory=dict)
    events: list[tuple[int, Finding]] = field(default_factory=list)  # (interval, finding)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.det = SlowRanks()
        self.totals = {r: [0.0, 0.0, 0.0] for r in range(self.world)}
        self.interval = 0

    def run(self, intervals: int, *, slow: dict[int, float] | None = None, jitter: float = 0.0,
            spike: dict[tuple[int, int], float] | None = None, steps: int = 3) -> None:  # fmt: skip
        """``slow``: rank -> factor on its compute; ``jitter``: each rank's per-interval
        factor drawn from 1 +- jitter; ``spike``: (interval, rank) -> seconds added once."""
        for _ in range(intervals):
            self.step += steps
            for r in range(self.world):
                factor = (slow or {}).get(r, 1.0) * (1 + self.rng.uniform(-jitter, jitter))
                extra = (spike or {}).get((self.interval, r), 0.0)
                for i, share in enumerate(SPLIT):
                    self.totals[r][i] += steps * STEP_S * factor * share + (extra if i == 1 else 0.0)
                found = self.det.observe(r, self.step, tuple(self.totals[r]), self.interval * self.beat_s)
                if found is not None:
                    self.events.append((self.interval, found))
            self.interval += 1

    def named(self) -> list[tuple[int, int]]:
        """(interval, rank) of each rank named slow."""
        return [(i, f.rank) for i, f in self.events if f.slow]


@pytest.mark.parametrize(
    "world, jitter, seed",
    [(2, 0.3, s) for s in range(20)]
    + [(4, 0.3, s) for s in range(10)]
    + [(8, 0.3, s) for s in range(5)]
    + [(64, 0.3, s) for s in range(2)],  # (64: above EXACT_PEERS, the stage's reference once per round)
)
def test_jitter_of_30_percent_names_no_rank(world, jitter, seed):
    sim = _Sim(world, seed=seed)
    sim.run(300, jitter=jitter)  # 300 intervals of 3 steps: 900 steps
    assert sim.named() == []


def test_one_off_spikes_gc_pause_and_checkpoint_step_name_no_rank():
    sim = _Sim(4, seed=1)
    # A GC pause of 2 s (20 steps' compute) in one interval; a slow checkpoint step's
    # interval on every rank; a warm-up whose first intervals are 10x slower.
    spikes = {(40, 1): 2.0, (41, 2): 0.5, **{(80, r): 1.0 for r in range(4)}, (0, 3): 3.0, (1, 3): 3.0}
    sim.run(120, jitter=0.2, spike=spikes)
    assert sim.named() == []


def test_warm_up_slower_on_one_rank_names_nothing():
    sim = _Sim(2, seed=2)
    sim.run(2, slow={1: 10.0})  # the first steps: allocation, caches
    sim.run(100, jitter=0.1)
    assert sim.named() == []


@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_a_rank_2x_slower_is_named_within_the_window(world):
    sim = _Sim(world, seed=3)
    sim.run(20, jitter=0.3)
    sim.run(30, slow={1: 2.0}, jitter=0.3)
    named = sim.named()
    assert [r for _, r in named] == [1]
    window = SlowRankSettings().window
    assert 20 <= named[0][0] < 20 + window  # within the window of intervals after it began
    finding = sim.events[0][1]  # (named once a majority of its window is slow: medians over both)
    assert 1.5 <= finding.ratio < 2.6
    assert finding.peers == world - 1
    assert SlowRanks.EXACT_PEERS < 63  # (so that 64 ranks take the large-stage path)
    assert 1.3 < finding.history < 2.6  # compared with its own earlier pace too
    assert all(1.3 < p < 2.6 for p in finding.phases)  # every phase grew
    assert "rank 1 computes" in finding.text(window)
    assert sim.det.slow() == [1]
    assert 1.6 < sim.det.ratios()[1] < 2.5 and sim.det.ratios()[0] < 1.3


def test_a_rank_slow_from_the_start_is_named():
    sim = _Sim(2, seed=4)
    sim.run(15, slow={0: 2.0}, jitter=0.1)
    assert [r for _, r in sim.named()] == [0]


@pytest.mark.parametrize("seed", range(10))
def test_a_rank_1_4x_slower_is_not_named(seed):
    sim = _Sim(4, seed=seed)
    sim.run(10)
    sim.run(200, slow={2: 1.4}, jitter=0.05)
    assert sim.named() == []


def test_a_recovered_rank_is_cleared_and_named_again_when_it_slows_again():
    sim = _Sim(3, seed=5)
    sim.run(10, jitter=0.1)
    sim.run(15, slow={2: 2.0}, jitter=0.1)
    sim.run(15, jitter=0.1)
    sim.run(15, slow={2: 3.0}, jitter=0.1)
    changes = [(f.rank, f.slow) for _, f in sim.events]
    assert changes == [(2, True), (2, False), (2, True)]
    cleared = sim.events[1]
    assert 25 <= cleared[0] < 25 + SlowRankSettings().window
    assert "no longer slow" in cleared[1].text(8)


def test_a_single_rank_is_compared_with_its_own_history():
    sim = _Sim(1, seed=6)
    sim.run(20, jitter=0.2)
    assert sim.named() == []
    sim.run(12, slow={0: 2.0}, jitter=0.1)
    named = sim.events[0][1]
    assert named.slow and named.peers == 0 and 1.7 < named.ratio < 2.4
    assert "its own earlier pace" in named.text(8)


def test_a_new_process_of_the_rank_starts_over_and_clears_its_finding():
    det = SlowRanks(SlowRankSettings(window=3, needed=2, warmup_samples=0, sample_seconds=0))
    for i in range(1, 6):
        det.observe(0, i, (0.1 * i, 0.0, 0.0), i)
        found = det.observe(1, i, (0.3 * i, 0.0, 0.0), i)
    assert det.slow() == [1] and found is None  # (named at an earlier beat)
    cleared = det.observe(1, 3, (0.1, 0.0, 0.0), 9)  # relaunched: its step went back
    assert cleared is not None and not cleared.slow and cleared.ended and det.slow() == []
    assert cleared.text(3).startswith("rank 1, named slow, ended at step")
    assert det.forget(0) is None  # (was not slow)


def test_ranks_of_different_pipeline_stages_are_not_compared():
    det = SlowRanks(SlowRankSettings(window=3, needed=2, warmup_samples=0, sample_seconds=0), stage_size=2)
    found = []
    for i in range(1, 10):  # stage 0 (ranks 0, 1) computes 3x what stage 1 (ranks 2, 3) does
        for rank, per_step in ((0, 0.3), (1, 0.3), (2, 0.1), (3, 0.1)):
            found.append(det.observe(rank, i, (per_step * i, 0.0, 0.0), i))
    assert [f for f in found if f is not None] == [] and det.slow() == []


def test_a_rank_without_steps_in_an_interval_gives_no_sample():
    det = SlowRanks(SlowRankSettings(window=3, needed=2, warmup_samples=0, sample_seconds=0))
    for i in range(1, 10):
        det.observe(0, i, (0.1 * i, 0.0, 0.0), i)
        det.observe(1, i, (0.1 * i, 0.0, 0.0), i)
        det.observe(1, i, (0.1 * i, 0.0, 0.0), i + 0.5)  # a second beat in the same step: no sample
    assert det.slow() == [] and det.ratios() == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}


@pytest.mark.parametrize(
    "kwargs, field_name",
    [({"threshold": 1.0}, "threshold"), ({"needed": 4, "window": 8}, "majority"), ({"needed": 9}, "needed"),
     ({"warmup_samples": -1}, "warmup_samples"), ({"sample_seconds": -1}, "sample_seconds")],
)  # fmt: skip
def test_settings_out_of_range_are_refused_naming_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        SlowRankSettings(**kwargs)


def test_beats_of_half_a_second_name_a_2x_rank_within_60_s_and_a_few_seconds_of_a_busy_host_are_no_finding():
    sim = _Sim(2, seed=7, beat_s=0.5)
    sim.run(40, jitter=0.3, steps=1)  # 20 s of normal steps
    sim.run(14, slow={0: 2.5}, jitter=0.3, steps=1)  # 7 s of a host busy with something else
    sim.run(40, jitter=0.3, steps=1)
    assert sim.named() == []
    began = sim.interval
    sim.run(120, slow={1: 2.0}, jitter=0.3, steps=1)
    (named,) = sim.named()
    detection_s = (named[0] - began) * sim.beat_s
    settings = SlowRankSettings()
    assert named[1] == 1 and detection_s <= settings.window * settings.sample_seconds < 60, detection_s


@pytest.mark.parametrize("world, seed", [(w, s) for w in (2, 4, 8, 64) for s in range(5)])
@pytest.mark.parametrize("factor, intervals", [(1.8, 10), (3.0, 40)])
def test_every_rank_slower_together_names_no_rank(world, seed, factor, intervals):
    # A job-wide slowdown (a `surgectl profile` of every rank, a shared host's contention, a
    # thermal cap on every device) is not one slow rank: the ranks are compared with their
    # peers at the same time, not with the peers' pace before it began.
    sim = _Sim(world, seed=seed)
    sim.run(20, jitter=0.3)
    sim.run(intervals, slow={r: factor for r in range(world)}, jitter=0.3)
    sim.run(20, jitter=0.3)
    assert sim.named() == []


def _stops(tell: bool, slow: float = 1.0) -> SlowRanks:
    """Two ranks, one sample of 30 steps per 3 s interval, each beating once per interval; in
    two intervals of every three rank 0's process is stopped 2 s inside a compute phase (a
    CPU rank's compute clock counts it), in the third rank 1's for 0.5 s (bench/quiet_faults.py's
    SIGSTOP/SIGCONT cycles). ``tell``: its node agent's statement reaches the detector
    (``stopped``); ``slow``: rank 1's compute factor from interval 12 on."""
    det, totals, step = SlowRanks(), {0: 0.0, 1: 0.0}, 0
    for i in range(40):
        step += 30
        stopped, seconds = (0, 2.0) if i % 3 != 2 else (1, 0.5)
        for r in (0, 1):
            factor = slow if r == 1 and i >= 12 else 1.0
            totals[r] += 30 * STEP_S * factor + (seconds if r == stopped else 0.0)
            if tell and r == stopped:
                det.stopped(r)  # (stated while it was stopped: before its next beat)
            det.observe(r, step, (0.0, totals[r], 0.0), i * 3.0)
    return det


def test_samples_holding_a_stated_stop_are_dropped_so_brief_stops_name_no_rank():
    # Unheard, the stops read as compute: the rank stopped longer is named (found by the bench).
    assert _stops(tell=False).slow() == [0]
    assert _stops(tell=True).slow() == []
    # A rank really 2x slower is still named between the stops (its unstopped samples).
    assert _stops(tell=True, slow=2.0).slow() == [1]


def test_a_finding_with_no_phase_figures_says_none_rather_than_an_empty_list():
    from services.control.slow_ranks import Finding

    text = Finding(1, True, 5, 2.0, (0.0, 0.0, 0.0), 1.9, 1, 0.5).text(8)
    assert text.endswith("over its last 8 intervals; 1.90x its own earlier pace)") and ": ;" not in text
    alone = Finding(1, True, 5, 2.0, (0.0, 0.0, 0.0), 0.0, 0, 0.5).text(8)
    assert alone.endswith("over its last 8 intervals)"), alone


def test_a_large_stage_stating_no_compute_takes_its_reference_once_per_round(monkeypatch):
    # Ranks that state no compute time (0 s every phase) keep the stage's reference at 0; it was
    # then recomputed on every sample: a median over the stage per beat (found at 2,048 ranks).
    import services.control.slow_ranks as slow_ranks

    calls = []
    real = slow_ranks._median_of
    monkeypatch.setattr(slow_ranks, "_median_of", lambda medians: calls.append(len(medians)) or real(medians))
    world, rounds = 100, 10
    det = SlowRanks()
    for interval in range(rounds + det.settings.warmup_samples + 1):
        for r in range(world):
            det.observe(r, 3 * interval, (0.0, 0.0, 0.0), interval * 3.0)
    assert det.slow() == []
    assert 1 <= len(calls) <= rounds + 1, len(calls)  # one per round, not one per sample (~world x rounds)
