"""Step faults wait for L1 (issue 13 part 4), on the real stack: every ``fault_policy`` action
taking effect for a NaN loss injected at a step (``SURGE_FAULT_INJECT``).

The loop blocks at the faulty step and reports it to L1-1; the orchestrator decides by the
policy and sends its verdict to every rank: ignore (the step is applied as it is), skip_step
(a standing order issued with the job: no round trip), rollback / restart_ranks /
exclude_node (the ranks are relaunched from a checkpoint before the step), stop (the job
fails, its ranks are released). The stack is the one its group shares
(tests/shared_stacks.py: two workers); tiny model, a few steps per job.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
import time

import pytest

from services.contract import control_pb2
from services.rank.faults import lift_pace
from tests.faults.test_recovery import cli, finished, metric, of_type

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
INJECT = (
    "sfroll:nan_loss@7:rank=1,sfskip:inf_grad@3,sfskip:nan_loss@5:rank=1,sfignore:nan_loss@4,"
    "sfstop:nan_loss@4,sfrestart:nan_loss@6,sfexclude:nan_loss@6,sfhold:nan_loss@5:rank=1,sfthaw:nan_loss@5:rank=1,"
    # (sfreload held to a pace from step 7 until its rollback is in: it is running when the
    # rollback lands whatever the machine's speed, 18 paced steps = 54 s; 1 s a step was not
    # enough at load 33. A sleep: the losses are the same)
    "sfreload:slow_steps@7:rank=0:seconds=3,sfreload:slow_steps@7:rank=1:seconds=3"
)
JOBS = (
    "sfroll", "sfskip", "sfignore", "sfstop", "sfrestart", "sfexclude", "sfhold", "sfthaw", "sfref", "sfreload", "sfall",
)  # fmt: skip

JOB = """\
name: {name}
steps: {steps}
seed: 0
model: {{n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}}
data: {{dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}}
parallel: {{dp: {dp}}}
optimizer: {{lr: 3.0e-3, warmup_steps: 2}}
checkpoint: {{every_steps: {every}, keep_last: 0, async: false}}
eval: {{every_steps: 0, at_end: false}}
fault_policy: {{actions: {{non_finite_loss: {action}}}{policy}}}
{extra}"""


def job(
    name: str, action: str, *, steps: int = 8, dp: int = 1, every: int = 3, extra: str = "", policy: str = ""
) -> str:
    return JOB.format(name=name, steps=steps, dp=dp, every=every, action=action, extra=extra, policy=policy)


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def faults(events) -> list[str]:
    """The step faults that opened a decision (not a relaunched generation's consequences)."""
    return [m for m in of_type(events, "fault") if "(consequence of" not in m]


def rank0_steps(stack, job_id: str, at_least: int = 0) -> list[dict]:
    """Rank 0's step records, once the store holds ``at_least`` of them."""
    return [r for r in stack.step_records(job_id, at_least=at_least, rank=0) if r["rank"] == 0]


def assert_relaunched_from(stack, job_id: str, resumed_at: int, faulty: int, last: int) -> None:
    """Rank 0's step records: the first generation's 1..k, then the relaunched one's
    ``resumed_at + 1 .. last``. k is at least ``resumed_at`` and below ``faulty`` (the faulty
    step is never recorded); the first generation's records after its newest checkpoint may
    be lost with it, since it is SIGKILLed (CI: the records of steps 4 and 5 were still on
    their way to the store), and they are steps the relaunch does again anyway."""
    steps = [r["step"] for r in rank0_steps(stack, job_id, at_least=last)]  # (1..resumed_at at least, then the rest)
    cut = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), len(steps))
    first, then = steps[:cut], steps[cut:]
    assert first == list(range(1, len(first) + 1)) and resumed_at <= len(first) < faulty, steps
    assert then == list(range(resumed_at + 1, last + 1)), steps


