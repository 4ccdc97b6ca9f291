"""Liveness measured right (issue 12, part 5): deadlines count from the beat's receipt, the
progress deadline knows the rank's phase (evaluation, checkpoint staging and compile have
their own budgets, a phase that advances never stalls), and a stall is blamed on the rank
that stopped outside a collective, its peers waiting in one reported after it as
``rank_stalled_in_collective``."""

from __future__ import annotations

import threading
import time

import pytest

from services.contract import Module, worker_pb2
from tests.control.test_fault_detector import wired

RankPhase = worker_pb2.RankPhase
pytestmark = pytest.mark.timeout(30)


def beat(
    bus,
    rank: int,
    step: int,
    phase: int,
    progress: int = 0,
    total: int = 0,
    *,
    phase_seconds: float = 0.0,
    received: float = 0.0,
    interval: float = 0.1,
    step_seconds: float = 0.1,
) -> None:
    bus.publish(
        Module.EXT_HARDWARE,
        worker_pb2.RankHeartbeat(
            job_id="j",
            rank=rank,
            step=step,
            stepping=True,
            step_seconds=step_seconds,
            worker_id=f"w{rank}",
            interval_seconds=interval,
            phase=phase,
            phase_progress=progress,
            phase_total=total,
            phase_seconds=phase_seconds,
            received_monotonic=received,
        ),
    )


class Beating:
    """A background thread beating what ``state[rank]`` says, every ``interval``."""

    def __init__(self, bus, state: dict, interval: float = 0.1):
        self.bus, self.state, self.interval = bus, state, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(self.interval):
            for rank, args in list(self.state.items()):
                beat(self.bus, rank, *args, interval=self.interval)


def test_the_silence_deadline_counts_from_when_control_received_the_beat_not_when_it_was_applied():
    bus, reports = wired(heartbeat_timeout_seconds=1.0, stall_min_seconds=30.0)
    t0 = time.monotonic()
    # The beat arrived 0.8 s ago and waited in the applier's queue since.
    beat(bus, 1, step=3, phase=RankPhase.PHASE_FORWARD, received=t0 - 0.8)
    (r,) = reports.wait(1, timeout=15.0)
    assert r.fault_class == "rank_silent"
    assert time.monotonic() - t0 < 0.6, "armed from the apply (1 s), not from the receipt (0.2 s left)"
    assert r.phase == RankPhase.PHASE_FORWARD


def test_an_evaluation_that_advances_is_never_a_stall_and_one_that_stops_advancing_is():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.5, stall_step_factor=0.01)
    state = {1: (3, RankPhase.PHASE_EVALUATION, 0, 50)}
    with Beating(bus, state):
        for batch in range(1, 12):  # 2.2 s of evaluation, 7x the step budget, one batch per 0.2 s
            time.sleep(0.2)
            state[1] = (3, RankPhase.PHASE_EVALUATION, batch, 50)
        assert reports == []
        (r,) = reports.wait(1, timeout=15.0)  # stops advancing: stalled in its evaluation
    assert r.fault_class == "rank_stalled" and r.phase == RankPhase.PHASE_EVALUATION
    assert "in its evaluation phase (11 of 50 done)" in r.detail, r.detail


def test_an_evaluations_budget_scales_with_its_batch_count():
    # Median step 0.1 s, factor 2, 10 batches: 0.3 + 2 x 0.1 x 10 = 2.3 s.
    bus, reports = wired(heartbeat_timeout_seconds=10.0, stall_min_seconds=0.3, stall_step_factor=2.0, eval_batches=10)
    for step in range(1, 4):
        beat(bus, 1, step=step, phase=RankPhase.PHASE_OPTIMIZER)
    state = {1: (3, RankPhase.PHASE_EVALUATION, 0, 10)}
    t0 = time.monotonic()
    with Beating(bus, state):
        (r,) = reports.wait(1, timeout=15.0)
    assert r.fault_class == "rank_stalled" and "deadline 2.3 s" in r.detail, r.detail
    assert time.monotonic() - t0 > 2.2


