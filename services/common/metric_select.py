"""What ReadMetrics sends of a job's records when the caller asks for less than all of them
(issue 31: a page of a 100,000-step x 64-rank job must not ship GBs): only some ranks'
records (``ranks``), and at most about ``points`` step records per rank (``points``).

How the points are chosen: M4 (Jugel et al., "M4: A Visualization-Oriented Time Series Data
Aggregation", VLDB 2014; what W&B's and TensorBoard's samplers approximate): the rank's steps
fall in buckets of consecutive steps, and each bucket keeps, of every curve (loss, learning
rate, gradient norm, tokens/s), the record holding its lowest and its highest value, and the
bucket's first and last record. A spike (a loss of 40 among 2.1s, a NaN: counted as the
highest) is always kept, and so is the run's last record: a line drawn through the kept
points is the line drawn through every point, to a bucket's width. Records, never averages:
what comes back are lines the store holds, as compaction (metric_files.compact) keeps them.

A rank with at most ``points`` step records keeps every one. Past that: at most
``2 x len(CURVES) + 2`` records a bucket, and at most ``points // 10`` buckets (a chart's
2,000 points: 100 to 200 buckets, 3.5 to 7 pixels of a 700-pixel chart each). The buckets'
width is a power of two, doubled (neighbours merged: the same answer as bucketing by the
final width from the start) whenever there are more buckets than that: memory holds the kept
records only, never the rank's whole history; the files are read once, a part at a time.

A step recorded twice (replayed after a rollback) counts its last record, as every reader
does (observe.step_records): the earlier records of the steps replayed are dropped when the
replay starts; the one bucket the rollback cuts keeps only the points it had kept before it
(its extremes among those, not among every step it held).

Every record that is not a step record (evaluations, samples, scores: few) is sent as read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

# What a chart asks for (the dashboard, `surgectl plot` and `compare`): a chart 700 pixels wide
# shows no more, and a 100,000-step job's chart costs what a 2,000-step one's does.
CHART_POINTS = 2000
CURVES = ("loss", "learning_rate", "grad_norm", "tokens_per_second")
PER_BUCKET = 2 * len(CURVES) + 2
_RANK = re.compile(rb'"rank"\s*:\s*(\d+)')  # (a job id never holds a '"': the first is the record's own)
_STEP_TYPE = re.compile(rb'"type"\s*:\s*"step"')


def rank_of(line: bytes) -> int | None:
    """A record line's rank without parsing it (the metrics logger writes ``"rank":N`` in
    every record, rank 0 included): None when the line names none (a record without the
    field is rank 0's to every reader: see :func:`keep_rank`)."""
    m = _RANK.search(line)
    return int(m.group(1)) if m else None


def keep_rank(line: bytes, ranks: Collection[int]) -> bool:
    """Whether ``line`` is of one of ``ranks`` (empty: every rank). A line naming no rank is
    rank 0's (observe.step_records reads it so)."""
    if not ranks:
        return True
    r = rank_of(line)
    return (0 if r is None else r) in ranks


@dataclass(slots=True)
class _Kept:
    step: int
    order: int  # the record's place in the files: ties and the replay rule
    line: bytes
    values: tuple[float, ...]  # CURVES' values (NaN: absent; ranked highest)


def _high(v: float) -> float:
    return math.inf if math.isnan(v) else v


@dataclass(slots=True)
class _Bucket:
    first: _Kept
    last: _Kept
    lows: list[_Kept | None] = field(default_factory=list)
    highs: list[_Kept | None] = field(default_factory=list)

    @classmethod
    def of(cls, k: _Kept) -> _Bucket:
        b = cls(k, k, [None] * len(CURVES), [None] * len(CURVES))
        b.add(k)
        return b

    def add(self, k: _Kept) -> None:
        if k.step < self.first.step:
            self.first = k
        if k.step >= self.last.step:
            self.last = k
        lows, highs = self.lows, self.highs
        for i, v in enumerate(k.values):
            lo, hi = lows[i], highs[i]
            if v == v and (lo is None or v < lo.values[i]):  # (v == v: not NaN)
                lows[i] = k
            if hi is None or _high(v) > _high(hi.values[i]):
                highs[i] = k

    def merge(self, other: _Bucket) -> None:
        for k in other.kept():
            self.add(k)

    def kept(self) -> list[_Kept]:
        """The distinct records this bucket keeps, by step."""
        found = {id(k): k for k in (self.first, self.last, *self.lows, *self.highs) if k is not None}
        return sorted(found.values(), key=lambda k: (k.step, k.order))


class Thinned:
    """One rank's step records thinned to about ``points`` (M4 buckets, module docstring)."""

    def __init__(self, points: int):
        self._points = max(1, points)
        self._buckets_max = max(1, points // PER_BUCKET)
        self._width = 1
        # Every record while there are at most ``points`` (a job shorter than the budget loses
        # none), then the buckets.
        self._all: list[_Kept] | None = []
        self._buckets: dict[int, _Bucket] = {}
        self._top = -1  # the highest step taken
        self._order = 0

    def add(self, step: int, record: dict, line: bytes) -> None:
        if step <= self._top:
            self._replayed_from(step)
        self._top = step
        self._order += 1
        k = _Kept(step, self._order, line, tuple(_number(record.get(c)) for c in CURVES))
        if self._all is not None:
            self._all.append(k)
            if len(self._all) <= self._points:
                return
            kept, self._all = self._all, None
            for k in kept:
                self._bucket(k)
            return
        self._bucket(k)

    def _bucket(self, k: _Kept) -> None:
        i = k.step // self._width
        if (b := self._buckets.get(i)) is None:
            self._buckets[i] = _Bucket.of(k)
            while len(self._buckets) > self._buckets_max:
                self._widen()
        else:
            b.add(k)

    def lines(self) -> list[bytes]:
        """The kept records by step."""
        if self._all is not None:
            return [k.line for k in self._all]
        return [k.line for i in sorted(self._buckets) for k in self._buckets[i].kept()]

    def _widen(self) -> None:
        self._width *= 2
        merged: dict[int, _Bucket] = {}
        for i in sorted(self._buckets):
            b = self._buckets[i]
            if (into := merged.get(i // 2)) is None:
                merged[i // 2] = b
            else:
                into.merge(b)
        self._buckets = merged

    def _replayed_from(self, step: int) -> None:
        """Drop what the replay from ``step`` supersedes (module docstring)."""
        if self._all is not None:
            self._all = [k for k in self._all if k.step < step]
            return
        cut = step // self._width
        for i in [i for i in self._buckets if i >= cut]:
            left = [k for k in self._buckets.pop(i).kept() if k.step < step]
            if left:
                b = _Bucket.of(left[0])
                for k in left[1:]:
                    b.add(k)
                self._buckets[i] = b


@dataclass(frozen=True)
class Selection:
    """What a ReadMetrics caller asked for: ``record_type`` ("": every type), ``ranks``
    (empty: every rank), ``points`` (0: every step record)."""

    record_type: str = ""
    ranks: frozenset[int] = frozenset()
    points: int = 0


class Selector:
    """:func:`select` fed a block at a time and kept: the store's chart reads resume it with
    the bytes written since (services/store/metric_scans.py), so a live job's page reloaded
    every few seconds reads only what is new."""

    def __init__(self, sel: Selection, keep: bool = True):
        """``keep``: hold what :meth:`feed` passes, for :meth:`others` (a resumed read sends
        it again; a streamed one need not hold it)."""
        self.sel = sel
        self._keep = keep
        self._thinned: dict[int, Thinned] = {}
        self._others: list[bytes] = []  # (records that are not step records: few)

    def feed(self, block: bytes) -> bytes:
        """The records of ``block`` (whole lines) that are not thinned, also kept for
        :meth:`others`; the step records go into each rank's buckets."""
        sel = self.sel
        out = []
        for line in _of_ranks(block, sel.ranks):
            if sel.points and _STEP_TYPE.search(line):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None  # (a write cut short: passed over, as the readers pass it)
                if isinstance(record, dict) and record.get("type") == "step":
                    try:
                        rank, step = int(record.get("rank", 0)), int(record["step"])
                    except (KeyError, TypeError, ValueError):
                        continue
                    self._thinned.setdefault(rank, Thinned(sel.points)).add(step, record, line)
                    continue
            out.append(line)
        fed = b"".join(out)
        if fed and self._keep:
            self._others.append(fed)
        return fed

    def others(self) -> list[bytes]:
        """Every record :meth:`feed` passed so far, in order."""
        return list(self._others)

    def steps(self) -> list[bytes]:
        """The kept step records of each rank (by rank, by step), one part a rank."""
        return [b"".join(kept) for rank in sorted(self._thinned) if (kept := self._thinned[rank].lines())]


def select(blocks: Iterable[bytes], sel: Selection) -> Iterator[bytes]:
    """``blocks`` (whole lines, as metric_files.lines reads them, type already filtered)
    narrowed to ``sel.ranks`` and thinned to ``sel.points``: the records that are not step
    records as they come, the thinned step records of each rank after them (by rank, by step)."""
    if not sel.ranks and not sel.points:
        yield from blocks
        return
    selector = Selector(sel, keep=False)
    for block in blocks:
        if fed := selector.feed(block):
            yield fed
    yield from selector.steps()


def _of_ranks(block: bytes, ranks: Collection[int]) -> Iterable[bytes]:
    """The lines of ``block`` (whole lines) of ``ranks`` (empty: every line), in order.

    Why not line by line: a 64-rank job's file is 63 lines of other ranks for each line asked,
    and a Python loop over GBs of lines takes minutes. When every line holds one
    ``,"rank":`` (the metrics logger writes compact JSON, every field present), the lines of a
    rank are found by searching the block for ``,"rank":R`` (C speed: three passes over the
    bytes for one rank), then checked."""
    if not ranks:
        return block.splitlines(keepends=True)
    if block.count(b',"rank":') != block.count(b"\n"):  # (a line without it, or not compact JSON)
        return [line for line in block.splitlines(keepends=True) if keep_rank(line, ranks)]
    starts: set[int] = set()
    for r in ranks:
        marker = b',"rank":%d' % r
        at = block.find(marker)
        while at >= 0:
            end = at + len(marker)
            if block[end : end + 1] in (b",", b"}"):  # (not rank 12 for rank 1)
                starts.add(block.rfind(b"\n", 0, at) + 1)
            at = block.find(marker, end)
    found = []
    for start in sorted(starts):
        line = block[start : block.index(b"\n", start) + 1]
        if rank_of(line) in ranks:  # (the line's first "rank": its own, not a nested one)
            found.append(line)
    return found


def _number(v: object) -> float:
    """As observe.number: the logger writes NaN and Infinity as strings."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def select_text(text: str, sel: Selection) -> str:
    """:func:`select` of a metrics file's text read here (the store's files on this machine,
    read while the store is down): the records the store would send, but of every type
    (``sel.record_type`` is not applied: the readers keep the types they want)."""
    if not sel.ranks and not sel.points:
        return text
    return b"".join(select([text.encode()], sel)).decode(errors="replace")
