"""The local stack: every service as a local process on loopback (`surgectl up` / `down`).

The run directory (``$SURGE_HOME/run``) holds ``stack.json`` (pid, port, address, Prometheus
``/metrics`` port, log and command line of every service) and ``logs/``. ``restart`` stops
one service and starts it again with its recorded command line (same ports);
``start_missing`` does so for every recorded service whose process is gone (`up` over a
stack partly down). ``up`` waits until every service reports SERVING on the standard gRPC
health service; if one fails to start, everything
started is stopped again and the failing service's log tail is shown. A service that exits
with ``EXIT_PORT_IN_USE`` (its composition root's typed answer to a taken address, read from
the exit status) lost its port to another process: ``up`` starts it again on fresh ports,
``restart`` after a moment (the old socket can outlive its pid).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli import stack_access
from services.cli.errors import CliError
from services.common import logs, paths
from services.common.departure import departure_seconds_from_env
from services.common.grpc_server import EXIT_PORT_IN_USE, channel
from services.common.pids import pid_alive
from services.worker.memory_chunks import remove_dead_dirs

HOST = "127.0.0.1"
PORTS_FILE = "ports.json"  # each service's ports the last time it ran: `up` gives them again
TARGETS_FILE = "prometheus_targets.json"  # the stack's /metrics endpoints, Prometheus file_sd


class StartFailed(CliError):
    """A service exited while starting (the message: its last log line). ``port_taken``: it
    exited with ``EXIT_PORT_IN_USE`` (another socket held its address), read from its exit
    status, never from the log's words: the one failure a fresh port or a moment's wait fixes."""

    def __init__(self, message: str, port_taken: bool):
        super().__init__(message)
        self.port_taken = port_taken


@dataclass
class ServiceProc:
    name: str
    pid: int
    port: int
    log: str
    metrics_port: int = 0
    service: str = ""  # the services.<service> module it runs
    args: list[str] = field(default_factory=list)  # its arguments after `--host HOST`

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


def free_port() -> int:
    """A port the kernel just handed out (bind to port 0, read it, close)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound on ``HOST`` now (a socket in TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


class _Ports:
    """Free ports for one `up`, never the same one twice. Another process can still take a
    port between our probe and the service's bind: `_start` then retries with fresh ports.
    A port the operator fixed (``SURGE_<SERVICE>_PORT``, the variable the service itself
    reads) is used as given, and the address in ``stack.json`` that every command reads
    names it. Otherwise a service gets the port it had the last time (``ports.json``) while
    that port is free, so a Prometheus scraping the stack keeps its targets (and series)
    across `down` / `up`; a port taken since, or a retry after a lost race, gets a fresh one."""

    def __init__(self, fixed: set[int] = frozenset(), remembered: dict[str, int] | None = None) -> None:
        self._given: set[int] = set(fixed)  # never hand out a port the operator fixed
        self._remembered = dict(remembered or {})  # "<service>.port" / "<service>.metrics" -> its last port

    def __call__(self, var: str | None = None, key: str = "") -> str:
        if var and os.environ.get(var):
            return str(env_port(var))
        last = self._remembered.pop(key, 0)  # (once: a retry means it was lost after all)
        if last and last not in self._given and port_free(last):
            self._given.add(last)
            return str(last)
        while (port := free_port()) in self._given:
            pass
        self._given.add(port)
        return str(port)


def env_port(var: str) -> int:
    """The port in environment variable ``var``. Raises CliError (one line) if it is not 1-65535."""
    raw = os.environ[var]
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise CliError(f"{var}: expected a port number 1-65535, got {raw!r}", code=2)
    return port


FIXED_PORT_VARS = {
    name: (f"SURGE_{name.upper()}_PORT", f"SURGE_{name.upper()}_METRICS_PORT") for name in ("store", "data", "control")
}


def _env() -> dict:
    env = {**os.environ, "SURGE_HOME": str(paths.surge_home()), "PYTHONUNBUFFERED": "1"}
    # Plain Prometheus: no `_created` series next to every counter (prometheus_client's default).
    env.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "true")
    return env


