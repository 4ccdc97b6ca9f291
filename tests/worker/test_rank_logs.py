"""Rank logs with a size bound (issue 29 item 8, services/worker/rank_logs.py): rotated at a
size between whole lines with N backups kept, read across rotations (oldest first, each line
once) by a node agent's tail and by `surgectl logs`, and one warning for a rank that logs
too fast."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time

import pytest
import structlog

from services.cli import observe
from services.common.rotated_files import rotated_paths
from services.contract import control_pb2
from services.worker.log_tail import LogTailer
from services.worker.rank_logs import LogPump, LogSettings, RankLog, env_problem, settings_from_env

pytestmark = pytest.mark.timeout(60)


def lines_of(n: int, start: int = 0, width: int = 100) -> list[bytes]:
    """``n`` lines of exactly ``width`` bytes (newline included), numbered from ``start``."""
    return [f"line {i:06d} ".ljust(width - 1, "x").encode() + b"\n" for i in range(start, start + n)]


def test_a_rank_log_rotates_at_its_size_between_whole_lines_and_keeps_its_backups(tmp_path):
    path = tmp_path / "j.rank0.log"
    log = RankLog(path, LogSettings(max_bytes=1000, backups=2))
    for line in lines_of(35):  # 3500 bytes: four files' worth; the oldest beyond 2 backups goes
        log.write(line)
    log.close()
    files = rotated_paths(path)
    assert [f.name for f in files] == ["j.rank0.log.2", "j.rank0.log.1", "j.rank0.log"]
    # The boundary: a file takes lines up to exactly its bound, the next line starts a new one.
    assert [f.stat().st_size for f in files] == [1000, 1000, 500]
    kept = b"".join(f.read_bytes() for f in files)
    assert kept == b"".join(lines_of(25, start=10))  # the newest 25 lines, in order, whole


def test_a_line_longer_than_the_bound_is_one_file_of_its_own(tmp_path):
    path = tmp_path / "j.rank0.log"
    log = RankLog(path, LogSettings(max_bytes=100, backups=5))
    log.write(b"a\n")
    log.write(b"b" * 250 + b"\n")
    log.write(b"c\n")
    log.close()
    assert [f.read_bytes() for f in rotated_paths(path)] == [b"a\n", b"b" * 250 + b"\n", b"c\n"]


def test_zero_max_bytes_never_rotates(tmp_path):
    path = tmp_path / "j.rank0.log"
    log = RankLog(path, LogSettings(max_bytes=0, backups=2))
    for line in lines_of(50):
        log.write(line)
    log.close()
    assert rotated_paths(path) == [path] and path.stat().st_size == 5000


def test_a_rank_that_logs_too_fast_is_named_once(tmp_path):
    now = [0.0]
    floods: list[float] = []
    log = RankLog(
        tmp_path / "j.rank0.log",
        LogSettings(max_bytes=8192, flood_bytes_per_s=1000),
        floods.append,
        clock=lambda: now[0],
    )
    for _ in range(10):  # 500 B/s for 10 s: under the bound
        now[0] += 1.0
        log.write(b"y" * 499 + b"\n")
    assert floods == []
    for _ in range(60):  # then 5 kB/s for a minute: one warning, not one per window or line
        now[0] += 1.0
        log.write(b"z" * 4999 + b"\n")
    log.close()
    assert floods == [5000.0]
    assert sum(f.stat().st_size for f in rotated_paths(tmp_path / "j.rank0.log")) <= 4 * 8192  # still bounded


def test_the_settings_come_from_the_environment_and_a_bad_value_is_one_line():
    env = {
        "SURGE_WORKER_RANK_LOG_MAX_BYTES": "1048576",
        "SURGE_WORKER_RANK_LOG_BACKUPS": "5",
        "SURGE_WORKER_RANK_LOG_FLOOD_BYTES_PER_S": "0",
    }
    assert settings_from_env(env) == LogSettings(max_bytes=1 << 20, backups=5, flood_bytes_per_s=0)
    assert settings_from_env({}) == LogSettings()
    assert settings_from_env({"SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S": "2.5"}).flood_window_s == 2.5
    assert env_problem({"SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S": "0"}) == (
        "SURGE_WORKER_RANK_LOG_FLOOD_WINDOW_S: expected seconds > 0, got '0'"
    )
    assert env_problem({"SURGE_WORKER_RANK_LOG_BACKUPS": "-1"}) == (
        "SURGE_WORKER_RANK_LOG_BACKUPS: expected a whole number >= 0, got '-1'"
    )


def writer_process(write_fd: int, n: int, partial: bytes = b"") -> subprocess.Popen:
    """A process that writes ``n`` numbered 100-byte lines (and ``partial``) to its stdout."""
    code = (
        "import sys\n"
        f"for i in range({n}):\n"
        "    sys.stdout.write(f'line {i:06d} '.ljust(99, 'x') + '\\n')\n"
        f"sys.stdout.write({partial.decode()!r})\n"
    )
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdout=write_fd, stderr=subprocess.STDOUT)
    finally:
        os.close(write_fd)


def test_the_pump_writes_a_process_output_whole_and_closes_the_log_at_its_end(tmp_path):
    pump = LogPump()
    try:
        path = tmp_path / "j.rank0.log"
        log = RankLog(path, LogSettings(max_bytes=10_000, backups=10))
        read, write = pump.pipe()
        proc = writer_process(write, 300, partial=b"last words")
        pump.attach(read, log)
        assert proc.wait(timeout=30) == 0
        assert log.closed.wait(10)
        files = rotated_paths(path)
        assert len(files) == 4 and all(f.stat().st_size <= 10_000 for f in files)
        assert b"".join(f.read_bytes() for f in files) == b"".join(lines_of(300)) + b"last words"
        assert [s[2] is not None for s in log.spans()] == [True] * 4  # every span ended
    finally:
        pump.close()


class Tail:
    """A node agent's log tail over ``logs`` with the spans of ``logs_of`` (rank -> RankLogs)."""

    def __init__(self, logs_dir, logs_of, alive=lambda job, rank: False):
        self.out: queue.Queue = queue.Queue()
        self.tailer = LogTailer(
            logs_dir,
            lambda ev: self.out.put(ev.rank_log_lines),
            structlog.get_logger(),
            lambda job: {rank: [s for lg in logs for s in lg.spans()] for rank, logs in logs_of.items()},
            alive,
        )

    def lines(self, follow: bool, timeout: float = 20.0) -> list[str]:
        self.tailer.tail(control_pb2.TailRankLogs(request_id="t", job_id="j", follow=follow, rank=-1))
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            batch = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            if batch.done:
                return got
            got.extend(batch.lines)


