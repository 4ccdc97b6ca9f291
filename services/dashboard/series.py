"""A job's curves: train loss, learning rate, gradient norm, tokens/s and held-out loss per step.

Read from the store's raw step records (``<store root>/metrics/<job>.jsonl``: every step of
every rank, as `surgectl plot` reads them, through the store's ReadMetrics) when it has them, else from
control's event history (``WatchJob``), whose step events are sampled (about one a second)
and carry no learning rate or gradient norm: those curves are then empty and the page says
why (``Series.source``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.cli.observe import number, step_records
from services.common.rotated_files import read_rotated
from services.contract import control_pb2

STORE_RECORDS = "the store's step records (at most 2,000 points a curve: each bucket of steps keeps its first, last, lowest and highest)"
SAMPLED_EVENTS = "control's event history (steps sampled about once a second; no learning rate or gradient norm)"


@dataclass
class Series:
    """One rank's curves, each a list aligned with ``steps`` (NaN where a record lacks it)."""

    source: str
    rank: int = 0
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    learning_rate: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    tokens_per_second: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)

    def has(self, curve: str) -> bool:
        """Whether ``curve`` (an attribute name) has a point that is a number."""
        return any(not math.isnan(v) for v in getattr(self, curve))


def from_records(path: Path, rank: int | None = None) -> Series | None:
    """The curves of ``rank`` (default: the lowest rank recorded) from a metrics file and its
    rotated files; None when the file is absent or holds no step record. A step recorded twice
    (replayed after a rollback) keeps its last record. A line that is not JSON (a write cut
    short by a crash) is passed over: the page shows the rest."""
    try:
        text = read_rotated(path)
    except OSError:
        return None
    return from_text(text, path, rank)


def from_text(text: str, where: Path | str, rank: int | None = None) -> Series | None:
    """``from_records`` of a metrics file's text (``where``: the file, or the store's records
    read through its API); None when it holds no step record."""
    steps, evals = step_records(text, where, strict=False)
    if not steps:
        return None
    rank = min(steps) if rank is None or rank not in steps else rank
    s = Series(source=STORE_RECORDS, rank=rank)
    for step, r in sorted(steps[rank].items()):
        s.steps.append(step)
        s.loss.append(number(r.get("loss")))
        s.learning_rate.append(number(r.get("learning_rate")))
        s.grad_norm.append(number(r.get("grad_norm")))
        s.tokens_per_second.append(number(r.get("tokens_per_second")))
    for step, loss in sorted(evals.get(rank, {}).items()):
        if not math.isnan(loss):
            s.eval_steps.append(step)
            s.eval_loss.append(loss)
    return s


def from_events(events: Iterable[control_pb2.JobEvent]) -> Series:
    """The curves from control's event log: each step event's status after it (a new step
    only: a replayed step keeps its first point here), each evaluation's held-out loss."""
    s = Series(source=SAMPLED_EVENTS)
    for ev in events:
        st = ev.status
        if ev.type == "step" and st.step and (not s.steps or st.step > s.steps[-1]):
            s.steps.append(st.step)
            s.loss.append(st.train_loss)
            s.learning_rate.append(math.nan)
            s.grad_norm.append(math.nan)
            s.tokens_per_second.append(st.tokens_per_second)
        elif ev.type == "eval" and not math.isnan(st.eval_loss):
            s.eval_steps.append(st.step)
            s.eval_loss.append(st.eval_loss)
    return s
