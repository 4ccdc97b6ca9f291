"""A job page of a large job stays small (issue 31): the dashboard asks the real store for one
rank's records and a chart's points, not the job's whole metrics file; a spike still shows.
The real `python -m services.store` process; control's answers canned (synthetic_records.py)."""

from __future__ import annotations

import re

import pytest

from services.common.metric_select import CHART_POINTS
from services.contract import control_pb2
from services.dashboard.server import Dashboard
from tests.dashboard.synthetic_records import SPIKE_EVERY, StoreOnlySources, write_job
from tests.store.test_store_service import Store, store  # noqa: F401 - the real service's fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS, RANKS = 24_000, 4
PAGE_BYTES = 600_000  # the page of a 2,000-step job is ~240 KB; every step of this one drew ~1.9 MB


def test_a_24000_step_jobs_page_carries_a_charts_points_of_the_rank_asked_and_its_spikes(store):  # noqa: F811
    metrics = store.root / "metrics"
    write_job(metrics / "big.jsonl", "big", STEPS, RANKS)
    status = control_pb2.JobStatus(
        job_id="big", name="big", state=control_pb2.RUNNING, step=STEPS, total_steps=STEPS, world_size=RANKS, dp=RANKS
    )
    sources = StoreOnlySources(f"127.0.0.1:{store.port}", {"big": status})
    try:
        page = Dashboard(sources).job("big", {"rank": ["3"]})
        assert len(page.encode()) < PAGE_BYTES, len(page.encode())
        points = {m[0]: int(m[1]) for m in re.findall(r'id="chart-([a-z-]+)" data-points="(\d+)"', page)}
        assert set(points) == {"loss", "lr", "grad-norm", "tokens-per-second"}
        assert 0 < max(points.values()) <= CHART_POINTS
        assert "rank 3." in page and 'name=rank min=0 value="3"' in page

        curves = sources.job_records("big", rank=3).series
        assert curves.rank == 3 and len(curves.steps) <= CHART_POINTS
        assert {1, STEPS} <= set(curves.steps)
        spikes = [s for s in range(SPIKE_EVERY, STEPS + 1, SPIKE_EVERY)]
        at = dict(zip(curves.steps, curves.loss))
        assert all(at.get(s, 0) > 30 for s in spikes), [(s, at.get(s)) for s in spikes]
        assert curves.eval_steps == list(range(1000, STEPS + 1, 1000))  # (held-out points: every one)
    finally:
        sources.close()
