"""A profile's export is a declared phase (issue 28 helper, profile28): `surgectl profile` on a
loaded machine held a rank's interpreter lock for longer than the running heartbeat deadline
while torch.profiler post-processed its trace, and control took that silence for death. The
rank now states PHASE_PROFILE_EXPORT (phase_total: the profiled steps) before it starts; the
detector allows ``profile_export_seconds + stall_step_factor x median step x steps`` and the
running timeout on top (so the rank's own overrun report comes first), for progress and
silence alike. Past that the rank is stuck and declared, as any other."""

from __future__ import annotations

import time

import pytest

from services.common.phase import profile_export_budget_s
from services.contract import worker_pb2
from services.control.fault_detector.watch import DEFAULT_PROFILE_EXPORT_S, _Job
from tests.control.test_fault_detector import RUNNING, process, wired
from tests.control.test_phase_deadlines import beat

RankPhase = worker_pb2.RankPhase
EXPORT = RankPhase.PHASE_PROFILE_EXPORT
pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "base, factor, step_times, steps, running, budget",
    [
        (120.0, 5.0, [], 40, 15.0, 120.0),  # no step seen yet: the base alone
        (120.0, 5.0, [0.5, 0.5, 0.7], 40, 15.0, 120.0 + 5.0 * 0.5 * 40),  # the median, not the mean
        (120.0, 5.0, [0.5], 0, 15.0, 120.0 + 5.0 * 0.5),  # steps unstated: one
        (10.0, 2.0, [1.0, 1.0], 100, 30.0, 10.0 + 2.0 * 1.0 * 100),
    ],
)
def test_the_exports_budget_grows_with_the_profiles_steps_and_their_length(
    base, factor, step_times, steps, running, budget
):
    job = _Job(heartbeat_timeout_s=3.0, stall_min_s=30.0, stall_step_factor=factor, attribution_s=0.0)
    job.profile_export_s, job.running_timeout_s = base, running
    job.step_times.extend(step_times)
    assert job.profile_export_budget_s(steps) == pytest.approx(budget)
    # Progress deadline = the budget and the running timeout on top: the rank's own overrun
    # report (at the budget, services/engine/step_profiler.py) arrives before anything here.
    assert job.phase_deadline_s(EXPORT, steps) == pytest.approx(budget + running)
    # The rank measures against the same formula, with its profiled steps' own seconds.
    median = sorted(step_times)[len(step_times) // 2] if step_times else 0.0
    assert profile_export_budget_s(base, factor, median * max(steps, 1)) == pytest.approx(budget)


def test_the_default_budget_is_pushed_when_the_spec_names_none_and_the_specs_when_it_does():
    from services.control.monitoring import start_monitoring
    from services.jobspec import parse_job_spec

    head = "name: x\nsteps: 3\ndata: {dataset: tiny@v1, seq_len: 8, micro_batch_size: 1}\n"
    assert start_monitoring("j", parse_job_spec(head)).profile_export_seconds == DEFAULT_PROFILE_EXPORT_S
    spec = parse_job_spec(head + "liveness: {phase_seconds: {profile_export: 45}}\n")
    assert start_monitoring("j", spec).profile_export_seconds == 45
    with pytest.raises(ValueError, match=r"liveness\.phase_seconds\.profile_export"):
        parse_job_spec(head + "liveness: {phase_seconds: {profile_export: 0}}\n")


@pytest.mark.parametrize("agent_states_running", [False, True], ids=["no-process-state", "agent-states-running"])
def test_a_rank_silent_within_its_announced_export_is_no_fault_and_past_it_is_silent(agent_states_running):
    # Silence deadline 0.4 s; the export's allowance 1.2 + 0.01 x 0.1 x 10 + 0.4 = 1.61 s.
    bus, reports = wired(
        heartbeat_timeout_seconds=0.4,
        heartbeat_timeout_running_seconds=0.4,
        stall_min_seconds=30.0,
        stall_step_factor=0.01,
        profile_export_seconds=1.2,
    )
    for step in range(1, 4):
        beat(bus, 1, step=step, phase=RankPhase.PHASE_OPTIMIZER)
    beat(bus, 1, step=3, phase=EXPORT, total=10)  # announced; then the lock is held: no beat
    t0 = time.monotonic()
    if agent_states_running:  # (its node agent still sees the process run: must not shorten it)
        time.sleep(0.2)
        process(bus, RUNNING, worker_id="w1")
    time.sleep(1.2)  # 3x the silence deadline, within the export's allowance
    assert reports == [], [r.detail for r in reports]
    (r,) = reports.wait(1, timeout=3.0)  # never beats again: stuck in its export, declared
    assert r.fault_class == "rank_silent" and r.phase == EXPORT, r.detail
    assert 1.5 < time.monotonic() - t0 < 2.5


def test_after_the_export_the_ranks_next_beat_brings_back_the_ordinary_silence_deadline():
    bus, reports = wired(
        heartbeat_timeout_seconds=0.4,
        heartbeat_timeout_running_seconds=0.4,
        stall_min_seconds=30.0,
        stall_step_factor=0.01,
        profile_export_seconds=1.5,
    )
    beat(bus, 1, step=3, phase=EXPORT, total=40)
    time.sleep(1.0)  # the export held the lock
    assert reports == []
    beat(bus, 1, step=3, phase=RankPhase.PHASE_DATA_WAIT)  # (the next step's data wait)
    t0 = time.monotonic()
    (r,) = reports.wait(1, timeout=3.0)
    assert r.fault_class == "rank_silent" and r.phase == RankPhase.PHASE_DATA_WAIT
    assert time.monotonic() - t0 < 0.9  # the 0.4 s deadline again, not the export's


def test_a_rank_stopped_by_a_signal_in_its_export_is_judged_by_the_stop_not_the_export():
    from tests.control.test_fault_detector import STOPPED

    bus, reports = wired(
        heartbeat_timeout_seconds=0.4,
        heartbeat_timeout_running_seconds=0.4,
        stall_min_seconds=30.0,
        profile_export_seconds=5.0,
    )
    beat(bus, 1, step=3, phase=EXPORT, total=10)
    t0 = time.monotonic()
    process(bus, STOPPED, worker_id="w1")  # (a stopped process exports nothing)
    (r,) = reports.wait(1, timeout=3.0)
    assert r.fault_class == "rank_silent" and "stopped" in r.detail, r.detail
    assert time.monotonic() - t0 < 1.0


def test_a_peer_waiting_in_a_collective_for_a_rank_in_its_silent_export_is_no_fault():
    # Rank 0 ended its profile first and waits in the next step's all-reduce for rank 1, whose
    # export holds its lock (no beats): past rank 0's 0.5 s collective budget, no fault.
    from tests.control.test_phase_deadlines import Beating

    bus, reports = wired(
        heartbeat_timeout_seconds=0.4,
        heartbeat_timeout_running_seconds=0.4,
        stall_min_seconds=0.5,
        stall_step_factor=0.01,
        profile_export_seconds=2.0,
    )
    beat(bus, 1, step=3, phase=EXPORT, total=10)
    with Beating(bus, {0: (3, RankPhase.PHASE_COLLECTIVE)}):
        time.sleep(1.5)  # 3x rank 0's budget, rank 1 quiet all along
        assert reports == [], [r.detail for r in reports]
        beat(bus, 1, step=4, phase=RankPhase.PHASE_COLLECTIVE)  # its export done: in the all-reduce too
        time.sleep(0.2)
    assert reports == [], [r.detail for r in reports]
