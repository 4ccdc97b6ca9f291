"""`kill -9` of `control` while a job trains (issue 4, control plane restart), on real processes.

The stack (control, store, data, two node agents, two rank processes; the one its group shares,
tests/shared_stacks.py: every service killed here is started again) runs a DP=2 job; control
is SIGKILLed mid-training and started again with the same command line (same ports,
same SURGE_HOME, so the same SQLite journal). The ranks keep training meanwhile; their node
agents reconnect, re-attach the ranks and resend the events control had not applied. The job
must finish with every step applied exactly once (control's journal of applied steps:
1..N, no gap, no repeat) and its final checkpoint committed.

A job is held to PACE a step from the step after the one its test waits for (``SURGE_FAULT_INJECT``
``slow_steps``), so that it cannot end before the test's kills however slow the machine (and
still trains while control is down); the test lifts the pace once they are done.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from services.control.orchestrator import REATTACH_MESSAGE, REATTACHED_MESSAGE
from services.rank.faults import lift_pace
from tests.conftest import REPO, processes_with
from tests.faults.test_recovery import cli, finished, metric, of_type, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS, EVERY = 60, 20
# ``trestart`` is paced from the step after the restart's (8), ``trfault`` (the jobs whose
# rank or node agent is lost: after step FAULT_AT, the checkpoint at step EVERY taken) from
# the step after FAULT_AT: at least 60 s to their end, more than any kill and restart here
# takes, until the test lifts it. They replay EVERY+1..STEPS after the recovery.
PACE, RESTART_AT, FAULT_AT = 2.0, 8, 30
INJECT = ",".join(
    f"{job}:slow_steps@{at + 1}:rank={r}:seconds={PACE:g}"
    for job, at in (("trestart", RESTART_AT), ("trfault", FAULT_AT))
    for r in (0, 1)
)


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def lift(stack, job: str) -> None:
    """The job's ranks (and those relaunched for it) train at their own speed from now on."""
    lift_pace(stack.home / "run" / "faults", job)


def restart_control(home: Path, argv: list[str]) -> subprocess.Popen:
    """Start control again with its old command line; the stack file names the new pid (so
    `surgectl down` stops it)."""
    env = {**os.environ, "SURGE_HOME": str(home), "PYTHONUNBUFFERED": "1", "PROMETHEUS_DISABLE_CREATED_SERIES": "true"}
    stack_json = home / "run" / "stack.json"
    services = json.loads(stack_json.read_text())
    with open(services["services"]["control"]["log"], "ab") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    services["services"]["control"]["pid"] = proc.pid
    stack_json.write_text(json.dumps(services, indent=2))
    return proc


def applied_steps(home: Path, job_id: str) -> list[tuple[int, float, float]]:
    """(step, loss, applied_unix) of every step control applied, in order of application."""
    with sqlite3.connect(home / "control.db") as db:
        return db.execute(
            "SELECT step, loss, applied_unix FROM steps WHERE job_id=? ORDER BY rowid", (job_id,)
        ).fetchall()


def agent_resends(home: Path, since: float) -> list[dict]:
    """The node agents' re-registrations after ``since``: their resend counts (JSON log lines)."""
    out = []
    for log in sorted((home / "run" / "logs").glob("worker-*.log")):
        for line in log.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "registered with control" and "events_resent" in rec:
                out.append(rec)
    return [r for r in out if _unix(r.get("timestamp", "")) >= since]


