"""The blend of a weighted mixture: which dataset each row of the blended sequence comes from.

Megatron-LM's BlendedDataset rule: blended row ``i`` comes from the component ``k`` with the
largest ``weight_k * (i + 1) - count_k(i)``, where ``count_k(i)`` is how many of the rows
before ``i`` came from ``k`` (ties: the lowest ``k``). So after every prefix of ``n`` rows
each component has had ``weight_k * n`` rows to within one, and the whole assignment is a
pure function of the normalised weights: each component's own position (rows of its own
sequence taken) is a function of the blended row alone, which is what lets a mixture resume
from one number, at any dp size.

Deterministic ordering, no content: this is the shuffler's kind of rule (L4-3 orders, the
packer never reorders), applied between the component pipelines by the mixture stream
(``mixture.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

FORMAT = "mix-v1"  # DataPosition.format of a mixture's position: epoch 0, row = blended row

# The walk's counts every MARK rows, per weights, in this process (a few integers per mark:
# 1e9 blended rows keep 15,000 of them).
MARK = 1 << 16
_MARKS: dict[tuple[float, ...], dict[int, list[int]]] = {}
_LOCKS: dict[tuple[float, ...], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def normalised(weights: Sequence[float]) -> np.ndarray:
    """The weights as float64 summing to 1.

    Raises:
        ValueError: no weight, or one that is not a finite number > 0.
    """
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if len(w) == 0:
        raise ValueError("a mixture needs at least one component")
    bad = [i for i, x in enumerate(w) if not np.isfinite(x) or x <= 0]
    if bad:
        raise ValueError(f"mixture component {bad[0]}: weight must be > 0, got {w[bad[0]]}")
    return w / w.sum()


class Blend:
    """Walks the blended sequence; :meth:`counts` and :meth:`sources` for any row, cheapest
    when asked in increasing order (the walk resumes from the last row asked, else from 0)."""

    def __init__(self, weights: Sequence[float]):
        self.weights = normalised(weights)
        self._w = [float(x) for x in self.weights]
        self._row = 0  # the walk's row: counts of rows [0, _row)
        self._counts = [0] * len(self._w)
        with _LOCKS_GUARD:
            self._lock = _LOCKS.setdefault(tuple(self._w), threading.Lock())
            self._marks = _MARKS.setdefault(tuple(self._w), {0: [0] * len(self._w)})

    def _step(self) -> int:
        i1 = self._row + 1
        best, err = 0, self._w[0] * i1 - self._counts[0]
        for k in range(1, len(self._w)):
            e = self._w[k] * i1 - self._counts[k]
            if e > err:  # strict: a tie keeps the lowest k
                best, err = k, e
        self._counts[best] += 1
        self._row += 1
        if self._row % MARK == 0:
            self._marks[self._row] = list(self._counts)
        return best

    def _seek(self, row: int) -> None:
        """Walk to ``row``: from the nearest point at or before it that this process has
        walked (a resume seeks once per process, not once per rank's stream; the walk costs
        about a microsecond a row), else from here or from 0."""
        with self._lock:  # streams opening together wait for one walk, then share it
            at = (row // MARK) * MARK
            while at not in self._marks:
                at -= MARK
            if self._row > row or at > self._row:
                self._row, self._counts = at, list(self._marks[at])
            while self._row < row:
                self._step()

    def counts(self, row: int) -> list[int]:
        """``count_k(row)``: rows of each component among blended rows ``[0, row)``."""
        self._seek(int(row))
        return list(self._counts)

    def sources(self, start: int, n: int) -> list[tuple[int, int]]:
        """For blended rows ``start .. start + n - 1``: (component, row of the component's own
        sequence) each."""
        self._seek(int(start))
        out = []
        for _ in range(int(n)):
            k = self._step()
            out.append((k, self._counts[k] - 1))
        return out
