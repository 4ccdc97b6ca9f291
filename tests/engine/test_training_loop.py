"""The training loop driving the real L2/L3 modules (real composition root, fake relays)."""

from __future__ import annotations

import threading

import pytest
import torch
from rank_fakes import (
    LocalRank,
    answer_step_faults,
    started,
    tiny_spec,
    torch_threads,
    wait_for,
)

from services.contract import Module, engine_pb2
from services.engine.training_loop import LoopState
from services.state.snapshot import Slot

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_thirty_steps_on_real_text_reduce_the_loss_and_report_every_step(tmp_path):
    rank = LocalRank(tiny_spec(steps=30, eval={"at_end": True}), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.run()
    assert rank.error is None
    steps = rank.steps()
    assert [s.step for s in steps] == list(range(1, 31))
    first, last = sum(s.loss for s in steps[:3]) / 3, sum(s.loss for s in steps[-3:]) / 3
    assert first > 5.0  # ~ln(256) = 5.55 at initialisation
    assert last < first - 1.5, (first, last)
    s = steps[-1]
    assert s.tokens == 8 * 64 and s.world_size == 1 and not s.skipped
    assert s.step_seconds >= s.forward_seconds + s.backward_seconds + s.optimizer_seconds
    assert s.learning_rate == pytest.approx(3e-3 * 0.1)  # cosine floor at the last step
    (ev,) = rank.up.of(engine_pb2.EvalCompleted)
    assert ev.step == 30 and ev.tokens == 4 * 8 * 64 and ev.loss < first
    assert isinstance(rank.up.events[-1], engine_pb2.TrainingLoopFinished)
    assert not rank.up.events[-1].stopped
    assert rank.store.flushed == 1  # pending saves settle before the end is reported
    assert rank.store.metrics[: len(steps)] == steps  # the metrics relay sees the same events
    assert rank.data.opened[0].split == "train" and rank.data.opened[-1].split == "val"


def test_a_stop_before_start_finishes_at_once_without_a_step(tmp_path):
    rank = LocalRank(tiny_spec(steps=50), tmp_path)
    t = started(rank)
    assert not rank.up.finished.wait(1.0)  # started, and waiting for StartTraining
    assert rank.up.of(engine_pb2.TrainingLoopStarted) and rank.steps() == []
    rank.command(engine_pb2.StopTraining(job_id="job", seq=1))
    t.join(30)
    assert rank.steps() == []
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 0


def test_pause_at_a_step_holds_there_until_resume_and_stop_ends_at_its_boundary(tmp_path):
    rank = LocalRank(tiny_spec(steps=50), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (paused,) = wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert paused.step == 2 and len(rank.steps()) == 2
    t.join(0.5)
    assert len(rank.steps()) == 2  # stays paused
    rank.command(engine_pb2.StopTraining(job_id="job", at_step=5, seq=2))  # later than now: keep paused
    t.join(0.3)
    assert len(rank.steps()) == 2 and not rank.up.of(engine_pb2.TrainingLoopFinished)
    rank.command(engine_pb2.ResumeTraining(job_id="job"))
    t.join(30)
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5]
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 5


def test_a_rebuild_resume_that_finds_the_loop_not_paused_is_dropped(tmp_path):
    # Left queued, it would leave the next pause into a resize nobody commanded (issue 16).
    rank = LocalRank(tiny_spec(steps=4), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, seq=1))
    rank.command(engine_pb2.ResumeTraining(job_id="job", rebuild=True))  # not paused yet: dropped
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    t.join(0.5)
    assert len(rank.steps()) == 2 and len(rank.up.of(engine_pb2.TrainingLoopStarted)) == 1  # still paused
    rank.command(engine_pb2.ResumeTraining(job_id="job"))  # a plain resume goes on as before
    t.join(30)
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4] and rank.error is None


def test_a_run_resumed_from_its_checkpoint_ends_with_the_same_parameters(tmp_path):
    spec = tiny_spec(steps=8, checkpoint={"every_steps": 4, "at_end": False})
    straight = LocalRank(spec, tmp_path / "a")
    straight.command(engine_pb2.StartTraining(job_id="job"))
    straight.run()
    assert [c.step for c in straight.store.committed] == [4, 8]

    no_saves = tiny_spec(steps=8)  # same run; this one only loads
    resumed = LocalRank(no_saves, tmp_path / "a", resume_version="step4")
    resumed.command(engine_pb2.StartTraining(job_id="job"))
    resumed.run()
    assert resumed.error is None
    assert resumed.up.of(engine_pb2.TrainingLoopStarted)[0].start_step == 4
    assert [s.step for s in resumed.steps()] == [5, 6, 7, 8]
    assert [s.loss for s in resumed.steps()] == [s.loss for s in straight.steps()[4:]]
    a, b = straight.model_state(), resumed.model_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_written_with_another_data_order_is_refused_as_a_config_error(tmp_path):
    first = LocalRank(tiny_spec(steps=4, checkpoint={"every_steps": 4}), tmp_path)
    first.command(engine_pb2.StartTraining(job_id="job"))
    first.run()
    other = LocalRank(tiny_spec(steps=8, data={"shuffle_seed": 9}), tmp_path, resume_version="step4")
    other.run()
    (failed,) = other.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "config_error"
    assert "written with data.shuffle_seed 1234 (this job: 9): its data position" in failed.detail