def _unix(stamp: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def test_a_job_survives_a_sigkill_of_control_with_every_step_applied_exactly_once(stack):
    home = stack.home
    job = stack.submit(spec("trestart", steps=STEPS, every=EVERY))
    stack.wait_step(job, RESTART_AT)
    pid = json.loads((home / "run" / "stack.json").read_text())["services"]["control"]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    argv = [a.decode() for a in argv]
    step_before = stack.status(job).step
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    time.sleep(2.0)  # control is down; the ranks keep training, their events wait in the agents
    assert processes_with(f"--job {job} --rank 0") and processes_with(f"--job {job} --rank 1")
    restarted = time.time()
    proc = restart_control(home, argv)
    # What `surgectl status` shows (GetJob, ListJobs): the restart's "waiting for the ranks"
    # until every rank was heard from, then that they re-attached, while the job trains on.
    t0 = time.monotonic()
    while (
        now := stack.stub.GetJob(control_pb2.JobQuery(job_id=job), timeout=30, wait_for_ready=True)
    ).message == REATTACH_MESSAGE:
        assert time.monotonic() - t0 < 60, f"status still {now.message!r} at step {now.step}"
        time.sleep(0.05)
    assert (now.state, now.message) == (control_pb2.JobState.RUNNING, REATTACHED_MESSAGE)
    (listed,) = [j for j in stack.stub.ListJobs(control_pb2.JobQuery(), timeout=30).jobs if j.job_id == job]
    assert (listed.state, listed.message) == (control_pb2.JobState.RUNNING, REATTACHED_MESSAGE)
    lift(stack, job)
    # The test's channel reconnects to the new process once it listens.
    query = control_pb2.JobQuery(job_id=job, follow=True)
    events = list(stack.stub.WatchJob(query, timeout=240, wait_for_ready=True))
    assert proc.poll() is None
    status = finished(events)
    assert status.step == STEPS and math.isfinite(status.train_loss)

    # Exactly once: every step applied, in order, no repeat, no gap.
    steps = applied_steps(home, job)
    assert [s for s, _, _ in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for _, loss, _ in steps)
    after = [applied for _, _, applied in steps if applied >= restarted]
    assert after, "no step was applied after the restart"
    to_next_step = min(after) - restarted
    # The log says so: restored, not frozen, no fault decided because of the restart.
    assert any(e.message.startswith("RUNNING: control restarted; waiting for the ranks to re-attach") for e in events)
    (reattached,) = [e for e in events if e.message == f"RUNNING: {REATTACHED_MESSAGE}"]
    assert reattached.status.message == REATTACHED_MESSAGE
    assert of_type(events, "decision")[1:] == []
    assert not [e for e in events if e.type == "fault"]
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))

    # The final checkpoint is committed and verified, and its loss is in the store's records.
    checkpoints = [m for m in of_type(events, "checkpoint")]
    assert any(f" at step {STEPS} " in m for m in checkpoints), checkpoints
    listed = cli(home, "checkpoints", job, "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert STEPS in [int(c.get("step", 0)) for c in json.loads(listed.stdout)]
    records = [r for r in stack.step_records(job) if r["rank"] == 0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    resends = agent_resends(home, restarted)
    assert len(resends) >= 2  # both node agents re-registered with the new control
    resent = sum(r["events_resent"] for r in resends)
    sent_after = sum(r["events_to_send"] for r in resends)
    duplicates = metric(stack.metrics(), "surge_worker_events_total", outcome="duplicate")
    applied = metric(stack.metrics(), "surge_worker_events_total", outcome="applied")
    print(
        f"control restart: killed at step {step_before}, down {restarted - killed:.1f} s; next step applied "
        f"{to_next_step:.2f} s after the restart; agents resent {resent} unacknowledged events and sent "
        f"{sent_after} queued in all; control applied {applied:.0f} sequenced events and dropped "
        f"{duplicates:.0f} duplicates"
    )
    assert duplicates == 0 or duplicates <= resent


def test_a_rank_that_dies_while_control_is_down_is_recovered_by_the_policy_after_the_restart(stack):
    home = stack.home
    job = stack.submit(spec("trfault", steps=STEPS, every=EVERY))
    wait_fault_at(stack, job)
    pid = json.loads((home / "run" / "stack.json").read_text())["services"]["control"]["pid"]
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    (victim,) = processes_with(f"--job {job} --rank 1")
    os.kill(victim, signal.SIGKILL)  # its node agent reaps it and keeps the fact for control
    lift(stack, job)
    time.sleep(1.0)
    proc = restart_control(home, argv)
    events = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=240, wait_for_ready=True))
    assert proc.poll() is None
    finished(events)
    (fault,) = [e for e in events if e.type == "fault" and e.message.startswith("SEVERE rank_exit: rank 1 ")]
    assert "(signal 9)" in fault.message
    decisions = of_type(events, "decision")[1:]
    assert decisions[0].startswith("restart_ranks after rank_exit of rank 1")
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job}:1;" in relaunch
    # Applied once each: 1..the last step before the fault, then the replay from step EVERY + 1.
    steps = [s for s, _, _ in applied_steps(home, job)]
    resumed = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # where the replay starts
    assert steps[:resumed] == list(range(1, resumed + 1)) and steps[resumed:] == list(range(EVERY + 1, STEPS + 1))
    print(
        f"rank killed while control was down: recovered from {job}:1 after the restart; "
        f"steps applied 1..{resumed} then {EVERY + 1}..{STEPS}"
    )


