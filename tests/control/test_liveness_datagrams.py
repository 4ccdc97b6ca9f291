"""A node agent's liveness beat as a UDP datagram (services/control/liveness_datagrams.py,
services/worker/liveness_sender.py): real control and node agent processes, real sockets on
127.0.0.1. The datagrams keep an agent alive with its gRPC beats gone quiet; a forged, replayed
or older session's datagram is dropped and counted; with the datagrams lost the agent is told
to beat on its session and is never declared silent; a stopped agent still is, at its deadline,
and once it runs again and its datagrams are heard it beats as datagrams alone again.

Bounds are generous (a loaded 2-core host): an order and an upper bound, never a fixed sleep
and look. The agent's silence deadline is 5 s (rules.AGENT_MISSED_BEATS periods of 1 s)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.liveness_mac import liveness_mac
from services.contract import Module, control_pb2, control_pb2_grpc
from services.control.liveness_datagrams import LIVENESS_HEADER
from tests.conftest import stop_process
from tests.ports import free_port

from .conftest import registration

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
HELD = "worker placement held"  # L1-1's line for an agent_silent node (orchestrator)


class Proc:
    """A service process whose combined output goes to a file; ended by its PID."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]):
        self.log = log
        with open(log, "wb") as out:
            self.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def end(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, SURGE_HOME=str(home), PYTHONPATH=str(REPO))
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        env.pop(var, None)
    return env


def start_control(tmp_path: Path, *extra: str) -> tuple[Proc, int, int]:
    """A control process (no data or store service: none is asked here); (proc, port, metrics port)."""
    port, metrics = free_port(), free_port()
    argv = [sys.executable, "-m", "services.control", "--port", str(port), "--metrics-port", str(metrics)]
    argv += ["--data", "127.0.0.1:1", "--store", "127.0.0.1:2", "--db", str(tmp_path / "control.db")]
    argv += ["--liveness-datagrams", *extra]  # (opt-in)
    proc = Proc(argv, tmp_path / "control.log", _env(tmp_path))
    wait_for(lambda: "control listening" in proc.text(), 20, "control listening", proc)
    return proc, port, metrics


def start_agent(tmp_path: Path, control_port: int, worker_id: str = "w1") -> Proc:
    argv = [sys.executable, "-m", "services.worker", "--port", str(free_port())]
    argv += ["--control", f"127.0.0.1:{control_port}", "--worker-id", worker_id]
    argv += ["--memory-check-seconds", "0", "--gpu-check-seconds", "0"]
    proc = Proc(argv, tmp_path / f"agent-{worker_id}.log", _env(tmp_path))
    wait_for(lambda: "registered with control" in proc.text(), 20, "the agent registered", proc)
    return proc


