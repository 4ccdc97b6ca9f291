"""The event-driven rule (DESIGN.md law 4, Issue 3 part 4): no module polls another.

A module acts when a command or an event arrives, on the thread that delivers it; none
sleeps in a loop, waits with a timeout to look again, or keeps a timer or thread that
wakes to look at anyone. Liveness is event-driven too: a rank that dies closes its stream
and the exit arrives as an event, graded at once; a rank that falls silent or stops making
progress misses a deadline that only its own heartbeats re-arm, kept by the fault detector
alone (DESIGN.md law 4: silence past a deadline is judged by the layer above).

Documented exceptions: the prefetcher's I/O pool and the checkpoint manager's hashing pool
run work a command asked for (reads, SHA-256), and never look at another module.
"""

from __future__ import annotations

import ast
import time

import pytest

from services.contract import Module, control_pb2

from .wiring import MODULES, source_tree

WORKER_POOLS = {Module.L4_PREFETCHER: "ThreadPoolExecutor", Module.L5_CHECKPOINT_MANAGER: "ThreadPoolExecutor"}
# Liveness deadlines, where a module keeps one: module -> why. A deadline is a one-shot
# timer (``self._deadlines.after``: services/common/deadlines.py) armed and re-armed
# (cancel + arm) only inside the handler of the event that proves progress, so silence past
# it is the fault and nothing is polled.
DEADLINE_TIMERS: dict[int, str] = {
    Module.L1_FAULT_DETECTOR: (
        "per rank: silence (re-armed by each RankHeartbeat) and stall (re-armed by a heartbeat "
        "showing a new step); per job: the attribution window a comm_error waits for its cause; "
        "per node agent: silence (re-armed by each AgentHeartbeat, ended by a WorkerRegistration of the id)"
    ),
    Module.L1_ORCHESTRATOR: (
        "per recovery step it commanded (issue 12): the retry backoff of a step the store's or the "
        "allocator's answer said must wait (store unreachable, no capacity), bounded by the fault "
        "policy's wait; and the restore step's deadline (restore_seconds). Armed only by the "
        "answer or command that starts the step (``_arm``), cancelled by the answer that ends it; "
        "never a judgment of a rank's liveness (that stays the detector's); and the waits of its "
        "preemption and growing-back policies (issue 30: a preempted job's grace to checkpoint, a "
        "protected job's minimum run time ending, a job's resize interval ending), armed by the "
        "decision that starts the wait (``_arm_policy_timer``), one per wait, re-arming cancels; "
        "and the starvation bound's next queued job reaching it (teams.py ``_arm_overdue``, through "
        "``_arm_policy_timer``: a pass then, so its promotion is shown and tried at once); and an "
        "operator's stop's deadline (stop_deadline.py, through ``_arm_policy_timer``: armed by the stop's "
        "decision, or by the restore of a stop in flight; past it the ranks not stopped are killed)"
    ),
}
# Functions of a DEADLINE_TIMERS module that arm a step deadline although they are not
# event handlers themselves: each is called only from handlers (see DEADLINE_TIMERS).
STEP_DEADLINE_ARMERS = {Module.L1_ORCHESTRATOR: {"_arm", "_arm_policy_timer"}}
# Functions that hand work to the deadline pool's thread with no delay: not a timer on
# anyone, a hand-off off the caller's thread. L1-1 starts its queued jobs so (issue 15):
# the caller may be the thread applying the node agents' events.
# (_hook_soon: eval.hooks submits; _report_soon, _write_held_soon: off the journal writer's
# thread, a refused step write's report and the held steps' write once the journal commits;
# _drain_soon: off it too, a job's commands released by its write's commit: commit_later.py)
HANDOFFS = {
    Module.L1_ORCHESTRATOR: {
        "_start_soon",
        "_grow_soon",
        "_hook_soon",
        "_report_soon",
        "_write_held_soon",
        "_drain_soon",
    }
}
# A blocking call that takes a timeout is a poll when it sits in a loop: wake, look, wait again.
TIMED_WAITS = {"sleep", "wait", "get", "put", "join", "poll", "select", "acquire", "result", "recv"}


