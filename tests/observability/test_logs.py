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
import time

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
    for name in obs_stack.services:
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

    # Through control (StreamLogs: an address given, as from another machine) the lines are
    # the same: every rank line of the job once, as its node agent wrote it. (On the local
    # stack's machine `logs` reads the files, every session's lines.)
    control = f"127.0.0.1:{obs_stack.services['control']['port']}"
    via_control = cli(obs_stack.home, "logs", job, "-o", "json", env={"SURGE_CONTROL_ADDRESS": control})
    assert via_control.returncode == 0, via_control.stderr
    on_disk = sorted(
        line for rank in (0, 1) for line in _lines(obs_stack.home / "run" / "logs" / f"{job}.rank{rank}.log")
    )
    assert sorted(via_control.stdout.splitlines()) == on_disk
    local = cli(obs_stack.home, "logs", job, "-o", "json")
    assert local.returncode == 0 and sorted(local.stdout.splitlines()) == on_disk, local.stderr

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
    for args, words in (
        (("logs", "no-such-job"), "no-such-job"),
        (("logs", obs_stack.job_id, "--rank", "7"), "no log of rank 7"),
        (("logs", obs_stack.job_id, "--follow", "--rank", "7"), "--rank 7: no such rank"),  # (not waited for)
        (("logs", obs_stack.job_id, "-o", "yaml"), "--output"),
    ):
        r = cli(obs_stack.home, *args)
        assert r.returncode == 2 and words in r.stderr, r.stderr  # (rank 7 of a dp 2 job: no such rank)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _record(stamp: str, rank: int, event: str) -> str:
    return json.dumps({"timestamp": f"2026-11-29T20:00:{stamp}Z", "level": "info", "rank": rank, "event": event})


def test_follow_merges_each_poll_of_the_rank_files_by_timestamp(tmp_path):
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    r0, r1 = logs_dir / "j.rank0.log", logs_dir / "j.rank1.log"
    # Poll 1: rank 0's file is read first but holds the later lines of each pair; rank 1
    # has a line that is not JSON (it sorts after its rank's previous line) and rank 0 a
    # line still being written (no newline yet).
    r0.write_text(_record("01.000", 0, "a") + "\n" + _record("03.000", 0, "c") + "\n" + _record("06.0", 0, "f")[:20])
    r1.write_text(_record("02.000", 1, "b") + "\nTraceback (not json)\n" + _record("04.000", 1, "d") + "\n")
    asked = []

    def finished() -> bool:
        asked.append(1)
        if len(asked) == 2:  # between poll 1 and poll 2: both files grow, rank 0's line ends
            with open(r0, "a") as f:
                f.write(_record("06.0", 0, "f")[20:] + "\n")
            with open(r1, "a") as f:
                f.write(_record("05.000", 1, "e") + "\n")
        return len(asked) >= 2

    from services.cli import observe

    got = [
        (line.rank, (line.record or {}).get("event", line.text))
        for line in observe.follow("j", finished, poll_s=0.01, directory=logs_dir)
    ]
    assert got == [(0, "a"), (1, "b"), (1, "Traceback (not json)"), (0, "c"), (1, "d"), (1, "e"), (0, "f")]


def test_time_order_keeps_a_line_without_timestamp_after_its_ranks_previous_line_across_batches():
    from services.cli.observe import TimeOrder, parse

    order = TimeOrder()
    first = order.order([parse(0, _record("05.000", 0, "x")), parse(1, _record("01.000", 1, "y"))])
    assert [line.rank for line in first] == [1, 0]
    second = order.order([parse(1, _record("02.000", 1, "z")), parse(0, "plain text of rank 0")])
    assert [line.text for line in second] == [_record("02.000", 1, "z"), "plain text of rank 0"]


def test_reconnect_backs_off_doubling_to_two_seconds_then_gives_up_without_advising_down(capsys):
    from services.cli.errors import CliError
    from services.cli.follow import Reconnect

    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    r = Reconnect("job-1", "127.0.0.1:1", bound_s=7.0, sleep=sleep, clock=lambda: now[0])
    r.connected()
    with pytest.raises(CliError) as e:
        while True:
            r.lost()
    assert slept[:6] == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0])  # capped at 2 s
    assert max(slept) <= 2.0 and sum(slept) == pytest.approx(7.0)  # gave up at the bound, not later
    message = str(e.value)
    assert "job-1" in message and "may still be running" in message and "down" not in message
    notices = capsys.readouterr().err.strip().splitlines()
    assert len(notices) == 1 and notices[0].startswith("control unavailable at 127.0.0.1:1; reconnecting")
    # Back in contact, a new outage starts from the first delay again.
    r.connected()
    slept.clear()
    r.lost()
    assert slept == [0.2]


