"""Logs: every service's and rank's log file is JSON lines (one event per line, with service,
job, rank, step), a terminal gets the human renderer, a job-wide line is written once and
not once per rank, and `surgectl logs` gets a job's rank logs from control (StreamLogs)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.observability.conftest import cli

FIRST = ["timestamp", "level", "service"]


def _lines(path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]


def _json_or_none(line: str):
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@pytest.mark.integration
def test_every_service_and_rank_log_of_the_stack_is_json_lines(obs_stack):
    not_json = []
    for name, s in obs_stack.services.items():
        lines = _lines(obs_stack.home / "run" / "logs" / f"{name}.log")
        assert lines, f"{name}.log is empty"
        for i, line in enumerate(lines, 1):
            record = _json_or_none(line)
            if record is None:
                not_json.append(f"{name}.log:{i}: {line[:160]}")
                continue
            assert list(record)[:3] == FIRST and record["event"], (name, record)
            assert record["service"] == ("worker" if name.startswith("worker") else name), (name, record)
    steps = set()
    for rank in (0, 1):
        path = obs_stack.home / "run" / "logs" / f"{obs_stack.job_id}.rank{rank}.log"
        for i, line in enumerate(_lines(path), 1):
            record = _json_or_none(line)
            if record is None:
                not_json.append(f"{path.name}:{i}: {line[:160]}")
                continue
            assert (record["service"], record["job"], record["rank"]) == ("rank", obs_stack.job_id, rank), record
            if "step" in record:
                steps.add(record["step"])
    assert not_json == [], "lines that are not JSON:\n" + "\n".join(not_json)
    assert steps, "no rank log line carries the step"


@pytest.mark.integration
def test_surgectl_logs_merges_the_ranks_and_follow_ends_with_the_job(obs_stack):
    job = obs_stack.job_id
    r = cli(obs_stack.home, "logs", job)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(" rank 0" in line for line in lines) and any(" rank 1" in line for line in lines)

    # The lines come from control (StreamLogs), not from this machine's files: every rank
    # line of the job, as its node agent wrote it.
    via_control = cli(obs_stack.home, "logs", job, "-o", "json")
    assert via_control.returncode == 0, via_control.stderr
    on_disk = sorted(line for rank in (0, 1)
                     for line in _lines(obs_stack.home / "run" / "logs" / f"{job}.rank{rank}.log"))
    assert sorted(via_control.stdout.splitlines()) == on_disk

    as_json = cli(obs_stack.home, "logs", job, "--rank", "1", "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert records and {x["rank"] for x in records} == {1}
    stamps = [x["timestamp"] for x in records]
    assert stamps == sorted(stamps)

    followed = cli(obs_stack.home, "logs", job, "--follow", timeout=60)  # the job has ended: it returns
    assert followed.returncode == 0, followed.stderr
    assert len(followed.stdout.splitlines()) == len(lines)


@pytest.mark.integration
def test_surgectl_logs_errors_are_one_line(obs_stack):
    for args, words in ((("logs", "no-such-job"), "no-such-job"),
                        (("logs", obs_stack.job_id, "--rank", "7"), "no log of rank 7"),
                        (("logs", obs_stack.job_id, "-o", "yaml"), "--output")):
        r = cli(obs_stack.home, *args)
        assert r.returncode != 0 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


PROGRAM = textwrap.dedent("""
    import logging, sys, threading, structlog
    from services.common import logs
    module_level = structlog.get_logger("orchestrator")
    rank = int(sys.argv[1])
    log = logs.configure("rank", job="j1", rank=rank)
    log = logs.configure("rank", job="j1", rank=rank)  # a second call replaces, never doubles
    log.info("composed", world_size=2)
    log.info("job_wide", once=True)
    logs.bind(step=3)
    module_level.warning("from a module logger", job_id="j1")
    logging.getLogger("grpc").warning("from the logging module")
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("failed")
    raise RuntimeError("nobody caught this")
""")


def _run(rank: int, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("SURGE_LOG_FORMAT", "SURGE_LOG_LEVEL")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", PROGRAM, str(rank)], cwd=REPO, capture_output=True, text=True,
                          env=full, timeout=60)


def test_configure_writes_one_json_object_per_event_with_service_job_rank_step():
    r = _run(0)
    lines = r.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # every line is JSON, tracebacks included
    assert [x["event"] for x in records] == [
        "composed", "job_wide", "from a module logger", "from the logging module", "failed", "uncaught_exception"]
    for x in records:
        assert list(x)[:5] == ["timestamp", "level", "service", "job", "rank"] and (x["service"], x["job"], x["rank"]) == ("rank", "j1", 0)
    assert [x.get("step") for x in records] == [None, None, 3, 3, 3, 3]
    assert "job_id" not in records[2] and records[2]["logger"] == "orchestrator"
    assert "ZeroDivisionError" in records[4]["exception"]
    assert records[5]["error"] == "RuntimeError: nobody caught this" and r.returncode == 1


def test_a_job_wide_line_is_written_by_rank_0_only():
    events = [json.loads(line)["event"] for line in _run(1).stderr.splitlines()]
    assert "job_wide" not in events and events.count("composed") == 1


def test_a_terminal_gets_the_human_console_renderer():
    main, sub = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-c", PROGRAM, "0"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=sub,
                                env={k: v for k, v in os.environ.items() if k != "SURGE_LOG_FORMAT"})
        os.close(sub)
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=60)
    finally:
        os.close(main)
    text = out.decode(errors="replace")
    assert "composed" in text and "world_size" in text
    assert not text.lstrip().startswith("{"), text[:300]
