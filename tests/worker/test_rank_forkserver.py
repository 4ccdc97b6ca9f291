"""The rank fork server (services/rank/forkserver.py, services/worker/rank_forkserver.py): a rank
forked from it is this process's child with its own environment, cwd, session and output; its
exit code, stops and continues are read as for a process started here; a server that died is
started again; helpers a rank leaves behind are reaped, never a rank."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from services.worker.rank_forkserver import RankForkServer, become_subreaper
from services.worker.rank_logs import LogPump, LogSettings, RankLog
from services.worker.rank_process import wait_reporting_stops

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the module's tests (its imports take seconds)."""
    assert become_subreaper()
    pump = LogPump()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    log = tmp_path_factory.mktemp("forkserver") / "forkserver.log"
    # (no background scan: the orphan test counts its own scans)
    fs = RankForkServer(env, REPO, log, pump, module="tests.worker.forked_rank", orphan_scan_seconds=1e6)
    yield fs, pump, log
    fs.close()
    pump.close()
    ctypes.CDLL(None).prctl(36, 0, 0, 0, 0)  # (this test process is no subreaper after it)


@pytest.fixture
def server(shared, tmp_path):
    fs, pump, _ = shared
    return fs, pump, tmp_path


def launch(fs, pump, tmp_path, *args: str, name: str = "rank", mark: str = "rank's own"):
    log = RankLog(tmp_path / f"{name}.log", LogSettings(flood_bytes_per_s=0))
    read, write = pump.pipe()
    argv = [sys.executable, "-m", "services.rank", *args]
    try:
        proc = fs.spawn(argv, dict(os.environ, FORKED_RANK_MARK=mark), write)
    finally:
        os.close(write)
    pump.attach(read, log)
    return proc, log


def output(log: RankLog, path: Path) -> list[str]:
    assert log.closed.wait(30), "the rank's output pipe never ended"
    return path.read_text().splitlines()


def test_a_forked_rank_is_this_process_s_child_with_its_own_environment_and_output(server, shared):
    fs, pump, tmp_path = server
    proc, log = launch(fs, pump, tmp_path, "exit", "3")
    parent = int((Path("/proc") / str(proc.pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    assert parent == os.getpid()  # adopted by the time spawn returns: ours to reap (alive or a zombie)
    assert proc.wait(timeout=60) == 3
    first = json.loads(output(log, tmp_path / "rank.log")[0])
    assert first["pid"] == proc.pid
    assert first["pgid"] == proc.pid  # its own group: a release signals it with its helpers
    assert (first["env"], first["cwd"], first["argv"], first["stdin"]) == ("rank's own", str(REPO), ["exit", "3"], "")
    ready = shared[2].read_text().count('"forkserver_ready"')
    assert ready >= 1
    # A second rank is forked from the same server (its imports are not paid again).
    again, log2 = launch(fs, pump, tmp_path, "exit", "0", name="rank2")
    assert again.wait(timeout=30) == 0
    assert shared[2].read_text().count('"forkserver_ready"') == ready


def test_an_uncaught_error_a_signal_a_stop_and_a_continue_read_as_for_a_started_process(server):
    fs, pump, tmp_path = server
    proc, log = launch(fs, pump, tmp_path, "raise")
    assert proc.wait(timeout=60) == 1
    assert "RuntimeError: a rank's uncaught error" in (
        output(log, tmp_path / "rank.log") and (tmp_path / "rank.log").read_text()
    )

    stopped, continued = [], []
    proc, log = launch(fs, pump, tmp_path, "stop", name="stopped")
    deadline = time.monotonic() + 30
    waiter = threading.Thread(
        target=lambda: continued.append(wait_reporting_stops(proc, stopped.append, lambda: continued.append("cont")))
    )
    waiter.start()
    while not stopped:
        assert time.monotonic() < deadline, "the rank's stop was never heard"
        time.sleep(0.02)
    assert stopped == [signal.SIGSTOP]
    os.kill(proc.pid, signal.SIGCONT)
    waiter.join(30)
    assert continued == ["cont", 0]  # continued, then exited with 0

    proc, _ = launch(fs, pump, tmp_path, "sleep", "60", name="killed")
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_server_that_died_is_started_again_at_the_next_launch(server):
    fs, pump, tmp_path = server
    proc, _ = launch(fs, pump, tmp_path, "exit", "0")
    assert proc.wait(timeout=60) == 0
    first = fs._proc.pid
    os.kill(first, signal.SIGKILL)
    fs._proc.wait()
    proc, _ = launch(fs, pump, tmp_path, "exit", "5", name="after")
    assert proc.wait(timeout=60) == 5
    assert fs._proc.pid != first


def test_a_helper_a_rank_left_behind_is_reaped_and_a_rank_never_is(server):
    fs, pump, tmp_path = server
    proc, log = launch(fs, pump, tmp_path, "orphan")
    lingering, _ = launch(fs, pump, tmp_path, "exit", "7", name="unwaited")
    assert proc.wait(timeout=60) == 0
    helper = json.loads(output(log, tmp_path / "rank.log")[1])["helper"]
    time.sleep(1.5)  # the helper (0.5 s) and the second rank have ended: zombies of this process
    # This test process is a subreaper: orphans of processes earlier tests left behind may be
    # adopted and reaped beside ours, so only our two pids are asserted.
    ours = {helper, lingering.pid}
    assert ours.isdisjoint(fs.reap_orphans())  # first sighting: neither is reaped yet
    assert ours & set(fs.reap_orphans()) == {helper}  # the helper, adopted, no one waits for it
    assert lingering.wait(timeout=5) == 7  # the rank's exit code is still ours to read


def test_a_forked_rank_s_hello_before_its_spawn_returned_finds_its_launch(server):
    """A forked rank connects within milliseconds, possibly before the spawn that forked it
    has returned in the agent: its hello waits for the launch to be recorded."""
    import structlog

    from services.contract import control_pb2, engine_pb2, worker_pb2
    from services.worker.node_agent import NodeAgent

    fs, pump, tmp_path = server
    hellos: list = []

    class HelloFirst:  # the fork server, with the rank's hello arriving before its answer
        def spawn(self, argv, env, out_fd):
            proc = fs.spawn(argv, env, out_fd)
            hello = worker_pb2.RankHello(job_id="j", rank=0, pid=proc.pid)
            said = threading.Thread(target=lambda: hellos.append(attach(hello)))
            said.start()
            time.sleep(0.5)
            return proc

        def close(self):
            pass  # (the module's server: closed by its fixture)

    def attach(hello):
        try:
            return agent.attach(hello).proc.pid
        except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
            return e

    agent = NodeAgent(
        "w1", "127.0.0.1:1", tmp_path / "run", lambda e: None, structlog.get_logger(),
        rank_module="tests.worker.forked_rank", cwd=REPO, forkserver=HelloFirst(), pump=pump,
    )  # fmt: skip
    assignment = engine_pb2.RankAssignment(rank=0, world_size=1, device="cpu")
    agent.launch_ranks(control_pb2.LaunchRanks(job_id="j", ranks=[assignment], init=engine_pb2.InitJob(job_id="j")))
    deadline = time.monotonic() + 20
    while not hellos:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (pid,) = hellos
    assert pid == agent._ranks[("j", 0)].proc.pid, pid
    agent.shutdown(grace_seconds=1.0)