@pytest.mark.parametrize(
    "phase, field",
    [(RankPhase.PHASE_CHECKPOINT_STAGING, "checkpoint_staging_seconds"), (RankPhase.PHASE_COMPILE, "compile_seconds")],
)
def test_checkpoint_staging_and_compile_have_their_own_budgets(phase, field):
    bus, reports = wired(heartbeat_timeout_seconds=10.0, stall_min_seconds=0.2, stall_step_factor=0.01, **{field: 1.2})
    t0 = time.monotonic()
    with Beating(bus, {1: (3, phase)}):
        (r,) = reports.wait(1, timeout=15.0)
    assert r.fault_class == "rank_stalled" and "deadline 1.2 s" in r.detail, r.detail
    assert time.monotonic() - t0 > 1.1


@pytest.mark.parametrize("peer_first", [True, False], ids=["collective-deadline-first", "hung-deadline-first"])
def test_the_rank_hung_outside_a_collective_is_blamed_and_its_peer_waiting_in_one_follows(peer_first):
    # Rank 1 hangs in its forward pass at step 4; rank 0 finished its backward and waits in
    # DDP's all-reduce for it. Whichever deadline fires first, rank 1 is the cause.
    bus, reports = wired(
        heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01, attribution_seconds=0.1
    )
    state = {0: (3, RankPhase.PHASE_FORWARD), 1: (3, RankPhase.PHASE_FORWARD)}
    beat(bus, 0, 3, RankPhase.PHASE_OPTIMIZER)
    beat(bus, 1, 3, RankPhase.PHASE_OPTIMIZER)
    with Beating(bus, state):
        if peer_first:
            state[0] = (3, RankPhase.PHASE_COLLECTIVE)  # rank 0 moves on first: its deadline fires first
            time.sleep(0.2)
            state[1] = (3, RankPhase.PHASE_FORWARD, 0, 0)
            beat(bus, 1, 3, RankPhase.PHASE_BACKWARD)
            beat(bus, 1, 3, RankPhase.PHASE_FORWARD)
        else:
            time.sleep(0.2)
            state[0] = (3, RankPhase.PHASE_COLLECTIVE)
        first, second = reports.wait(2, timeout=15.0)
        time.sleep(1.0)
    assert (first.fault_class, first.rank, first.worker_id, first.phase) == (
        "rank_stalled",
        1,
        "w1",
        RankPhase.PHASE_FORWARD,
    )
    assert (second.fault_class, second.rank, second.phase) == (
        "rank_stalled_in_collective",
        0,
        RankPhase.PHASE_COLLECTIVE,
    )
    assert "waiting for rank 1" in second.detail or "waits in a collective" in second.detail
    assert len(reports) == 2, [(r.fault_class, r.rank) for r in reports]


def test_a_rank_waiting_in_a_collective_for_a_peer_that_still_advances_is_no_fault():
    # Rank 1's evaluation is slow but advances; rank 0 finished its own and waits for it in
    # the evaluation's all-reduce far longer than the step budget.
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.5, stall_step_factor=0.01)
    state = {0: (3, RankPhase.PHASE_COLLECTIVE), 1: (3, RankPhase.PHASE_EVALUATION, 0, 50)}
    # (beats every 0.3 s: a peer counts as working while it beats within 1.5 periods, and a
    # loaded machine delays a 0.1 s beat thread by more than its 0.05 s of slack)
    with Beating(bus, state, interval=0.3):
        for batch in range(1, 12):
            time.sleep(0.2)
            state[1] = (3, RankPhase.PHASE_EVALUATION, batch, 50)
        assert reports == []
        state[1] = (4, RankPhase.PHASE_DATA_WAIT)  # both go on
        state[0] = (4, RankPhase.PHASE_DATA_WAIT)
        time.sleep(0.2)
    assert reports == []


