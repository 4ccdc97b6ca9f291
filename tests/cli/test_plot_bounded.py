"""`surgectl plot` of a large job reads one rank and a chart's points (issue 31), through the
real `python -m services.store` process, and the same selection from the local file when the
store is down; a --rank the job lacks still names the ranks present. Control is not running:
the job id is taken as given (services/cli/job_records.py)."""

from __future__ import annotations

import re
import signal

import pytest

from services.common.metric_select import CHART_POINTS
from tests.cli.test_housekeeping import assert_one_line, run_cli
from tests.dashboard.synthetic_records import write_job
from tests.store.test_store_service import Store, store  # noqa: F401 - the real service's fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def drawn(out: str) -> int:
    m = re.search(r"\((\d+) of steps 1-(\d+) from ", out)  # (a chart's points of every step)
    assert m and int(m.group(2)) == 12_000, out
    return int(m.group(1))


def test_plot_of_a_12000_step_job_draws_a_charts_points_from_the_store_or_the_local_file(
    store,  # noqa: F811
    surge_home,
    tmp_path,
    monkeypatch,
    capsys,
):
    write_job(store.root / "metrics" / "big.jsonl", "big", 12_000, 4)
    monkeypatch.setenv("SURGE_STORE_ROOT", str(store.root))
    monkeypatch.setenv("SURGE_STORE_ADDRESS", f"127.0.0.1:{store.port}")
    png = tmp_path / "big.png"
    code, out, err = run_cli(["plot", "big", "--out", str(png)], monkeypatch, capsys)
    assert code == 0 and "from the store" in out and png.is_file(), out + err
    assert 400 < drawn(out) <= CHART_POINTS
    code, out, err = run_cli(["plot", "big", "--rank", "3", "--out", str(png)], monkeypatch, capsys)
    assert code == 0 and 400 < drawn(out) <= CHART_POINTS, out + err
    code, _, err = run_cli(["plot", "big", "--rank", "9", "--out", str(png)], monkeypatch, capsys)
    assert_one_line(code, err, 2, "--rank 9", "ranks present: 0, 1, 2, 3")

    store.proc.send_signal(signal.SIGTERM)  # the stack down: the local file, the same selection
    assert store.proc.wait(timeout=30) == 0
    code, out, err = run_cli(["plot", "big", "--out", str(png)], monkeypatch, capsys)
    assert code == 0 and f"from {store.root / 'metrics' / 'big.jsonl'}" in out, out + err
    assert 400 < drawn(out) <= CHART_POINTS