def test_every_step_reaches_controls_journal_and_the_store_though_the_steps_ride_with_the_beats(stack):
    """A rank's steps go up a beat period at a time (services/rank/session_batches.py), many
    steps a message with this tiny model: control still applies every one of rank 0's, in
    order (its journal of steps, the job's status), and the store holds each rank's record of
    each step."""
    job_id = stack.submit(job("sfall", "stop", steps=40, dp=2, every=0))
    status = finished(stack.events(job_id))
    assert status.step == 40
    with sqlite3.connect(stack.home / "control.db") as db:
        applied = [s for (s,) in db.execute("SELECT step FROM steps WHERE job_id=? ORDER BY rowid", (job_id,))]
    assert applied == list(range(1, 41))
    records = stack.step_records(job_id, at_least=80)
    for rank in (0, 1):
        assert sorted(r["step"] for r in records if r["rank"] == rank) == list(range(1, 41)), rank


def test_rollback_relaunches_both_ranks_from_the_newest_checkpoint_before_the_faulty_step(stack):
    job_id = stack.submit(job("sfroll", "rollback", steps=10, dp=2))
    events = stack.events(job_id)
    # The NaN is injected on rank 1 but seen in the all-reduced loss: both ranks block at step
    # 7 and report it; whichever report comes first is decided, once.
    (fault,) = faults(events)
    assert re.match(r"non_finite_loss: rank [01] blocked at step 7: training loss is nan at step 7", fault), fault
    (decision,) = of_type(events, "decision")[1:]
    assert re.match(
        r"rollback after non_finite_loss of rank [01] on worker-\d+ at step 7 "
        r"\(restart 1 of 3 for non_finite_loss\)$",
        decision,
    ), decision
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job_id}:2;" in relaunch  # step 6: the newest, saved before step 7
    records = rank0_steps(stack, job_id, at_least=10)
    assert [r["step"] for r in records] == [*range(1, 7), *range(7, 11)]
    assert all(math.isfinite(float(r["loss"])) for r in records)  # the NaN step was never applied
    finished(events)


def test_skip_step_is_a_standing_order_each_faulty_step_is_skipped_on_both_ranks_with_no_round_trip(stack):
    before = {
        r: metric(stack.metrics(), "surge_skipped_steps_total", reason=r) for r in ("overflow", "non_finite_loss")
    }
    fp16 = "precision: {dtype: fp16, loss_scale: {init_scale: 1024.0, hysteresis: 1}}"
    job_id = stack.submit(job("sfskip", "skip_step", dp=2, every=0, extra=fp16))
    events = stack.events(job_id)
    assert faults(events) == [] and of_type(events, "decision")[1:] == []  # nobody was asked
    skips = of_type(events, "skip")
    assert [m.split(" (")[0] for m in skips] == ["step 3 skipped", "step 5 skipped"]
    assert "(overflow)" in skips[0] and "(non_finite_loss)" in skips[1] and skips[1].endswith("loss nan")
    after = {r: metric(stack.metrics(), "surge_skipped_steps_total", reason=r) for r in before}
    assert after == {"overflow": before["overflow"] + 1, "non_finite_loss": before["non_finite_loss"] + 1}
    records = {(r["rank"], r["step"]): r for r in stack.step_records(job_id, at_least=16)}
    for rank in (0, 1):
        assert [records[rank, s]["skipped"] for s in range(1, 9)] == [s in (3, 5) for s in range(1, 9)]
        assert records[rank, 4]["loss_scale"] == 512.0  # hysteresis 1: the overflow at step 3 halved 1024
    finished(events)


def test_ignore_applies_the_faulty_step_as_it_is_and_the_job_goes_on(stack):
    job_id = stack.submit(job("sfignore", "ignore", steps=6))
    events = stack.events(job_id)
    # The NaN gradients were applied: the weights are NaN, every later step faults too, and
    # each is decided (ignored) and applied.
    assert [m.split(": training")[0] for m in faults(events)] == [
        f"non_finite_loss: rank 0 blocked at step {s}" for s in (4, 5, 6)
    ]
    decisions = of_type(events, "decision")[1:]
    assert [re.sub(r"worker-\d+", "W", d) for d in decisions] == [
        f"ignore non_finite_loss of rank 0 on W at step {s}: fault policy; {n} ignored so far; the step is applied "
        "as it is"
        for n, s in enumerate((4, 5, 6), 1)
    ]
    records = rank0_steps(stack, job_id, at_least=6)
    assert [(r["step"], r["skipped"]) for r in records] == [(s, False) for s in range(1, 7)]
    # (proto3's JSON mapping writes a non-finite float as a string: "NaN")
    assert [math.isnan(float(r["loss"])) for r in records] == [False, False, False, True, True, True]
    finished(events)