def test_ranks_that_all_wait_in_a_collective_with_nobody_working_are_reported_stalled_in_it():
    bus, reports = wired(
        heartbeat_timeout_seconds=5.0, stall_min_seconds=0.3, stall_step_factor=0.01, attribution_seconds=0.1
    )
    with Beating(bus, {0: (3, RankPhase.PHASE_COLLECTIVE), 1: (3, RankPhase.PHASE_COLLECTIVE)}):
        got = reports.wait(2, timeout=15.0)
    assert {(r.fault_class, r.rank) for r in got} == {
        ("rank_stalled_in_collective", 0),
        ("rank_stalled_in_collective", 1),
    }


def test_a_rank_that_waited_for_a_working_peer_is_reported_with_it_when_that_peer_stops_too():
    # Rank 0 waits in a collective while rank 1 evaluates; then rank 1 enters the
    # collective too and nothing moves any more (a collective that never completes).
    bus, reports = wired(
        heartbeat_timeout_seconds=5.0, stall_min_seconds=0.5, stall_step_factor=0.01, attribution_seconds=0.1
    )
    state = {0: (3, RankPhase.PHASE_COLLECTIVE), 1: (3, RankPhase.PHASE_EVALUATION, 0, 50)}
    with Beating(bus, state):
        for batch in range(1, 6):
            time.sleep(0.2)
            state[1] = (3, RankPhase.PHASE_EVALUATION, batch, 50)
        state[1] = (3, RankPhase.PHASE_COLLECTIVE)
        first, second = reports.wait(2, timeout=15.0)
        time.sleep(0.5)
    assert [(r.fault_class, r.rank) for r in (first, second)] == [
        ("rank_stalled_in_collective", 1),
        ("rank_stalled_in_collective", 0),
    ]
    assert len(reports) == 2


def test_the_event_applier_stamps_a_beats_receipt_and_observes_how_long_it_waited():
    # Issue 12 part 5: the stamp is taken when the message is queued (on control's asyncio
    # side), not when a thread of the applier's pool gets to it.
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from services.contract import control_pb2
    from services.control.event_applier import EventApplier

    applied, release = [], threading.Event()

    class Hub:
        def admit(self, session, ev):
            return True

        def on_worker_events(self, burst, admitted=False, wait=True):
            release.wait(5.0)  # the applier is busy (say, a slow journal write)
            applied.extend((ev, time.monotonic()) for _, ev in burst)

    def lag_count() -> float:
        return REGISTRY.get_sample_value("surge_control_applier_lag_seconds_count", {"queue": "job"}) or 0.0

    before = lag_count()
    applier = EventApplier(Hub())
    beat = worker_pb2.RankHeartbeat(job_id="j", rank=0, step=1, stepping=True)
    event = control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id="j", rank=0, heartbeat=beat), seq=1)
    queued = time.monotonic()
    applier.event(SimpleNamespace(worker_id="wa"), event)
    time.sleep(0.3)
    release.set()
    applier.stop()
    ((ev, applied_at),) = applied
    stamp = ev.rank_event.heartbeat.received_monotonic
    assert queued <= stamp < queued + 0.1 and applied_at - stamp >= 0.3
    assert lag_count() == before + 1


def test_the_job_specs_phase_budgets_are_pushed_to_the_detector():
    from services.control.monitoring import start_monitoring
    from services.jobspec import parse_job_spec

    spec = parse_job_spec(
        "name: x\nsteps: 3\ndata: {dataset: tiny@v1, seq_len: 8, micro_batch_size: 1}\neval: {batches: 12}\n"
        "liveness: {phase_seconds: {evaluation: 40, checkpoint_staging: 120, compile: 300}}\n"
    )
    msg = start_monitoring("j", spec)
    assert (msg.eval_seconds, msg.eval_batches, msg.checkpoint_staging_seconds, msg.compile_seconds) == (
        40,
        12,
        120,
        300,
    )
    with pytest.raises(ValueError, match=r"liveness\.phase_seconds\.compile"):
        parse_job_spec(
            "name: x\nsteps: 3\ndata: {dataset: tiny@v1, seq_len: 8, micro_batch_size: 1}\n"
            "liveness: {phase_seconds: {compile: -1}}\n"
        )