def journaled_messages(home: Path, job_id: str) -> list[str]:
    """The job's event messages as control journaled them (read while control may be busy)."""
    with sqlite3.connect(home / "control.db") as db:
        return [m for (m,) in db.execute("SELECT message FROM events WHERE job_id=? ORDER BY seq", (job_id,))]


def test_a_recovery_interrupted_by_a_sigkill_of_control_is_resumed_after_the_restart(stack):
    home = stack.home
    job = stack.submit(spec("trfault", steps=STEPS, every=EVERY))
    wait_fault_at(stack, job)
    services = json.loads((home / "run" / "stack.json").read_text())["services"]
    pid, store_pid = services["control"]["pid"], services["store"]["pid"]
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    # The store frozen: the recovery control decides next waits in its checkpoint check, after
    # the decision is journaled and before any rank is relaunched.
    os.kill(store_pid, signal.SIGSTOP)
    try:
        (victim,) = processes_with(f"--job {job} --rank 1")
        os.kill(victim, signal.SIGKILL)
        lift(stack, job)
        t0 = time.monotonic()
        while not any(m.startswith("restart_ranks after rank_exit of rank 1") for m in journaled_messages(home, job)):
            assert time.monotonic() - t0 < 60, "no recovery decided"
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)  # mid-recovery: FAULT_FROZEN, nothing relaunched yet
    finally:
        os.kill(store_pid, signal.SIGCONT)
    assert not any(m.startswith("ranks killed and relaunched") for m in journaled_messages(home, job))
    time.sleep(1.0)
    restarted = time.time()
    proc = restart_control(home, argv)
    events = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=240, wait_for_ready=True))
    assert proc.poll() is None
    status = finished(events)
    assert status.step == STEPS
    assert any(
        e.message.startswith(
            "FAULT_FROZEN: control restarted mid-recovery; resuming it (restart_ranks after rank_exit of rank 1)"
        )
        for e in events
    )
    decisions = of_type(events, "decision")[1:]
    # One restart spent (before the kill); the relaunch commanded again after the restart.
    (spent,) = [d for d in decisions if "(restart " in d]
    assert spent.startswith("restart_ranks after rank_exit of rank 1") and "(restart 1 of " in spent
    (again,) = [d for d in decisions if d.startswith("relaunch again for the recovery from rank_exit of rank 1")]
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job}:1;" in relaunch
    steps = applied_steps(home, job)
    numbers = [s for s, _, _ in steps]
    resumed = next(i for i in range(1, len(numbers)) if numbers[i] <= numbers[i - 1])
    assert numbers[:resumed] == list(range(1, resumed + 1)) and numbers[resumed:] == list(range(EVERY + 1, STEPS + 1))
    first_after = min(applied for _, _, applied in steps if applied >= restarted)
    recovered = [e for e in events if e.type == "state" and "recovered from rank_exit" in e.message]
    assert recovered
    print(
        f"recovery interrupted by a control SIGKILL: resumed after the restart ({again!r}); first step "
        f"(step {numbers[resumed]}) applied {first_after - restarted:.2f} s after control was restarted; "
        f"RUNNING again {recovered[0].unix_time - restarted:.2f} s after it"
    )


