"""Footprint on the real stack (issue 29 item 8): with small bounds, every rank's log file is
rotated while a dp 2 job trains, `surgectl logs` reads each rank's lines across the rotations
(from the files, and through control from the node agents), each rank is named once as logging
too fast (one warning event, not one per line), and the store's metric records rotate and
compact while `surgectl plot` still draws the whole run. Memory copies' room check: unit-tested
(tests/worker/test_memory_copies.py), no cgroup is bounded here."""

from __future__ import annotations

import json

import pytest

from services.cli import observe
from tests.faults.test_recovery import JobOutcome, JobState, cli, of_type, running_stack, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ENV = {
    "SURGE_WORKER_RANK_LOG_MAX_BYTES": "1024",
    "SURGE_WORKER_RANK_LOG_BACKUPS": "50",  # (every line kept: the test compares them all)
    "SURGE_WORKER_RANK_LOG_FLOOD_BYTES_PER_S": "1",  # any rank that logs at all is "too fast" ...
    "SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S": "1",  # ... over a second (a short job's ranks live < 10 s)
    "SURGE_STORE_METRICS_MAX_BYTES": "4096",
    "SURGE_STORE_METRICS_BACKUPS": "1",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("surge-footprint"), ("json",), ("footprint",), env=ENV) as s:
        yield s


def test_bounded_rank_logs_and_metric_files_are_read_whole_and_a_fast_rank_is_named_once(stack):
    job = stack.submit(spec("footprint", steps=40, every=10))
    events = stack.events(job)
    status = events[-1].status
    assert (status.state, status.outcome) == (JobState.TERMINATED, JobOutcome.FINISHED), events[-1].message

    logs = stack.home / "run" / "logs"
    on_disk: list[str] = []
    for rank in (0, 1):
        rotated = sorted(logs.glob(f"{job}.rank{rank}.log.*"), key=lambda f: -int(f.suffix[1:]))
        assert rotated, f"rank {rank}'s log was not rotated"
        files = [*rotated, logs / f"{job}.rank{rank}.log"]
        assert all(f.stat().st_size <= 1024 + 4096 for f in files)  # (a file may end with one long line)
        on_disk += [line for f in files for line in f.read_text(errors="replace").splitlines() if line.strip()]

    local = cli(stack.home, "logs", job, "-o", "json")  # the local stack: the files, oldest first
    assert local.returncode == 0, local.stderr
    assert sorted(local.stdout.splitlines()) == sorted(on_disk)
    control = json.loads((stack.home / "run" / "stack.json").read_text())["services"]["control"]["port"]
    streamed = cli(stack.home, "logs", job, "-o", "json", env={"SURGE_CONTROL_ADDRESS": f"127.0.0.1:{control}"})
    assert streamed.returncode == 0, streamed.stderr  # the node agents' tails, across the rotations
    assert sorted(streamed.stdout.splitlines()) == sorted(on_disk)

    floods = [m for m in of_type(events, "fault") if "rank_log_flood" in m]
    assert sorted(m.split(": rank ")[1][0] for m in floods) == ["0", "1"], floods  # each rank once
    assert all(m.startswith("MINOR rank_log_flood: rank ") for m in floods)

    metrics = stack.home / "store" / "metrics"
    assert (metrics / f"{job}.jsonl.1").exists()  # rotated
    plot = cli(stack.home, "plot", job, "--out", str(stack.home / "p.png"))
    assert plot.returncode == 0 and "steps from" in plot.stdout, plot.stdout + plot.stderr
    h = observe.history_from_jsonl(metrics / f"{job}.jsonl")  # what plot drew: the whole run
    assert (h.steps[0], h.steps[-1]) == (1, 40) and h.steps == sorted(h.steps)