START_ATTEMPTS = 4


class StackRunning(CliError):
    """`up` found the stack recorded and running: ``procs`` as recorded, ``down`` the names of
    those whose process is gone (``start_missing`` starts them again)."""

    def __init__(self, procs: dict[str, ServiceProc], down: list[str]):
        super().__init__("a stack is already running (see `surgectl status`; `surgectl down` stops it)")
        self.procs, self.down = procs, down


def down_services(procs: dict[str, ServiceProc] | None = None) -> list[str]:
    """The services of the recorded stack whose process is gone, in stack order (none
    recorded: [])."""
    procs = read_stack() if procs is None else procs
    return [name for name, p in (procs or {}).items() if not _running(p.pid)]


def stopped_pid(service: str, procs: dict[str, ServiceProc] | None = None) -> int:
    """The pid of ``service``'s recorded process when it is stopped (state ``T``/``t`` in
    /proc/PID/stat: a SIGSTOP, a debugger), else 0. Such a process still holds its port (the
    kernel completes connects) but never answers: `kill -CONT PID` resumes it where it was,
    which a restart would not (fresh36 F6: was "its process runs")."""
    procs = read_stack() if procs is None else procs
    p = (procs or {}).get(service)
    if p is None:
        return 0
    try:
        state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return 0
    return p.pid if state in ("T", "t") else 0


# The order services start in: store and data, then control (it needs their addresses),
# then the node agents (they register with control).
_START_ORDER = ("store", "data", "control")


def start_missing(procs: dict[str, ServiceProc], timeout_s: float = 60.0) -> list[str]:
    """`surgectl up` over a stack that is partly running (a service killed, a `restart` or
    a `down` cut short): start again every recorded service whose process is gone, with its
    recorded command line (same ports), in start order, each waited for until SERVING;
    ``stack.json`` gets the new pids. The running ones are left alone (their jobs' ranks go
    on). Returns the names started.

    Raises:
        CliError: one did not come back (the log tail in the message; ``stack.json`` names
            its new pid, so `down` stops it).
    """
    missing = sorted(
        down_services(procs),
        key=lambda n: (_START_ORDER.index(n) if n in _START_ORDER else len(_START_ORDER), n),
    )
    env, run = _env(), paths.run_dir()
    for name in missing:
        _start_again(procs, name, env, run, timeout_s)
    return missing