def numbered(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines]


def test_a_tail_reads_a_rank_across_its_rotations_oldest_first_each_line_once(tmp_path):
    logs = tmp_path / "logs"
    path = logs / "j.rank0.log"
    first = RankLog(path, LogSettings(max_bytes=1000, backups=2))  # an earlier process of the rank
    for line in lines_of(15):
        first.write(line)
    first.close()
    second = RankLog(path, LogSettings(max_bytes=1000, backups=2))  # its relaunch appends, rotates on
    for line in lines_of(20, start=15):
        second.write(line)
    second.close()
    # 35 lines written in files of 10, 3 files kept: lines 10..34 (the first process's oldest
    # span was rotated out; its newest, 10..14, is read before the relaunch's).
    assert numbered(Tail(logs, {0: [first, second]}).lines(follow=False)) == list(range(10, 35))
    # `surgectl logs` (the local stack's files, no control) reads the same, oldest file first.
    read = observe.read_all(observe.rank_logs("j", logs))
    assert [line.rank for line in read] == [0] * 25 and numbered([line.text for line in read]) == list(range(10, 35))


def test_a_followed_tail_goes_on_into_the_next_file_when_the_log_rotates_under_it(tmp_path):
    logs = tmp_path / "logs"
    path = logs / "j.rank0.log"
    pump = LogPump()
    try:
        log = RankLog(path, LogSettings(max_bytes=20_000, backups=50))
        read, write = pump.pipe()
        running = [True]
        tail = Tail(logs, {0: [log]}, alive=lambda job, rank: running[0])
        proc = writer_process(write, 2000)  # 200 kB: ten rotations while the tail follows
        pump.attach(read, log)
        got: list[str] = []
        tail.tailer.tail(control_pb2.TailRankLogs(request_id="t", job_id="j", follow=True, rank=0))
        assert proc.wait(timeout=30) == 0
        assert log.closed.wait(10)
        running[0] = False
        deadline = time.monotonic() + 20
        while True:
            batch = tail.out.get(timeout=max(0.1, deadline - time.monotonic()))
            if batch.done:
                break
            got.extend(batch.lines)
        assert len(rotated_paths(path)) == 10
        assert numbered(got) == list(range(2000))
    finally:
        pump.close()


