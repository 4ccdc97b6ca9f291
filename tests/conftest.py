"""Shared fixtures: an isolated SURGE_HOME and process hygiene."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.ports import free_port, free_ports  # noqa: F401 (the tests' ports, one place)

REPO = Path(__file__).resolve().parents[1]


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (read from /proc, no extra packages)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(d.name) != os.getpid():
            pids.append(int(d.name))
    return pids


def processes_of_home(home: Path) -> list[int]:
    """PIDs of the Surge stack whose ``SURGE_HOME`` is ``home``: surgectl starts every service
    with it in its environment and a node agent passes its environment on to its ranks, so
    this finds the stack's services and every rank its agents started (read from /proc).

    Unlike a job-name or port marker on the command line it never matches a process of
    another stack on the machine: another test session running the same module names its
    jobs alike, and killing "the ranks of job tsave-" killed that session's ranks too."""
    entries = {f"SURGE_HOME={h}".encode() for h in (home, Path(home).resolve())}  # surgectl passes it resolved
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if entries.intersection(env):
            pids.append(int(d.name))
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_to_end(argvs: list[list[str]], timeout: float, tail: int = 3000, **popen) -> list[str]:
    """Start one process per argv (stdout and stderr together, text), wait for all of them
    (``timeout`` seconds each), SIGKILL any still running; assert every exit code is 0, the
    outputs' last ``tail`` characters in the message. Returns the outputs."""
    import subprocess

    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen) for a in argvs]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-tail:] for o in outputs)
    return outputs


def down_and_reap(home: Path, cli) -> None:
    """`surgectl down` this stack, then SIGKILL whatever of *it* survived: its services and
    the ranks of its workers (a rank's command line names its worker's port). Processes of
    any other Surge stack on the machine are never touched."""
    import json

    stack_json = home / "run" / "stack.json"
    services = json.loads(stack_json.read_text())["services"] if stack_json.exists() else {}
    cli(home, "down", "--force", timeout=60)  # (no drain: a job left running or hung must not hold the teardown)
    kill_all([s["pid"] for s in services.values()])
    for name, s in services.items():
        if name.startswith("worker"):
            kill_all(processes_with(f"--session 127.0.0.1:{s['port']} "))


@pytest.fixture
def surge_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "surge"
    home.mkdir()
    monkeypatch.setenv("SURGE_HOME", str(home))
    for var in (
        "SURGE_CONTROL_ADDRESS",
        "SURGE_DATA_ADDRESS",
        "SURGE_STORE_ADDRESS",
        "SURGE_DATA_ROOT",
        "SURGE_STORE_ROOT",
    ):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(autouse=True)
def _restore_process_logging():
    """A test that runs a service's ``main`` in-process (``logs.configure``) sets up logging
    for the whole process: the root logger's handler and level, and warnings captured as log
    records. Put back as it was when the test ends, or every later test of the process would
    have the in-process planes' INFO lines on its stderr (and on the captured stream of a
    test long gone, before logs.configure wrote to the stderr of the moment)."""
    import logging
    import warnings

    root = logging.getLogger()
    handlers, level, showwarning = list(root.handlers), root.level, warnings.showwarning
    yield
    if root.handlers != handlers or root.level != level:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    if warnings.showwarning is not showwarning:
        logging.captureWarnings(False)
        warnings.showwarning = showwarning


@pytest.fixture(autouse=True)
def _stop_control_planes(monkeypatch):
    """Every in-process control plane a test builds (``services.control.__main__.build``,
    directly or through a fixture) is stopped when the test ends, as control's main stops
    it (``tests.control.conftest.stop_plane``). Tests that close a plane's journal to stand
    for a killed control, or that build one inline, otherwise left its threads running:
    a store call answered after its 10 s deadline, or a deadline firing, then wrote to the
    closed journal and logged the failure into whichever test the process ran next."""
    import sys

    main = sys.modules.get("services.control.__main__")
    if main is None:  # (no test module imported so far builds a plane)
        yield
        return
    built = []
    made = main.Control

    def record(**parts):
        built.append(made(**parts))
        return built[-1]

    monkeypatch.setattr(main, "Control", record)
    yield
    from tests.control.conftest import stop_plane

    for control in built:
        stop_plane(control)
