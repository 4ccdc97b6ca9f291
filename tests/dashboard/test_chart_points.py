"""A chart draws at most charts.MOST_POINTS points a line whatever its source (control's sampled
events are not thinned by the store), each run's first, last, lowest and highest kept."""

from __future__ import annotations

import math
import re

from services.dashboard import charts, pages


def test_a_long_line_is_thinned_to_the_bound_keeping_its_ends_and_spikes():
    x = list(range(1, 50_001))
    y = [2.0 + 1.0 / s for s in x]
    y[12_345], y[40_000], y[777] = 40.0, 0.01, math.nan
    line = charts.thin(charts.Line("train", x, y))
    assert len(line.x) <= charts.MOST_POINTS and line.x == sorted(line.x)
    assert {1, 50_000, 12_346, 40_001} <= set(line.x) and 778 not in line.x
    assert dict(zip(line.x, line.y))[12_346] == 40.0
    short = charts.Line("train", [1, 2, 3], [1.0, 2.0, 3.0])
    assert charts.thin(short) is short  # (within the bound: the line itself)


def test_a_chart_of_a_long_line_says_and_draws_at_most_the_bound():
    x = list(range(1, 20_001))
    html = pages.chart("loss", "loss", "nats", [charts.Line("train", x, [1.0 + (s % 7) for s in x])])
    (points,) = re.findall(r'data-points="(\d+)"', html)
    assert 0 < int(points) <= charts.MOST_POINTS
