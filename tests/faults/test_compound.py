"""Compound faults on the real stack (issue 12): a fault during a recovery, a service down
while another fails, a node agent leaving with notice (issue 30 item 5), with a spare and
without. Each test asserts that no intact
version is struck, that no progress is lost beyond the newest verified checkpoint, and that
no other job is disturbed.

One stack (control, store, data, two workers of one slot each) serves the module; every
process it started is killed by PID at the end. A job that must still run when its fault
comes is held to PACE a step from the step after the one its test waits for
(``SURGE_FAULT_INJECT`` ``slow_steps``: PACED), whatever the machine's speed; the test lifts
the pace once the fault is in, and the job runs the rest at its own speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from services.rank.faults import lift_pace
from tests.conftest import REPO, processes_with

from .test_control_restart import process_argv_env, restart_control, restart_worker
from .test_recovery import JobOutcome, JobState, cli, of_type, running_stack
from .test_recovery import spec as recovery_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

PACE = 2.0
PACED = ",".join(
    f"{job}:slow_steps@{at}:rank={r}:seconds={PACE:g}"
    for job, at in (("cstore", 13), ("cflip", 13), ("cleave", 9), ("cmove", 9), ("cdrain", 9))
    for r in (0, 1)
)


def spec(name: str, steps: int) -> str:
    """test_recovery's job at dp=1 (two jobs fit the two one-slot workers), with a fault policy
    that waits long enough for every wait these tests make."""
    return (
        recovery_spec(name, steps=steps, every=5).replace("parallel: {dp: 2}", "parallel: {dp: 1}")
        + "fault_policy: {store_wait_seconds: 300, capacity_wait_seconds: 300}\n"
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # No in-memory checkpoint copies: these faults are about the store's files (a recovery
    # would otherwise read a damaged version's chunks from the agents' memory, intact; that
    # path is tested in tests/worker/test_memory_copies.py).
    with running_stack(
        tmp_path_factory.mktemp("surge-compound"),
        ("json", "email"),
        ("cstore", "cother", "cctl", "cleave", "cflip"),
        env={"SURGE_WORKER_MEMORY_COPY_BYTES": "0", "SURGE_FAULT_INJECT": PACED},
    ) as s:
        yield s


def lift(stack, job_id: str) -> None:
    """The job's ranks (and those relaunched for it) train at their own speed from now on."""
    lift_pace(stack.home / "run" / "faults", job_id)


def services(home: Path) -> dict:
    return json.loads((home / "run" / "stack.json").read_text())["services"]


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    t0 = time.monotonic()
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(every)


def events_so_far(stack, job_id: str) -> list[control_pb2.JobEvent]:
    q = control_pb2.JobQuery(job_id=job_id, follow=False)
    return list(stack.stub.WatchJob(q, timeout=30))


def committed_versions(events, verified: bool = False) -> list[tuple[int, str]]:
    """(step, version) of each commit whose report control applied; ``verified``: and of each
    version the store's verification found committed, its report not (yet) arrived (a recovery
    that verifies the store before a commit's report comes in records it so, and the report,
    arriving later, is then recorded nowhere: the version is known)."""
    out = []
    for m in of_type(events, "checkpoint"):
        found = verified and " verified: committed by the store" in m
        if m.startswith("checkpoint ") and " at step " in m and ("bytes" in m or found):
            version, rest = m[len("checkpoint ") :].split(" at step ", 1)
            out.append((int(rest.split(" ", 1)[0]), version))
    return out


def newest_at_relaunch(events) -> str:
    """The newest version control knew of when it relaunched the ranks: committed (its report
    applied) or found by the store's verification (a commit whose report never arrived)."""
    relaunch = next(i for i, e in enumerate(events) if e.type == "recovery" and e.message.startswith("ranks killed"))
    versions = [
        e.message.split()[1]
        for e in events[:relaunch]
        if e.type == "checkpoint" and (" bytes, " in e.message or "committed by the store" in e.message)
    ]
    return max(versions, key=lambda v: int(v.rsplit(":", 1)[1]))


def assert_nothing_struck(events) -> None:
    struck = [
        m for m in (e.message for e in events) if "fails verification" in m or "unusable" in m or "never loaded" in m
    ]
    assert struck == [], struck


