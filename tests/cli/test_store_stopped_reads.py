"""`surgectl checkpoints` and `surgectl plot J` with the real store process SIGSTOPped (an operator's
trial, session 35: `checkpoints` took 19.5 s before its one-line error, `plot` 30.7 s before it fell
back to the local file: each read waited out gRPC's handshake timeout). Both now ask the store's
health check first (status's one check, ``clients.store_outage``, 2 s): `checkpoints` ends in one
line saying the store did not answer it, exit 1; `plot` reads this machine's file at once and says
why. Control is a stand-in gRPC server; the store is ``python -m services.store``."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from services.cli import observe
from tests.conftest import stop_process
from tests.store.test_store_service import store  # noqa: F401 (the real service's fixture)

from .test_housekeeping import run_cli
from .test_status_store_outage import write_stack
from .test_status_store_stopped import control  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# The old code waited out gRPC's ~20 s handshake timeout (19.5 s, 30.7 s): a deadline, not the
# machine's load, so a bound well under it holds on a loaded 2-core host.
BOUND_S = 15.0


@pytest.fixture
def stopped_store(store) -> Iterator[tuple[int, int]]:  # noqa: F811
    """The real store (test_store_service's fixture), answering, then SIGSTOPped; continued
    before that fixture ends it."""
    stop_process(store.proc.pid)
    try:
        yield store.proc.pid, store.port
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)


def _timed(args, monkeypatch, capsys):
    started = time.monotonic()
    code, out, err = run_cli(args, monkeypatch, capsys)
    return code, out + err, time.monotonic() - started


def test_checkpoints_and_plot_answer_in_seconds_with_the_store_stopped(
    surge_home,
    control,  # noqa: F811
    stopped_store,
    monkeypatch,
    capsys,
    tmp_path,
):
    monkeypatch.setenv("COLUMNS", "400")
    pid, port = stopped_store
    write_stack(control, pid, port)

    code, out, took = _timed(["checkpoints"], monkeypatch, capsys)
    assert code == 1, out
    assert "checkpoints: the store did not answer its health check in 2 s" in out, out
    assert f"127.0.0.1:{port}" in out, out
    assert took < BOUND_S, took
    code, out, took = _timed(["checkpoints", "--verify"], monkeypatch, capsys)
    assert code == 1 and "did not answer its health check" in out and took < BOUND_S, (out, took)

    local = observe.metrics_file("j-1")  # this machine's records of the job
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(
        "".join(
            json.dumps({"type": "step", "rank": 0, "step": s, "loss": 3.0 - s / 10, "tokens_per_second": 100.0}) + "\n"
            for s in (1, 2, 3)
        )
    )
    png = tmp_path / "j.png"
    code, out, took = _timed(["plot", "j-1", "--out", str(png)], monkeypatch, capsys)
    assert code == 0, out
    assert f"the store did not answer its health check in 2 s (store unreachable at 127.0.0.1:{port}" in out, out
    assert f"read {local} instead" in out and f"wrote {png} (3 steps from {local})" in out, out
    assert png.is_file()
    assert took < BOUND_S, took
