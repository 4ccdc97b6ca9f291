"""The training loop driving the real L2/L3 modules (real composition root, fake relays)."""

from __future__ import annotations

import pytest
import torch
from rank_fakes import LocalRank, started, tiny_spec, torch_threads, wait_for

from services.contract import Module, engine_pb2

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
    rank.command(engine_pb2.StopTraining(job_id="job"))
    t.join(30)
    assert rank.steps() == []
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 0


def test_pause_at_a_step_holds_there_until_resume_and_stop_ends_at_its_boundary(tmp_path):
    rank = LocalRank(tiny_spec(steps=50), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (paused,) = wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert paused.step == 2 and len(rank.steps()) == 2
    t.join(0.5)
    assert len(rank.steps()) == 2  # stays paused
    rank.command(engine_pb2.StopTraining(job_id="job", at_step=5))  # later than now: keep paused
    t.join(0.3)
    assert len(rank.steps()) == 2 and not rank.up.of(engine_pb2.TrainingLoopFinished)
    rank.command(engine_pb2.ResumeTraining(job_id="job"))
    t.join(30)
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5]
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 5


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
    assert "data.shuffle_seed 1234" in failed.detail and "this job has 9" in failed.detail


def test_an_unknown_dataset_is_reported_as_data_unavailable_with_the_reason(tmp_path):
    rank = LocalRank(tiny_spec(data={"dataset": "missing@v1"}), tmp_path)
    rank.run()
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "data_unavailable"
    assert failed.detail == "dataset missing@v1 not found"
    assert not rank.up.of(engine_pb2.TrainingLoopStarted)


def test_steps_with_a_non_finite_loss_are_skipped_under_skip_step_reported_and_leave_the_weights_alone(tmp_path):
    policy = {"actions": {"non_finite_loss": "skip_step"}}
    rank = LocalRank(tiny_spec(steps=3, fault_policy=policy), tmp_path)
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopStarted)
    port = rank.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
    live = port(engine_pb2.ExportState()).payload.state_dict()  # views of the parameters
    with torch.no_grad():
        live["norm.weight"].fill_(float("inf"))  # every step's loss and gradients: not finite
    before = rank.model_state()
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    steps = rank.steps()
    assert [s.skipped for s in steps] == [True, True, True]
    assert [s.skip_reason for s in steps] == ["non_finite_loss"] * 3
    assert all(s.loss != s.loss for s in steps)  # reported as it was: NaN, never smoothed away
    assert all(s.grad_norm != s.grad_norm or s.grad_norm == float("inf") for s in steps)
    after = rank.model_state()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "norm.weight")


def test_a_non_finite_loss_without_skip_step_is_a_typed_failure_and_nothing_is_applied(tmp_path):
    rank = LocalRank(tiny_spec(steps=3), tmp_path)
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopStarted)
    port = rank.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
    with torch.no_grad():
        port(engine_pb2.ExportState()).payload.state_dict()["norm.weight"].fill_(float("inf"))
    before = rank.model_state()
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t.join(30)
    assert rank.steps() == []
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "non_finite_loss" and failed.step == 0
    assert failed.detail.startswith("training loss is nan at step 1 (512 tokens): the step is not applied")
    after = rank.model_state()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "norm.weight")
