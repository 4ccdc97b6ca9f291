"""Operating a running stack across a control restart, on real processes.

One stack (control on the port fixed by SURGE_CONTROL_PORT, store, data, two node agents,
DP=2 jobs as real rank processes) serves the module: the one the group cli-two-workers
shares (tests/conftest.py STACK_GROUPS, tests/shared_stacks.py); its last test takes it down
(the group's turn starts it again for the next module). `surgectl events --follow` and
`surgectl logs --follow` started before control is SIGKILLed and started again on its port
print every event and every rank line exactly once and exit 0 when the job ends, and one
bounded by ``--reconnect-seconds`` gives up saying so; `surgectl restart control` brings a
dead control back, and restarts a live one under a running job, which finishes; `surgectl
down` then leaves no process of the stack or its ranks behind. Each job here is a rank
launch, so each test checks every fact its job can show (the follows ride along with the
graceful restart; the bounded follow gives up in the outage of the job that ends while
control is down).

A job is held to PACE a step from step 6 on (``SURGE_FAULT_INJECT`` ``slow_steps``), so it
cannot end before the test's restart however slow the machine, still training while control
is down; the test lifts the pace once control is back (or, for the job that must end in the
outage, once control is killed), and the job runs its last steps at its own speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from services.contract import control_pb2
from services.rank.faults import lift_pace
from tests.conftest import REPO, processes_of_home, processes_with
from tests.faults.test_control_restart import restart_control
from tests.faults.test_recovery import SURGECTL, cli, finished, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS, EVERY = 60, 20
# Steps 6..STEPS paced: at least 110 s, more than any restart here takes (`surgectl restart`
# waits 120 s at most), until the test lifts it.
PACE = 2.0
INJECT = ",".join(f"{job}:slow_steps@6:rank={r}:seconds={PACE:g}" for job in ("cfollow", "crestart") for r in (0, 1))
JobOutcome = control_pb2.JobOutcome


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py); its jobs:
    cfollow, crestart."""
    return shared_stack


def control_port(stack) -> int:
    """The port the group's stack fixed for control (SURGE_CONTROL_PORT)."""
    return int(stack.env["SURGE_CONTROL_PORT"])


def lift(stack, job: str) -> None:
    """The job's ranks train at their own speed from now on (its pace lifted)."""
    lift_pace(stack.home / "run" / "faults", job)


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
    assert services(stack.home)["control"]["port"] == control_port(stack)


@contextlib.contextmanager
def follows(home: Path, tmp_path: Path, job: str):
    """`surgectl events JOB --follow -o json` and `surgectl logs JOB --follow -o json`, their
    output under ``tmp_path`` (events.out/.err, logs.out/.err); killed if still running."""
    events = start_follow(home, tmp_path / "events", "events", job, "--follow", "-o", "json")
    logs = start_follow(home, tmp_path / "logs", "logs", job, "--follow", "-o", "json")
    try:
        yield events, logs
    finally:
        for p in (events, logs):
            if p.poll() is None:
                p.kill()
                p.wait()


def check_follows(stack, tmp_path: Path, job: str, events, logs, steps: int, graceful: bool) -> None:
    """Both follows exited 0 after the job FINISHED at ``steps``, having said control was
    unavailable: every event printed once, in order, as control's log has them (a graceful
    restart: nothing graded, no decision but the placement), every rank line once, each
    rank's in its file's order."""
    home = stack.home
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
    if graceful:  # a graceful stop is no fault: nothing graded, no decision but the placement
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


