"""Footprint on the real stack (issue 29 item 8): with small bounds, every rank's log file is
rotated while a dp 2 job trains, `surgectl logs` reads each rank's lines across the rotations
(from the files, and through control from the node agents), each rank is named once as logging
too fast (one warning event, not one per line), and the store's metric records rotate and
compact while `surgectl plot` still draws the whole run. Memory copies' room check: unit-tested
(tests/worker/test_memory_copies.py), no cgroup is bounded here."""

from __future__ import annotations

import contextlib
import json
import re
import time

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

    def read_on_disk() -> list[str]:
        lines: list[str] = []
        for rank in (0, 1):
            rotated = sorted(logs.glob(f"{job}.rank{rank}.log.*"), key=lambda f: -int(f.suffix[1:]))
            assert rotated, f"rank {rank}'s log was not rotated"
            files = [*rotated, logs / f"{job}.rank{rank}.log"]
            assert all(f.stat().st_size <= 1024 + 4096 for f in files)  # (a file may end with one long line)
            lines += [line for f in files for line in f.read_text(errors="replace").splitlines() if line.strip()]
        return lines

    # The job's end is decided once its ranks exited; the node agent's log pump may still be
    # writing a rank's last line (its pipe drained after the exit): read once the files settle.
    on_disk, deadline = read_on_disk(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = read_on_disk()
        if again == on_disk:
            break
        on_disk = again

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

    # A rank waits at most SURGE_METRICS_FLUSH_S (5 s) for the store's ack of its last records,
    # then exits (training is not held up for it: metrics_client.py) while its node agent still
    # holds and delivers them: they may reach the store after the job ended (session 36's
    # reading). Plot once the store has rank 0's last step; never arriving is a loss, and fails
    # here. (Session 40: ci8's failure here, rank 0's steps 33-40 not in the store's files, was
    # a loss, not a delay: each node's agent has its own stream, rank 1's records reached the
    # store up to ~26 steps after rank 0's of the same step, rank 0's newest records were
    # rotated out first and thinned away; the compaction keeps each rank's newest step now,
    # tests/store/test_metric_files.py. Under load 5-19, 45 runs: rank 0's step 40 was in the
    # file before this test saw the job's end, every run.)
    def records() -> dict[str, list[tuple[int, int]]]:
        """Each metric file's step records, (rank, step), in the file's order."""
        seen: dict[str, list[tuple[int, int]]] = {}
        for f in sorted(metrics.glob(f"{job}.jsonl*")):
            with contextlib.suppress(FileNotFoundError):  # (rotated or compacted meanwhile)
                for line in f.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        r = json.loads(line)
                        if r.get("type") == "step":
                            seen.setdefault(f.name, []).append((r.get("rank"), r.get("step")))
        return seen

    def rank0_steps(seen: dict[str, list[tuple[int, int]]]) -> set[int]:
        return {step for file in seen.values() for rank, step in file if rank == 0}

    deadline = time.monotonic() + 30
    while 40 not in rank0_steps(seen := records()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 40 in rank0_steps(seen), seen  # (each file's (rank, step) records: thinned away, or never came)
    plot = cli(stack.home, "plot", job, "--out", str(stack.home / "p.png"))
    drawn = re.search(r"\((\d+ steps|\d+ of steps 1-40) from ", plot.stdout)  # (a chart's points of steps 1-40)
    assert plot.returncode == 0 and drawn, plot.stdout + plot.stderr
    h = observe.history_from_jsonl(metrics / f"{job}.jsonl")  # what plot drew: the whole run
    assert (h.steps[0], h.steps[-1]) == (1, 40) and h.steps == sorted(h.steps)
