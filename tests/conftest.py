"""Shared fixtures: an isolated SURGE_HOME and process hygiene."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.ports import free_port, free_ports  # noqa: F401 (the tests' ports, one place)

REPO = Path(__file__).resolve().parents[1]

# Control's re-attach window after a restart (services/control/monitoring.py), in every stack
# the tests start (they inherit this process's environment) and in-process: 8 s, not the
# product's 15 s. Each test that restarts control under a job whose ranks are gone waits it
# out before the loss is graded; the test specs' heartbeat deadlines (2 s) put the window's
# own floor at 6 s, and a node agent reconnects within 2 s of control's return.
os.environ.setdefault("SURGE_REATTACH_MIN_SECONDS", "8")
# Sick-node quarantine off in the stacks the tests start: a module shares one stack across
# tests that each kill ranks on the same two nodes, which would otherwise quarantine them
# (3 faults from 2 incidents in 10 min) and leave the next test's job queued. The tests of
# the quarantine itself set it (tests/faults/test_sick_node_live.py, tests/control/test_sick_nodes.py).
os.environ.setdefault("SURGE_SICK_NODE_FAULTS", "0")
# No dashboard beside the tests' stacks (`surgectl up` starts one by default): nobody looks at
# them in a browser, and it is one more process per stack. The dashboard's own tests start it
# (`surgectl dashboard`, or up with SURGE_UP_DASHBOARD=1: tests/faults/test_recovery.py).
os.environ.setdefault("SURGE_UP_DASHBOARD", "0")


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


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. The stop starts only when
    one of its threads is scheduled to take the signal: on a loaded machine tens of milliseconds
    after the kill (86 ms seen), and meanwhile its other threads run on and may still answer a
    request (test_slow_store's "stopped" store staged and committed a save that way)."""
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(") ", 1)[1].split()[0] for t in tasks]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # (a thread ended while read: read again)
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} not stopped {timeout:g} s after its SIGSTOP")


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


# Modules that share one real stack (their directory's conftest.py starts it) instead of each
# starting its own: a stack costs ~19 CPU-s before its tests do anything
# (docs/LOG.md, session 27). Each group runs as one unit on one test process, its files in the
# order below, so the stack is started once per group, not once per file and process (under
# xdist a session or package fixture is per process: with files dealt one at a time, both
# processes would start it and keep it idle to the end). A module joins a group only if it
# leaves the stack as the next one needs it (its jobs ended, its workers up and uncordoned, its
# faults over); a module that breaks the stack for good runs last (and says so), one that needs
# a pristine stack keeps its own.
STACK_GROUPS = {
    # tests/shared_stacks.py GROUP_STACKS: 2 workers, the modules' injections together
    "faults-two-workers": (
        "tests/faults/test_step_faults.py",
        "tests/faults/test_slow_rank.py",
        "tests/faults/test_replica_divergence.py",
        "tests/faults/test_phase_blame.py",
        "tests/faults/test_stall_blame.py",
        "tests/faults/test_data_outage.py",
        "tests/faults/test_control_restart.py",
        "tests/faults/test_recovery.py",  # last: its last test kills a node agent
    ),
    # tests/shared_stacks.py GROUP_STACKS: 3 workers of one slot each, the modules' injections
    "faults-three-workers": (
        "tests/faults/test_fencing.py",
        "tests/faults/test_resize_in_place.py",
        "tests/faults/test_rebuild_in_place.py",  # last: its last test kills a node agent
    ),
    # tests/shared_stacks.py GROUP_STACKS: 2 workers, control on a fixed port, the modules'
    # injections and STACK_ENV together
    "cli-two-workers": (
        "tests/cli/test_resume_dp.py",
        "tests/faults/test_data_changed_live.py",  # (puts the byte it flips back: tiny@v1 as prepared)
        "tests/cli/test_operator_actions.py",
        "tests/cli/test_interrupted_operator_commands.py",  # (its last test kills every service)
        "tests/cli/test_restart.py",  # (its last test takes the stack down)
        "tests/cli/test_housekeeping_stack.py",  # last: it deletes the dataset the others train on
    ),
    # tests/observability/conftest.py obs_stack (package scope: it ends when a process's next test
    # is outside the package; dealt a file at a time, these files were started again each time)
    "observability": (
        "tests/observability/test_cli.py",
        "tests/observability/test_grpc.py",
        "tests/observability/test_logs.py",
        "tests/observability/test_metrics.py",
        "tests/observability/test_profile.py",
    ),
}
GROUP_OF = {path: group for group, paths in STACK_GROUPS.items() for path in paths}

