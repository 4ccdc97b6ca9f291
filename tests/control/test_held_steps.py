"""A rank 0 step whose journal write the disk refuses is held and written again once the disk
takes writes (issue 28 item 2, held_steps.py): first in the job's next step write, or, when
no step follows, once any write commits again, so the job's step history (``JobStore.steps``) and event log have
no hole; its failure goes up to L1-3 as L1-1's typed failure event, graded
journal_write_failed and ignored by the default policy (once while the writes fail, not once a
step). The failure is injected as test_journal_failure.py does: every journal transaction
fails with SQLite's full-disk error."""

from __future__ import annotations

import pytest

from services.contract import control_pb2
from services.control.orchestrator.held_steps import HeldStep, HeldSteps

from . import test_operator_actions as operator_actions
from .conftest import settle
from .test_commit_undo import full
from .test_journal_failure import _count
from .test_operator_actions import running_job, step

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)
plane, store = operator_actions.plane, operator_actions.store
IGNORED = ("surge_fault_decisions_total", {"class": "journal_write_failed", "action": "ignore"})


def disk_full(plane, monkeypatch) -> list[int]:  # noqa: F811
    refused: list[int] = []

    def transaction(writes) -> None:  # every transaction of the journal, as SQLite on a full disk
        refused.append(len(writes))
        raise full()

    monkeypatch.setattr(plane.c.journal._writer, "_transaction", transaction)
    return refused


def steps_journaled(plane, job_id: str) -> list[int]:  # noqa: F811
    return [s for s, _ in plane.c.journal.steps(job_id)]


def step_events(plane, job_id: str) -> list[str]:  # noqa: F811
    return [e.message.split("/")[0] for e in plane.events(job_id) if e.type == "step"]


def test_refused_steps_are_held_then_written_first_in_the_next_step_and_l1_3_hears_once(plane, monkeypatch):  # noqa: F811
    job_id, a, b = running_job(plane)
    ignored = _count(IGNORED[0], **IGNORED[1])
    step(plane, a, job_id, 1)
    disk_full(plane, monkeypatch)
    for n in (2, 3, 4):
        step(plane, a, job_id, n)
    held = plane.c.orchestrator._held_steps
    settle(lambda: held.held(job_id), 3)
    # L1-3 graded L1-1's failure journal_write_failed (typed, not internal_error: the job would
    # have FAILED); the policy ignored it, once for the three refused steps.
    settle(lambda: _count(IGNORED[0], **IGNORED[1]) - ignored, 1.0)
    assert plane.get(job_id).state == JobState.RUNNING
    monkeypatch.undo()  # the disk takes writes again
    step(plane, a, job_id, 5)
    assert steps_journaled(plane, job_id) == [1, 2, 3, 4, 5]  # no hole, in order
    assert step_events(plane, job_id) == [f"step {n}" for n in (1, 2, 3, 4, 5)]  # (their events too)
    assert held.held(job_id) == 0
    assert _count(IGNORED[0], **IGNORED[1]) - ignored == 1.0


def test_refused_steps_of_a_job_that_steps_no_more_are_written_once_the_journal_commits(plane, monkeypatch):  # noqa: F811
    job_id, a, b = running_job(plane)
    disk_full(plane, monkeypatch)
    step(plane, a, job_id, 1)
    step(plane, a, job_id, 2)
    settle(lambda: plane.c.orchestrator._held_steps.held(job_id), 2)
    monkeypatch.undo()
    assert steps_journaled(plane, job_id) == []  # (held: nothing commits yet)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))  # a write of anything commits: the journal recovered
    settle(lambda: steps_journaled(plane, job_id), [1, 2])
    assert plane.c.orchestrator._held_steps.held(job_id) == 0


def test_held_steps_are_bounded_the_oldest_dropped():
    held = HeldSteps(limit=2)
    steps = [HeldStep(("j", n), (), n) for n in (1, 2, 3)]
    assert held.failed("j", steps[1:2]) is True  # the first failure: reported
    # (an earlier write, queued before, that fails after it: held in queue order)
    assert held.failed("j", [steps[0], steps[2]]) is False  # still failing: not again
    assert [h.row for h in held.take("j")] == [("j", 2), ("j", 3)]  # (beyond the bound: the oldest went)
    held.committed("j")
    assert held.failed("j", steps[:1]) is True  # a commit between: reported again