def test_stop_fails_the_job_at_the_faulty_step_and_releases_its_ranks(stack):
    job_id = stack.submit(job("sfstop", "stop"))
    events = stack.events(job_id)
    (decision,) = of_type(events, "decision")[1:]
    assert re.match(r"stop after non_finite_loss of rank 0 on worker-\d+ at step 4: fault policy$", decision)
    status = events[-1].status
    assert (status.state, status.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert status.message.startswith("FAILED: non_finite_loss: rank 0 blocked at step 4: training loss is nan")
    assert [r["step"] for r in rank0_steps(stack, job_id, at_least=3)] == [1, 2, 3]
    released = time.monotonic() + 10.0  # the test's own clock: the released rank's process ends
    while stack.rank_pids(job_id, 0) and time.monotonic() < released:
        time.sleep(0.1)
    assert stack.rank_pids(job_id, 0) == []


def test_restart_ranks_relaunches_from_the_newest_checkpoint(stack):
    job_id = stack.submit(job("sfrestart", "restart_ranks"))
    events = stack.events(job_id)
    (decision,) = of_type(events, "decision")[1:]
    assert re.match(r"restart_ranks after non_finite_loss of rank 0 on worker-\d+ at step 6 \(restart 1 of 3", decision)
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job_id}:1;" in relaunch  # step 3 (step 6 never completed)
    assert_relaunched_from(stack, job_id, resumed_at=3, faulty=6, last=8)
    finished(events)


def test_exclude_node_relaunches_the_rank_on_another_worker(stack):
    job_id = stack.submit(job("sfexclude", "exclude_node"))
    events = stack.events(job_id)
    (decision,) = of_type(events, "decision")[1:]
    worker = re.match(
        r"exclude_node after non_finite_loss of rank 0 on (worker-\d+) at step 6 .*; excluding \1$", decision
    ).group(1)
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    (placed,) = re.match(r"ranks killed and relaunched on (worker-\d+) \(", relaunch).groups()
    assert placed != worker and f"resume from checkpoint {job_id}:1;" in relaunch
    assert_relaunched_from(stack, job_id, resumed_at=3, faulty=6, last=8)
    finished(events)


def held(stack, job_id: str, timeout: float = 60) -> control_pb2.JobStatus:
    """The test's own clock: until the job is held for inspection."""
    t0 = time.monotonic()
    while not (s := stack.status(job_id)).message.startswith("held for inspection"):
        assert time.monotonic() - t0 < timeout and s.state != JobState.TERMINATED, s.message
        time.sleep(0.05)
    return s


def alive(pids: list[int]) -> bool:
    try:
        for pid in pids:
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_freeze_holds_both_ranks_alive_until_its_bound_then_the_decided_relaunch_runs(stack):
    # Issue 29 item 9: a NaN loss at step 5 with freeze_seconds 4: the decided restart_ranks
    # waits while both ranks stay blocked at the step, alive (same PIDs), never declared stalled.
    job_id = stack.submit(job("sfhold", "restart_ranks", dp=2, policy=", freeze_seconds: 4"))
    s = held(stack, job_id)
    t_held = time.monotonic()
    assert s.state == JobState.FAULT_FROZEN and "then restart_ranks runs" in s.message, s.message
    pids = [stack.rank_pids(job_id, r) for r in (0, 1)]
    assert all(len(p) == 1 for p in pids), pids
    time.sleep(2.0)
    assert [stack.rank_pids(job_id, r) for r in (0, 1)] == pids and alive([p[0] for p in pids])
    assert stack.status(job_id).state == JobState.FAULT_FROZEN
    events = stack.events(job_id)
    ran_out = [m for m in of_type(events, "decision") if m.startswith("the hold for inspection ran out")]
    assert len(ran_out) == 1 and time.monotonic() - t_held >= 2.0, of_type(events, "decision")
    thawed_at = next(e.unix_time for e in events if e.message.startswith("the hold for inspection ran out"))
    held_at = next(e.unix_time for e in events if "held for inspection after" in e.message)
    assert 3.9 <= thawed_at - held_at < 10, thawed_at - held_at
    assert not [m for m in of_type(events, "fault") if "stalled" in m or "silent" in m]
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job_id}:1;" in relaunch  # step 3
    assert_relaunched_from(stack, job_id, resumed_at=3, faulty=5, last=8)
    finished(events)


