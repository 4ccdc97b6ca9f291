"""Operating a running stack across a control restart, on real processes.

One stack (control on the port fixed by SURGE_CONTROL_PORT, store, data, two node agents,
DP=2 jobs as real rank processes) serves the module. `surgectl events --follow` and
`surgectl logs --follow` started before control is SIGKILLed and started again on its port
print every event and every rank line exactly once and exit 0 when the job ends;
`surgectl restart control` restarts control under a running job, which finishes, and
`surgectl down` then leaves no process of the stack or its ranks behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from services.contract import control_pb2
from tests.conftest import REPO, free_ports, processes_of_home, processes_with
from tests.faults.test_control_restart import restart_control
from tests.faults.test_recovery import SURGECTL, cli, finished, running_stack, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS, EVERY = 1000, 250  # long enough (about 20 ms a step here) to outlast the restart
JobOutcome = control_pb2.JobOutcome
CONTROL_PORT = free_ports(1)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge-cli-restart")
    with running_stack(home, ("json",), ("cfollow", "crestart"), env={"SURGE_CONTROL_PORT": str(CONTROL_PORT)}) as s:
        yield s


def services(home: Path) -> dict:
    return json.loads((home / "run" / "stack.json").read_text())["services"]


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited child of this test process is one until reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def start_follow(home: Path, out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SURGE_HOME": str(home)}
    for var in ("SURGE_CONTROL_ADDRESS", "SURGE_DATA_ADDRESS", "SURGE_STORE_ADDRESS"):
        env.pop(var, None)
    return subprocess.Popen(
        [*SURGECTL, *args],
        cwd=REPO,
        env=env,
        stdout=open(out.with_suffix(".out"), "wb"),
        stderr=open(out.with_suffix(".err"), "wb"),
        stdin=subprocess.DEVNULL,
    )


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while len(path.read_text().splitlines()) < n:
        assert proc.poll() is None, path.with_suffix(".err").read_text()
        assert time.monotonic() - t0 < timeout, f"{path}: fewer than {n} lines after {timeout} s"
        time.sleep(0.1)


def status_step(events) -> int:
    return finished(events).step


def cmdline(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]


def test_up_puts_control_on_the_port_of_SURGE_CONTROL_PORT(stack):
    assert services(stack.home)["control"]["port"] == CONTROL_PORT


@pytest.mark.parametrize(
    ("steps", "how"),
    [(STEPS, "sigkill"), (300, "sigkill"), (STEPS, "restart")],
    ids=["job-outlives-the-outage", "job-ends-during-the-outage", "surgectl-restart-control"],
)
def test_events_and_logs_follow_print_everything_once_across_a_control_restart(stack, tmp_path, steps, how):
    """A SIGKILL of control and its start on the same port, or a graceful `surgectl restart
    control` (SIGTERM: control ends its sessions and streams first; a logs stream ended
    that way must not read as the job's end)."""
    home = stack.home
    job = stack.submit(spec("cfollow", steps=steps, every=EVERY))
    events = start_follow(home, tmp_path / "events", "events", job, "--follow", "-o", "json")
    logs = start_follow(home, tmp_path / "logs", "logs", job, "--follow", "-o", "json")
    try:
        stack.wait_step(job, 5)
        wait_for_lines(tmp_path / "events.out", 3, events)
        wait_for_lines(tmp_path / "logs.out", 3, logs)
        pid = services(home)["control"]["pid"]
        argv = cmdline(pid)
        assert stack.rank_pids(job, 0) and stack.rank_pids(job, 1), "the job ended before control was killed"
        if how == "restart":
            r = cli(home, "restart", "control")
            assert r.returncode == 0, r.stdout + r.stderr
            assert "uncaught_exception" not in (home / "run" / "logs" / "control.log").read_text()
        else:
            os.kill(pid, signal.SIGKILL)
            time.sleep(2.0)  # control is down; the ranks train on, the follows wait for it
            if steps < STEPS:  # the ranks finish and exit while control is down
                t0 = time.monotonic()
                while stack.rank_pids(job, 0) or stack.rank_pids(job, 1):
                    assert time.monotonic() - t0 < 120, "the ranks did not finish while control was down"
                    time.sleep(0.2)
            assert events.poll() is None and logs.poll() is None
            restart_control(home, argv)
        events.wait(timeout=300)
        logs.wait(timeout=300)
    finally:
        for p in (events, logs):
            if p.poll() is None:
                p.kill()
                p.wait()
    everything = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job), timeout=60, wait_for_ready=True))
    assert finished(everything).outcome == JobOutcome.FINISHED

    err = (tmp_path / "events.err").read_text()
    assert events.returncode == 0, err
    assert "control unavailable" in err and "reconnecting" in err and "surgectl down" not in err
    printed = [json.loads(line) for line in (tmp_path / "events.out").read_text().splitlines()]
    seqs = [int(e["seq"]) for e in printed]
    assert seqs == [e.seq for e in everything] == list(range(1, len(everything) + 1))  # each once, in order
    assert [e["message"] for e in printed] == [e.message for e in everything]
    assert status_step(everything) == steps
    if how == "restart":  # a graceful stop is no fault: nothing graded, no decision but the placement
        judged = [e["message"] for e in printed if e["type"] in ("fault", "decision")]
        assert len(judged) == 1 and judged[0].startswith("2 ranks allocated"), judged

    err = (tmp_path / "logs.err").read_text()
    assert logs.returncode == 0, err
    assert "control unavailable" in err and "surgectl down" not in err
    shown = (tmp_path / "logs.out").read_text().splitlines()
    on_disk = {
        r: [line for line in (home / "run" / "logs" / f"{job}.rank{r}.log").read_text().splitlines() if line.strip()]
        for r in (0, 1)
    }
    assert Counter(shown) == Counter(on_disk[0] + on_disk[1])  # every rank line exactly once
    for r in (0, 1):  # and each rank's lines in the order its file has them
        mine = set(on_disk[r])
        assert [line for line in shown if line in mine] == on_disk[r]