def _start_again(
    procs: dict[str, ServiceProc], name: str, env: dict, run: Path, timeout_s: float, line: tuple | None = None
) -> ServiceProc:
    """Start recorded service ``name`` again with its command line ``line`` (service, args;
    default: as recorded), same ports; record its pid before waiting for it; retry while
    its old socket still holds the port."""
    old = procs[name]
    service, args = line or ((old.service, list(old.args)) if old.args else _command_line(old))
    for attempt in range(START_ATTEMPTS):
        procs[name] = _spawn(service, args, env, run, log_name=name)
        _write(procs)  # before waiting: `down` must find the new process whatever happens next
        try:
            _wait_healthy(procs[name], timeout_s)
            return procs[name]
        except StartFailed as e:
            # The old process's listening socket can outlive its pid by a moment.
            if not e.port_taken or attempt == START_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def up(
    num_workers: int = 2,
    timeout_s: float = 60.0,
    exit_on_interrupt: bool = False,
    tokens: str | None = None,
    open_stack: bool = False,
) -> dict[str, ServiceProc]:
    """Start control, store, data and ``num_workers`` workers; wait for health.

    ``tokens`` (a tokens file) / ``open_stack`` (none, on purpose): per-team access, recorded
    in the store's and control's command lines (services/cli/stack_access.py).

    ``exit_on_interrupt`` (`surgectl up`): Ctrl-C (SIGINT) meanwhile stops every service
    started so far and ends this process at once, exit 130 (see ``_StopOnInterrupt``).

    Store and data start together, then control (it needs their addresses), then the
    workers together. A service that loses its port to another process is restarted on
    fresh ports (up to ``START_ATTEMPTS`` times), never reported as a failure.

    Raises:
        StackRunning: a stack is already running (some of it, maybe: ``start_missing``).
        CliError: a service failed to start (its log tail
            is in the message); nothing is left running in that case.
    """
    existing = read_stack()
    if existing and any(pid_alive(s.pid) for s in existing.values()):
        raise StackRunning(existing, [name for name, s in existing.items() if not _running(s.pid)])
    fixed = {var for pair in FIXED_PORT_VARS.values() for var in pair if os.environ.get(var)}
    fixed_ports = _check_fixed_ports(fixed)  # a bad or shared value is refused before anything starts
    problem = logs.env_problem()  # every service would refuse it at start-up
    if problem:
        raise CliError(problem, code=2)
    access = stack_access.service_args(tokens, open_stack)  # (refused before anything starts)
    run = paths.run_dir()
    check_writable(run / "logs")
    env = _env()
    port = _Ports(fixed_ports, _remembered_ports())
    procs: dict[str, ServiceProc] = {}
    guard = _StopOnInterrupt(procs) if exit_on_interrupt else None

    def start_group(specs: dict[str, tuple[str, callable]]) -> None:
        """Spawn every (name -> (service, args())) at once, then wait for each; retry a
        service that lost its port."""
        for name, (service, args) in specs.items():
            with guard.spawning() if guard else nullcontext():
                procs[name] = _spawn(service, args(), env, run, log_name=name)
        _write(procs)
        for name, (service, args) in specs.items():
            for attempt in range(START_ATTEMPTS):
                try:
                    _wait_healthy(procs[name], timeout_s)
                    break
                except StartFailed as e:
                    pinned = [var for var in FIXED_PORT_VARS.get(name, ()) if var in fixed]
                    if not e.port_taken or attempt == START_ATTEMPTS - 1 or pinned:
                        if pinned and e.port_taken:
                            raise CliError(f"{e} (its port is fixed by {', '.join(pinned)})") from None
                        raise
                    with guard.spawning() if guard else nullcontext():
                        procs[name] = _spawn(service, args(), env, run, log_name=name)
                    _write(procs)

    try:
        if guard:
            guard.install()
        start_group(
            {
                "store": (
                    "store",
                    lambda: [
                        "--port",
                        port("SURGE_STORE_PORT", "store.port"),
                        "--metrics-port",
                        port("SURGE_STORE_METRICS_PORT", "store.metrics"),
                        *access,
                    ],
                ),
                "data": (
                    "data",
                    lambda: [
                        "--port",
                        port("SURGE_DATA_PORT", "data.port"),
                        "--metrics-port",
                        port("SURGE_DATA_METRICS_PORT", "data.metrics"),
                    ],
                ),
            }
        )
        start_group(
            {
                "control": (
                    "control",
                    lambda: [
                        "--port",
                        port("SURGE_CONTROL_PORT", "control.port"),
                        "--data",
                        procs["data"].address,
                        "--store",
                        procs["store"].address,
                        "--metrics-port",
                        port("SURGE_CONTROL_METRICS_PORT", "control.metrics"),
                        *access,
                    ],
                )
            }
        )
        start_group(
            {
                f"worker-{i}": (
                    "worker",
                    lambda i=i: [
                        "--port",
                        port(key=f"worker-{i}.port"),
                        "--control",
                        procs["control"].address,
                        "--worker-id",
                        f"worker-{i}",
                        "--metrics-port",
                        port(key=f"worker-{i}.metrics"),
                        # the host's RAM shared by its agents: each registers RAM / N, so
                        # admission by memory never places more than the host holds
                        "--host-share",
                        str(num_workers),
                    ],
                )
                for i in range(num_workers)
            }
        )
        # A service can exit after another answered its health check in its place (two
        # fixed to one port): up only if every process we started still runs.
        for p in procs.values():
            if not _running(p.pid):
                raise CliError(_start_failure(p))
    except BaseException:
        _stop_all(procs)
        stack_file().unlink(missing_ok=True)
        raise
    finally:
        if guard:
            guard.uninstall()
    stack_access.remember(access)
    return procs


