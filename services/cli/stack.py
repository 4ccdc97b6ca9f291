"""The local stack: every service as a local process on loopback (`surgectl up` / `down`).

The run directory (``$SURGE_HOME/run``) holds ``stack.json`` (pid, port, address, Prometheus
``/metrics`` port and log of every service) and ``logs/``. ``up`` waits until every service
reports SERVING on the standard gRPC health service; if one fails to start, everything
started is stopped again and the failing service's log tail is shown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.errors import CliError
from services.common import paths
from services.common.grpc_server import channel

HOST = "127.0.0.1"


@dataclass
class ServiceProc:
    name: str
    pid: int
    port: int
    log: str
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"


def stack_file() -> Path:
    return paths.run_dir() / "stack.json"


def read_stack() -> dict[str, ServiceProc] | None:
    f = stack_file()
    if not f.exists():
        return None
    raw = json.loads(f.read_text())
    return {name: ServiceProc(**s) for name, s in raw["services"].items()}


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    """A port the kernel just handed out (bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class _Ports:
    """Free ports for one `up`, never the same one twice. Another process can still take a
    port between our probe and the service's bind: `_start` then retries with fresh ports."""

    def __init__(self) -> None:
        self._given: set[int] = set()

    def __call__(self) -> str:
        while (port := free_port()) in self._given:
            pass
        self._given.add(port)
        return str(port)


START_ATTEMPTS = 4


def up(num_workers: int = 2, timeout_s: float = 60.0) -> dict[str, ServiceProc]:
    """Start control, store, data and ``num_workers`` workers; wait for health.

    Store and data start together, then control (it needs their addresses), then the
    workers together. A service that loses its port to another process is restarted on
    fresh ports (up to ``START_ATTEMPTS`` times), never reported as a failure.

    Raises:
        CliError: a stack is already running, or a service failed to start (its log tail
            is in the message); nothing is left running in that case.
    """
    existing = read_stack()
    if existing and any(is_alive(s.pid) for s in existing.values()):
        raise CliError("a stack is already running (see `surgectl status`; `surgectl down` stops it)")
    run = paths.run_dir()
    (run / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SURGE_HOME": str(paths.surge_home()), "PYTHONUNBUFFERED": "1"}
    # Plain Prometheus: no `_created` series next to every counter (prometheus_client's default).
    env.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "true")
    port = _Ports()
    procs: dict[str, ServiceProc] = {}

    def start_group(specs: dict[str, tuple[str, callable]]) -> None:
        """Spawn every (name -> (service, args())) at once, then wait for each; retry a
        service that lost its port."""
        for name, (service, args) in specs.items():
            procs[name] = _spawn(service, args(), env, run, log_name=name)
        _write(procs)
        for name, (service, args) in specs.items():
            for attempt in range(START_ATTEMPTS):
                try:
                    _wait_healthy(procs[name], timeout_s)
                    break
                except CliError as e:
                    if "in use" not in str(e) or attempt == START_ATTEMPTS - 1:
                        raise
                    procs[name] = _spawn(service, args(), env, run, log_name=name)
                    _write(procs)

    try:
        start_group({
            "store": ("store", lambda: ["--port", port(), "--metrics-port", port()]),
            "data": ("data", lambda: ["--port", port(), "--metrics-port", port()]),
        })
        start_group({"control": ("control", lambda: [
            "--port", port(), "--data", procs["data"].address, "--store", procs["store"].address,
            "--metrics-port", port(),
        ])})
        start_group({
            f"worker-{i}": ("worker", lambda i=i: [
                "--port", port(), "--control", procs["control"].address, "--worker-id", f"worker-{i}",
                "--metrics-port", port(),
            ])
            for i in range(num_workers)
        })
    except BaseException:
        _stop_all(procs)
        stack_file().unlink(missing_ok=True)
        raise
    return procs


def down(timeout_s: float = 10.0) -> list[str]:
    """Stop every service of the stack (workers first, they stop their ranks). Returns names."""
    procs = read_stack()
    if procs is None:
        return []
    _stop_all(procs, timeout_s)
    stack_file().unlink(missing_ok=True)
    return list(procs)


def _spawn(service: str, args: list[str], env: dict, run: Path, log_name: str | None = None) -> ServiceProc:
    log = run / "logs" / f"{log_name or service}.log"
    with open(log, "ab") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", f"services.{service}", "--host", HOST, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: `down` stops it with its children
        )
    port = int(args[args.index("--port") + 1])
    metrics_port = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else 0
    return ServiceProc(name=log_name or service, pid=p.pid, port=port, log=str(log), metrics_port=metrics_port)


def _write(procs: dict[str, ServiceProc]) -> None:
    f = stack_file()
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({"services": {n: asdict(p) for n, p in procs.items()}}, indent=2))
    tmp.replace(f)


def _wait_healthy(proc: ServiceProc, timeout_s: float) -> None:
    """Block until ``proc`` reports SERVING (health Watch stream, no polling loop)."""
    deadline = time.monotonic() + timeout_s
    with channel(proc.address) as ch:
        ready = grpc.channel_ready_future(ch)
        while True:
            try:
                ready.result(timeout=0.5)
                break
            except grpc.FutureTimeoutError:
                # The only reason to wake up: notice a process that died while starting.
                if not is_alive(proc.pid) or _exited(proc.pid):
                    raise CliError(f"{proc.name} failed to start: {_tail(proc.log)}") from None
                if time.monotonic() > deadline:
                    raise CliError(f"{proc.name} did not come up within {timeout_s:.0f} s; log: {proc.log}") from None
        stub = health_pb2_grpc.HealthStub(ch)
        remaining = max(1.0, deadline - time.monotonic())
        for resp in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=remaining):
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return


def _exited(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child (a zombie still answers kill(pid, 0))."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


def _tail(log: str, lines: int = 1) -> str:
    try:
        text = Path(log).read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {log})"
    useful = [_readable(line) for line in text if line.strip()]
    return " | ".join(useful[-lines:]) if useful else f"(empty log {log})"


def _readable(line: str) -> str:
    """A JSON log line (services.common.logs) as its event and error, else the line."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict):
        return line
    return str(record.get("error") or record.get("event") or line)


def _stop_all(procs: dict[str, ServiceProc], timeout_s: float = 10.0) -> None:
    order = sorted(procs.values(), key=lambda p: (not p.name.startswith("worker"), p.name))
    for p in order:
        _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in order:
        while is_alive(p.pid) and not _exited(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for p in order:
        if is_alive(p.pid) and not _exited(p.pid):
            _signal_group(p.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
