"""bench/profile_overhead.py's arithmetic: the profiled steps against the steps before them
(step time and the job's tokens/s), the step after (the export), and a rank without a profile
or records refused by name."""

from __future__ import annotations

import pytest

from bench.profile_overhead import overhead
from services.contract import engine_pb2


def records(times: dict[int, float], tokens: int = 400) -> list[dict]:
    """Step records as the store writes them: the job's tokens/s is its tokens over the step."""
    return [{"step": s, "step_seconds": t, "tokens_per_second": tokens / t} for s, t in sorted(times.items())]


def test_the_overhead_is_the_profiled_median_over_the_median_before():
    rec = engine_pb2.ProfileRecorded(rank=1, first_step=9, last_step=10, bytes=1234, seconds=0.9)
    times = {s: 0.40 for s in range(1, 9)} | {9: 0.48, 10: 0.52, 11: 1.4, 12: 0.4}
    times[3] = 5.0  # (a slow step long before: outside the 4 x steps window)
    out = overhead(2, [rec], {1: records(times)})
    r = out["ranks"][1]
    assert r["step_seconds_before_median"] == 0.4 and r["step_seconds_profiled_median"] == 0.5
    assert r["overhead_percent_while_tracing"] == 25.0 and r["step_seconds_after"] == 1.4
    assert (r["trace_bytes"], r["steps"]) == (1234, [9, 10])
    # Tokens/s without the profiler (the steps before) and with it, and the throughput lost.
    assert r["tokens_per_second_without_profiler_median"] == 1000.0
    assert r["tokens_per_second_profiled_median"] == pytest.approx(801.3, abs=0.1)  # (833.3 + 769.2) / 2
    assert r["throughput_overhead_percent"] == 19.9


def test_a_rank_that_recorded_nothing_or_has_no_records_is_named():
    with pytest.raises(RuntimeError, match="rank 0: disk full"):
        overhead(1, [engine_pb2.ProfileRecorded(rank=0, error="disk full")], {})
    with pytest.raises(RuntimeError, match="rank 2: no step records around steps 5-5"):
        overhead(1, [engine_pb2.ProfileRecorded(rank=2, first_step=5, last_step=5)], {2: []})
