"""An operator's stop or pause checkpoints the boundary step first (issue 12, part 7): the
loop saves the step it stops or pauses at (unless that step is saved already) and reports
paused / finished only after the commit; a run continued from that checkpoint ends with the
parameters of an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from rank_fakes import LocalRank, started, tiny_spec, torch_threads, wait_for

from services.contract import engine_pb2, store_pb2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def kinds(rank: LocalRank) -> list[str]:
    return [type(e).__name__ for e in rank.up.events if not isinstance(e, engine_pb2.StepCompleted)]


def test_a_stop_with_checkpoint_saves_its_boundary_step_and_a_resume_from_it_ends_bit_identical(tmp_path):
    spec = tiny_spec(steps=8)  # no periodic checkpoint, none at the end
    straight = LocalRank(spec, tmp_path / "straight")
    straight.command(engine_pb2.StartTraining(job_id="job"))
    straight.run()
    assert straight.store.committed == []

    stopped = LocalRank(spec, tmp_path / "ckpt")
    stopped.command(engine_pb2.StartTraining(job_id="job"))  # (queued first: the stop waits for its boundary)
    stopped.command(engine_pb2.StopTraining(job_id="job", at_step=3, checkpoint=True, seq=1))
    stopped.run()
    assert stopped.error is None
    assert [c.step for c in stopped.store.committed] == [3]
    (fin,) = stopped.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 3
    # The commit is reported before the end, and the end waited for it (flush).
    assert kinds(stopped)[-2:] == ["SaveCompleted", "TrainingLoopFinished"]
    assert stopped.store.flushed == 1

    resumed = LocalRank(spec, tmp_path / "ckpt", resume_version="step3")
    resumed.command(engine_pb2.StartTraining(job_id="job"))
    resumed.run()
    assert resumed.error is None
    assert [s.step for s in resumed.steps()] == [4, 5, 6, 7, 8]
    assert [s.loss for s in resumed.steps()] == [s.loss for s in straight.steps()[3:]]
    a, b = straight.model_state(), resumed.model_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_without_checkpoint_saves_nothing(tmp_path):
    rank = LocalRank(tiny_spec(steps=8), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))  # (queued first: the stop waits for its boundary)
    rank.command(engine_pb2.StopTraining(job_id="job", at_step=3, seq=1))
    rank.run()
    assert rank.store.committed == [] and rank.up.of(engine_pb2.TrainingLoopFinished)[0].step == 3


def test_a_stop_at_a_step_already_saved_does_not_save_it_twice(tmp_path):
    rank = LocalRank(tiny_spec(steps=8, checkpoint={"every_steps": 2}), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))  # (queued first: the stop waits for its boundary)
    rank.command(engine_pb2.StopTraining(job_id="job", at_step=4, checkpoint=True, seq=1))
    rank.run()
    assert [c.step for c in rank.store.committed] == [2, 4]


def test_a_pause_with_checkpoint_commits_before_reporting_paused_and_a_stop_while_paused_adds_none(tmp_path):
    rank = LocalRank(tiny_spec(steps=8), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, checkpoint=True, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (paused,) = wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert paused.step == 2
    assert [c.step for c in rank.store.committed] == [2]
    assert kinds(rank)[-2:] == ["SaveCompleted", "TrainingLoopPaused"] and rank.store.flushed == 1
    rank.command(engine_pb2.StopTraining(job_id="job", checkpoint=True, seq=2))
    t.join(30)
    assert [c.step for c in rank.store.committed] == [2]  # step 2 is saved already
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert fin.stopped and fin.step == 2


def test_a_stop_with_checkpoint_while_paused_without_one_saves_the_paused_step(tmp_path):
    rank = LocalRank(tiny_spec(steps=8), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert rank.store.committed == []
    rank.command(engine_pb2.StopTraining(job_id="job", checkpoint=True, seq=2))
    t.join(30)
    assert [c.step for c in rank.store.committed] == [2]
    assert isinstance(rank.up.events[-1], engine_pb2.TrainingLoopFinished)


def test_a_stop_of_a_resumed_run_before_any_new_step_saves_nothing(tmp_path):
    spec = tiny_spec(steps=8, checkpoint={"every_steps": 4})
    first = LocalRank(spec, tmp_path)
    first.command(engine_pb2.StartTraining(job_id="job"))  # (queued first: the stop waits for its boundary)
    first.command(engine_pb2.StopTraining(job_id="job", at_step=4, checkpoint=True, seq=1))
    first.run()
    assert [c.step for c in first.store.committed] == [4]
    again = LocalRank(spec, tmp_path, resume_version="step4")
    again.command(engine_pb2.StopTraining(job_id="job", checkpoint=True, seq=1))
    again.run()
    assert again.store.committed == [] and again.up.of(engine_pb2.TrainingLoopFinished)[0].step == 4
    assert store_pb2.SaveCompleted not in {type(e) for e in again.up.events}
