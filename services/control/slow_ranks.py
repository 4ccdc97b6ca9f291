"""Slow ranks: which rank computes markedly slower than the job's others, for long enough.

Part of L1-3 (the fault detector feeds it from each rank's heartbeat and reports what it
names as ``slow_rank``); a pure state machine: no clock of its own (the beat's time is an
input), no lock, no I/O, so it is table-tested (tests/control/test_slow_ranks.py).

Input: per beat, a rank's last completed step, its compute seconds so far in forward,
backward and optimizer (``RankHeartbeat.*_compute_seconds``: without its waits in collectives
or for data, services/common/compute_time.py) and when it beat. The beats of a rank spanning
at least ``sample_seconds`` and one step make one *sample*: its compute seconds per step over
that span, per phase. (A span of seconds, not one beat period: a host busy with something
else for a few seconds, or a beat period of 0.25 s, would otherwise fill a window.)

The comparison, per sample of rank r:

* with the others: ``ratio = sample / reference``, the reference being the median, over r's
  peers (the job's other ranks doing the same work: the same pipeline stage), of each peer's
  median over its last ``reference_samples`` samples (3: the same few seconds as r's sample).
  Medians make one peer's spike (a GC pause, a step with a checkpoint) no reference, and
  jitter of +-30 % in r's own samples no ratio of 1.5. The peers' *recent* pace, not their
  pace over the whole window: when every rank slows down together (a profile of every rank,
  a shared host's contention, a power cap on every device) the reference follows within two
  samples, so no rank is named for what all of them do (at most two ratios of the window
  are high, against ``needed`` to name one);
* with its own history: its pace once it was warm (the median of its first ``window``
  samples) is its baseline; with no peer (one rank in its stage) the baseline is the
  reference, and the report says how r compares with it either way.

A rank is named slow when at least ``needed`` of its last ``window`` ratios are >=
``threshold`` (a majority: one slow interval, or a few, is noise), and cleared when at least
``needed`` of them are below it (the gap between is hysteresis: no flapping). Its first
``warmup_samples`` samples are not compared (the first steps allocate, fill caches, and the
first step's compute is marked as compilation). A rank whose step or sums went back (a new
process: relaunched, replaced) starts over, its finding cleared.

Detection time: ``warmup_samples`` (only at start) + ``needed`` samples after the slowdown
starts, a sample being ``sample_seconds`` (3 s) or one step when steps are longer: 15 to 24 s
at the defaults (measured: tests/faults/test_slow_rank.py), within 60 s for steps of up to
12 s. A slowdown shorter than about ``needed`` x ``sample_seconds`` / 2 is never named.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class SlowRankSettings:
    """The detector's thresholds (defaults: issue 29 item 2, "1.5x slower, sustained").

    Raises:
        ValueError: a setting out of range (the message names it).
    """

    threshold: float = 1.5  # compute per step / the reference that names a rank slow
    window: int = 8  # the samples (intervals with steps) each judgement looks at
    needed: int = 5  # of them at or above the threshold to name it (below it: to clear it)
    warmup_samples: int = 2  # a rank's first samples, not compared
    sample_seconds: float = 3.0  # the least span of beats one sample covers
    reference_samples: int = 3  # each peer's last samples its part of the reference takes (a median)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(f"slow ranks: threshold must be > 1, got {self.threshold}")
        if not 0 < self.needed <= self.window:
            raise ValueError(f"slow ranks: needed must be in 1..window ({self.window}), got {self.needed}")
        if self.needed * 2 <= self.window:
            raise ValueError(f"slow ranks: needed ({self.needed}) must be a majority of window ({self.window})")
        if self.warmup_samples < 0:
            raise ValueError(f"slow ranks: warmup_samples must be >= 0, got {self.warmup_samples}")
        if self.sample_seconds < 0:
            raise ValueError(f"slow ranks: sample_seconds must be >= 0, got {self.sample_seconds}")
        if not 0 < self.reference_samples <= self.window:
            raise ValueError(
                f"slow ranks: reference_samples must be in 1..window ({self.window}), got {self.reference_samples}"
            )


@dataclass(frozen=True)
class Finding:
    """A rank named slow (``slow``) or cleared (not ``slow``) at ``step``.

    ``ratio``: the median of its last ratios to the reference (compute per step / peers'
    median, or / its own baseline without peers); ``phases``: the same per phase (forward,
    backward, optimizer; 0 where the reference spends nothing); ``history``: its median
    compute per step / its own baseline (0: no baseline yet); ``peers``: how many ranks it
    was compared with (0: its own history only); ``seconds``: its median compute per step.
    """

    rank: int
    slow: bool
    step: int
    ratio: float
    phases: tuple[float, float, float]
    history: float
    peers: int
    seconds: float
    ended: bool = False  # cleared because its process ended (its replacement starts over)

    def text(self, window: int) -> str:
        """One line for the job's events."""
        against = f"the median of its {self.peers} peer rank(s)" if self.peers else "its own earlier pace"
        phases = ", ".join(f"{n} {r:.2f}x" for n, r in zip(PHASES, self.phases) if r > 0)
        history = f"; {self.history:.2f}x its own earlier pace" if self.peers and self.history > 0 else ""
        if self.slow:
            return (
                f"rank {self.rank} computes {self.ratio:.2f}x {against} per step at step {self.step} "
                f"({self.seconds:.3f} s per step over its last {window} intervals{': ' + phases if phases else ''}"
                f"{history})"
            )
        if self.ended:
            return f"rank {self.rank}, named slow, ended at step {self.step} (last {self.ratio:.2f}x {against})"
        return f"rank {self.rank} is no longer slow at step {self.step}: {self.ratio:.2f}x {against}{history}"