def test_a_checkpoint_of_the_data_position_format_before_rows_is_refused_naming_it(tmp_path, monkeypatch):
    written = LoopState.state_dict

    def old_format(self):  # what a build before row positions wrote
        state = written(self)
        state["data_position"] = torch.tensor([0, 3, 17], dtype=torch.int64)  # epoch, document, offset
        state["data_order"] = state["data_order"][:5]
        return state

    monkeypatch.setattr(LoopState, "state_dict", old_format)
    first = LocalRank(tiny_spec(steps=4, checkpoint={"every_steps": 4}), tmp_path)
    first.command(engine_pb2.StartTraining(job_id="job"))
    first.run()
    monkeypatch.setattr(LoopState, "state_dict", written)
    other = LocalRank(tiny_spec(steps=8), tmp_path, resume_version="step4")
    other.run()
    (failed,) = other.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "config_error"
    assert failed.detail.startswith(
        "checkpoint step4 holds a data position of format 1 ([epoch, document, offset] of the epoch's document "
        "order); this build resumes format 2 ([epoch, row] of the epoch's ordered packed rows)"
    )
    assert "\n" not in failed.detail


def test_an_unknown_dataset_is_reported_as_data_unavailable_with_the_reason(tmp_path):
    rank = LocalRank(tiny_spec(data={"dataset": "missing@v1"}), tmp_path)
    rank.run()
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "data_unavailable"
    assert failed.detail == "dataset missing@v1 not found"
    assert not rank.up.of(engine_pb2.TrainingLoopStarted)


def test_a_dataset_whose_bytes_changed_is_reported_as_data_corrupt_by_its_typed_cause(tmp_path):
    # Issue 29 item 7: the class from the failure's cause (FAILURE_DATA_CORRUPT), not the text.
    rank = LocalRank(tiny_spec(data={"dataset": "changed@v1"}), tmp_path)
    rank.run()
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "data_corrupt"
    assert failed.detail == "dataset changed@v1: shard train.bin changed since it was prepared"


# ------------------------------------------------------------------ step faults: the blocked state


def poisoned(rank: LocalRank) -> threading.Thread:
    """Start ``rank`` with one weight made inf: every step's loss and gradients are not finite."""
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopStarted)
    port = rank.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
    # ExportState hands out a copy: poison the copy and restore it (the only way in).
    slot = port(engine_pb2.ExportState(version="poison", digest=True)).payload
    state = slot.state_dict()
    state["norm.weight"].fill_(float("inf"))
    poisoned = Slot.copy_of(slot.key, slot.owner, slot.step, slot.version, state)
    port(engine_pb2.RestoreState(version="poison", digest=poisoned.digest), poisoned)
    return t


def test_a_step_fault_blocks_the_loop_until_l1_says_skip_and_nothing_is_applied(tmp_path):
    rank = LocalRank(tiny_spec(steps=3), tmp_path)  # non_finite_loss: rollback, no standing order
    reports = answer_step_faults(rank, lambda r: engine_pb2.STEP_SKIP)
    t = poisoned(rank)
    before = rank.model_state()
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert [(r.step, r.kind, r.reminder) for r in reports] == [
        (s, engine_pb2.STEP_FAULT_NON_FINITE_LOSS, 0) for s in (1, 2, 3)
    ]
    assert reports[0].detail == "training loss is nan at step 1 (512 tokens)" and reports[0].loss != reports[0].loss
    steps = rank.steps()
    assert [(s.fault, s.action, s.standing_order, s.skipped, s.skip_reason) for s in steps] == [
        (engine_pb2.STEP_FAULT_NON_FINITE_LOSS, engine_pb2.STEP_SKIP, 0, True, "non_finite_loss")
    ] * 3
    assert all(s.loss != s.loss for s in steps)  # reported as it was: NaN, never smoothed away
    after = rank.model_state()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "norm.weight")
    assert isinstance(rank.up.events[-1], engine_pb2.TrainingLoopFinished)