def assert_moved_with_nothing_lost(events, at: int) -> int:
    """A departure with notice: no fault decided (no restart spent), the ranks relaunched from
    the departure's checkpoint, taken at a boundary at or after step ``at`` (the step when the
    agent got its signal): no step lost. Returns that checkpoint's step."""
    decisions = [m for m in of_type(events, "decision") if " after " in m]
    assert decisions == [], decisions
    departed = [m for m in (e.message for e in events if e.type == "fault") if "worker_departed" in m]
    assert departed == [], departed
    moved = [
        m
        for m in of_type(events, "departure")
        if ": checkpoint at step " in m and ("moving to" in m or "continues from it off" in m)
    ]
    assert len(moved) == 1, of_type(events, "departure")
    step = int(moved[0].split(": checkpoint at step ", 1)[1].split(" ", 1)[0])
    assert step >= at, (step, at)
    resumed = [
        m for m in of_type(events, "decision") if m.startswith("resume ") and "departs" in m and "restart budgets" in m
    ]
    assert len(resumed) == 1 and f"(step {step})" in resumed[0] and "restart budgets kept" in resumed[0], resumed
    return step


def assert_one_departure(events) -> None:
    """One decision (worker_departed, one restart spent), one relaunch, from a checkpoint."""
    decisions = [m for m in of_type(events, "decision") if " after " in m]
    assert len(decisions) == 1 and decisions[0].startswith("restart_ranks after worker_departed"), decisions
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert len(relaunches) == 1 and "resume from checkpoint" in relaunches[0], relaunches


def test_the_store_stopped_during_a_recovery_loses_nothing_and_disturbs_no_other_job(stack):
    """A rank of job A is SIGKILLed while the store is SIGSTOPped (past every RPC deadline):
    A waits FAULT_FROZEN for the store, strikes nothing, and resumes from its newest version
    once the store runs again; job B, training on the other worker all along, is never graded
    silent nor restarted (its saves fail and are reported; it trains on)."""
    # A is killed soon after step 12 (paced from step 13 until then) and then has only to
    # finish: ~30 steps after its recovery (a save every 5).
    a = stack.submit(spec("cstore", steps=40))
    # B outlasts A's wait by any machine's speed: it is stopped once the store is back (a job
    # that ends while the store is away cannot hand the store its last metric records).
    b = stack.submit(spec("cother", steps=1_000_000))
    stack.wait_step(a, 12)
    store_pid = services(stack.home)["store"]["pid"]
    (rank_pid,) = stack.rank_pids(a, 0)
    os.kill(store_pid, signal.SIGSTOP)
    try:
        before = committed_versions(events_so_far(stack, a))
        assert before, "job A committed no version before the fault"
        os.kill(rank_pid, signal.SIGKILL)
        lift(stack, a)
        wait_for(lambda: stack.status(a).message.startswith("waiting for the store"), 60, "A waiting for the store")
        b_step = stack.status(b).step
        # Past the store relay's 10 s deadline: the verification times out and is retried; B's
        # save, blocked as long by the stopped store, is skipped and B trains on (both waited
        # for by their status, not slept through: the deadlines are all they wait).
        retried = ("waiting for the store (timeout", "asking the store again")
        wait_for(lambda: stack.status(a).message.startswith(retried), 60, "A's store check to time out")
        wait_for(lambda: stack.status(b).step > b_step, 60, "B to train on while A waits")
        status = stack.status(a)
        assert status.state == JobState.FAULT_FROZEN, status.message  # (still waiting: the store is stopped)
    finally:
        os.kill(store_pid, signal.SIGCONT)
    resumed_at = stack.status(b).step
    stack.wait_step(b, resumed_at + 5)  # B trains on with the store back; then it leaves A the cores
    stack.stub.StopJob(control_pb2.StopJobRequest(job_id=b, no_checkpoint=True))
    events_a = stack.events(a, timeout=300)
    relaunches = [m for m in of_type(events_a, "recovery") if m.startswith("ranks killed and relaunched")]
    newest = newest_at_relaunch(events_a)  # (a commit in flight at the SIGSTOP may be newer than `before`)
    assert int(newest.rsplit(":", 1)[1]) >= int(max(before)[1].rsplit(":", 1)[1])
    assert len(relaunches) == 1 and f"to resume from checkpoint {newest};" in relaunches[0], relaunches
    assert_nothing_struck(events_a)
    assert events_a[-1].status.outcome == JobOutcome.FINISHED, events_a[-1].message
    events_b = stack.events(b, timeout=300)
    assert events_b[-1].status.outcome == JobOutcome.STOPPED, events_b[-1].message
    graded = [m for m in of_type(events_b, "decision") if "after" in m and not m.startswith("stop requested")]
    assert graded == []  # never graded, never restarted
    assert of_type(events_b, "fault") == []
    last = events_b[-1].status.step
    assert last > b_step
    wait_for(lambda: len(stack.step_records(b)) >= last, 30, "B's records of every step")
    steps_b = [r["step"] for r in stack.step_records(b)]
    assert sorted(steps_b) == list(range(1, last + 1))  # every step's record, exactly once


