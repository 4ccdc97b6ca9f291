"""Evaluation hooks (issue 31 item 4, ``eval.hooks``), in-process through the real bus and
sessions: control submits by itself the evaluation job `surgectl evaluate` submits, of every
N-th committed version and of the newest one when the job finishes; once per version and
hook, however often the commit is relayed; never for a stopped job; a hook that cannot submit
is a warning on the job, not a fault."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2, store_pb2
from services.jobspec import parse_job_spec, spec_from_json

from .conftest import settle, spec_yaml

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)

HOOKS = "eval: {hooks: [{command: [python, score.py], every_versions: 2}, {command: [x], on_finish: true, hf: false}]}"


def evaluations(plane, source: str) -> list[tuple[str, str, list[str]]]:
    """(job id, version, command) of every evaluation job of ``source``."""
    out = []
    for j in plane.user(control_pb2.JobQuery()).jobs:
        spec = spec_from_json(plane.user(control_pb2.JobQuery(job_id=j.job_id, with_spec=True)).spec_json)
        if spec.evaluation is not None and spec.evaluation.source_job == source:
            out.append((j.job_id, spec.evaluation.version, list(spec.evaluation.command)))
    return sorted(out, key=lambda e: e[1])


def saved(plane, session, job_id: str, n: int) -> None:
    plane.rank_event(session, job_id, 0, saved=store_pb2.SaveCompleted(version=f"{job_id}:{n}", step=n, seconds=0.1))


def test_every_nth_version_and_the_finish_submit_one_evaluation_each_through_the_queue(plane):
    a = plane.register("wa")
    job = plane.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="hooked", dp=1, extra=HOOKS))).job_id
    plane.rank_event(a, job, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    saved(plane, a, job, 1)
    saved(plane, a, job, 2)
    saved(plane, a, job, 2)  # (relayed again: one submit)
    settle(lambda: len(evaluations(plane, job)), 1)
    ((eval_id, version, command),) = evaluations(plane, job)
    assert (version, command) == (f"{job}:2", ["python", "score.py"])
    # `status` lists jobs without their specs: the status itself says which is an evaluation
    listed = {j.job_id: j for j in plane.user(control_pb2.JobQuery()).jobs}
    assert listed[eval_id].evaluation and not listed[job].evaluation and not listed[eval_id].spec_json
    spec = spec_from_json(plane.user(control_pb2.JobQuery(job_id=eval_id, with_spec=True)).spec_json)
    assert spec.world_size == 1 and spec.init_from.checkpoint == f"{job}:2" and spec.eval.hooks == []
    assert parse_job_spec(spec_yaml(name="hooked", dp=1, extra=HOOKS), "j.yaml").model.d_model == spec.model.d_model
    saved(plane, a, job, 3)
    plane.rank_event(a, job, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=3))
    settle(lambda: len(evaluations(plane, job)), 2)
    assert [(v, c) for _, v, c in evaluations(plane, job)] == [
        (f"{job}:2", ["python", "score.py"]),
        (f"{job}:3", ["x"]),
    ]

    def said(
        start: str,
    ) -> bool:  # (the submit's event on the source job follows its answer, off the decision's thread)
        return any(e.message.startswith(start) for e in plane.events(job) if e.type == "eval")

    settle(lambda: said("eval.hooks[0] (version 2, every 2): evaluation job "), True)
    settle(lambda: said("eval.hooks[1] (the job finished): evaluation job "), True)
    assert plane.get(job).outcome == control_pb2.JobOutcome.FINISHED


def test_a_stopped_job_submits_no_finish_evaluation_and_a_hook_that_cannot_submit_is_a_warning(plane):
    a = plane.register("wa")
    job = plane.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="stopped", dp=1, extra=HOOKS))).job_id
    plane.rank_event(a, job, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    saved(plane, a, job, 1)
    plane.rank_event(a, job, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=1, stopped=True))
    settle(lambda: plane.get(job).state, JobState.TERMINATED)
    assert evaluations(plane, job) == []

    # A version whose evaluation the queue refuses (its priority out of range cannot happen; a
    # name the evaluation's bounds refuse can: a version text of 161 characters).
    job2 = plane.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="long", dp=1, extra=HOOKS))).job_id
    plane.rank_event(a, job2, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    plane.rank_event(a, job2, 0, saved=store_pb2.SaveCompleted(version=f"{job2}:{'0' * 150}2", step=2, seconds=0.1))
    settle(lambda: any(e.type == "eval" for e in plane.events(job2)), True)
    (said,) = [e.message for e in plane.events(job2) if e.type == "eval"]
    assert said.startswith("WARNING: eval.hooks[0] (version 2, every 2): no evaluation of ") and "version" in said
    assert plane.get(job2).state == JobState.RUNNING  # (the training job is not touched)
    assert not [e for e in plane.events(job2) if e.type == "fault"]


def test_versions_committed_while_a_hooks_evaluation_waits_are_skipped_not_piled_up(plane):
    # One slot, held by the training job: its first evaluation waits in the queue; the versions
    # after it are skipped (said) until it ends, so the queue holds one evaluation per hook.
    a = plane.register("wa")
    every = "eval: {hooks: [{command: [python, score.py], every_versions: 1}]}"
    job = plane.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="fast", dp=1, extra=every))).job_id
    plane.rank_event(a, job, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    saved(plane, a, job, 1)
    settle(lambda: len(evaluations(plane, job)), 1)
    for n in (2, 3):
        saved(plane, a, job, n)
    assert [v for _, v, _ in evaluations(plane, job)] == [f"{job}:1"]
    said = [e.message for e in plane.events(job) if e.type == "eval"]
    skipped = [m for m in said if "still waits or runs (one at a time)" in m]
    assert len(skipped) == 2 and skipped[0].startswith(f"eval.hooks[0] (version 2, every 1): no evaluation of {job}:2")
    # The skip is said after the commit it is about, never before it.
    order = [(e.type, e.message) for e in plane.events(job) if e.type in ("checkpoint", "eval")]
    commit = next(i for i, (t, m) in enumerate(order) if t == "checkpoint" and f"{job}:2" in m)
    assert order[commit + 1][0] == "eval" and f"no evaluation of {job}:2" in order[commit + 1][1]