def test_ranks_relaunched_just_before_a_sigkill_of_control_are_adopted_not_relaunched_again(stack):
    home = stack.home
    job = stack.submit(spec("trfault", steps=STEPS, every=EVERY))
    wait_fault_at(stack, job)
    pid = json.loads((home / "run" / "stack.json").read_text())["services"]["control"]["pid"]
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    (victim,) = processes_with(f"--job {job} --rank 1")
    os.kill(victim, signal.SIGKILL)
    lift(stack, job)
    t0 = time.monotonic()
    while not any(m.startswith("ranks killed and relaunched") for m in journaled_messages(home, job)):
        assert time.monotonic() - t0 < 60, "no relaunch"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)  # the relaunched ranks are still starting: none reported ready
    killed_msgs = journaled_messages(home, job)
    assert not any(m.startswith("FAULT_FROZEN -> RUNNING") for m in killed_msgs)
    time.sleep(1.0)
    restarted = time.time()
    proc = restart_control(home, argv)
    events = list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=240, wait_for_ready=True))
    assert proc.poll() is None
    assert finished(events).step == STEPS
    assert any(
        e.message.startswith(
            "FAULT_FROZEN: control restarted mid-recovery; resuming it (restart_ranks after "
            "rank_exit of rank 1): its ranks were relaunched"
        )
        for e in events
    )
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    decisions = of_type(events, "decision")[1:]
    # The designed fallback, seen only on a machine so loaded that a relaunched rank takes
    # longer than the re-attach window to send its first beat: control cannot tell it from
    # one that never started, and commands the relaunch again (no second restart spent).
    again = [d for d in decisions if d.startswith("relaunch again for the recovery")]
    assert len(again) <= 1 and len(relaunches) == 1 + len(again)
    assert len(decisions) == 1 + len(again)  # the one restart; nothing else decided after the restart
    assert len([d for d in decisions if "(restart " in d]) == 1
    numbers = [s for s, _, _ in applied_steps(home, job)]
    resumed = next(i for i in range(1, len(numbers)) if numbers[i] <= numbers[i - 1])
    assert numbers[resumed:] == list(range(EVERY + 1, STEPS + 1))
    first_after = min(applied for _, _, applied in applied_steps(home, job) if applied >= restarted)
    print(
        f"ranks relaunched just before the control SIGKILL: adopted after the restart, not relaunched again; "
        f"first step applied {first_after - restarted:.2f} s after control was restarted"
    )


def process_argv_env(pid: int) -> tuple[list[str], dict[str, str]]:
    """A live process's command line and environment (to start it again the same way)."""
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    return argv, {k.decode(): v.decode() for k, v in env.items()}


def restart_worker(home: Path, name: str, argv: list[str], env: dict[str, str]) -> None:
    """Start a node agent SIGKILLed by a test again (same id, port and run dir), so the
    module's later tests have two workers; the stack file names the new pid."""
    stack_json = home / "run" / "stack.json"
    services = json.loads(stack_json.read_text())
    # The old agent gone first (a SIGTERMed one stops its ranks before it exits): its port is
    # the new one's, which would exit EXIT_PORT_IN_USE while the old still holds it.
    wait_gone([services["services"][name]["pid"]])
    log_path = Path(services["services"][name]["log"])
    start = log_path.stat().st_size
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    services["services"][name]["pid"] = proc.pid
    stack_json.write_text(json.dumps(services, indent=2))
    t0 = time.monotonic()
    while "registered with control" not in log_path.read_bytes()[start:].decode(errors="replace"):
        assert proc.poll() is None and time.monotonic() - t0 < 60, f"{name} did not register again"
        time.sleep(0.1)


def worker_of(home: Path, job_id: str, rank: int) -> tuple[str, int]:
    """(name, pid) of the node agent running ``rank`` of ``job_id`` (a rank's command line
    names its agent's port)."""
    services = json.loads((home / "run" / "stack.json").read_text())["services"]
    (pid,) = processes_with(f"--job {job_id} --rank {rank}")
    for name, s in services.items():
        if name.startswith("worker") and pid in processes_with(f"--session 127.0.0.1:{s['port']} "):
            return name, s["pid"]
    raise AssertionError(f"no worker runs rank {rank} of {job_id}")


def wait_fault_at(stack, job: str) -> None:
    """The job is at step FAULT_AT and its checkpoint at step EVERY is committed (under load
    that save may still be committing at FAULT_AT: a fault then would be recovered from no
    version, not the one these tests resume from; CI saw it once)."""
    stack.wait_step(job, FAULT_AT)
    t0 = time.monotonic()
    so_far = lambda: list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job), timeout=30))  # noqa: E731
    while not any(m.startswith("checkpoint ") and f" at step {EVERY} " in m for m in of_type(so_far(), "checkpoint")):
        assert time.monotonic() - t0 < 60, "no checkpoint at step EVERY"
        time.sleep(0.2)


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while any(Path(f"/proc/{p}").exists() and "Z" not in _proc_state(p) for p in pids):
        assert time.monotonic() - t0 < timeout, f"processes {pids} still alive"
        time.sleep(0.05)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


