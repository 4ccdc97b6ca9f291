"""The real stacks several test modules share (tests/conftest.py STACK_GROUPS): the
``shared_stack`` fixture and the hooks that end a group's stack, taken by the conftest.py of
each directory that has grouped modules (tests/faults, tests/cli).

A stack costs ~19 CPU-s before its tests do anything (docs/LOG.md, session 27): a group's
modules take turns on one instead of each starting its own. It is started by the first of
them that runs and ended (``surgectl down``, then every process of it killed by PID) after the
test process's last test of the group: a group runs as one unit (tests/conftest.py's
scheduler), so it is never left idle beside the files that run next. A session or package
scoped fixture would keep it to the end of the session or of tests/faults, and a fixture's
cached value cannot be ended and started again.

Each module's ``stack`` fixture is its turn (:func:`shared_stack`), which hands the stack on as
the next module needs it. The injections (``SURGE_FAULT_INJECT``, set for the whole stack at
``up``) are the group's modules' own ``INJECT`` strings together: each is keyed by job name
(services/rank/faults.py ``parse_injections``), and no two modules name the same job (checked).
A module's other needs of the stack's environment are its ``STACK_ENV`` (a dict): the group's
modules' together, two that set one variable to different values fail the start.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import time

import pytest

from services.contract import control_pb2
from tests.conftest import GROUP_OF, REPO, STACK_GROUPS
from tests.ports import free_port

# What each group's stack is, beyond its modules' injections.
GROUP_STACKS = {
    # (the dashboard: tests/faults/test_recovery.py's browser test)
    "faults-two-workers": {"workers": 2, "env": {"SURGE_UP_DASHBOARD": "1"}},
    # one rank per node: a DP=2 job leaves a spare
    "faults-three-workers": {"workers": 3, "env": {"SURGE_WORKER_SLOTS": "1"}},
    # control on a fixed port (SURGE_CONTROL_PORT, picked at the start): its modules kill
    # control, or every service, and `surgectl up` must bring it back where the stack's
    # client and the CLI look for it
    "cli-two-workers": {"workers": 2, "env": {}, "control_port": True, "packages": ("json",)},
}
PACKAGES = ("json", "email", "logging")  # (the dataset tiny@v1: the standard library's packages, by default)
ENDED = (control_pb2.JobState.TERMINATED,)

_running: dict[str, tuple[contextlib.ExitStack, object]] = {}  # group -> (what ends it, its Stack)


def group_injections(group: str) -> str:
    """The ``INJECT`` strings of the group's modules, joined; fails if two modules inject
    faults into jobs of the same name (one would get the other's faults)."""
    owner: dict[str, str] = {}
    parts = []
    for path in STACK_GROUPS[group]:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        inject = getattr(module, "INJECT", "")
        for job in {item.split(":", 1)[0] for item in inject.split(",") if item}:
            assert owner.setdefault(job, path) == path, f"job {job} injected by {owner[job]} and {path}"
        parts += [inject] if inject else []
    return ",".join(parts)


def group_env(group: str) -> dict[str, str]:
    """The ``STACK_ENV`` dicts of the group's modules, merged; fails if two modules set one
    variable to different values (one would run under the other's setting)."""
    env: dict[str, str] = {}
    owner: dict[str, str] = {}
    for path in STACK_GROUPS[group]:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for key, value in getattr(module, "STACK_ENV", {}).items():
            assert env.setdefault(key, value) == value, f"{key}: {owner[key]} sets {env[key]!r}, {path} {value!r}"
            owner.setdefault(key, path)
    return env


def _group_of(node) -> str | None:
    return GROUP_OF.get(str(node.path.relative_to(REPO)))


def _start(group: str, tmp_path_factory):
    from tests.faults.test_recovery import running_stack

    shape = GROUP_STACKS[group]
    env = {**shape["env"], **group_env(group), "SURGE_FAULT_INJECT": group_injections(group)}
    if shape.get("control_port"):
        env["SURGE_CONTROL_PORT"] = str(free_port())
    closer = contextlib.ExitStack()
    home = tmp_path_factory.mktemp(f"surge-{group}")
    stack = closer.enter_context(
        running_stack(home, shape.get("packages", PACKAGES), (), env=env, workers=shape["workers"])
    )
    stack.env = env  # (what a test that restarts a service of it passes on)
    stack.workers = shape["workers"]
    _running[group] = (closer, stack)
    return stack


def _end(group: str) -> None:
    closer, _ = _running.pop(group)
    closer.close()


@pytest.fixture(scope="module")
def shared_stack(request, tmp_path_factory):
    """The stack of the requesting module's group, for this module; when the module ends it is
    handed on as a fresh stack would be (unless the module is its group's last): a service of
    it left down (a test that failed before it started it again) is started again, a job of
    the module still live (a test that failed before its job ended) is stopped and waited for,
    a worker left cordoned is uncordoned, so that one module's failure stays its own instead of
    failing or queueing the next module's jobs."""
    group = _group_of(request.node)
    assert group in GROUP_STACKS, f"{request.node.path}: not in a group of tests/conftest.py STACK_GROUPS"
    stack = _running[group][1] if group in _running else _start(group, tmp_path_factory)
    yield stack
    if str(request.node.path.relative_to(REPO)) == STACK_GROUPS[group][-1]:
        return  # (the stack ends with it: the group's last module may leave it broken, tests/conftest.py)
    _start_what_is_down(stack)
    listed = stack.stub.ListJobs(control_pb2.JobQuery(), timeout=30, wait_for_ready=True)  # (control may be new)
    live = [j.job_id for j in listed.jobs if j.state not in ENDED]
    for job_id in live:
        stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job_id, no_checkpoint=True), timeout=30)
    for cordoned in listed.cordoned:
        stack.stub.UncordonWorker(control_pb2.UncordonWorkerRequest(worker_id=cordoned.worker_id), timeout=30)
    deadline = time.monotonic() + 120
    while live and time.monotonic() < deadline:
        states = {j.job_id: j.state for j in stack.stub.ListJobs(control_pb2.JobQuery(), timeout=30).jobs}
        live = [j for j in live if states.get(j) not in ENDED]
        time.sleep(0.2)
    assert not live, f"jobs still live 120 s after their stop, the next module would queue behind them: {live}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start_what_is_down(stack) -> None:
    """`surgectl up` (which starts what is down, as it was: the stack's environment) if a
    service of the stack is not running; the whole stack again (its workers, its environment)
    if a module took it down (`surgectl down` leaves no stack.json)."""
    from tests.faults.test_recovery import cli

    stack_json = stack.home / "run" / "stack.json"
    services = json.loads(stack_json.read_text())["services"] if stack_json.exists() else {}
    down = [name for name, service in services.items() if not _alive(service["pid"])] if services else ["all"]
    if down:
        up = cli(stack.home, "up", "--workers", str(stack.workers), env=stack.env, timeout=120)
        assert up.returncode == 0, f"{down} down after the module; up: {up.stdout}{up.stderr}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the fixtures of ``item`` are torn down (its module's turn among them): end its
    group's stack when the next test is not of the group (or there is none)."""
    try:
        return (yield)
    finally:
        group = _group_of(item)
        if group in _running and (nextitem is None or _group_of(nextitem) != group):
            _end(group)


def pytest_sessionfinish(session, exitstatus) -> None:
    """A session cut short (-x, Ctrl-C) ends whatever stack is still up."""
    for group in list(_running):
        _end(group)