def test_l1s_apply_verdict_applies_the_step_as_it_is(tmp_path):
    rank = LocalRank(tiny_spec(steps=2, fault_policy={"actions": {"non_finite_loss": "ignore"}}), tmp_path)
    answer_step_faults(rank, lambda r: engine_pb2.STEP_APPLY)
    t = poisoned(rank)
    before = rank.model_state()
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    steps = rank.steps()
    assert [(s.fault, s.action, s.skipped) for s in steps] == [
        (engine_pb2.STEP_FAULT_NON_FINITE_LOSS, engine_pb2.STEP_APPLY, False)
    ] * 2
    after = rank.model_state()  # the NaN gradients were applied: the weights are NaN now
    assert any(not torch.isfinite(v).all() for k, v in after.items() if k != "norm.weight")
    assert all(torch.isfinite(v).all() for k, v in before.items() if k != "norm.weight")


@pytest.mark.parametrize("action", [engine_pb2.STEP_RELAUNCH, engine_pb2.STEP_STOP])
def test_a_relaunch_or_stop_verdict_ends_the_loop_at_that_step_with_nothing_more_reported(tmp_path, action):
    rank = LocalRank(tiny_spec(steps=5), tmp_path)
    answer_step_faults(rank, lambda r: action)
    t = poisoned(rank)
    before = rank.model_state()
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert not t.is_alive() and rank.error is None  # run() returned: the rank is released
    assert rank.steps() == []
    assert not rank.up.of(engine_pb2.TrainingLoopFinished) and not rank.up.of(engine_pb2.TrainingLoopFailed)
    after = rank.model_state()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "norm.weight")


def test_without_a_verdict_the_loop_reports_again_every_verdict_seconds_and_decides_nothing(tmp_path):
    rank = LocalRank(tiny_spec(steps=1, fault_policy={"verdict_seconds": 0.2}), tmp_path)
    reports = answer_step_faults(rank, lambda r: engine_pb2.STEP_SKIP if r.reminder == 2 else None)
    t = poisoned(rank)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert [r.reminder for r in reports] == [0, 1, 2]
    assert {r.step for r in reports} == {1}
    assert 0.2 <= reports[1].waited_seconds < reports[2].waited_seconds
    assert reports[2].waited_seconds >= 0.4
    (step,) = rank.steps()
    assert step.skipped and step.action == engine_pb2.STEP_SKIP


def test_a_verdict_that_arrives_before_the_rank_blocks_is_kept_for_that_step(tmp_path):
    rank = LocalRank(tiny_spec(steps=1), tmp_path)
    reports = answer_step_faults(rank, lambda r: None)  # L1 answered a peer's report already
    t = poisoned(rank)
    rank.command(
        engine_pb2.StepVerdict(
            job_id="job", step=1, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, action=engine_pb2.STEP_SKIP
        )
    )
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert [r.step for r in reports] == [1]  # it still says it blocked, and went on at once
    assert [s.action for s in rank.steps()] == [engine_pb2.STEP_SKIP]


def test_a_standing_order_needs_no_round_trip_is_echoed_and_a_revocation_takes_effect_after_its_step(tmp_path):
    rank = LocalRank(tiny_spec(steps=4), tmp_path)
    del rank.init.standing_orders[:]
    rank.init.standing_orders.add(id=7, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, action=engine_pb2.STEP_SKIP)
    reports = answer_step_faults(rank, lambda r: engine_pb2.STEP_SKIP)
    rank.command(engine_pb2.RevokeStandingOrder(job_id="job", order=7, after_step=2, seq=1))
    t = poisoned(rank)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert [(s.step, s.standing_order, s.action) for s in rank.steps()] == [
        (1, 7, engine_pb2.STEP_SKIP),
        (2, 7, engine_pb2.STEP_SKIP),
        (3, 0, engine_pb2.STEP_SKIP),
        (4, 0, engine_pb2.STEP_SKIP),
    ]
    assert [r.step for r in reports] == [3, 4]  # asked only after the named boundary


