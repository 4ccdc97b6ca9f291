"""ReadMetrics' rank filter and point budget (issue 31: a page of a 100,000-step x 64-rank job):
the selection as a pure function, then through the real `python -m services.store` process."""

from __future__ import annotations

import json
import math

import pytest

from services.common.metric_select import CURVES, PER_BUCKET, Selection, select, select_text
from services.contract import store_pb2, store_pb2_grpc
from tests.callers import any_caller_channel
from tests.store.test_store_service import Store, store  # noqa: F401 - the real service's fixture

SPIKES = {1234: ("loss", 40.0), 4321: ("grad_norm", 1e4), 7777: ("tokens_per_second", 1.0), 9001: ("loss", "NaN")}


def step_line(rank: int, step: int, compact: bool = True, **values) -> str:
    record = {
        "type": "step",
        "job_id": "j",
        "rank": rank,
        "step": step,
        "loss": 2.0 + 5.0 / math.sqrt(step) + (step * 7919 % 101) / 1000,
        "learning_rate": 3e-4 * min(1.0, step / 500),
        "grad_norm": 1.0 + (step * 104729 % 97) / 1000,
        "tokens_per_second": 1000.0 + step % 13,
    }
    record.update(values)
    return json.dumps(record, separators=(",", ":") if compact else (", ", ": ")) + "\n"


def job_text(steps: int, ranks: int) -> str:
    lines = []
    for step in range(1, steps + 1):
        for rank in range(ranks):
            curve, value = SPIKES.get(step, (None, None))
            lines.append(step_line(rank, step, **({curve: value} if curve else {})))
            if step % 1000 == 0:
                lines.append(
                    json.dumps({"type": "eval", "job_id": "j", "rank": rank, "step": step, "loss": 2.5}) + "\n"
                )
    return "".join(lines)


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def value(r: dict, curve: str) -> float:
    v = r[curve]
    return float(v) if isinstance(v, str) else v


def width_for(steps: list[int], points: int) -> int:
    """The buckets' width the module docstring says: the smallest power of two that makes at
    most ``points // PER_BUCKET`` buckets."""
    w = 1
    while len({s // w for s in steps}) > points // PER_BUCKET:
        w *= 2
    return w


def test_only_the_ranks_asked_come_back_compact_or_spaced_and_a_record_naming_none_is_rank_0s():
    text = "".join(step_line(r, s, compact=bool(s % 2)) for s in range(1, 41) for r in range(12))
    text += '{"type":"scores","job_id":"j","step":40,"scores":{"ppl":9}}\n'  # (no "rank": rank 0's)
    for ranks in ({3}, {0, 11}, {10}):
        got = records(select_text(text, Selection(ranks=frozenset(ranks))))
        assert {r.get("rank", 0) for r in got} == ranks
        assert len([r for r in got if r["type"] == "step"]) == 40 * len(ranks)
        assert any(r["type"] == "scores" for r in got) == (0 in ranks)
    assert select_text(text, Selection()) == text  # (nothing asked: every record, as before)


def test_the_budget_bounds_each_ranks_step_records_and_keeps_every_buckets_first_last_and_extremes():
    steps, points = 10_000, 400
    text = job_text(steps, 3)
    got = records(select_text(text, Selection(ranks=frozenset({1}), points=points)))
    kept = [r for r in got if r["type"] == "step"]
    assert {r["rank"] for r in got} == {1}
    assert 0 < len(kept) <= points
    assert [r["step"] for r in kept] == sorted({r["step"] for r in kept})  # (by step, each once)
    assert [r["step"] for r in got if r["type"] == "eval"] == list(range(1000, steps + 1, 1000))  # (all of them)
    kept_steps = {r["step"] for r in kept}
    assert set(SPIKES) <= kept_steps  # every spike, the NaN one too
    assert {1, steps} <= kept_steps
    # Every bucket's first, last, lowest and highest of each curve, as the docstring says.
    every = [r for r in records(text) if r["type"] == "step" and r["rank"] == 1]
    w = width_for([r["step"] for r in every], points)
    buckets: dict[int, list[dict]] = {}
    for r in every:
        buckets.setdefault(r["step"] // w, []).append(r)
    for members in buckets.values():
        assert {members[0]["step"], members[-1]["step"]} <= kept_steps
        for curve in CURVES:
            numbers = [m for m in members if not math.isnan(value(m, curve))]
            low = min(numbers, key=lambda m: value(m, curve))
            high = max(members, key=lambda m: math.inf if math.isnan(value(m, curve)) else value(m, curve))
            assert value(low, curve) in {value(k, curve) for k in kept if k["step"] // w == low["step"] // w}
            assert high["step"] in kept_steps or value(high, curve) in {
                value(k, curve) for k in kept if k["step"] // w == high["step"] // w
            }


def test_a_rank_within_the_budget_keeps_every_step_and_a_replayed_step_only_its_last_record():
    first = "".join(step_line(0, s, loss=9.0) for s in range(1, 101))
    replay = "".join(step_line(0, s, loss=1.0) for s in range(60, 121))  # (after a rollback to step 59)
    got = [r for r in records(select_text(first + replay, Selection(ranks=frozenset({0}), points=500)))]
    assert [r["step"] for r in got] == list(range(1, 121))
    assert {r["loss"] for r in got if r["step"] >= 60} == {1.0}
    # Thinned: no record the replay superseded survives.
    first = "".join(step_line(0, s, loss=50.0 if s % 97 == 0 else 3.0) for s in range(1, 3001))
    replay = "".join(step_line(0, s, loss=2.0) for s in range(1500, 3001))
    got = records(select_text(first + replay, Selection(ranks=frozenset({0}), points=100)))
    assert len(got) <= 100
    assert all(r["loss"] == 2.0 for r in got if r["step"] >= 1500)
    assert any(r["loss"] == 50.0 for r in got if r["step"] < 1500)  # (a spike before the rollback stays)


def test_the_selection_reads_block_by_block_as_the_store_streams_them():
    text = job_text(3000, 4).encode()
    blocks, rest = [], text
    while rest:  # (whole lines, ~64 KiB each, as metric_files.lines cuts them)
        cut = rest.rfind(b"\n", 0, 1 << 16) + 1 or len(rest)
        blocks.append(rest[:cut])
        rest = rest[cut:]
    sel = Selection(ranks=frozenset({2}), points=300)
    assert b"".join(select(blocks, sel)) == b"".join(select([text], sel))


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_read_metrics_returns_only_the_rank_asked_within_the_budget_and_old_callers_get_every_record(store):  # noqa: F811
    metrics = store.root / "metrics"
    metrics.mkdir(parents=True, exist_ok=True)
    text = job_text(6000, 8)
    (metrics / "big.jsonl").write_text(text)
    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)

        def read(**query) -> list[dict]:
            parts = list(stub.ReadMetrics(store_pb2.MetricsQuery(job_id="big", **query), timeout=60))
            assert parts[0].found
            return records(b"".join(p.text for p in parts[1:]).decode())

        got = read(ranks=[5], points=1000)
        steps = [r for r in got if r["type"] == "step"]
        assert {r["rank"] for r in got} == {5} and 0 < len(steps) <= 1000
        assert {s for s in SPIKES if s <= 6000} <= {r["step"] for r in steps}
        assert len([r for r in read(ranks=[5]) if r["type"] == "step"]) == 6000  # no budget: every step
        assert len(read(type="eval", ranks=[0, 7], points=10)) == 12  # (evaluations are never thinned)
        assert read() == records(text)  # an old caller: every record, in the order written