@dataclass(eq=False)
class _Rank:
    step: int  # where the sample being gathered began: its step, sums and time
    totals: tuple[float, float, float]
    at: float
    seen: int = 0  # samples taken (the first warmup_samples are not compared)
    samples: deque = field(default_factory=deque)  # (forward, backward, optimizer) s per step
    ratios: deque = field(default_factory=deque)  # each sample's total / the reference then
    stopped: bool = False  # its process was stated stopped during the sample being gathered
    baseline: float = 0.0  # its median s per step once warm (its own history)
    slow: bool = False
    median: tuple[float, float, float] = (0.0, 0.0, 0.0)  # of `samples`, per phase (kept as they change)
    recent: tuple[float, float, float] = (0.0, 0.0, 0.0)  # of its last reference_samples, per phase


@dataclass(eq=False)
class _Stage:
    """The ranks of one pipeline stage (peers of each other), and, for a large stage, its
    reference computed once per round of samples (not once per sample: a stage of thousands
    of ranks would cost each beat a median over all of them)."""

    ranks: set = field(default_factory=set)
    reference: tuple[float, tuple[float, float, float]] = (0.0, (0.0, 0.0, 0.0))
    samples_since: int = 0  # samples taken in the stage since `reference` was computed
    computed: bool = False  # `reference` was computed once (its value may be 0: ranks stating no compute)


def _median3(samples) -> tuple[float, float, float]:
    f, b, o = zip(*samples)
    return statistics.median(f), statistics.median(b), statistics.median(o)


def _median_of(medians: list[tuple[float, float, float]]) -> tuple[float, tuple[float, float, float]]:
    """(median of the totals, median per phase) of ranks' per-phase medians."""
    if not medians:
        return 0.0, (0.0, 0.0, 0.0)
    per_phase = (
        statistics.median(m[0] for m in medians),
        statistics.median(m[1] for m in medians),
        statistics.median(m[2] for m in medians),
    )
    return statistics.median(sum(m) for m in medians), per_phase