def test_a_node_agent_bounds_a_flooding_rank_log_and_names_it_once(tmp_path):
    """The agent's wiring: a rank process writing 2 MB as fast as it can (tests/worker/
    flood_rank.py) leaves at most (backups + 1) files of the bound and one RankLogFlood."""
    from services.contract import control_pb2, engine_pb2
    from services.contract.relay import unpack
    from services.worker.node_agent import NodeAgent
    from services.worker.rank_process import REPO_ROOT

    events: queue.Queue = queue.Queue()
    settings = LogSettings(max_bytes=64 << 10, backups=2, flood_bytes_per_s=100_000, flood_window_s=0.05)
    agent = NodeAgent(
        "w1", "127.0.0.1:1", tmp_path / "run", events.put, structlog.get_logger(),
        rank_module="tests.worker.flood_rank", cwd=REPO_ROOT, log_settings=settings,
    )  # fmt: skip
    try:
        assignment = engine_pb2.RankAssignment(rank=3, world_size=4, device="cpu")
        agent.launch_ranks(control_pb2.LaunchRanks(job_id="j", ranks=[assignment], init=engine_pb2.InitJob(job_id="j")))
        seen = []
        while not any(e.WhichOneof("event") == "rank_exited" for e in seen):
            seen.append(events.get(timeout=30))
        deadline = time.monotonic() + 30
        while agent._rank_alive("j", 3):  # (exited is set once its output is written: RankExited goes first)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while not events.empty():  # (the pump may state the flood after the exit is reported)
            seen.append(events.get())
        floods = [
            unpack(e.routed)
            for e in seen
            if e.WhichOneof("event") == "routed" and e.routed.type.endswith("RankLogFlood")
        ]
        assert [(f.job_id, f.rank, f.worker_id, f.max_file_bytes, f.backups) for f in floods] == [
            ("j", 3, "w1", 64 << 10, 2)
        ]
        assert floods[0].bytes_per_second > 100_000
        files = rotated_paths(tmp_path / "run" / "logs" / "j.rank3.log")
        assert len(files) == 3 and all(f.stat().st_size <= 64 << 10 for f in files)
        assert all(f.read_bytes().endswith(b"x\n") for f in files)  # whole lines
    finally:
        agent.shutdown(grace_seconds=1.0)


def test_the_local_follow_reads_on_across_a_rotation(tmp_path):
    """`observe.follow` (the local files' follow): a rotation between two polls loses no line."""
    logs = tmp_path / "logs"
    log = RankLog(logs / "j.rank0.log", LogSettings(max_bytes=1000, backups=5))
    written = iter(range(0, 100, 10))

    def finished() -> bool:
        start = next(written, None)
        if start is None:
            return True
        for line in lines_of(10, start=start):  # a file of 10 lines a poll: one rotation each
            log.write(line)
        return False

    got = [line.text for line in observe.follow("j", finished, poll_s=0.001, directory=logs)]
    log.close()
    assert numbered(got) == list(range(100))


def test_a_finish_writes_what_the_pipe_holds_then_ends_it_though_a_helper_keeps_it_open(tmp_path):
    """A rank ended but a helper that left its process group holds the pipe: the agent asks
    the pump to finish it (node_agent._end_log_span): nothing already written is lost."""
    pump = LogPump()
    try:
        log = RankLog(tmp_path / "j.rank0.log", LogSettings(max_bytes=0))
        read, write = pump.pipe()
        pump.attach(read, log)
        os.write(write, b"".join(lines_of(50)) + b"last, no newline")  # (the helper keeps `write` open)
        pump.finish(log)
        assert log.closed.wait(10)
        assert (tmp_path / "j.rank0.log").read_bytes() == b"".join(lines_of(50)) + b"last, no newline"
        with pytest.raises(BrokenPipeError):  # a helper's later output is not taken: the pipe is closed
            os.write(write, b"after the end\n")
        os.close(write)
    finally:
        pump.close()
    assert b"after the end" not in (tmp_path / "j.rank0.log").read_bytes()


def test_closing_a_pump_with_no_pipe_open_ends_its_thread_at_once(tmp_path):
    """An agent with no rank left (its ranks ended, or none ever ran) stops: the pump's thread
    ends as soon as it is told, not at close()'s join timeout (5 s on every worker stop)."""
    for attach_first in (False, True):
        pump = LogPump()
        if attach_first:  # (a pipe that ended before the close: none open at it)
            read, write = pump.pipe()
            log = RankLog(tmp_path / "j.rank0.log", LogSettings(max_bytes=0))
            pump.attach(read, log)
            os.close(write)
            assert log.closed.wait(10)
        t0 = time.monotonic()
        pump.close()
        assert not pump._thread.is_alive()  # (close() returned because the thread ended)
        assert time.monotonic() - t0 < 4.0  # (under the join's 5 s: waited out, it fails)


def test_a_burst_before_the_end_is_measured_over_a_whole_window(tmp_path):
    now = [0.0]
    floods: list[float] = []
    settings = LogSettings(max_bytes=0, flood_bytes_per_s=1000, flood_window_s=10.0)
    log = RankLog(tmp_path / "j.rank0.log", settings, floods.append, clock=lambda: now[0])
    now[0] = 2.0
    log.write(b"q" * 49_999 + b"\n")  # 50 kB within 2 s, then the process ends
    assert floods == []  # (the window is not over)
    log.close()
    assert floods == [5000.0]  # 50 kB over the whole 10 s window: never overestimated
    quiet = RankLog(tmp_path / "k.rank0.log", settings, floods.append, clock=lambda: now[0])
    quiet.write(b"a few lines\n")
    quiet.close()
    assert floods == [5000.0]