def test_a_rank_that_waited_for_a_peer_that_then_went_silent_follows_that_silence():
    # Rank 0 waits in the all-reduce; rank 1 was last seen computing (forward) and stops
    # beating (SIGSTOP) before its own progress deadline: rank 0's deadline fires while rank 1
    # still looks alive (it waits, no report), then rank 1's silence is the cause and rank 0
    # follows it.
    bus, reports = wired(
        heartbeat_timeout_seconds=2.0, stall_min_seconds=1.2, stall_step_factor=0.01, attribution_seconds=0.1
    )
    state = {0: (3, RankPhase.PHASE_COLLECTIVE)}
    beat(bus, 0, 3, RankPhase.PHASE_COLLECTIVE, interval=0.4)  # its deadline: 1.2 s from now
    beat(bus, 1, 3, RankPhase.PHASE_BACKWARD, interval=0.4)
    with Beating(bus, state, interval=0.4):
        time.sleep(0.4)
        beat(bus, 1, 3, RankPhase.PHASE_FORWARD, interval=0.4)  # its deadline: 1.2 s from now
        time.sleep(0.4)
        beat(bus, 1, 3, RankPhase.PHASE_FORWARD, interval=0.4)  # its last beat (quiet 0.6 s later)
        first, second = reports.wait(2, timeout=15.0)
        time.sleep(0.3)
    assert [(r.fault_class, r.rank) for r in (first, second)] == [("rank_silent", 1), ("rank_stalled_in_collective", 0)]
    assert "waiting for rank 1 (silent)" in second.detail
    assert len(reports) == 2


def test_a_rank_told_to_step_that_never_leaves_idle_is_stalled_and_one_not_stepping_never_is():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.4, stall_step_factor=0.01)
    stop = threading.Event()

    def beats():
        while not stop.wait(0.1):
            bus.publish(
                Module.EXT_HARDWARE,
                worker_pb2.RankHeartbeat(  # paused, finished, not started
                    job_id="j", rank=0, step=3, stepping=False, interval_seconds=0.1, phase=RankPhase.PHASE_IDLE
                ),
            )
            beat(bus, 1, 3, RankPhase.PHASE_IDLE)  # stepping, yet its loop never started the step

    t = threading.Thread(target=beats, daemon=True)
    t.start()
    try:
        (r,) = reports.wait(1, timeout=15.0)
        time.sleep(0.6)
    finally:
        stop.set()
        t.join()
    assert (r.fault_class, r.rank) == ("rank_stalled", 1) and len(reports) == 1


def test_a_rank_blocked_on_a_step_fault_waiting_for_l1s_verdict_has_no_progress_deadline():
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.3, stall_step_factor=0.01)
    state = {1: (3, RankPhase.PHASE_FAULT_WAIT)}
    with Beating(bus, state):
        time.sleep(1.0)  # 3x the step budget, alive and blocked (L1 decides)
        assert reports == []
        state[1] = (3, RankPhase.PHASE_OPTIMIZER)  # the verdict came; then no progress: stalled
        (r,) = reports.wait(1, timeout=15.0)
    assert r.fault_class == "rank_stalled" and r.phase == RankPhase.PHASE_OPTIMIZER


def test_a_rank_held_for_inspection_has_no_progress_deadline_whatever_it_waits_in():
    # Issue 29 item 9: FreezeTraining; the rank's beats say PHASE_FROZEN (over a broken
    # collective too: services/common/phase.PhaseMarker.freeze) while L1-1 holds its decision.
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.3, stall_step_factor=0.01)
    state = {0: (3, RankPhase.PHASE_FROZEN), 1: (3, RankPhase.PHASE_FROZEN)}
    with Beating(bus, state):
        time.sleep(1.0)  # 3x the step budget, alive and held
    assert reports == []