def test_an_operator_thaw_runs_the_held_relaunch_at_once(stack):
    job_id = stack.submit(job("sfthaw", "restart_ranks", dp=2, policy=", freeze_seconds: 600"))
    held(stack, job_id)
    pids = [stack.rank_pids(job_id, r) for r in (0, 1)]
    thaw = cli(stack.home, "thaw", job_id)
    assert thaw.returncode == 0, thaw.stdout + thaw.stderr
    assert f"{job_id}: thawed; now" in thaw.stdout
    events = stack.events(job_id, timeout=90)
    assert any(m.startswith("thawed by the operator: restart_ranks") for m in of_type(events, "decision"))
    assert all(not alive(p) for p in pids)  # the relaunch replaced them
    assert_relaunched_from(stack, job_id, resumed_at=3, faulty=5, last=8)
    finished(events)


def test_a_rollback_in_place_keeps_the_processes_and_replays_the_uninterrupted_runs_losses(stack):
    # Issue 29 item 9: `surgectl rollback JOB --version V` on a running dp 2 job: the ranks pause,
    # load V (step 6) into their live processes and train on from step 6; the same PIDs, and
    # every step's loss equal to an uninterrupted run's (bit-exact resume). 24 steps, not 60: the
    # job is paced from step 7 until the rollback is in (INJECT), so no margin of steps is needed
    # for the rollback to find it running (each step of the two runs costs the stack's CPU).
    n = 24
    ref = stack.submit(job("sfref", "restart_ranks", steps=n, dp=2))
    finished(stack.events(ref))
    job_id = stack.submit(job("sfreload", "restart_ranks", steps=n, dp=2))
    t0 = time.monotonic()
    while not any(
        " at step 6 " in m for m in of_type(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job_id)), "checkpoint")
    ):
        assert time.monotonic() - t0 < 60, "the checkpoint of step 6 was never committed"
        time.sleep(0.05)
    pids = [stack.rank_pids(job_id, r) for r in (0, 1)]
    assert all(len(p) == 1 for p in pids), pids
    back = cli(stack.home, "rollback", job_id, "--version", f"{job_id}:2")
    assert back.returncode == 0, back.stdout + back.stderr
    t0 = time.monotonic()
    while not (s := stack.status(job_id)).message.startswith("rolled back in place"):
        assert time.monotonic() - t0 < 60 and s.state != JobState.TERMINATED, s.message
        time.sleep(0.02)
    lift_pace(stack.home / "run" / "faults", job_id)
    assert s.message == f"rolled back in place to checkpoint {job_id}:2 at step 6", s.message
    assert [stack.rank_pids(job_id, r) for r in (0, 1)] == pids and alive([p[0] for p in pids])
    events = stack.events(job_id)
    (done,) = [m for m in of_type(events, "recovery") if m.startswith("rollback in place done")]
    assert f"all 2 ranks loaded checkpoint {job_id}:2 in their live processes (none relaunched)" in done, done
    assert not [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    steps = [r["step"] for r in rank0_steps(stack, job_id, at_least=n)]  # (1..6 at least, then 7..n)
    cut = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[cut] == 7 and steps[cut:] == list(range(7, n + 1)), steps  # trained again from step 7
    la, lb = stack.losses(ref), stack.losses(job_id)
    assert sorted(la) == sorted(lb) == list(range(1, n + 1))
    assert [s for s in la if la[s] != lb[s]] == [], "per-step losses after the rollback differ"
    finished(events)