# The files that take longest on CI (their tests together, real stacks and rank processes),
# longest first. `make test` gives each of its two workers a whole file (or a whole group of
# STACK_GROUPS) at a time, the next in the order below as one frees up (--dist loadfile
# --no-loadscope-reorder, the scheduler below): started first, they end while the short
# files fill in, and the two workers finish together. xdist's own order (most tests first)
# ran them last: a 100 s file taken by one worker as the queue emptied left the other idle. A
# file missing here only runs later; keep the list to files of about 40 s or more, in the
# order of CI's "slowest files" summary (ci6 of session 25: 136 s down to 38 s; files whose
# ranks are forked since then placed by their new figure). A group takes the place of its
# first file here (ci28-29: the two-worker group ~600 s, the three-worker group ~275 s).
LONGEST_FIRST = (
    "tests/faults/test_recovery.py",  # (the faults-two-workers group)
    "tests/cli/test_operator_actions.py",  # (the cli-two-workers group: its files ~400 s apart on CI)
    "tests/integration/test_examples.py",
    "tests/faults/test_rebuild_in_place.py",  # (the faults-three-workers group)
    "tests/faults/test_compound.py",
    "tests/parallel/test_memory_limited_fsdp2.py",
    "tests/checkpoint/test_no_shared_fs.py",
    "tests/faults/test_store_outage.py",
    "tests/observability/test_cli.py",  # (the observability group)
    "tests/integration/test_end_to_end.py",
    "tests/multihost/test_cut_links.py",
    "tests/multihost/test_netns_bed.py",
    "tests/checkpoint/test_reshard_resume.py",
    "tests/checkpoint/test_resume_no_shared_fs.py",
    "tests/scale/test_boundary_delay.py",
    "tests/parallel/test_pipeline_rank.py",
    "tests/faults/test_memory_recovery.py",
    "tests/checkpoint/test_kill_during_save.py",
    "tests/checkpoint/test_exact_resume.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Files in LONGEST_FIRST order, then the others by their number of tests, most first
    (xdist's own order); each file's tests stay together and in their order, and the files of
    a STACK_GROUPS group follow one another in the group's order, at its first file's place."""
    place = {path: i for i, path in enumerate(LONGEST_FIRST)}
    files = [item.nodeid.split("::", 1)[0] for item in items]
    counts = {f: files.count(f) for f in set(files)}
    for paths in STACK_GROUPS.values():
        here = [p for p in paths if p in counts]
        first, tests = min((place.get(p, len(LONGEST_FIRST)) for p in here), default=0), sum(counts[p] for p in here)
        place.update(dict.fromkeys(here, first))
        counts.update(dict.fromkeys(here, tests))
    within = {path: i for paths in STACK_GROUPS.values() for i, path in enumerate(paths)}
    order = {
        id(item): (place.get(f, len(LONGEST_FIRST)), -counts[f], within.get(f, 0)) for item, f in zip(items, files)
    }
    items.sort(key=lambda item: order[id(item)])  # (stable: a file's tests keep their order)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (``make test``), xdist's file-at-a-time scheduling with each
    STACK_GROUPS group as one unit: its files go to one process, one after another, and share
    its stack. (xdist's own hook is trylast: this one answers first.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupsOfFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return GROUP_OF.get(path, path)

    return GroupsOfFiles(config, log)


FILES_SHOWN = 30  # (the summary's length: where a suite's time goes, for LONGEST_FIRST above)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The files that took longest, each the sum of its tests' setup, call and teardown (what
    a worker spends on it: ``--dist loadfile`` hands out whole files), after the per-test
    ``--durations``. Under xdist the controller sees every worker's reports."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                path = report.nodeid.split("::", 1)[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", f"slowest {min(FILES_SHOWN, len(per_file))} files")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.2f}s {path}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.2f}s in all {len(per_file)} files (summed over workers)")


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


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server():
    """The fork server test ranks are forked from (tests/rank_forks.py), started by the first
    rank a test starts in this process and shared by the later ones, ended by its pid when
    the session ends."""
    yield
    from tests.rank_forks import stop_fork_server

    stop_fork_server()