def wait_for(check, timeout: float, what: str, proc: Proc | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.p.poll() is not None:
            raise AssertionError(f"{what}: the process exited {proc.p.returncode}\n{proc.text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g} s" + (f"\n{proc.text()[-3000:]}" if proc else ""))


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(surge_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


READ = "surge_liveness_datagrams_read_total"
FALLBACKS = "surge_liveness_fallbacks_total"
RESUMED = "surge_liveness_resumed_total"
GRPC_BEATS = 'surge_control_messages_total{direction="in",kind="heartbeat"}'


def dropped(reason: str) -> str:
    return f'surge_liveness_datagrams_dropped_total{{reason="{reason}"}}'


def test_datagram_beats_keep_a_real_agent_alive_with_no_grpc_beat_and_a_stopped_one_is_declared_at_its_deadline(
    tmp_path,
):
    control, port, mport = start_control(tmp_path)
    agent = None
    try:
        agent = start_agent(tmp_path, port)
        # Longer than its silence deadline (5 s) on datagrams alone: 7 read, no placement held.
        wait_for(lambda: metrics(mport).get(READ, 0) >= 7, 20, "7 datagrams read", control)
        m = metrics(mport)
        assert m.get(GRPC_BEATS, 0) <= 1  # (its first, queued before the session opened)
        assert m[FALLBACKS] == 0
        assert HELD not in control.text()
        assert all(m[dropped(r)] == 0 for r in ("bad_mac", "stale_seq", "unknown_slot", "stale_session"))
        # A stopped agent sends nothing: declared silent at its deadline (5 s after its last beat).
        stop_process(agent.p.pid)
        stopped = time.monotonic()
        wait_for(lambda: HELD in control.text(), 15, "the stopped agent declared silent", control)
        assert time.monotonic() - stopped < 15
        line = next(x for x in control.text().splitlines() if HELD in x)
        silent = re.search(r"sent no AgentHeartbeat for ([\d.]+) s \(its deadline 5\.0 s\)", line)
        assert silent is not None and float(silent.group(1)) >= 5.0, line  # (at its deadline, not before)
        # Continued, it reads control's switch and beats on its session (and datagrams): heard again.
        os.kill(agent.p.pid, signal.SIGCONT)
        wait_for(lambda: "worker placement hold ended" in control.text(), 15, "the agent heard again", control)
        assert metrics(mport)[FALLBACKS] == 1  # (nothing heard of it while stopped: told to use its session)
        wait_for(lambda: "beating on the session" in agent.text(), 10, "the agent beats on its session", agent)
        # Its datagrams, still going, are heard: datagrams alone again.
        wait_for(lambda: metrics(mport).get(RESUMED, 0) >= 1, 10, "the session told datagrams are heard", control)
        wait_for(lambda: "beating as datagrams" in agent.text(), 10, "the agent beats as datagrams again", agent)
    finally:
        if agent is not None:
            agent.end()
        control.end()


def test_datagrams_to_a_dead_port_fall_back_to_grpc_beats_and_the_agent_is_never_declared_silent(tmp_path):
    # The agents are told a port nothing listens on (what a firewall or an unpublished port is
    # to them): control hears none, tells the session to beat on its stream after ~2 periods.
    dead = free_port()
    control, port, mport = start_control(tmp_path, "--liveness-advertise-port", str(dead))
    agent = None
    try:
        agent = start_agent(tmp_path, port)
        wait_for(lambda: metrics(mport).get(FALLBACKS, 0) >= 1, 15, "the session told to beat on gRPC", control)
        # Past its silence deadline (5 s) counted from the registration, on gRPC beats.
        wait_for(lambda: metrics(mport).get(GRPC_BEATS, 0) >= 6, 20, "6 gRPC beats", control)
        m = metrics(mport)
        assert m[READ] == 0
        assert m[FALLBACKS] == 1
        assert m[RESUMED] == 0
        assert HELD not in control.text()
        wait_for(lambda: "beating on the session" in agent.text(), 10, "the agent beats on its session", agent)
    finally:
        if agent is not None:
            agent.end()
        control.end()


class Session:
    """A node agent's WorkerSession driven from the test: registers, reads control's grant."""

    def __init__(self, port: int, worker_id: str, incarnation: str):
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = control_pb2_grpc.ControlServiceStub(self._channel)
        self._up: queue.Queue = queue.Queue()
        reg = registration(worker_id)
        reg.incarnation = incarnation
        self._up.put(control_pb2.WorkerEvent(register=reg))
        self.call = stub.WorkerSession(
            iter(self._up.get, None), metadata=(("x-surge-module", Module.Name(Module.EXT_HARDWARE)),)
        )
        header = dict(self.call.initial_metadata())
        self.grant = control_pb2.LivenessGrant.FromString(header[LIVENESS_HEADER])

    def close(self) -> None:
        self._up.put(None)
        self.call.cancel()
        self._channel.close()


def datagram(grant: control_pb2.LivenessGrant, seq: int, key: bytes | None = None, **fields) -> bytes:
    msg = control_pb2.AgentLiveness(slot=grant.slot, session=grant.session, seq=seq, interval_seconds=1.0)
    msg.unix_time = time.time()
    for name, value in fields.items():
        setattr(msg, name, value)
    msg.mac = liveness_mac(grant.key if key is None else key, msg)
    return msg.SerializeToString()


def test_a_forged_replayed_or_older_session_datagram_is_dropped_and_counted(tmp_path):
    control, port, mport = start_control(tmp_path)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    first = second = None
    try:
        first = Session(port, "w1", "inc-1")
        grant = first.grant
        assert grant.port == port and grant.slot > 0 and len(grant.key) == 32
        to = ("127.0.0.1", grant.port)

        def counted(name: str, value: float) -> None:
            wait_for(lambda: metrics(mport).get(name, 0) >= value, 10, f"{name} >= {value}", control)

        out.sendto(datagram(grant, 1), to)
        counted(READ, 1)
        out.sendto(datagram(grant, 1), to)  # the same datagram again: a replay
        counted(dropped("stale_seq"), 1)
        out.sendto(datagram(grant, 2, key=b"k" * 32), to)  # signed with another key
        counted(dropped("bad_mac"), 1)
        out.sendto(datagram(grant, 3, slot=grant.slot + 1000), to)  # a slot nobody holds
        counted(dropped("unknown_slot"), 1)
        out.sendto(b"\xff\xff\xff", to)
        counted(dropped("malformed"), 1)
        out.sendto(datagram(grant, 2), to)  # (the forged seq 2 took nothing: this one is taken)
        counted(READ, 2)
        # A new incarnation's session: the old session's key and number are dead.
        first.close()
        first = None
        wait_for(lambda: "worker session ended" in control.text(), 10, "the first session ended", control)
        second = Session(port, "w1", "inc-2")
        assert second.grant.session != grant.session and second.grant.key != grant.key
        out.sendto(datagram(grant, 10, slot=second.grant.slot), to)  # the old session's, on the reused slot
        counted(dropped("stale_session"), 1)
        out.sendto(datagram(second.grant, 1), to)
        counted(READ, 3)
        m = metrics(mport)
        assert m[READ] == 3
        assert [m[dropped(r)] for r in ("stale_seq", "bad_mac", "unknown_slot", "malformed", "stale_session")] == [
            1,
            1,
            1,
            1,
            1,
        ]
    finally:
        out.close()
        for s in (first, second):
            if s is not None:
                s.close()
        control.end()


@pytest.mark.parametrize(("value", "on"), [("on", True), ("ON", True), (" Off ", False), ("", False)])
def test_the_datagrams_variable_is_on_or_off_whatever_its_case(monkeypatch, value, on):
    from services.control.__main__ import _parse_args

    monkeypatch.setenv("SURGE_CONTROL_LIVENESS_DATAGRAMS", value)
    base = ["--port", "1", "--data", "a:1", "--store", "b:1"]
    assert _parse_args(base).liveness_datagrams is on
    assert _parse_args([*base, "--liveness-datagrams"]).liveness_datagrams is True


def test_a_datagrams_variable_neither_on_nor_off_is_one_line_and_exit_2():
    # (was: anything but "on" meant off without a word: `=1`, `=true` left datagrams off)
    env = dict(os.environ, SURGE_CONTROL_LIVENESS_DATAGRAMS="true")
    argv = [sys.executable, "-m", "services.control", "--port", "1", "--data", "a:1", "--store", "b:1"]
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip().splitlines()[-1].endswith("SURGE_CONTROL_LIVENESS_DATAGRAMS: expected on or off, got 'true'")
    )
