"""Fencing on the real stack (issue 29 item 4): a replaced incarnation of a rank that wakes up
is ended by its node agent and changes nothing; a replacement avoids a node whose agent is
silent.

The stack (control, store, data, three workers of one slot each, ranks as real processes, a
DP=2 job: the third worker is free) is the one its group shares (tests/shared_stacks.py). A
stopped rank's job rebuilds in place (the survivor keeps its process, the replacement heals
from its memory); the job whose node agent freezes has the default policy
(every rank relaunched from the newest checkpoint), as a new user's would. A rank frozen with
its node agent (a frozen node) under rebuild cannot be ended, so its job relaunches every rank,
off that node. Either way the run's losses equal an uninterrupted one's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from services.common.grpc_server import channel
from services.contract import Module, control_pb2, store_pb2, store_pb2_grpc
from services.rank.faults import lift_pace
from tests.conftest import kill_all, stop_process
from tests.faults.test_recovery import causes, finished, metric, of_type, parent_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 24
JOB = """\
name: {name}
steps: {steps}
seed: 0
model: {{n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}}
data:
  dataset: tiny@v1
  seq_len: 64
  micro_batch_size: 4
parallel: {{dp: 2}}
optimizer: {{lr: 3.0e-3, warmup_steps: 4}}
checkpoint: {{every_steps: 10, keep_last: 0}}
eval: {{every_steps: 0, batches: 2, at_end: false}}
liveness: {{heartbeat_interval_seconds: 0.5, heartbeat_timeout_seconds: 4.0,
           heartbeat_timeout_running_seconds: 8.0, stall_min_seconds: 60}}
{policy}"""
REBUILD = "fault_policy: {actions: {rank_exit: rebuild, rank_silent: rebuild, worker_lost: rebuild}}\n"
# Rank 1 of "fagent" hangs before step 12's backward (alive, its peer waiting in the all-reduce):
# the job cannot finish while its node agent is frozen, and the process stays for the agent to end.
# Rank 1 of "fstop" and "ffrozen" waits before step 7 until the test lifts the pace: its SIGSTOP
# lands before the step-10 save whatever the machine's load (a stop during that save drops it
# with its group).
# Rank 1 of "fzero" waits before step 12 (every incarnation, until the test lifts the pace):
# rank 0 waits in that step's all-reduce while its node agent is frozen, and the relaunched
# generation is still training (paced) when the frozen agent wakes.
INJECT = (
    "fagent:hang@12:rank=1,fstop:slow_steps@7:rank=1:seconds=120,ffrozen:slow_steps@7:rank=1:seconds=120,"
    "fzero:slow_steps@12:rank=1:seconds=120"
)


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


@pytest.fixture(scope="module")
def baseline(stack):
    """An uninterrupted run: (step -> loss, the steps of its committed versions)."""
    job = stack.submit(JOB.format(name="fbase", steps=STEPS, policy=REBUILD))
    finished(stack.events(job))
    return stack.losses(job), committed_steps(stack, job)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class DeathWatch:
    """When process ``pid`` stops running (time.time()), watched from a thread of the test (the
    test's own clock: tests may poll) every 20 ms."""

    def __init__(self, pid: int):
        self.pid, self.ended = pid, 0.0
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while alive(self.pid):
            time.sleep(0.02)
        self.ended = time.time()

    def wait(self, limit: float = 30.0) -> float:
        self._thread.join(limit)
        assert self.ended, f"process {self.pid} still runs {limit:.0f} s later"
        return self.ended


def store_service(stack) -> tuple[int, int]:
    services = json.loads((stack.home / "run" / "stack.json").read_text())["services"]
    return services["store"]["port"], services["store"].get("metrics_port", 0)


def committed_steps(stack, job: str) -> list[int]:
    port, _ = store_service(stack)
    with channel(f"127.0.0.1:{port}", module=Module.EXT_USER) as ch:
        listed = store_pb2_grpc.StoreServiceStub(ch).List(store_pb2.CheckpointQuery(job_id=job), timeout=30)
    return sorted(c.step for c in listed.checkpoints)


def fenced_count(port: int, where: str = "") -> float:
    """surge_fenced_calls_total of the service whose metrics are on ``port`` (``where``: that
    label only; "": summed over every place it refused)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    if where:
        return metric(text, "surge_fenced_calls_total", where=where)
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("surge_fenced_calls_total{")
    )


def same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    differ = [s for s in want if abs(got[s] - want[s]) > 1e-6 * max(1.0, abs(want[s]))]
    assert differ == [], f"losses differ at steps {differ}"


def _until_recovered(stack, job: str, never: str) -> None:
    """Until the job's first step after its recovery from worker_lost (120 s: else ``never``)."""
    t0 = time.monotonic()
    query = control_pb2.JobQuery(job_id=job)
    while not [
        e
        for e in stack.stub.WatchJob(query, timeout=30)
        if e.message.startswith("first step after the recovery from worker_lost")
    ]:
        assert time.monotonic() - t0 < 120, never
        time.sleep(0.2)


def test_a_rank_stopped_past_its_timeout_is_replaced_and_ended_by_its_agent_when_continued(stack, baseline):
    job = stack.submit(JOB.format(name="fstop", steps=STEPS, policy=REBUILD))
    stack.wait_step(job, 6)
    (victim,) = stack.rank_pids(job, 1)
    (survivor,) = stack.rank_pids(job, 0)
    stopped = time.time()
    os.kill(victim, signal.SIGSTOP)
    lift_pace(stack.home / "run" / "faults", job)  # (its replacement trains at its own speed)
    death = DeathWatch(victim)
    try:
        stack.wait_step(job, 12)  # replaced: the job trains on without it
        # Continued now (the ^Z'd process's fg): its agent ended it with the kill that came
        # with its replacement's generation; nothing of it runs on.
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
        ended = death.wait()
        events = stack.events(job)
    finally:
        kill_all([victim])
    finished(events)
    (fault,) = causes(events, "SEVERE rank_silent")
    assert fault.message.startswith("SEVERE rank_silent: rank 1 on worker "), fault.message
    decisions = of_type(events, "decision")[1:]
    assert len(decisions) == 1 and decisions[0].startswith("rebuild after rank_silent of rank 1"), decisions
    assert stack.rank_pids(job, 0) in ([survivor], [])  # the survivor kept its process (ended with the job)
    same_losses(stack.losses(job), baseline[0])
    assert committed_steps(stack, job) == baseline[1]  # one per interval, by the live group
    (first,) = [e for e in events if e.message.startswith("first step after the recovery from rank_silent")]
    print(
        f"SIGSTOP of rank 1: declared silent {fault.unix_time - stopped:.2f} s after the stop, first step of the "
        f"rebuilt group {first.unix_time - stopped:.2f} s after it; the stopped process ended {ended - stopped:.2f} s "
        "after the stop (by its agent, with the replacement's generation)"
    )


def test_a_replacement_avoids_a_frozen_agent_and_the_incarnation_it_froze_is_ended_when_it_wakes(stack, baseline):
    job = stack.submit(JOB.format(name="fagent", steps=STEPS, policy=""))
    stack.wait_step(job, 11)
    time.sleep(1.0)  # rank 1 reached step 12 and hangs there (injected); rank 0 waits in the all-reduce
    (victim,) = stack.rank_pids(job, 1)
    agent = parent_pid(victim)
    _, store_metrics = store_service(stack)
    before = fenced_count(stack.metrics_port, "control")
    frozen = time.time()
    os.kill(agent, signal.SIGSTOP)  # the node agent, not the rank: the rank runs on, unheard
    try:
        _until_recovered(stack, job, "rank 1 was never replaced while its agent was frozen")
        replaced = time.time()
        assert alive(victim)  # its agent is frozen: nobody has ended it yet
    finally:
        death = DeathWatch(victim)
        woke = time.time()
        os.kill(agent, signal.SIGCONT)
    try:
        ended = death.wait()
        events = stack.events(job)
    finally:
        kill_all([victim])
    finished(events)
    # The agent's fault, named (session 34: its healthy rank was named silent): its own beats
    # stopped, and with them the rank's it relays.
    (fault,) = causes(events, "SEVERE worker_lost")
    assert fault.message.startswith("SEVERE worker_lost (agent_silent): the node agent of "), fault.message
    frozen_worker = fault.message.removeprefix("SEVERE worker_lost (agent_silent): the node agent of ").split()[0]
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched on ")]
    workers = relaunch.removeprefix("ranks killed and relaunched on ").split(" (rendezvous")[0].split(", ")
    assert len(workers) == 2 and frozen_worker not in workers, relaunch  # the free worker, not the frozen one
    # The woken agent's backlog (the old incarnation's beats) opened no incident.
    decisions = of_type(events, "decision")[1:]
    assert len(decisions) == 1 and decisions[0].startswith(
        "restart_ranks after worker_lost (agent_silent) of rank 1"
    ), decisions
    same_losses(stack.losses(job), baseline[0])
    assert committed_steps(stack, job) == baseline[1]
    dropped = fenced_count(stack.metrics_port, "control") - before
    store_refused = fenced_count(store_metrics) if store_metrics else 0.0
    print(
        f"node agent of rank 1 frozen: declared silent {fault.unix_time - frozen:.2f} s after the freeze, "
        f"replaced on another worker and trained on {replaced - frozen:.2f} s after it; once the agent woke, the "
        f"old incarnation ended {ended - woke:.2f} s later; control dropped {dropped:.0f} of its events "
        f"(store refusals {store_refused:.0f})"
    )


def test_the_exit_of_a_replaced_generation_that_comes_up_late_is_recorded_stale_never_a_second_incident(
    stack, baseline
):
    """F2 of session 36's trial: rank 0's node agent is frozen past its deadline. The job is
    relaunched off that node (one restart spent); the old rank 0 trains on unheard, fails its
    all-reduce when its peer is killed and exits while its agent is stopped. That exit comes
    up once the agent wakes, after the new generation trains: L1-3 grades it stale (its
    generation was replaced), L1-1 records the old incarnation's end and decides nothing: no
    second restart, no second relaunch, no fault counted."""
    job = stack.submit(JOB.format(name="fzero", steps=STEPS, policy=""))
    stack.wait_step(job, 11)  # rank 1 waits before step 12 (paced), rank 0 in its all-reduce
    (old,) = stack.rank_pids(job, 0)
    agent = parent_pid(old)
    exits_before = exit_faults(stack.metrics_port)
    death = DeathWatch(old)
    stop_process(agent)  # the node agent, not the rank: the rank runs on, unheard
    try:
        _until_recovered(stack, job, "rank 0 was never replaced while its agent was frozen")
        # Its peer was killed: the old rank 0's all-reduce broke and it ends, unheard.
        death.wait(60.0)
    finally:
        os.kill(agent, signal.SIGCONT)
    try:
        # The woken agent's backlog (the old rank's failure and exit) is applied before the pace
        # is lifted, so the job is still running (in its new generation) when it comes.
        t0 = time.monotonic()
        query = control_pb2.JobQuery(job_id=job)
        frozen_worker = _frozen_worker(stack.stub.WatchJob(query, timeout=30))
        while not [e for e in stack.stub.WatchJob(query, timeout=30) if _old_end(e, frozen_worker)]:
            assert time.monotonic() - t0 < 60, "the old rank 0's exit never came up"
            time.sleep(0.2)
    finally:
        lift_pace(stack.home / "run" / "faults", job)
        kill_all([old])
    events = stack.events(job)
    finished(events)
    (fault,) = causes(events, "SEVERE worker_lost")
    assert _frozen_worker(events) == frozen_worker
    decisions = of_type(events, "decision")[1:]
    assert len(decisions) == 1 and decisions[0].startswith(
        "restart_ranks after worker_lost (agent_silent) of rank 0"
    ), decisions
    relaunches = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched on ")]
    assert len(relaunches) == 1, relaunches
    assert not [m for m in of_type(events, "fault") if " rank_exit" in m and f"rank 0 on worker {frozen_worker}" in m]
    (stale,) = [e for e in events if _old_end(e, frozen_worker)]
    assert stale.type == "rank", stale.message  # (the old incarnation's end, recorded: no fault)
    counted = exit_faults(stack.metrics_port) - exits_before
    assert counted == 0, counted  # (surge_faults_total: the old end is no fault)
    same_losses(stack.losses(job), baseline[0])
    print(
        f"node agent of rank 0 frozen, its old rank ended unheard; once the agent woke its exit was recorded "
        f"stale ({stale.message!r}), {stale.unix_time - fault.unix_time:.2f} s after the agent was declared silent"
    )


def _old_end(event, worker: str) -> bool:
    """An event about the old rank 0's end on ``worker`` (decided as a fault, or recorded as the
    end of a replaced generation)."""
    return f"rank 0 on worker {worker} ended" in event.message or (
        event.type == "rank" and event.message.startswith("rank 0 ") and "replaced" in event.message
    )


def _frozen_worker(events) -> str:
    (fault,) = causes(list(events), "SEVERE worker_lost")
    assert fault.message.startswith("SEVERE worker_lost (agent_silent): the node agent of "), fault.message
    return fault.message.removeprefix("SEVERE worker_lost (agent_silent): the node agent of ").split()[0]


def exit_faults(port: int) -> float:
    """surge_faults_total of control for the class rank_exit (every grade)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("surge_faults_total{") and 'class="rank_exit"' in line
    )


def test_a_rank_frozen_with_its_node_agent_under_rebuild_relaunches_every_rank_off_that_node(stack, baseline):
    """Rank 1 and, a second later, its node agent SIGSTOPped (a frozen node) under rebuild. Its
    process cannot be ended, so a rebuild in place could not free the survivor from their
    all-reduce (measured before: no step until the 120 s recovery deadline). Every rank is
    relaunched instead (the survivor killed by its own agent), none on the frozen node; the
    job trains on long before that deadline: asserted by the order of what happened (the
    decision, the relaunch, the first step) and by no recovery_timeout, not by a clock."""
    job = stack.submit(JOB.format(name="ffrozen", steps=STEPS, policy=REBUILD))
    stack.wait_step(job, 6)
    (victim,) = stack.rank_pids(job, 1)
    agent = parent_pid(victim)
    stopped = time.time()
    os.kill(victim, signal.SIGSTOP)
    lift_pace(stack.home / "run" / "faults", job)  # (the relaunched rank 1 trains at its own speed)
    try:
        time.sleep(1.0)  # (the agent states the rank's process stopped, then freezes with it)
        os.kill(agent, signal.SIGSTOP)
        t0 = time.monotonic()
        query = control_pb2.JobQuery(job_id=job)
        while not [
            e
            for e in stack.stub.WatchJob(query, timeout=30)
            if e.message.startswith("first step after the recovery from rank_silent")
        ]:
            assert time.monotonic() - t0 < 180, "no step after the freeze"
            time.sleep(0.2)
        assert alive(victim)  # its agent is frozen: nobody has ended it yet
    finally:
        death = DeathWatch(victim)
        woke = time.time()
        os.kill(agent, signal.SIGCONT)  # (the node thaws: its agent, then the rank)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    try:
        ended = death.wait()
        events = stack.events(job)
    finally:
        kill_all([victim])
    finished(events)
    (fault,) = causes(events, "SEVERE rank_silent")
    frozen_worker = fault.message.split(" on worker ")[1].split()[0]
    decisions = of_type(events, "decision")[1:]
    assert len(decisions) == 1, decisions  # (the woken agent's backlog opened no incident)
    assert decisions[0].startswith("restart_ranks after rank_silent of rank 1"), decisions
    assert f"restart_ranks instead of rebuild: rank 1's node agent on {frozen_worker} is unheard" in decisions[0]
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched on ")]
    workers = relaunch.removeprefix("ranks killed and relaunched on ").split(" (rendezvous")[0].split(", ")
    assert len(workers) == 2 and frozen_worker not in workers, relaunch  # the free worker, not the frozen one
    assert not [e.message for e in events if "recovery_timeout" in e.message]
    order = [e.seq for e in events if e.message in (fault.message, decisions[0], relaunch)]
    (first,) = [e for e in events if e.message.startswith("first step after the recovery from rank_silent")]
    assert order == sorted(order) and len(order) == 3 and order[-1] < first.seq, (order, first.seq)
    same_losses(stack.losses(job), baseline[0])
    (relaunched,) = [e.unix_time for e in events if e.message == relaunch]
    print(
        f"rank 1 and its node agent frozen: declared silent {fault.unix_time - stopped:.2f} s after the stop, every "
        f"rank relaunched off {frozen_worker} at {relaunched - stopped:.2f} s, first step {first.unix_time - stopped:.2f} "
        f"s after the stop; once the node thawed, the old incarnation ended {ended - woke:.2f} s later (by its agent)"
    )