def _loops(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.While, ast.For, ast.AsyncFor))]


def _timed(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    if name == "sleep":
        return True
    if name not in TIMED_WAITS:
        return False
    return any(k.arg in ("timeout", "block") for k in call.keywords) or (name in ("wait", "join") and bool(call.args))


@pytest.mark.parametrize("module", list(MODULES), ids=Module.Name)
def test_no_module_sleeps_or_polls_in_a_loop(module):
    tree = source_tree(module)
    polls = [ast.unparse(c) for loop in _loops(tree) for c in ast.walk(loop) if isinstance(c, ast.Call) and _timed(c)]
    sleeps = [
        ast.unparse(c) for c in ast.walk(tree) if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("sleep")
    ]
    assert polls == [] and sleeps == []


@pytest.mark.parametrize("module", list(MODULES), ids=Module.Name)
def test_no_module_keeps_a_thread_or_timer_of_its_own(module):
    tree = source_tree(module)
    started = {
        ast.unparse(c.func).rsplit(".", 1)[-1]
        for c in ast.walk(tree)
        if isinstance(c, ast.Call)
        and ast.unparse(c.func).rsplit(".", 1)[-1]
        in (
            "Thread",
            "Timer",
            "ThreadPoolExecutor",
            "ProcessPoolExecutor",
            "scheduler",
            "call_later",
            "call_at",
            "Deadlines",
        )
    }
    expected = {WORKER_POOLS[module]} if module in WORKER_POOLS else set()
    if module in DEADLINE_TIMERS:
        expected.add("Deadlines")  # services/common/deadlines.py: one heap, not a thread per deadline
    assert started == expected
    assert not {"sched", "asyncio", "signal"} & {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


@pytest.mark.parametrize("module", list(DEADLINE_TIMERS) or [None], ids=lambda m: Module.Name(m) if m else "none")
def test_a_liveness_deadline_is_armed_only_by_the_event_it_waits_for(module):
    if module is None:
        pytest.skip("no module keeps a liveness deadline yet (see DEADLINE_TIMERS)")
    tree = source_tree(module)
    for fn in (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)):
        arms = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("_deadlines.after")]
        if arms and fn.name in ("_hold", "_release_held", "_broken_by_peer", "_hold_degraded", "_hold_down"):
            # Not a liveness deadline: an attribution window holds a symptom (the fault
            # detector's: a stall, or a lossy link whose cause may be an end's paused node
            # agent, or a link both ends say is down, held for the job's heartbeat timeout; the
            # orchestrator's: a save broken in its collectives) for a fixed time so
            # that its cause (a peer's silence or exit, an agent's) can arrive first; it is
            # opened by the symptom's own report, or by that cause's end (a quiet agent that
            # beats again), never by the window's own expiry (the detector's stall extended once).
            continue
        if arms and fn.name in ("_arm_recheck", "_recheck_held"):
            # Not a liveness deadline either: the fault detector's silence verdicts held
            # while control itself is behind or most agents are quiet at once (the likelier
            # cause of the symptom is control's own lag: fault_detector/disruption.py). One
            # check looks at the held verdicts again until control keeps up; each agent's own
            # (and each rank's) deadline is still armed only by its beats (on_agent_heartbeat,
            # on_rank_heartbeat, or moved by a beat read on the loop: beat_stamps.py).
            continue
        if arms and fn.name == "start_fault_monitoring":
            # One exception: after a control restart, a restored job's ranks get a first
            # (re-attach) deadline when monitoring starts, because the heartbeat that would
            # arm it may never come. It only arms fresh timers; events re-arm them after.
            assert not any(getattr(c.func, "attr", "") == "cancel" for c in ast.walk(fn) if isinstance(c, ast.Call))
            continue
        if arms and fn.name in HANDOFFS.get(module, ()):
            assert all(ast.unparse(c.args[0]) in ("0", "0.0") for c in arms), ast.unparse(fn)
            continue
        if arms and fn.name in STEP_DEADLINE_ARMERS.get(module, ()):
            assert any(getattr(c.func, "attr", "") == "_cancel_timer" for c in ast.walk(fn) if isinstance(c, ast.Call))
            continue
        if arms:
            assert fn.name.startswith("on_"), f"{fn.name}: a deadline is (re-)armed by an event handler"
            assert any(isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "cancel" for c in ast.walk(fn))


