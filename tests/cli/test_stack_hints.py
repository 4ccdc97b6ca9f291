"""What surgectl tells the operator to do when a service of the local stack does not answer,
named by the state the stack's processes are really in (issue 28 item 6): a process gone is
started again by `surgectl up` (which starts what is down and leaves the rest running), a
process that runs but does not answer by `surgectl restart SERVICE`. Was: always `surgectl
restart control`, also after a kill of every service."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.cli import clients, stack
from services.cli.errors import CliError
from services.contract import control_pb2
from tests.ports import free_port

pytestmark = pytest.mark.timeout(30)
SERVICES = ["store", "data", "control", "worker-0", "worker-1"]


@pytest.mark.parametrize(
    ("service", "down", "says", "never"),
    [
        (
            "control",
            [],
            "control unreachable at A although its process runs; `surgectl restart control` starts it again on "
            "the same port (running jobs keep running)",
            "surgectl up",
        ),
        (
            "control",
            ["control"],
            "control at A is down (its process is gone; the rest of the stack runs); `surgectl up` starts it "
            "again on the same port",
            "restart",
        ),
        (
            "control",
            SERVICES,
            "control unreachable at A: every service of the local stack is down (their processes are gone); "
            "`surgectl up` starts again what is down, on the same ports",
            "restart",
        ),
        (
            "store",
            ["store", "worker-1"],
            "store unreachable at A: store, worker-1 are down (their processes are gone); `surgectl up` starts "
            "again what is down, on the same ports",
            "restart",
        ),
    ],
    ids=["hung", "control-gone", "all-gone", "some-gone"],
)
def test_the_hint_for_an_unreachable_service_names_the_command_for_the_stack_s_real_state(service, down, says, never):
    hint = clients.unreachable_hint(service, "A", SERVICES, down)
    assert hint == says
    assert never not in hint and "surgectl down" not in hint  # (down would stop the jobs' ranks)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_stack(pids: dict[str, int], control_port: int) -> None:
    services = {
        name: {"name": name, "pid": pid, "port": control_port if name == "control" else free_port(), "log": "x"}
        for name, pid in pids.items()
    }
    stack.stack_file().parent.mkdir(parents=True, exist_ok=True)
    stack.stack_file().write_text(json.dumps({"services": services}))


def status_error() -> str:
    with pytest.raises(CliError) as e:
        clients.call("control", lambda s: s.ListJobs(control_pb2.JobQuery(), timeout=5))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_after_a_kill_of_every_service_status_says_up_and_with_control_s_process_running_restart(surge_home):
    port = free_port()  # nothing listens there: control does not answer
    write_stack({name: dead_pid() for name in SERVICES}, port)
    assert stack.down_services() == SERVICES
    message = status_error()
    assert "every service of the local stack is down" in message and "`surgectl up`" in message, message
    assert "restart" not in message
    # The same address with a process that still runs under control's name (hung): restart it.
    write_stack({**{name: dead_pid() for name in SERVICES}, "control": os.getpid()}, port)
    message = status_error()
    assert "although its process runs; `surgectl restart control`" in message, message
    assert clients.start_again_hint("control").startswith("`surgectl restart control`")
    write_stack({**{name: os.getpid() for name in SERVICES}, "control": dead_pid()}, port)
    assert stack.down_services() == ["control"]
    assert clients.start_again_hint("control").startswith("`surgectl up` starts control again")


def test_the_demo_s_last_line_says_up_starts_the_stack_again_to_read_its_job():
    from services.cli.demo import stopped_line

    assert stopped_line(5, 131.04, "") == "stack stopped (5 services); total 131.0 s"  # (nothing submitted)
    line = stopped_line(5, 131.04, "demo-3f2a1c")
    assert line.startswith(
        "stack stopped (5 services); total 131.0 s. `surgectl up` starts it again to read demo-3f2a1c"
    )
    assert "`surgectl status demo-3f2a1c`" in line and "`surgectl logs demo-3f2a1c`" in line