class _Stream:
    """A response stream as gRPC's client hands it over: iterable, cancellable."""

    def __init__(self, items):
        self._items, self.cancelled = items, False

    def __iter__(self):
        for item in self._items:
            if isinstance(item, float):
                time.sleep(item)  # a pause in the stream
            elif isinstance(item, Exception):
                raise item
            else:
                yield item

    def cancel(self):
        self.cancelled = True


def test_log_windows_batch_what_arrives_within_the_window_and_pass_errors_on():
    import grpc

    from services.cli.follow import _windows

    class Broken(grpc.RpcError):
        pass

    stream = _Stream(["a", "b", "c", 0.6, "d", Broken()])
    got = []
    with pytest.raises(Broken):
        for window in _windows(stream, window_s=0.3):
            got.append(window)
    assert got == [["a", "b", "c"], ["d"]] and stream.cancelled


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
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, str(rank)], cwd=REPO, capture_output=True, text=True, env=full, timeout=60
    )


def test_configure_writes_one_json_object_per_event_with_service_job_rank_step():
    r = _run(0)
    lines = r.stderr.splitlines()
    records = [json.loads(line) for line in lines]  # every line is JSON, tracebacks included
    assert [x["event"] for x in records] == [
        "composed",
        "job_wide",
        "from a module logger",
        "from the logging module",
        "failed",
        "uncaught_exception",
    ]
    for x in records:
        assert list(x)[:5] == ["timestamp", "level", "service", "job", "rank"] and (
            x["service"],
            x["job"],
            x["rank"],
        ) == ("rank", "j1", 0)
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
        proc = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, "0"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=sub,
            env={k: v for k, v in os.environ.items() if k != "SURGE_LOG_FORMAT"},
        )
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


@pytest.mark.parametrize(
    "var, value, allowed",
    [
        ("SURGE_LOG_FORMAT", "xml", "json, console"),
        ("SURGE_LOG_LEVEL", "LOUD", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ],
)
def test_a_bad_log_setting_stops_the_process_with_one_line_and_exit_2(var, value, allowed):
    r = _run(0, {var: value})
    assert r.returncode == 2 and r.stderr == f"error: {var}: expected one of {allowed}, got {value!r}\n", r.stderr


def test_log_settings_are_case_insensitive_and_empty_means_unset():
    r = _run(0, {"SURGE_LOG_FORMAT": "JSON", "SURGE_LOG_LEVEL": "warning"})
    levels = {json.loads(line)["level"] for line in r.stderr.splitlines()}
    assert levels and levels <= {"warning", "error", "critical"}, r.stderr
    assert _run(0, {"SURGE_LOG_FORMAT": "", "SURGE_LOG_LEVEL": ""}).returncode == 1  # the program's own uncaught error


SWAPPED = textwrap.dedent("""
    import io, sys
    from services.common import logs
    first, sys.stderr = sys.stderr, io.StringIO()  # as a test runner swaps it for one test's capture
    log = logs.configure("data")
    log.info("while swapped")
    swapped, sys.stderr = sys.stderr, first
    swapped.close()  # the capture ends; the process goes on logging
    log.info("after the swapped stream was closed")
    print(swapped.closed, file=sys.stdout)
""")


def test_lines_go_to_the_stderr_of_the_moment_and_never_to_a_closed_one():
    """``configure`` called while ``sys.stderr`` is swapped for another stream (pytest's
    capture of one test, when a test runs a service's main in-process), which is then closed:
    later lines go to the stderr of the moment, not to the closed stream (which printed
    '--- Logging error --- ValueError: I/O operation on closed file' into whatever test ran
    next in the same process)."""
    env = {**os.environ, "SURGE_LOG_FORMAT": "json", "SURGE_LOG_LEVEL": "INFO"}
    r = subprocess.run([sys.executable, "-c", SWAPPED], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout == "True\n", r.stderr
    events = [json.loads(line)["event"] for line in r.stderr.splitlines()]
    assert events == ["after the swapped stream was closed"], r.stderr