def test_the_worker_pools_only_run_work_a_command_asked_for():
    # The pools are created inside a command (SetPrefetch) or used inside one (commit, load)
    # and their tasks are file reads / hashes: no task calls back into a port or an emitter.
    for module in WORKER_POOLS:
        tree = source_tree(module)
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") in ("submit", "map"):
                task = ast.unparse(call.args[0])
                assert "_emit" not in task and "port" not in task, task


def test_a_rank_exit_is_graded_and_decided_the_moment_its_event_arrives(tmp_path):
    from .test_reported_events_are_read_only import _control, _shut

    control, job = _control(tmp_path)
    bus = control.bus
    user = lambda: bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job)).message  # noqa: E731
    assert user().state == control_pb2.WARMING_UP
    bus.publish(Module.EXT_HARDWARE, control_pb2.RankExited(job_id=job, rank=0, exit_code=-9, worker_id="w"))
    # Synchronously, on the delivering thread: detector grades, orchestrator decides (by the
    # default fault policy: restart the ranks) and the recovery is commanded. No timer, no
    # later sweep, no polling of the rank.
    # The journal answers what was decided on this thread; the status message may already
    # have moved on to the recovery's own progress (its store wait runs on another thread).
    assert user().state == control_pb2.FAULT_FROZEN
    log = bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job), "event_log").payload
    decided = [e.message for e in log if e.type == "decision"]
    assert decided[-1].startswith("restart_ranks after rank_exit of rank 0")
    states = [e.message for e in log if e.type == "state"]
    assert "WARMING_UP -> FAULT_FROZEN: recovering from rank_exit of rank 0" in states
    _shut(control)


def test_a_silent_rank_is_declared_by_the_deadline_its_heartbeats_re_arm(tmp_path):
    from services.contract import worker_pb2

    from .test_reported_events_are_read_only import _control, _shut

    control, job = _control(tmp_path, liveness="{heartbeat_interval_seconds: 0.2, heartbeat_timeout_seconds: 1.0}")
    bus = control.bus
    user = lambda: bus.command(Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job)).message  # noqa: E731
    beat = worker_pb2.RankHeartbeat(job_id=job, rank=0, worker_id="w")
    for _ in range(5):  # beats faster than the deadline: nothing happens
        bus.publish(Module.EXT_HARDWARE, beat)
        time.sleep(0.2)
    assert user().state == control_pb2.WARMING_UP
    time.sleep(2.0)  # silence: the detector's timer fires once and the orchestrator decides
    decided = [
        e.message
        for e in bus.command(
            Module.EXT_USER, Module.L1_ORCHESTRATOR, control_pb2.JobQuery(job_id=job), "event_log"
        ).payload
        if e.type == "decision"
    ]
    assert decided[-1].startswith("restart_ranks after rank_silent of rank 0")
    assert user().state == control_pb2.FAULT_FROZEN  # (then waiting for the store this test has none of)
    _shut(control)


def _identifiers(tree: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
    return {x.lower() for x in names}


@pytest.mark.parametrize("module", [m for m in MODULES if m not in DEADLINE_TIMERS], ids=Module.Name)
def test_no_module_judges_another_modules_liveness_by_its_own_clock(module):
    # A module may time its own work (perf_counter deltas) or throttle its own journal; no
    # module but the one keeping the deadlines (DEADLINE_TIMERS) keeps a heartbeat, a
    # last-seen clock or a staleness check on anyone. A dead rank is found by its closed
    # stream (an event), a silent one by L1-3's deadline; L1-3 grades, L1-1 decides.
    words = ("heartbeat", "last_seen", "stale", "liveness", "silent", "deadline", "watchdog")
    assert [n for n in _identifiers(source_tree(module)) if any(w in n for w in words)] == []