@pytest.mark.parametrize("when", ["before_the_restart", "just_after_it_re_attached"])
def test_a_node_agent_lost_around_a_control_restart_is_blamed_not_the_surviving_rank(stack, when):
    # DP=2, one rank per node agent. Control is SIGKILLed; then rank 1's node agent, before
    # the new control is up (it never re-attaches: nobody tells control), or just after it
    # re-attached to it (its session closes): rank 1 exits with it (its session ended), rank
    # 0's all-reduce fails (gloo) and rank 0 exits with its comm_error. As without a restart (see
    # test_recovery's dead node agent): the loss is graded worker_lost for rank 1, on its
    # worker, the survivor's reports are its consequences, and the relaunch waits for capacity
    # (two ranks, one worker left) until the lost agent is back under its id; then the job
    # runs again from its newest checkpoint, one restart spent.
    home = stack.home
    job = stack.submit(spec("trfault", steps=STEPS, every=EVERY))
    wait_fault_at(stack, job)
    control_pid = json.loads((home / "run" / "stack.json").read_text())["services"]["control"]["pid"]
    argv = [a.decode() for a in Path(f"/proc/{control_pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    worker, agent_pid = worker_of(home, job, 1)
    agent_argv, agent_env = process_argv_env(agent_pid)
    ranks = processes_with(f"--job {job} --rank 0") + processes_with(f"--job {job} --rank 1")
    os.kill(control_pid, signal.SIGKILL)
    time.sleep(0.5)
    events: list[control_pb2.JobEvent] = []
    try:
        if when == "before_the_restart":
            os.kill(agent_pid, signal.SIGKILL)
            wait_gone(ranks)  # rank 1 with its session, rank 0 on its failed collective
            time.sleep(0.5)
            proc = restart_control(home, argv)
        else:
            agent_log = Path(json.loads((home / "run" / "stack.json").read_text())["services"][worker]["log"])
            seen = agent_log.stat().st_size
            proc = restart_control(home, argv)
            t0 = time.monotonic()  # the agent re-attaches to the new control; the other may not have yet
            while "registered with control" not in agent_log.read_bytes()[seen:].decode(errors="replace"):
                assert time.monotonic() - t0 < 60, f"{worker} did not re-attach"
                time.sleep(0.02)
            os.kill(agent_pid, signal.SIGKILL)
        lift(stack, job)
        watch = stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=240, wait_for_ready=True)
        for e in watch:  # until the recovery waits for the lost worker's slot
            events.append(e)
            if e.type == "recovery" and "waiting for capacity" in e.message:
                break
        assert proc.poll() is None
    finally:
        wait_gone([agent_pid])
        restart_worker(home, worker, agent_argv, agent_env)
    for e in watch:  # the agent back: relaunched, running again
        events.append(e)
        if e.type == "state" and e.status.state == control_pb2.JobState.RUNNING:
            break
    stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job, no_checkpoint=True))
    events += list(watch)
    story = "\n".join(f"{e.type}: {e.message}" for e in events)
    faults = [e.message for e in events if e.type == "fault"]
    causes = [m for m in faults if "(consequence of" not in m]
    assert len(causes) == 1 and causes[0].startswith("SEVERE worker_lost"), story
    lost = causes[0]
    assert lost.startswith(f"SEVERE worker_lost: rank 1 lost with worker {worker}"), story
    # The survivor is never blamed: whatever rank 0 reported is a consequence of the loss.
    assert all(m.endswith("(consequence of rank 1's worker_lost)") for m in faults if "rank 0" in m), story
    decisions = [m for m in of_type(events, "decision")[1:] if not m.startswith("stop requested")]
    assert decisions == [f"restart_ranks after worker_lost of rank 1 on {worker} (restart 1 of 3 for worker_lost)"], (
        story
    )
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    # The newest version committed before the relaunch: a save every rank wrote before the
    # loss may commit just after the fault is reported (its commit runs in the background).
    relaunched = next(i for i, e in enumerate(events) if e.message.startswith("ranks killed and relaunched"))
    newest = [e.message.split()[1] for e in events[:relaunched] if e.type == "checkpoint"][-1]
    assert len(relaunches) == 1 and f"to resume from checkpoint {newest};" in relaunches[0], story
    status = events[-1].status
    assert (status.state, status.outcome) == (control_pb2.JobState.TERMINATED, control_pb2.JobOutcome.STOPPED), story
    print(f"node agent lost {when.replace('_', ' ')}: {lost}; then {decisions[0]}; {relaunches[0]}")