@contextmanager
def exit_on_interrupt(message: str) -> Iterator[None]:
    """Ctrl-C inside the block prints ``message`` on stderr and ends the process at once
    (exit 130) instead of raising KeyboardInterrupt inside a gRPC call (see
    ``_StopOnInterrupt`` for why). Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, frame) -> None:
        try:
            sys.stdout.flush()
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        finally:
            os._exit(130)

    old = signal.signal(signal.SIGINT, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def ignoring_interrupts() -> Iterator[None]:
    """Ctrl-C and SIGTERM (a `timeout`, a supervisor) inside the block are ignored (a bounded
    step that must not be cut in half, e.g. `down` stopping the services: control gone but the
    node agents left would strand their ranks). Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# How long the services started before a Ctrl-C of `surgectl up` get to stop after SIGTERM
# before SIGKILL (they are still starting: nothing of theirs is worth waiting for).
INTERRUPT_STOP_SECONDS = 3.0


class _StopOnInterrupt:
    """Ctrl-C while `surgectl up` starts the stack: stop the services started so far
    (SIGTERM to their process groups, SIGKILL after ``INTERRUPT_STOP_SECONDS``), remove
    ``stack.json`` and end the process at once (exit 130).

    Done in the SIGINT handler instead of by a KeyboardInterrupt: raised inside a gRPC call
    (the health checks) that exception can leave the channel's state locked, and the
    channel's finalizer then blocks the process's exit for good. The handler touches no
    gRPC object and the process ends with ``os._exit``. A signal arriving while a service
    is being spawned waits until its pid is known (``spawning``); a second Ctrl-C during
    the clean-up is ignored."""

    def __init__(self, procs: dict[str, ServiceProc]):
        self._procs = procs  # filled by up as it spawns
        self._before = set(_CHILDREN)
        self._spawning = 0
        self._pending = False
        self._old = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    @contextmanager
    def spawning(self) -> Iterator[None]:
        self._spawning += 1
        try:
            yield
        finally:
            self._spawning -= 1
            if self._pending and not self._spawning:
                self._stop()

    def _on_sigint(self, signum, frame) -> None:
        if self._spawning:
            self._pending = True
            return
        self._stop()

    def _stop(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        pids = {p.pid for p in self._procs.values()} | (set(_CHILDREN) - self._before)
        for pid in pids:
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + INTERRUPT_STOP_SECONDS
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if _running(pid):
                _signal_group(pid, signal.SIGKILL)
        stack_file().unlink(missing_ok=True)
        try:
            sys.stdout.flush()
            sys.stderr.write(f"interrupted: stopped the {len(pids)} services started so far\n")
            sys.stderr.flush()
        finally:
            os._exit(130)


def check_writable(logs: Path) -> None:
    """Create ``logs`` (under SURGE_HOME) and write a file in it, before anything starts.

    Raises:
        CliError (exit 2): one line naming SURGE_HOME and the path that could not be written.
    """
    try:
        logs.mkdir(parents=True, exist_ok=True)
        probe = logs / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        where = e.filename or logs
        raise CliError(
            f"SURGE_HOME: cannot write {where} ({e.strerror or e}); choose a writable SURGE_HOME", code=2
        ) from None


def _check_fixed_ports(fixed: set[str]) -> set[int]:
    """The ports in the set variables ``fixed``. Raises CliError (exit 2, one line) for a
    value that is not a port, or for two variables giving the same port (the second service
    could not listen, and the health check of its port would be answered by the first)."""
    seen: dict[int, str] = {}
    for var in sorted(fixed):
        port = env_port(var)
        if port in seen:
            raise CliError(f"{seen[port]} and {var} are both {port}; every service needs a port of its own", code=2)
        seen[port] = var
    return set(seen)


def down(timeout_s: float = 10.0, control_first: bool = False) -> list[str]:
    """Stop every service of the stack (workers first, they stop their ranks). Returns names.

    ``control_first`` (jobs were drained): control stops before anything else, so that the
    ranks the workers then stop are never seen going (a drained job stays PAUSED, journaled
    as drained, instead of being recovered); then the rest as usual."""
    procs = read_stack()
    if procs is None:
        return []
    if control_first and "control" in procs:
        _stop_all({"control": procs["control"]}, timeout_s)
    _stop_all(procs, timeout_s)
    remove_dead_dirs()  # the in-memory checkpoint copies of agents that died without cleaning up
    stack_file().unlink(missing_ok=True)
    return list(procs)


STOP_GRACE_SECONDS = 10.0  # SIGTERM, then SIGKILL: control's own shutdown grace is 2 s


def restart(name: str, grace_s: float = STOP_GRACE_SECONDS, timeout_s: float = 60.0) -> tuple[ServiceProc, ServiceProc]:
    """Stop service ``name`` of the running stack (SIGTERM to its process group, SIGKILL
    after ``grace_s`` seconds), start it again with the same command line (same ports),
    wait until it reports SERVING, and record its new pid in ``stack.json`` (so `down`
    stops it). The other services keep running; a restarted worker's ranks stop with it (its
    SIGTERM is a departure with notice: the grace gets the agent's departure deadline on top).

    Returns (old, new). Raises:
        CliError: no stack, no service ``name`` in it, its command line unknown, or it did
            not come back (``stack.json`` still names the new pid, so `down` stops it).
    """
    procs = read_stack()
    if not procs:
        raise CliError(f"no local stack is running ({stack_file()} not found; `surgectl up` starts one)")
    if name not in procs:
        raise CliError(f"SERVICE: no service {name!r} in {stack_file()} (one of: {', '.join(procs)})", code=2)
    old = procs[name]
    stack_access.check_file(old)  # (a broken tokens file would leave it down)
    line = (old.service, list(old.args)) if old.args else _command_line(old)  # (read while it runs)
    if old.service == "worker":  # (a departure with notice: control moves its ranks away first)
        grace_s += departure_seconds_from_env()
    _stop(old, grace_s)
    return old, _start_again(procs, name, _env(), paths.run_dir(), timeout_s, line)


def _command_line(proc: ServiceProc) -> tuple[str, list[str]]:
    """(service, args) of a stack.json entry written before command lines were recorded,
    read from the running process's /proc/<pid>/cmdline."""
    try:
        argv = [a.decode() for a in Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
        module = argv[argv.index("-m") + 1]
        rest = argv[argv.index("-m") + 2 :]
        if rest[:2] == ["--host", HOST]:
            rest = rest[2:]
        if module.startswith("services.") and "--port" in rest:
            return module.removeprefix("services."), rest
    except (OSError, ValueError, IndexError):
        pass
    raise CliError(
        f"{proc.name}: {stack_file()} does not record its command line and pid {proc.pid} "
        "is not running it; cannot start it again with the same arguments"
    )


def _stop(proc: ServiceProc, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group; SIGKILL it after ``grace_s``; return once it is gone."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(proc.pid):
        _signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    if _running(proc.pid):
        raise CliError(f"{proc.name} (pid {proc.pid}) survived SIGKILL for 10 s; not starting a second one")


def _running(pid: int) -> bool:
    return pid_alive(pid) and not _exited(pid) and not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process its parent has not reaped yet (not ours to reap: kill(pid, 0) still
    answers for it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


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
    _CHILDREN[p.pid] = p
    port = int(args[args.index("--port") + 1])
    metrics_port = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else 0
    return ServiceProc(
        name=log_name or service,
        pid=p.pid,
        port=port,
        log=str(log),
        metrics_port=metrics_port,
        service=service,
        args=list(args),
    )


def _write(procs: dict[str, ServiceProc]) -> None:
    f = stack_file()
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({"services": {n: asdict(p) for n, p in procs.items()}}, indent=2))
    tmp.replace(f)
    _remember_ports(procs)


def _remembered_ports() -> dict[str, int]:
    """``ports.json``: each service's ports the last time it ran ("<name>.port" / ".metrics")."""
    try:
        raw = json.loads((paths.run_dir() / PORTS_FILE).read_text())
        return {k: int(v) for k, v in raw.items() if isinstance(v, int) and 0 < v < 65536}
    except (OSError, ValueError, AttributeError):  # none yet, or not ours: fresh ports
        return {}


def control_metrics_url(procs: dict[str, ServiceProc] | None = None) -> str:
    """The local stack's control /metrics URL (its stack file), "" when none is known."""
    control = (procs if procs is not None else read_stack() or {}).get("control")
    return f"http://{HOST}:{control.metrics_port}/metrics" if control and control.metrics_port else ""


def remembered_port(key: str) -> int:
    """The port ``key`` ("<name>.port") had the last time, if it is free now; else 0."""
    port = _remembered_ports().get(key, 0)
    return port if port and port_free(port) else 0


def remember_port(key: str, port: int) -> None:
    """Keep ``port`` as ``key``'s for the next time (``ports.json``)."""
    _write_run_file(PORTS_FILE, {**_remembered_ports(), key: port})


def _write_run_file(file: str, content: object) -> None:
    """``content`` as JSON in the run directory's ``file``, replaced whole (never read half-written)."""
    tmp = paths.run_dir() / f"{file}.tmp"
    tmp.write_text(json.dumps(content, indent=2))
    tmp.replace(paths.run_dir() / file)


def _remember_ports(procs: dict[str, ServiceProc]) -> None:
    """Keep every service's ports for the next `up` (``ports.json``, kept by `down`) and write
    ``prometheus_targets.json``: the stack's /metrics endpoints in Prometheus' file_sd format,
    labelled ``service`` (as deploy/prometheus.yml labels the compose stack's)."""
    ports = _remembered_ports()
    for name, p in procs.items():
        ports[f"{name}.port"] = p.port
        if p.metrics_port:
            ports[f"{name}.metrics"] = p.metrics_port
    targets = [
        {"targets": [f"{HOST}:{p.metrics_port}"], "labels": {"service": name}}
        for name, p in procs.items()
        if p.metrics_port
    ]
    for file, content in ((PORTS_FILE, ports), (TARGETS_FILE, targets)):
        _write_run_file(file, content)


def _wait_healthy(proc: ServiceProc, timeout_s: float) -> None:
    """Block until ``proc`` reports SERVING (health Watch stream, no polling loop).

    Raises:
        StartFailed: it exited meanwhile.
        CliError: it did not come up within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    with channel(proc.address) as ch:
        ready = grpc.channel_ready_future(ch)
        while True:
            try:
                ready.result(timeout=0.5)
                break
            except grpc.FutureTimeoutError:
                # The only reason to wake up: notice a process that died while starting.
                if not pid_alive(proc.pid) or _exited(proc.pid):
                    raise StartFailed(_start_failure(proc), _exit_status(proc.pid) == EXIT_PORT_IN_USE) from None
                if time.monotonic() > deadline:
                    raise CliError(f"{proc.name} did not come up within {timeout_s:.0f} s; log: {proc.log}") from None
        stub = health_pb2_grpc.HealthStub(ch)
        remaining = max(1.0, deadline - time.monotonic())
        for resp in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=remaining):
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return


# The services this process started (pid -> Popen), held so that their exit status stays
# ours to read (a dropped Popen of a running child is reaped by the next Popen's clean-up).
_CHILDREN: dict[int, subprocess.Popen] = {}


def _exited(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child (a zombie still answers kill(pid, 0))."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is not None
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


def _exit_status(pid: int) -> int | None:
    """The exit status of a service this process started and saw end (None: not known)."""
    child = _CHILDREN.get(pid)
    return child.poll() if child is not None else None


def _start_failure(proc: ServiceProc) -> str:
    """``<name> failed to start: <its last log line>``, without the service's own
    ``error: <service>:`` prefix (one "error:" is printed by surgectl)."""
    last = _tail(proc.log).removeprefix("error: ")
    for prefix in {proc.name, proc.service}:
        if prefix:
            last = last.removeprefix(f"{prefix}: ")
    return f"{proc.name} failed to start: {last}"


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
        while _running(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for p in order:
        if _running(p.pid):
            _signal_group(p.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