def test_the_overflow_storm_steps_th_consecutive_skip_is_a_step_fault_of_its_own(tmp_path):
    rank = LocalRank(tiny_spec(steps=5, fault_policy={"overflow_storm_steps": 2}), tmp_path)
    del rank.init.standing_orders[:]
    rank.init.standing_orders.add(id=1, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, action=engine_pb2.STEP_SKIP)
    reports = answer_step_faults(
        rank, lambda r: engine_pb2.STEP_SKIP
    )  # ignore/skip the storm: go on, the count restarts
    t = poisoned(rank)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert [(r.step, r.kind, r.consecutive_skips) for r in reports] == [
        (2, engine_pb2.STEP_FAULT_OVERFLOW_STORM, 2),
        (4, engine_pb2.STEP_FAULT_OVERFLOW_STORM, 2),
    ]
    assert reports[0].detail.startswith("2 consecutive steps skipped (up to step 2, last: non_finite_loss")
    assert [(s.fault, s.skipped) for s in rank.steps()] == [
        (engine_pb2.STEP_FAULT_NON_FINITE_LOSS, True),
        (engine_pb2.STEP_FAULT_OVERFLOW_STORM, True),
    ] * 2 + [(engine_pb2.STEP_FAULT_NON_FINITE_LOSS, True)]


def test_a_rank_held_for_inspection_steps_no_further_until_l1_thaws_it_then_trains_on(tmp_path):
    # Issue 29 item 9: a rebuild in place held by fault_policy.freeze_seconds keeps its survivors;
    # L1-1's FreezeTraining.thaw ends their hold (a relaunch would kill them instead).
    rank = LocalRank(tiny_spec(steps=12), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    wait_for(rank, t, engine_pb2.StepCompleted)
    rank.command(engine_pb2.FreezeTraining(job_id="job", reason="held for inspection", until_unix=1.0))
    t.join(1.0)
    held = len(rank.steps())
    t.join(0.5)
    loop = rank.modules.loop
    assert (len(rank.steps()), loop._phase, t.is_alive()) == (held, "frozen", True)  # held, alive, idle
    assert held < 12
    rank.command(engine_pb2.FreezeTraining(job_id="job", thaw=True))
    t.join(60)
    assert rank.error is None and not t.is_alive()
    assert [s.step for s in rank.steps()] == list(range(1, 13))  # on from where it was held, none twice
    assert loop._frozen is None


def test_a_loop_waiting_on_a_replica_divergence_goes_on_when_l1_ignores_it_and_only_then(tmp_path):
    # Issue 29 item 3 with `actions: {replica_divergence: ignore}`: the ranks wait in their loop
    # for L1-1's decision (a rollback in place, a stop, or now an ignore). The check needs dp >= 2;
    # here the loop's boundary finds the divergence itself at step 3, once.
    from services.engine.training_loop.faults import TrainingFault

    rank = LocalRank(tiny_spec(steps=6), tmp_path)
    loop = rank.modules.loop
    boundary, found = loop._boundary, []

    def diverging(step):
        if step == 3 and not found:
            found.append(step)
            raise TrainingFault("replica_divergence", "replicas differ after step 3 in w: dp ranks 0, 1 differ")
        return boundary(step)

    loop._boundary = diverging
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (failed,) = wait_for(rank, t, engine_pb2.TrainingLoopFailed)
    assert (failed.step, failed.fault_class) == (3, "replica_divergence")
    rank.command(engine_pb2.ResumeTraining(job_id="job", go_on_at_step=2))  # another step's: not this wait
    t.join(1.0)
    assert [s.step for s in rank.steps()] == [1, 2, 3] and loop._phase == "fault_wait"
    rank.command(engine_pb2.ResumeTraining(job_id="job", go_on_at_step=3))
    t.join(60)
    assert rank.error is None and not t.is_alive()
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5, 6]  # on as it was, nothing replayed
    assert loop._control.empty()  # (nothing left queued to resume a later pause)


def test_a_rollback_decided_before_the_loop_began_to_wait_on_its_divergence_is_kept_for_that_wait(tmp_path):
    # A peer's report of the divergence is decided while this rank still leaves the check that
    # found it: the reload came with the loop still "stepping" and was dropped, and the rollback
    # in place waited for this rank for good (tests/faults/test_replica_divergence.py at load 30).
    # Here the reload comes inside the check; the version does not exist: the load's error shows
    # that the wait took it.
    from services.engine.training_loop.faults import TrainingFault

    rank = LocalRank(tiny_spec(steps=6), tmp_path)
    loop = rank.modules.loop
    boundary = loop._boundary

    def diverging(step):
        if step == 3:
            rank.command(engine_pb2.ResumeTraining(job_id="job", reload_version="job:7"))  # (early)
            raise TrainingFault("replica_divergence", "replicas differ after step 3 in w: dp ranks 0, 1 differ")
        return boundary(step)

    loop._boundary = diverging
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    t.join(60)
    assert not t.is_alive()  # (it took the reload: a dropped one left it waiting)
    assert rank.error is not None and "step7" in str(rank.error), rank.error  # (the fake store: job:7 -> step7)
    assert [s.step for s in rank.steps()] == [1, 2, 3]