class SlowRanks:
    """Slow-rank findings of one job (see the module docstring).

    Args:
        settings: thresholds.
        stage_size: ranks per pipeline stage (dp x tp): ranks ``r // stage_size`` equal are
            peers; 0 (or anything >= the world) makes every rank a peer of every other.
    """

    # Up to this many peers, a rank's reference is its peers' exactly (itself left out: at dp 2
    # the job's median would be the mean of the slow rank and its peer, 1.33x at 2x); beyond,
    # the stage's median (itself in it moves the median one place of many) once per round.
    EXACT_PEERS = 32

    def __init__(self, settings: SlowRankSettings | None = None, stage_size: int = 0):
        self._s = settings or SlowRankSettings()
        self._stage_size = stage_size
        self._ranks: dict[int, _Rank] = {}
        self._stages: dict[int, _Stage] = {}

    @property
    def settings(self) -> SlowRankSettings:
        return self._s

    def observe(self, rank: int, step: int, compute: tuple[float, float, float], at: float) -> Finding | None:
        """A beat of ``rank``: its last completed ``step``, its (forward, backward, optimizer)
        compute seconds so far, and when it beat (seconds, on a clock that only moves forward
        for the rank). Returns the finding it changes (named slow, or cleared), else None."""
        state = self._ranks.get(rank)
        if state is None:
            self._ranks[rank] = _Rank(step, compute, at)
            self._stage(rank).ranks.add(rank)
            return None
        steps = step - state.step
        deltas = tuple(now - before for now, before in zip(compute, state.totals))
        if steps < 0 or min(deltas) < 0:  # a new process of the rank: what was known is not its own
            cleared = self._finding(rank, state, slow=False, ended=True) if state.slow else None
            self._ranks[rank] = _Rank(step, compute, at)
            return cleared
        if steps == 0 or at - state.at < self._s.sample_seconds:
            return None  # the sample goes on: no step ended yet, or too short a span
        state.step, state.totals, state.at = step, compute, at
        if state.stopped:  # (its span held a stop: no sample; the next one starts here)
            state.stopped = False
            return None
        state.seen += 1
        if state.seen <= self._s.warmup_samples:
            return None
        state.samples.append(tuple(d / steps for d in deltas))
        while len(state.samples) > self._s.window:
            state.samples.popleft()
        state.median = _median3(state.samples)
        state.recent = _median3(list(state.samples)[-self._s.reference_samples :])
        self._stage(rank).samples_since += 1
        if not state.baseline and len(state.samples) == self._s.window:
            state.baseline = statistics.median(sum(x) for x in state.samples)
        reference, _ = self._reference(rank, state)
        if reference <= 0:
            return None
        state.ratios.append(sum(state.samples[-1]) / reference)
        while len(state.ratios) > self._s.window:
            state.ratios.popleft()
        at_or_above = sum(r >= self._s.threshold for r in state.ratios)
        if not state.slow and at_or_above >= self._s.needed:
            state.slow = True
            return self._finding(rank, state, slow=True)
        if state.slow and len(state.ratios) - at_or_above >= self._s.needed:
            state.slow = False
            return self._finding(rank, state, slow=False)
        return None

    def stopped(self, rank: int) -> None:
        """``rank``'s process was stated stopped (by a signal): the sample being gathered,
        whose compute time may hold the stop, is dropped when it ends (module docstring)."""
        state = self._ranks.get(rank)
        if state is not None:
            state.stopped = True

    def forget(self, rank: int) -> Finding | None:
        """``rank``'s process ended: what was known of it goes; its finding, if any, is cleared."""
        state = self._ranks.pop(rank, None)
        self._stage(rank).ranks.discard(rank)
        return self._finding(rank, state, slow=False, ended=True) if state is not None and state.slow else None

    def ratios(self) -> Mapping[int, float]:
        """Each compared rank's slowdown now: the median of its last ratios to its reference
        (1: as its peers; what the ``surge_rank_slowdown_ratio`` gauge shows)."""
        return {r: statistics.median(s.ratios) for r, s in self._ranks.items() if s.ratios}

    def ratio(self, rank: int) -> float | None:
        """``rank``'s entry of :meth:`ratios` (None: not compared yet)."""
        state = self._ranks.get(rank)
        return statistics.median(state.ratios) if state is not None and state.ratios else None

    def slow(self) -> list[int]:
        """The ranks named slow now."""
        return sorted(r for r, s in self._ranks.items() if s.slow)

    def _stage(self, rank: int) -> _Stage:
        key = rank // self._stage_size if self._stage_size > 0 else 0
        stage = self._stages.get(key)
        if stage is None:
            stage = self._stages[key] = _Stage()
        return stage

    def _peers(self, rank: int) -> list[_Rank]:
        return [s for r in self._stage(rank).ranks if r != rank and (s := self._ranks[r]).samples]

    def _reference(self, rank: int, state: _Rank) -> tuple[float, tuple[float, float, float]]:
        """(s per step, per phase) that ``rank`` is compared with: the median of its peers'
        recent medians, else its own baseline (0: nothing to compare with yet)."""
        stage = self._stage(rank)
        if len(stage.ranks) - 1 > self.EXACT_PEERS:
            # (a new round; not "while the reference is 0": ranks that state no compute time
            # kept it 0 and cost every beat a median over the stage, 83 % of control's CPU at
            # 2,048 simulated ranks)
            if stage.samples_since >= len(stage.ranks) or not stage.computed:
                stage.reference = _median_of([s.recent for r in stage.ranks if (s := self._ranks[r]).samples])
                stage.samples_since, stage.computed = 0, True
            return stage.reference
        peers = self._peers(rank)
        if peers:
            return _median_of([p.recent for p in peers])
        return state.baseline, (0.0, 0.0, 0.0)

    def _finding(self, rank: int, state: _Rank, *, slow: bool, ended: bool = False) -> Finding:
        _, per_phase = self._reference(rank, state)
        mine = _median3(state.samples) if state.samples else (0.0, 0.0, 0.0)
        phases = tuple(m / p if p > 0 else 0.0 for m, p in zip(mine, per_phase))
        seconds = sum(mine)
        return Finding(
            rank=rank,
            slow=slow,
            step=state.step,
            ratio=statistics.median(state.ratios) if state.ratios else 0.0,
            phases=phases,  # type: ignore[arg-type]
            history=seconds / state.baseline if state.baseline else 0.0,
            peers=len(self._peers(rank)),
            seconds=seconds,
            ended=ended,
        )
