"""WatchJob's ``tail`` and ``types`` over real gRPC, against the real control process: the
history is the newest N events of those types, in seq order; with ``follow`` the live events
are of those types too, and the stream still ends at the job's end."""

from __future__ import annotations

import threading

import pytest

from services.contract import control_pb2

from .test_control_service import start_control, submit  # noqa: F401 (the fixture)

JobState = control_pb2.JobState
pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_watch_job_answers_the_newest_events_of_the_types_asked_then_follows_those_types(start_control):  # noqa: F811
    control = start_control()
    job = submit(control, dp=2)  # no worker registered: it waits in the queue
    assert job.state == JobState.STANDBY
    for n in range(5):
        control.stub.AnnotateJob(control_pb2.AnnotateJobRequest(job_id=job.job_id, note=f"note {n}"))

    def watch(**query) -> list[control_pb2.JobEvent]:
        return list(control.stub.WatchJob(control_pb2.JobQuery(job_id=job.job_id, **query), timeout=30))

    everything = watch()
    assert [e.seq for e in everything] == list(range(1, len(everything) + 1))
    assert [e.message for e in everything if e.type == "note"] == [f"note {n}" for n in range(5)]
    assert [e.seq for e in watch(tail=3)] == [e.seq for e in everything[-3:]]
    assert [e.message for e in watch(tail=2, types=["note"])] == ["note 3", "note 4"]
    assert [e.seq for e in watch(tail=1000)] == [e.seq for e in everything]  # a tail longer than the history
    assert [e.type for e in watch(types=["state", "note"])] == [
        e.type for e in everything if e.type in ("state", "note")
    ]
    assert watch(types=["no-such-type"]) == []
    assert watch(tail=2, types=["note"], from_seq=everything[-1].seq + 1) == []

    followed: list[control_pb2.JobEvent] = []
    stream = control.stub.WatchJob(
        control_pb2.JobQuery(job_id=job.job_id, tail=1, types=["note"], follow=True), timeout=60
    )
    first = next(stream)  # the history (its newest note): the stream is open, what follows is live
    reader = threading.Thread(target=lambda: followed.extend(stream), daemon=True)
    reader.start()
    control.stub.AnnotateJob(control_pb2.AnnotateJobRequest(job_id=job.job_id, note="live"))
    stopped = control.stub.StopJob(control_pb2.StopJobRequest(job_id=job.job_id))  # takes it out of the queue
    assert stopped.state == JobState.TERMINATED
    reader.join(timeout=60)
    assert not reader.is_alive()  # the stream ended at the job's end (its TERMINATED event not a note)
    assert [first.message] + [e.message for e in followed] == ["note 4", "live"]
    assert {e.type for e in followed} == {"note"}