def test_control_killed_during_a_recovery_with_the_store_down_resumes_from_the_newest_version(stack):
    """The store SIGKILLed, then the job's rank, then control SIGKILLed while the recovery
    waits for the store; control comes back and its restored recovery waits for the store
    again, then the store comes back: the job resumes from its newest committed version (never
    from scratch) and finishes."""
    job = stack.submit(spec("cctl", steps=60))
    stack.wait_step(job, 12)
    svc = services(stack.home)
    store_argv, store_env = process_argv_env(svc["store"]["pid"])
    control_argv, _ = process_argv_env(svc["control"]["pid"])
    before = committed_versions(events_so_far(stack, job))
    newest_step, newest = max(before)
    os.kill(svc["store"]["pid"], signal.SIGKILL)
    os.kill(stack.rank_pids(job, 0)[0], signal.SIGKILL)
    wait_for(lambda: stack.status(job).message.startswith("waiting for the store"), 60, "waiting for the store")
    os.kill(svc["control"]["pid"], signal.SIGKILL)
    restart_control(stack.home, control_argv)
    wait_for(lambda: _answers(stack, job), 60, "control back")
    # The restarted control's recovery finds the store still away (then it comes back).
    wait_for(lambda: stack.status(job).message.startswith("waiting for the store"), 60, "waiting for the store again")
    with open(svc["store"]["log"], "ab") as log:
        store = subprocess.Popen(
            store_argv,
            cwd=REPO,
            env=store_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    stack_json = stack.home / "run" / "stack.json"
    data = json.loads(stack_json.read_text())
    data["services"]["store"]["pid"] = store.pid
    stack_json.write_text(json.dumps(data, indent=2))
    events = stack.events(job, timeout=300)
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert relaunches and all("resume from scratch" not in m for m in relaunches), relaunches
    assert int(newest_at_relaunch(events).rsplit(":", 1)[1]) >= int(newest.rsplit(":", 1)[1])
    assert f"to resume from checkpoint {newest_at_relaunch(events)};" in relaunches[-1], relaunches
    assert_nothing_struck(events)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message


def _answers(stack, job_id: str) -> bool:
    try:
        stack.status(job_id)
        return True
    except Exception:  # noqa: BLE001 - control still starting
        return False


def test_a_node_agent_leaving_with_no_spare_checkpoints_and_the_job_continues_from_there_when_it_is_back(stack):
    """SIGTERM of the node agent running a dp=1 job's rank while the other worker is busy
    (no spare): a departure with notice, no fault: the job checkpoints at a step boundary, its
    rank is released (never relaunched onto the departing agent), the job waits in the queue
    and continues from that checkpoint once the agent is back under the same id; no restart
    spent, no step lost."""
    busy = stack.submit(spec("cother", steps=100000))  # holds the other worker's only slot
    try:
        _leave_and_come_back(stack)
    finally:  # the busy job never holds a slot past this test, passed or failed
        stack.stub.StopJob(control_pb2.StopJobRequest(job_id=busy, no_checkpoint=True))
        stack.events(busy, timeout=120)  # (to its end: its rank has left the slot)


def _leave_and_come_back(stack) -> None:
    job = stack.submit(spec("cleave", steps=60))
    stack.wait_step(job, 8)
    svc = services(stack.home)
    worker = worker_of(stack, job)
    argv, env = process_argv_env(svc[worker]["pid"])
    at = stack.status(job).step
    os.kill(svc[worker]["pid"], signal.SIGTERM)
    lift(stack, job)
    wait_for(lambda: stack.status(job).state == JobState.STANDBY, 120, "queued for a slot")
    time.sleep(1.0)
    restart_worker(stack.home, worker, argv, env)
    events = stack.events(job, timeout=300)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    assert_moved_with_nothing_lost(events, at)


def worker_of(stack, job: str) -> str:
    """The stack's worker running the job's rank 0."""
    (rank_pid,) = stack.rank_pids(job, 0)
    return next(
        n
        for n, s in services(stack.home).items()
        if n.startswith("worker") and rank_pid in processes_with(f"--session 127.0.0.1:{s['port']} ")
    )


def test_a_node_agent_s_sigterm_with_a_spare_free_moves_the_job_there_with_no_step_lost(stack):
    """SIGTERM of the node agent running a dp=1 job's rank while the other worker is free: the
    job checkpoints at a boundary every rank agrees on and continues on the spare from that
    step; no fault, no restart spent. Prints the seconds from the signal to the job stepping
    again (docs/LOG.md). With SURGE_TEST_DEPARTURE_BEFORE=1 the agent gets SIGINT instead (a
    stop without notice: today's worker_departed handling), which prints the steps it lost."""
    before = os.environ.get("SURGE_TEST_DEPARTURE_BEFORE") == "1"
    job = stack.submit(recovery_spec("cmove", steps=80, every=50).replace("parallel: {dp: 2}", "parallel: {dp: 1}"))
    stack.wait_step(job, 8)
    svc = services(stack.home)
    worker = worker_of(stack, job)
    argv, env = process_argv_env(svc[worker]["pid"])
    at = stack.status(job).step
    t0 = time.monotonic()
    os.kill(svc[worker]["pid"], signal.SIGINT if before else signal.SIGTERM)
    lift(stack, job)
    try:
        # Stepping again on the spare: RUNNING past the step it resumed from.
        wait_for(
            lambda: (
                (s := stack.status(job)).state == JobState.RUNNING
                and s.step > s.checkpoint_step > 0
                or (before and s.state == JobState.RUNNING and 0 < s.step < at)
            ),
            180,
            "stepping again on the spare",
            every=0.05,
        )
        stepping_s = time.monotonic() - t0
        assert worker_of(stack, job) != worker
    finally:
        restart_worker(stack.home, worker, argv, env)  # (the module's later tests have two workers)
    events = stack.events(job, timeout=300)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    if before:  # (one worker_departed decision; its relaunch from the newest checkpoint or from scratch)
        decisions = [m for m in of_type(events, "decision") if " after " in m]
        assert len(decisions) == 1 and decisions[0].startswith("restart_ranks after worker_departed"), decisions
        resumed = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
        print(f"\nDEPARTURE BEFORE: signal at step {at}, {resumed}, stepping again after {stepping_s:.1f} s")
        return
    step = assert_moved_with_nothing_lost(events, at)
    print(
        f"\nDEPARTURE: SIGTERM at step {at}, checkpoint at step {step}, stepping on the spare after {stepping_s:.1f} s"
    )


def own_chunk(job_dir: Path, n: str) -> Path:
    """The largest chunk of version ``n`` that no other version of the job references (the
    versions of an epoch share the chunks that did not change)."""
    manifests = {d.name: json.loads((d / "manifest.json").read_text()) for d in job_dir.iterdir() if d.name.isdigit()}
    mine = manifests[n]
    shared = {c["sha"] for k, m in manifests.items() if k != n for c in m.get("chunks", ())}
    sha = max((c for c in mine["chunks"] if c["sha"] not in shared), key=lambda c: (c["bytes"], c["sha"]))["sha"]
    return job_dir / mine["chunk_dir"] / sha[:2] / sha


def test_flipped_bytes_in_the_newest_version_strike_only_it_and_the_job_resumes_from_the_one_before(stack):
    """One byte flipped in a chunk of the newest version (one no other version shares) of a paused job, then its rank
    killed: the relaunched ranks find it as they read it (a digest mismatch,
    checkpoint_integrity): only that version is struck, the policy rolls back to the one
    before; recovered, the job stays paused until the operator resumes it, then finishes."""
    job = stack.submit(spec("cflip", steps=40))  # (paced from step 13: the pause lands before its end)
    stack.wait_step(job, 12)
    stack.stub.PauseJob(control_pb2.PauseJobRequest(job_id=job))  # (no newer save while the bytes are flipped)
    wait_for(lambda: stack.status(job).state == JobState.PAUSED, 120, "paused")
    versions = sorted(committed_versions(events_so_far(stack, job)))
    (_, newest), (_, previous) = versions[-1], versions[-2]
    shard = own_chunk(stack.home / "store" / "checkpoints" / job, newest.rsplit(":", 1)[1])
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.kill(stack.rank_pids(job, 0)[0], signal.SIGKILL)
    lift(stack, job)
    # Recovered, the job is paused as the operator left it (then resumed by the operator).
    wait_for(
        lambda: stack.status(job).message.endswith("paused, as before the fault (resume continues it)"),
        240,
        "recovered and paused",
    )
    stack.stub.ResumeJob(control_pb2.ResumeJobRequest(job_id=job))
    events = stack.events(job, timeout=300)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    struck = [m for m in (e.message for e in events) if "never loaded" in m]
    assert len(struck) == 1 and newest in struck[0] and previous not in struck[0], struck
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"to resume from checkpoint {newest};" in relaunches[0]
    assert f"to resume from checkpoint {previous};" in relaunches[-1], relaunches


def test_surgectl_drain_moves_the_job_off_the_node_with_no_step_lost(stack):
    """`surgectl drain worker-N --deadline 60` under a dp=1 job with the other worker free: the
    node is cordoned, the job checkpoints at a boundary and continues on the other worker from
    that step; no fault. `surgectl uncordon` gives the node back (the module's later tests)."""
    job = stack.submit(recovery_spec("cdrain", steps=60, every=50).replace("parallel: {dp: 2}", "parallel: {dp: 1}"))
    stack.wait_step(job, 8)
    worker = worker_of(stack, job)
    at = stack.status(job).step
    try:
        drained = cli(stack.home, "drain", worker, "--deadline", "60")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert drained.stdout.startswith(f"{worker}: draining, leaves within 60 s;") and job in drained.stdout
        lift(stack, job)
        events = stack.events(job, timeout=300)
    finally:
        back = cli(stack.home, "uncordon", worker)
    assert back.returncode == 0, back.stdout + back.stderr
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    assert_moved_with_nothing_lost(events, at)
    other = "worker-0" if worker == "worker-1" else "worker-1"
    assert any(m.startswith("resume ") and f"allocated on {other}" in m for m in of_type(events, "decision")), events


def test_surgectl_restart_of_a_worker_under_a_dp2_job_loses_nothing_and_the_job_finishes(stack):
    """`surgectl restart worker-1` on the two-worker stack while a dp=2 job trains: the
    agent's SIGTERM is a departure with notice: the job checkpoints at a boundary, its ranks
    are released (never relaunched onto the leaving agent), it waits the second or two until
    the agent is back, then continues from that checkpoint; no fault, no restart spent."""
    # Paced from step 9: it cannot finish in the seconds `surgectl restart` takes to start, stop
    # the agent and start its successor, whatever the machine's speed.
    steps = 40
    job = stack.submit(spec("cleave", steps=steps).replace("parallel: {dp: 1}", "parallel: {dp: 2}"))
    stack.wait_step(job, 8)
    at = stack.status(job).step
    restarted = cli(stack.home, "restart", "worker-1", timeout=120)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert stack.status(job).step < steps, "the job finished before the worker was restarted: the test proves nothing"
    lift(stack, job)
    events = stack.events(job, timeout=300)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    assert_moved_with_nothing_lost(events, at)
