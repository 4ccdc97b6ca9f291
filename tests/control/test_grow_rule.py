"""Which shrunk jobs grow back first (grow_rule.py): priority, then age; the queue's head of
an equal or higher priority first; one resize per job per interval."""

from __future__ import annotations

import time

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator.grow_rule import Grower, arbitrate

from .conftest import drain, spec_yaml, to_ranks
from .test_resize import SHRINK, ready

CASES = [
    # (case, growers, now, interval, head priority, order, later)
    ("priority first", [Grower("lo", 0, 1.0), Grower("hi", 5, 9.0)], 100.0, 60.0, None, ["hi", "lo"], None),
    ("then age", [Grower("new", 1, 9.0), Grower("old", 1, 1.0)], 100.0, 60.0, None, ["old", "new"], None),
    ("then id", [Grower("b", 1, 1.0), Grower("a", 1, 1.0)], 100.0, 60.0, None, ["a", "b"], None),
    ("a queued head of equal priority first", [Grower("g", 3, 1.0)], 100.0, 60.0, 3, [], None),
    ("a queued head of lower priority does not", [Grower("g", 3, 1.0)], 100.0, 60.0, 2, ["g"], None),
    ("resized 10 s ago: waits 50 s", [Grower("g", 0, 1.0, last_resize=90.0)], 100.0, 60.0, None, [], 50.0),
    ("resized 61 s ago: grows", [Grower("g", 0, 1.0, last_resize=39.0)], 100.0, 60.0, None, ["g"], None),
    (
        "one held, the next grows",
        [Grower("held", 5, 1.0, last_resize=95.0), Grower("free", 0, 2.0)],
        100.0,
        60.0,
        None,
        ["free"],
        55.0,
    ),
    ("never resized: grows at once", [Grower("g", 0, 1.0)], 0.5, 60.0, None, ["g"], None),
]


@pytest.mark.parametrize(
    ("growers", "now", "interval", "head", "order", "later"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_grow_arbitration(growers, now, interval, head, order, later):
    assert arbitrate(growers, now, interval, head) == (order, later)


def test_two_shrunk_jobs_and_one_returned_slot_the_higher_priority_grows_the_other_waits(plane):
    """In-process: jobs lo (priority 0, older) and hi (priority 5) each shrunk 3 -> 2 by a lost
    node; one worker registers: hi's ranks pause to grow back, lo's get nothing."""
    sessions = {w: plane.register(w) for w in ("a0", "a1", "a2", "b0", "b1", "b2")}
    jobs = {}
    for name, priority, workers in (("lo", 0, ("a0", "a1", "a2")), ("hi", 5, ("b0", "b1", "b2"))):
        text = spec_yaml(name=name, dp=3, steps=50, extra=SHRINK)
        jobs[name] = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="j.yaml", priority=priority))
        for rank, w in enumerate(workers):
            plane.rank_event(sessions[w], jobs[name].job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    for name, lost, kept in (("lo", "a2", ("a0", "a1")), ("hi", "b2", ("b0", "b1"))):
        plane.c.sessions.close(sessions.pop(lost))
        ready(plane, jobs[name].job_id, {r: sessions[w] for r, w in enumerate(kept)}, step=5, generation=2)
        assert plane.get(jobs[name].job_id).world_size == 2
    for s in sessions.values():
        drain(s)
    plane.register("new")
    deadline = time.monotonic() + 10
    while not (hi := [to_ranks(c) for c in drain(sessions["b0"]) if c.WhichOneof("command") == "routed"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [type(m).__name__ for m in hi] == ["PauseTraining"] and not hi[0].checkpoint
    time.sleep(0.3)
    assert drain(sessions["a0"]) == [] and drain(sessions["a1"]) == []
    assert plane.get(jobs["lo"].job_id).world_size == 2