@pytest.mark.parametrize(
    "steps", [STEPS, STEPS - 1], ids=["job-outlives-the-outage", "job-ends-during-the-outage-and-a-follow-gives-up"]
)
def test_events_and_logs_follow_print_everything_once_across_a_sigkill_of_control(stack, tmp_path, steps):
    """A SIGKILL of control and its start on the same port. In the second case the job ends
    while control is down, an outage long enough for a third follow, bounded to 3 s by
    ``--reconnect-seconds``, to give up saying so, and `surgectl restart control` starts the
    dead control again (the graceful `surgectl restart control` under a running job, and
    `surgectl down` after it: test_restart_control_under_a_running_job_...)."""
    home = stack.home
    job = stack.submit(spec("cfollow", steps=steps, every=EVERY))
    bounded = None
    with follows(home, tmp_path, job) as (events, logs):
        try:
            if steps < STEPS:
                bounded = start_follow(
                    home, tmp_path / "bounded", "events", job, "--follow", "--reconnect-seconds", "3"
                )
            stack.wait_step(job, 5)
            wait_for_lines(tmp_path / "events.out", 3, events)
            wait_for_lines(tmp_path / "logs.out", 3, logs)
            if bounded is not None:
                wait_for_lines(tmp_path / "bounded.out", 3, bounded)
            dead = services(home)["control"]["pid"]
            argv = cmdline(dead)
            assert stack.rank_pids(job, 0) and stack.rank_pids(job, 1), "the job ended before control was killed"
            os.kill(dead, signal.SIGKILL)
            time.sleep(2.0)  # control is down; the ranks train on, the follows wait for it
            if bounded is not None:  # the ranks finish and exit while control is down
                lift(stack, job)
                t0 = time.monotonic()
                while stack.rank_pids(job, 0) or stack.rank_pids(job, 1):
                    assert time.monotonic() - t0 < 120, "the ranks did not finish while control was down"
                    time.sleep(0.2)
                assert bounded.wait(timeout=60) == 1  # (3 s after it lost control, at most 5 s after this)
                assert events.poll() is None and logs.poll() is None
                r = cli(home, "restart", "control")  # its process is gone: nothing to stop, start it again
                assert r.returncode == 0, r.stdout + r.stderr
                assert f"pid {dead} -> " in r.stdout and services(home)["control"]["port"] == control_port(stack)
            else:
                assert events.poll() is None and logs.poll() is None
                restart_control(home, argv)
                back = stack.stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=60, wait_for_ready=True)
                assert back.state == control_pb2.JobState.RUNNING, back  # it outlived the outage
                lift(stack, job)
            events.wait(timeout=300)
            logs.wait(timeout=300)
        finally:
            if bounded is not None and bounded.poll() is None:
                bounded.kill()
                bounded.wait()
    check_follows(stack, tmp_path, job, events, logs, steps, graceful=False)
    if bounded is not None:
        err = (tmp_path / "bounded.err").read_text().strip().splitlines()
        assert len(err) == 2 and err[0].startswith("control unavailable"), err  # the notice, then the error
        assert "unreachable for 3 s" in err[1] and "may still be running" in err[1] and "down" not in err[1]


def test_restart_control_under_a_running_job_then_down_leaves_no_process(stack, tmp_path):
    """`surgectl restart control` (SIGTERM: control ends its sessions and streams first; a
    logs stream ended that way must not read as the job's end) under a running job: control
    alone comes back with the same command line, the follows print everything once, the job
    finishes; then `surgectl down` leaves no process of the stack or its ranks."""
    home = stack.home
    bad = cli(home, "restart", "no-such-service")
    assert bad.returncode == 2 and "SERVICE" in bad.stderr and "no-such-service" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    job = stack.submit(spec("crestart", steps=STEPS, every=EVERY))
    with follows(home, tmp_path, job) as (events, logs):
        stack.wait_step(job, 5)
        wait_for_lines(tmp_path / "events.out", 3, events)
        wait_for_lines(tmp_path / "logs.out", 3, logs)
        assert stack.rank_pids(job, 0) and stack.rank_pids(job, 1), "the job ended before control was restarted"
        before = services(home)
        r = cli(home, "restart", "control")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "uncaught_exception" not in (home / "run" / "logs" / "control.log").read_text()
        after = services(home)
        old, new = before["control"]["pid"], after["control"]["pid"]
        assert f"pid {old} -> {new}" in r.stdout
        assert not running(old) and running(new)
        assert after["control"]["port"] == control_port(stack)
        argv = cmdline(new)
        assert (
            argv[argv.index("--host") + 2 :] == after["control"]["args"] == before["control"]["args"]
        )  # same command line
        assert {n: s["pid"] for n, s in after.items() if n != "control"} == {
            n: s["pid"] for n, s in before.items() if n != "control"
        }  # nothing else was touched
        assert stack.status(job).state == control_pb2.JobState.RUNNING  # restarted under the running job
        lift(stack, job)
        events.wait(timeout=300)
        logs.wait(timeout=300)
    check_follows(stack, tmp_path, job, events, logs, STEPS, graceful=True)

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