def test_follow_gives_up_after_the_bound_and_restart_brings_a_dead_control_back(stack, tmp_path):
    home = stack.home
    job = stack.submit(spec("cfollow", steps=STEPS, every=EVERY))
    events = start_follow(home, tmp_path / "events", "events", job, "--follow", "--reconnect-seconds", "3")
    try:
        stack.wait_step(job, 5)
        wait_for_lines(tmp_path / "events.out", 3, events)
        dead = services(home)["control"]["pid"]
        os.kill(dead, signal.SIGKILL)
        assert events.wait(timeout=60) == 1
    finally:
        if events.poll() is None:
            events.kill()
            events.wait()
    err = (tmp_path / "events.err").read_text().strip().splitlines()
    assert len(err) == 2 and err[0].startswith("control unavailable"), err  # the notice, then the error
    assert "unreachable for 3 s" in err[1] and "may still be running" in err[1] and "down" not in err[1]

    r = cli(home, "restart", "control")  # its process is gone: nothing to stop, start it again
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pid {dead} -> " in r.stdout and services(home)["control"]["port"] == CONTROL_PORT
    events = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=300, wait_for_ready=True))
    assert (finished(events).outcome, finished(events).step) == (JobOutcome.FINISHED, STEPS)


def test_restart_control_under_a_running_job_then_down_leaves_no_process(stack):
    home = stack.home
    bad = cli(home, "restart", "no-such-service")
    assert bad.returncode == 2 and "SERVICE" in bad.stderr and "no-such-service" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    job = stack.submit(spec("crestart", steps=STEPS, every=EVERY))
    stack.wait_step(job, 5)
    before = services(home)
    r = cli(home, "restart", "control")
    assert r.returncode == 0, r.stdout + r.stderr
    after = services(home)
    old, new = before["control"]["pid"], after["control"]["pid"]
    assert f"pid {old} -> {new}" in r.stdout
    assert not running(old) and running(new)
    assert after["control"]["port"] == CONTROL_PORT
    argv = cmdline(new)
    assert (
        argv[argv.index("--host") + 2 :] == after["control"]["args"] == before["control"]["args"]
    )  # same command line
    assert {n: s["pid"] for n, s in after.items() if n != "control"} == {
        n: s["pid"] for n, s in before.items() if n != "control"
    }  # nothing else was touched

    events = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=300, wait_for_ready=True))
    status = finished(events)
    assert (status.outcome, status.step) == (JobOutcome.FINISHED, STEPS)
    # Every process of this stack, its ranks included (found by its home: a job-name marker
    # also matched the ranks of another test session running this module at the same time).
    stack_processes = processes_of_home(home)
    assert {s["pid"] for s in after.values()} <= set(stack_processes)  # (the look-up sees the stack)

    down = cli(home, "down")
    assert down.returncode == 0, down.stderr
    pids = [s["pid"] for s in after.values()] + stack_processes
    assert [p for p in pids if running(p)] == []
    assert [p for p in processes_of_home(home) if running(p)] == []
    assert [p for p in processes_with(f"--job {job}") if running(p)] == []
