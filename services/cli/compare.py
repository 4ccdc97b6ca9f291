"""`surgectl compare`: two or more jobs side by side -- what their specs set differently,
their final and best losses, and their curves overlaid in one plot.

Everything is read from what exists already: control's status and journaled spec
(``JobQuery.with_spec``) and each job's step records (the store's metrics file when it is on
this machine, else control's event history, as `surgectl plot` reads them). Nothing is
stored by comparing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.cli import render
from services.contract import control_pb2

# Keys every job differs in by construction: never a difference worth a row.
_ALWAYS_DIFFERENT = ("name",)


@dataclass
class Run:
    """One job as compared: its status, its spec as a flat mapping, its curves."""

    status: control_pb2.JobStatus
    spec: dict[str, object]
    history: render.History

    @property
    def label(self) -> str:
        return self.status.name or self.status.job_id


def flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}``: dotted keys as
    ``--set`` writes them; lists are values (a mixture's list is one setting)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def spec_mapping(spec_json: str) -> dict[str, object]:
    """The flat mapping of a journaled spec (``JobStatus.spec_json``); {} when there is none."""
    return flatten(json.loads(spec_json)) if spec_json else {}


def spec_differences(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """The keys whose values are not the same in every run, with each run's value as text
    ("-" where a run's spec has no such key), sorted by key."""
    keys = sorted(set().union(*(r.spec for r in runs)) - set(_ALWAYS_DIFFERENT))
    rows = []
    for key in keys:
        values = [r.spec.get(key, _MISSING) for r in runs]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, [_text(v) for v in values]))
    return rows


_MISSING = object()


def _text(value: object) -> str:
    if value is _MISSING:
        return "-"
    return json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


@dataclass(frozen=True)
class Summary:
    """What `compare` reports of one run's metrics (NaN where there is nothing to report)."""

    steps: int
    final_train: float
    best_train: float
    best_train_step: int
    final_eval: float
    best_eval: float
    best_eval_step: int
    tokens_per_second: float


def summarize(h: render.History, status_rate: float = 0.0) -> Summary:
    """Final and best (lowest) train and held-out loss, with the step of the best; tokens/s as
    `status` says it (``status_rate``: control's one definition, tokens over the step seconds
    of every step but the first), else the median of the steps after the first."""
    train = [(loss, step) for step, loss in zip(h.steps, h.loss) if not math.isnan(loss)]
    held = [(loss, step) for step, loss in zip(h.eval_steps, h.eval_loss) if not math.isnan(loss)]
    rates = sorted(t for t in h.tokens_per_second[1:] if t > 0 and not math.isnan(t))
    best_t = min(train, default=(math.nan, 0))
    best_e = min(held, default=(math.nan, 0))
    return Summary(
        steps=h.steps[-1] if h.steps else 0,
        final_train=train[-1][0] if train else math.nan,
        best_train=best_t[0],
        best_train_step=best_t[1],
        final_eval=held[-1][0] if held else math.nan,
        best_eval=best_e[0],
        best_eval_step=best_e[1],
        tokens_per_second=status_rate or (rates[len(rates) // 2] if rates else math.nan),
    )


def as_json(runs: list[Run]) -> dict:
    """`compare -o json`: per job its state and summary, and the spec keys that differ."""
    out = {
        "jobs": [],
        "spec_differences": {k: dict(zip((r.status.job_id for r in runs), v)) for k, v in spec_differences(runs)},
    }
    for r in runs:
        s = summarize(r.history, r.status.tokens_per_second)
        out["jobs"].append(
            {
                "job_id": r.status.job_id,
                "name": r.status.name,
                "state": render.state_text(r.status),
                "tags": dict(r.status.tags),
                **_plain(s),
            }
        )
    return out


def _plain(s: Summary) -> dict:
    """A summary for JSON: NaN is null, and so is the step of a best that does not exist."""
    out = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.__dict__.items()}
    for best, step in (("best_train", "best_train_step"), ("best_eval", "best_eval_step")):
        if out[best] is None:
            out[step] = None
    return out


def overlay_plot(runs: list[Run], out: Path, title: str) -> Path:
    """Every run's train loss (a line) and held-out loss (points) on one axis, and its
    tokens/s on a second, one colour per run (PNG, SVG or PDF by ``out``'s suffix)."""
    plt, fig, ax1, ax2 = render.loss_and_rate_axes()
    for i, r in enumerate(runs):
        colour = f"C{i % 10}"
        ax1.plot(r.history.steps, r.history.loss, lw=1, color=colour, label=f"{r.label} train")
        if r.history.eval_steps:
            ax1.plot(r.history.eval_steps, r.history.eval_loss, "o--", color=colour, label=f"{r.label} held-out")
        ax2.plot(r.history.steps, r.history.tokens_per_second, lw=1, color=colour, label=r.label)
    ax1.legend(fontsize="small")
    ax2.legend(fontsize="small")
    return render.save_figure(plt, fig, out, title)
