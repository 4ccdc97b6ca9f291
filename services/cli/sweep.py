"""`surgectl sweep`: a family of jobs from one spec, submitted through the queue, ranked by a
metric, with the worst stopped early when asked (asynchronous successive halving, ASHA).

The sweep lives in the client: its trials are ordinary jobs (each a `--set` of the base spec
and named ``<name>-<sweep>-<i>``), so control, the queue and every other command treat them
as any job; the sweep's record (which job is which trial) is a JSON file under
``$SURGE_HOME/sweeps/``. Early stopping is a `stop` of the trial (it checkpoints first, so a
stopped trial can still be resumed by hand).

ASHA (Li et al., 2018): rungs at ``min_steps * eta**k`` steps; when a trial reaches a rung,
its metric there is compared with every trial that reached that rung before it, and it goes
on only if it is in the best ``1/eta`` of them (a trial that is among the first ``eta`` to
reach a rung always goes on: too few to judge). No trial waits for another.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.cli.errors import CliError

METRICS = ("eval_loss", "train_loss")  # lower is better for both
MAX_TRIALS = 1000  # a sweep is jobs in control's queue: more is a typo, not a search


@dataclass(frozen=True)
class Axis:
    """One swept key: the values of a grid, or a range to draw from."""

    key: str
    values: tuple[str, ...] = ()  # a grid's values, as YAML text (what --set takes)
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    integer: bool = False

    @property
    def is_grid(self) -> bool:
        return bool(self.values)


def parse_grid(item: str) -> Axis:
    """``KEY=V1,V2,...`` (``--grid``). Raises CliError (exit 2) naming the option."""
    key, values = _split(item, "--grid", "KEY=V1,V2,...")
    parts = tuple(v.strip() for v in values.split(","))
    if not all(parts):
        raise CliError(f"--grid {item}: an empty value in the list", code=2)
    if twice := sorted({v for v in parts if parts.count(v) > 1}):
        raise CliError(f"--grid {item}: {', '.join(twice)} given twice (two identical trials)", code=2)
    return Axis(key=key, values=parts)


def parse_random(item: str) -> Axis:
    """``KEY=LOW:HIGH`` or ``KEY=LOW:HIGH:log`` (``--random``): uniform (or log-uniform) in
    [LOW, HIGH]; integers when both ends are integers. Raises CliError (exit 2)."""
    key, spec = _split(item, "--random", "KEY=LOW:HIGH[:log]")
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
        raise CliError(f"--random {item}: expected KEY=LOW:HIGH or KEY=LOW:HIGH:log", code=2)
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise CliError(f"--random {item}: LOW and HIGH must be numbers", code=2) from None
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise CliError(f"--random {item}: need finite LOW <= HIGH", code=2)
    log = len(parts) == 3
    if log and low <= 0:
        raise CliError(f"--random {item}: a log range needs LOW > 0", code=2)
    integer = all(_is_int(p) for p in parts[:2])
    return Axis(key=key, low=low, high=high, log=log, integer=integer)


def _split(item: str, option: str, form: str) -> tuple[str, str]:
    key, sep, rest = item.partition("=")
    if not sep or not key.strip() or not rest.strip():
        raise CliError(f"{option} {item!r}: expected {form}", code=2)
    return key.strip(), rest.strip()


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def trials(axes: Sequence[Axis], count: int, seed: int) -> list[dict[str, str]]:
    """The trials' settings (key -> YAML value text): the grid axes' product, each combination
    repeated with ``count`` draws of the random axes (``count`` ignored without random axes;
    draws reproducible from ``seed``). Raises CliError (exit 2) when a key is swept twice or
    nothing is swept."""
    if not axes:
        raise CliError("sweep: give at least one --grid or --random", code=2)
    keys = [a.key for a in axes]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        raise CliError(f"sweep: {', '.join(twice)} swept more than once", code=2)
    grid = [a for a in axes if a.is_grid]
    drawn = [a for a in axes if not a.is_grid]
    rng = random.Random(seed)
    out = []
    for combo in itertools.product(*(a.values for a in grid)):
        for _ in range(count if drawn else 1):
            t = {a.key: v for a, v in zip(grid, combo)}
            t.update({a.key: _draw(a, rng) for a in drawn})
            out.append(t)
            if len(out) > MAX_TRIALS:
                n = math.prod(len(a.values) for a in grid) * (count if drawn else 1)
                raise CliError(f"sweep: {n} trials; at most {MAX_TRIALS} (fewer values or --trials)", code=2)
    return out


def _draw(a: Axis, rng: random.Random) -> str:
    if a.integer and not a.log:
        return str(rng.randint(int(a.low), int(a.high)))
    x = math.exp(rng.uniform(math.log(a.low), math.log(a.high))) if a.log else rng.uniform(a.low, a.high)
    return str(round(x)) if a.integer else f"{x:.6g}"


def rungs(min_steps: int, eta: int, total_steps: int) -> list[int]:
    """ASHA's rungs: ``min_steps * eta**k`` below the trials' ``total_steps``."""
    if min_steps < 1 or eta < 2:
        raise CliError("--early-stop: need --min-steps >= 1 and --eta >= 2", code=2)
    out, r = [], min_steps
    while r < total_steps:
        out.append(r)
        r *= eta
    return out


@dataclass
class Halving:
    """ASHA's bookkeeping for one sweep: each rung's recorded metrics, and the decision when a
    trial reaches a rung (pure: the caller reads the jobs and stops the ones told)."""

    rungs: list[int]
    eta: int
    seen: dict[int, dict[str, float]] = field(default_factory=dict)  # rung -> job -> metric there

    def reached(self, job: str, step: int, metric: float) -> bool:
        """``job`` has trained ``step`` steps with ``metric`` now: record it at every rung it
        passed and not yet recorded; False when it should stop (outside the best ``1/eta`` of
        the trials seen at a rung, counting itself). A NaN metric ranks last."""
        keep = True
        for rung in self.rungs:
            if step < rung:
                break
            at = self.seen.setdefault(rung, {})
            if job in at:
                continue
            at[job] = metric
            if len(at) >= self.eta:
                ranked = sorted(at, key=lambda j: _rank_key(at[j]))
                keep = keep and job in ranked[: max(1, len(ranked) // self.eta)]
        return keep

    def outranked(self, running: set[str]) -> set[str]:
        """The ``running`` trials no longer in the best ``1/eta`` at the highest rung each has
        reached, now that more trials reached it (ASHA judges a trial once, on arrival: the
        first ones to arrive always go on; judged again, a trial that was early but worse
        stops too)."""
        out = set()
        for job in running:
            reached = [r for r in self.rungs if job in self.seen.get(r, {})]
            if not reached:
                continue
            at = self.seen[reached[-1]]
            if (
                len(at) >= self.eta
                and job not in sorted(at, key=lambda j: _rank_key(at[j]))[: max(1, len(at) // self.eta)]
            ):
                out.add(job)
        return out


def _rank_key(x: float) -> tuple[int, float]:
    return (1, 0.0) if math.isnan(x) else (0, x)


def ranked(results: dict[str, float]) -> list[str]:
    """Jobs best first (lowest metric; NaN last)."""
    return sorted(results, key=lambda j: _rank_key(results[j]))
