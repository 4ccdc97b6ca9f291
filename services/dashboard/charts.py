"""Charts as SVG, drawn by matplotlib (already a dependency: `surgectl plot`), server-side.

matplotlib's object API (``Figure`` with its own SVG canvas), never ``pyplot``: pyplot keeps
global state and the HTTP server draws pages on several threads at once.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure


@dataclass(frozen=True)
class Line:
    """One curve: ``label`` in the legend, ``x`` steps, ``y`` values (NaN: no point);
    ``points`` draws markers only (held-out loss: a point per evaluation)."""

    label: str
    x: list[int]
    y: list[float]
    points: bool = False


MOST_POINTS = 2000  # a line's points drawn at most (a chart is 700 pixels wide): ``thin``
CACHED = 64  # charts kept: a finished job's page (and every reload of it) draws nothing again
_cache: OrderedDict[tuple, str] = OrderedDict()
_cache_lock = threading.Lock()


def svg(title: str, ylabel: str, lines: list[Line], log_y: bool = False) -> str:
    """``draw``'s SVG of ``lines``, each :func:`thin`-ned to ``MOST_POINTS``, from a small
    cache keyed by the data itself (drawing one is a few hundred milliseconds of matplotlib;
    the same curves make the same chart)."""
    lines = [thin(ln) for ln in lines]
    key = (title, ylabel, log_y, tuple((ln.label, tuple(ln.x), tuple(ln.y), ln.points) for ln in lines))
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    out = draw(title, ylabel, lines, log_y)
    with _cache_lock:
        _cache[key] = out
        while len(_cache) > CACHED:
            _cache.popitem(last=False)
    return out


def thin(line: Line, most: int = MOST_POINTS) -> Line:
    """``line`` with at most about ``most`` points: its points in ``most // 4`` runs of
    consecutive ones, each keeping its first, last, lowest and highest (M4, as the store
    thins records: services/common/metric_select.py), so a spike still shows. The store's
    curves come thinned already; this bounds the rest (control's event history, a long run's
    held-out points). NaN points are dropped first (the chart draws none)."""
    pts = [(x, y) for x, y in zip(line.x, line.y) if not math.isnan(y)]
    if len(pts) <= most:
        return (
            line if len(pts) == len(line.x) else Line(line.label, [p[0] for p in pts], [p[1] for p in pts], line.points)
        )
    runs = max(1, most // 4)
    size = -(-len(pts) // runs)
    kept: list[tuple[int, float]] = []
    for i in range(0, len(pts), size):
        run = pts[i : i + size]
        keep = {
            0,
            len(run) - 1,
            min(range(len(run)), key=lambda j: run[j][1]),
            max(range(len(run)), key=lambda j: run[j][1]),
        }
        kept.extend(run[j] for j in sorted(keep))
    return Line(line.label, [p[0] for p in kept], [p[1] for p in kept], line.points)


def warm_up() -> None:
    """Draw one chart and throw it away: matplotlib loads its fonts at the first draw (about a
    second), which the composition root spends at start-up rather than in the first page."""
    draw("", "", [Line("", [0, 1], [1.0, 0.5])])


def draw(title: str, ylabel: str, lines: list[Line], log_y: bool = False) -> str:
    """An SVG document of ``lines`` against step (bytes of text, UTF-8), 7 x 2.6 inches.

    ``log_y``: a log scale, taken only when every value is positive (a loss can be 0 or NaN
    early on; matplotlib would warn and drop them)."""
    # Fixed margins, not layout="constrained": that solver doubled a chart's drawing time
    # (0.16 s against 0.30 s on a loaded 2-core host) and the axes' text fits these.
    fig = Figure(figsize=(7, 2.6), dpi=100)
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.18, top=0.88)
    FigureCanvasSVG(fig)
    ax = fig.add_subplot()
    drawn = False
    for i, line in enumerate(lines):
        pts = [(x, y) for x, y in zip(line.x, line.y) if not math.isnan(y)]
        if not pts:
            continue
        xs, ys = zip(*pts)
        colour = f"C{i % 10}"
        if line.points:
            ax.plot(xs, ys, "o--", ms=3, lw=0.8, color=colour, label=line.label)
        else:
            ax.plot(xs, ys, lw=1.2, color=colour, label=line.label)
        drawn = True
    values = [y for line in lines for y in line.y if not math.isnan(y)]
    if log_y and values and min(values) > 0:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    if drawn and len(lines) > 1:
        ax.legend(fontsize=7)
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None})  # (no date: the same data, the same bytes)
    return out.getvalue()
