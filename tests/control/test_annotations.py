"""`surgectl tag` and `note`: L1-1 keeps a job's tags in its status (journaled: a restarted
control has them) and a note as an event, in any state; a malformed tag or note is refused
in one line, changing nothing."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator.refusals import BadAnnotation

from .conftest import Plane, drain

pytestmark = pytest.mark.timeout(30)


def _events(plane, job_id: str) -> list:
    return list(plane.events(job_id))


def _annotate(plane, job_id: str, **kw) -> control_pb2.JobStatus:
    return plane.user(control_pb2.AnnotateJobRequest(job_id=job_id, **kw))


def test_tags_and_notes_are_kept_in_any_state_and_across_a_control_restart(plane, tmp_path):
    a = plane.register("wa")
    job_id = plane.submit(dp=1, steps=1).job_id
    drain(a)
    s = _annotate(plane, job_id, set_tags={"lr": "3e-3", "arm": "baseline"}, note="first try")
    assert dict(s.tags) == {"lr": "3e-3", "arm": "baseline"} and dict(plane.get(job_id).tags) == dict(s.tags)
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    plane.rank_event(a, job_id, 0, finished=engine_pb2.TrainingLoopFinished(step=1))
    assert plane.get(job_id).state == control_pb2.TERMINATED
    ended = _annotate(plane, job_id, set_tags={"verdict": "diverged"}, remove_tags=["arm"], note="lr too high")
    assert dict(ended.tags) == {"lr": "3e-3", "verdict": "diverged"} and ended.state == control_pb2.TERMINATED
    events = [(e.type, e.message) for e in _events(plane, job_id) if e.type in ("tags", "note")]
    assert events == [
        ("tags", "tags: arm=baseline, lr=3e-3"),
        ("note", "first try"),
        ("tags", "tags: verdict=diverged, -arm"),
        ("note", "lr too high"),
    ]
    journal = JobStore(tmp_path / "control.db")
    try:
        again = Plane(build(journal, data_address="127.0.0.1:7001", store_address="127.0.0.1:7002"))
        assert dict(again.get(job_id).tags) == {"lr": "3e-3", "verdict": "diverged"}
    finally:
        journal.close()


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"set_tags": {"bad key": "x"}}, "tag 'bad key': a key is 1-63 letters"),
        ({"set_tags": {"k": "x" * 257}}, "tag k: a value is one line of at most 256 characters"),
        ({"set_tags": {"k": "two\nlines"}}, "tag k: a value is one line"),
        ({"set_tags": {"k": ""}}, "tag k: an empty value (`surgectl tag JOB --remove k` removes a tag)"),
        ({"set_tags": {"k": "  "}}, "tag k: an empty value"),
        ({"remove_tags": ["nope"]}, "tag 'nope': the job has no such tag to remove (its tags: keep)"),
        ({"note": "a\nb"}, "note: one line of at most 2000 characters"),
        ({"note": "   "}, "annotate: give a tag to set or remove, or a note"),
        ({"set_tags": {f"k{i}": "v" for i in range(64)}}, "tags: a job holds at most 64 tags (65 asked)"),
    ],
)
def test_a_malformed_annotation_is_refused_and_changes_nothing(plane, kw, words):
    plane.register("wa")
    job_id = plane.submit(dp=1, steps=1).job_id
    _annotate(plane, job_id, set_tags={"keep": "1"})
    before = len(_events(plane, job_id))
    with pytest.raises(BadAnnotation) as e:
        _annotate(plane, job_id, **kw)
    assert words in str(e.value)
    assert dict(plane.get(job_id).tags) == {"keep": "1"} and len(_events(plane, job_id)) == before


def test_the_status_carries_rank_0s_peak_and_last_mfu(plane):
    a = plane.register("wa")
    job_id = plane.submit(dp=1, steps=5).job_id
    drain(a)
    plane.rank_event(
        a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0, peak_tflops=0.05, peak_source="measured: cpu")
    )
    plane.rank_event(a, job_id, 0, step=engine_pb2.StepCompleted(rank=0, step=1, loss=2.0, tokens=64, mfu=0.31))
    s = plane.get(job_id)
    assert (s.peak_tflops, s.peak_source, round(s.mfu, 2)) == (0.05, "measured: cpu", 0.31)