# Stall blame on a hung host (tests/faults/test_stall_blame.py, CI under load): rank 1's host
# hangs (rank and node agent SIGSTOPped) while rank 0 waits for it in the all-reduce. Rank 1's
# last beats that reached control said it waited in a collective (stale: it had gone on since,
# but those beats died with its agent). Whichever stall deadline fires first, while rank 1 still
# looks alive (its last beat under 1.5 periods old), rank 1 goes quiet during the hold: the
# verdict waits for its silence, which names the incident; rank 0's stall follows it, and rank
# 1's own stall (extrapolated from a rank whose reports stopped) is not reported at all.
HUNG_HOST_CASES = {
    # (seconds from the start, rank, its phase): rank 0 is beaten by a thread from its first entry
    # on. Rank 1's deadline fires first (0.8 s, its last beat 0.4 s old): the CI failure, "rank 1
    # waits in a collective: no step progress for 1.0 s".
    "the hung rank's own deadline first": [
        (0.0, 1, RankPhase.PHASE_COLLECTIVE),
        (0.3, 0, RankPhase.PHASE_COLLECTIVE),
        (0.4, 1, RankPhase.PHASE_COLLECTIVE),
    ],
    # Rank 0's fires first (0.8 s, rank 1's last beat 0.4 s old); rank 1 is quiet (and its own
    # deadline passes) before rank 0's stall is released.
    "its waiting peer's deadline first": [
        (0.0, 0, RankPhase.PHASE_COLLECTIVE),
        (0.4, 1, RankPhase.PHASE_COLLECTIVE),
    ],
}


@pytest.mark.parametrize("timeline", HUNG_HOST_CASES.values(), ids=list(HUNG_HOST_CASES))
def test_a_stall_of_a_rank_that_then_goes_quiet_waits_for_its_silence_and_its_peer_follows(timeline):
    bus, reports = wired(
        heartbeat_timeout_seconds=2.0, stall_min_seconds=0.8, stall_step_factor=0.01, attribution_seconds=0.1
    )
    state = {}
    t0 = time.monotonic()
    with Beating(bus, state, interval=0.4):
        for at, rank, phase in timeline:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            step = 20 if rank == 0 else 18  # (rank 1's beats of steps 19 and 20 died with its agent)
            beat(bus, rank, step, phase, interval=0.4)
            if rank == 0:
                state[0] = (step, phase)
        quiet_from = time.monotonic() - t0
        first = reports.wait(1, timeout=15.0)[0]
        time.sleep(0.5)  # (its followers)
    got = [(r.fault_class, r.rank) for r in reports]
    assert (first.fault_class, first.rank) == ("rank_silent", 1), [(r.fault_class, r.rank, r.detail) for r in reports]
    assert quiet_from < 0.6, quiet_from  # (the timeline held: rank 1 quiet at 1.0 s)
    assert ("rank_stalled_in_collective", 0) in got[1:], got
    assert [g for g in got if g[1] == 1] == [("rank_silent", 1)], got


def test_a_rank_quiet_when_its_stall_deadline_passed_that_beats_again_without_progress_is_stalled():
    # A pause of the beats (a loaded host) over the stall deadline: the silence deadline was
    # to decide, but the rank beats again, still stuck in its forward: it is stalled.
    bus, reports = wired(heartbeat_timeout_seconds=5.0, stall_min_seconds=0.6, stall_step_factor=0.01)
    t0 = time.monotonic()
    beat(bus, 1, 3, RankPhase.PHASE_FORWARD, interval=0.2)
    time.sleep(0.2)
    beat(bus, 1, 3, RankPhase.PHASE_FORWARD, interval=0.2)
    time.sleep(0.8)  # quiet (0.3 s after that beat) when its deadline passes (0.6 s)
    with Beating(bus, {1: (3, RankPhase.PHASE_FORWARD)}, interval=0.2):
        beat(bus, 1, 3, RankPhase.PHASE_FORWARD, interval=0.2)
        (r,) = reports.wait(1, timeout=15.0)
    assert (r.fault_class, r.rank) == ("rank_stalled", 1), r.detail
    assert time.monotonic() - t0 < 3.5
    stalled_for = float(r.detail.split("no step progress for ")[1].split(" s")[0])
    assert stalled_for >= 1.4, r.detail  # since its last progress, not since it beat again
