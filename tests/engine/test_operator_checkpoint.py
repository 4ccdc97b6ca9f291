"""An operator's stop or pause checkpoints the boundary step first (issue 12, part 7): the
loop saves the step it stops or pauses at (unless that step is saved already) and reports
paused / finished only after the commit; a run continued from that checkpoint ends with the
parameters of an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from rank_fakes import FakeStore, LocalRank, started, tiny_spec, torch_threads, wait_for

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


def test_a_stop_that_says_save_again_saves_the_paused_step_though_the_rank_marked_it_saved(tmp_path):
    # L1-1 holds no commit of the step the ranks paused at (their pause's save failed, the store
    # away: each rank marked the step saved all the same): the stop saves it again.
    rank = LocalRank(tiny_spec(steps=8), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, checkpoint=True, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert [c.step for c in rank.store.committed] == [2]
    rank.command(engine_pb2.StopTraining(job_id="job", checkpoint=True, save_again=True, seq=2))
    t.join(30)
    assert [c.step for c in rank.store.committed] == [2, 2]
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


class HeldCommitStore(FakeStore):
    """The store relay's asynchronous save as the loop sees it (services/rank/store_client.py):
    an async save's commit is sent, and its SaveCompleted goes up, only once its background
    write is done, which here is when the loop next settles saves (a flush, or the next save's
    wait for the previous one). A rank that reports paused before then leaves the save in
    flight for whatever L1-1 does next: a resize's new group, a release of the ranks."""

    def __init__(self, events, root):
        super().__init__(events, root)
        self._held: store_pb2.CommitCheckpoint | None = None
        self.order: list[str] = []  # the relay's calls, in order

    def save_checkpoint(self, msg, payload):
        assert msg.write_async  # (the default: what this fake stands for)
        self.order.append(f"save {msg.step}")
        self._settle()  # (the relay waits for the previous save first)
        return super().save_checkpoint(msg, payload)

    def commit_checkpoint(self, msg, payload=None):
        self._held = msg  # (chained on the write: sent from the relay's thread once it is done)

    def flush_checkpoint(self, msg, payload=None):
        self.order.append("flush")
        self._settle()
        super().flush_checkpoint(msg, payload)

    def _settle(self) -> None:
        if self._held is not None:
            msg, self._held = self._held, None
            self.order.append(f"commit {msg.step}")
            super().commit_checkpoint(msg)


def held_commit_rank(spec, tmp_path) -> tuple[LocalRank, HeldCommitStore]:
    rank = LocalRank(spec, tmp_path, store=HeldCommitStore)
    return rank, rank.store


@pytest.mark.parametrize("pause_at", [4, 5], ids=["at-the-save-step", "a-step-after-it"])
def test_a_pause_without_checkpoint_reports_paused_only_after_the_save_in_flight_is_committed(tmp_path, pause_at):
    # A resize pauses with no checkpoint of its own, then rebuilds the group (a scale down
    # releases the ranks above the new size first): an asynchronous periodic save still being
    # written then would be dropped with the old group, its step lost (session 29's trial:
    # "the save of step 33 was dropped with the replaced group"). Every pause settles it first.
    rank, held = held_commit_rank(tiny_spec(steps=8, checkpoint={"every_steps": 4, "at_end": False}), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=pause_at, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (paused,) = wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert paused.step == pause_at
    assert [c.step for c in rank.store.committed] == [4]
    assert kinds(rank)[-2:] == ["SaveCompleted", "TrainingLoopPaused"]
    assert held.order == ["save 4", "flush", "commit 4"]
    rank.command(engine_pb2.ResumeTraining(job_id="job"))
    t.join(30)
    assert rank.error is None
    assert [c.step for c in rank.store.committed] == [4, 8]
    assert [s.step for s in rank.steps()] == list(range(1, 9))


def test_a_pause_with_no_save_in_flight_commits_nothing_and_pauses(tmp_path):
    rank, held = held_commit_rank(tiny_spec(steps=8, checkpoint={"every_steps": 4, "at_end": False}), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=3, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    (paused,) = wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert paused.step == 3 and rank.store.committed == [] and held.order == ["flush"]
    rank.command(engine_pb2.StopTraining(job_id="job", seq=2))
    t.join(30)
    assert rank.store.committed == [] and rank.up.of(engine_pb2.TrainingLoopFinished)[0].step == 3


def test_a_checkpointing_pause_while_paused_without_one_saves_the_paused_step_and_stays_paused(tmp_path):
    """A drain of a job whose pause has no checkpoint of its step (its save failed, or the
    operator paused it without one): L1-1 sends the paused ranks a PauseTraining with
    ``checkpoint``. They save the step they are paused at, in place, and report paused again
    at it; no step is trained (was: they resumed and saved the next boundary: one step more,
    a fresh operator's trial). The next boundary command is agreed as before."""
    rank = LocalRank(tiny_spec(steps=8), tmp_path)
    rank.command(engine_pb2.PauseTraining(job_id="job", at_step=2, seq=1))
    rank.command(engine_pb2.StartTraining(job_id="job"))
    t = started(rank)
    wait_for(rank, t, engine_pb2.TrainingLoopPaused)
    assert rank.store.committed == []
    rank.command(engine_pb2.PauseTraining(job_id="job", checkpoint=True, seq=2))
    for _ in range(300):
        if len(rank.up.of(engine_pb2.TrainingLoopPaused)) == 2:
            break
        t.join(0.1)
    assert [p.step for p in rank.up.of(engine_pb2.TrainingLoopPaused)] == [2, 2]
    assert [c.step for c in rank.store.committed] == [2]
    assert [s.step for s in rank.steps()] == [1, 2]  # nothing trained past the pause
    assert kinds(rank)[-2:] == ["SaveCompleted", "TrainingLoopPaused"]
    rank.command(engine_pb2.ResumeTraining(job_id="job"))  # (the drain undone: `up`)
    rank.command(engine_pb2.StopTraining(job_id="job", checkpoint=True, seq=3))  # agreed after #2
    t.join(60)
    (fin,) = rank.up.of(engine_pb2.TrainingLoopFinished)
    assert rank.error is None and fin.stopped and fin.step > 2
    assert [c.step for c in rank.store.committed] == [2, fin.step]
