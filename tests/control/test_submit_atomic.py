"""A submit that fails after its ranks were allocated leaves nothing behind (issue 12, part 8):
no rank (killed, slots free), no journal record, no job; the next submit is placed."""

from __future__ import annotations

import pytest

from services.contract import control_pb2
from services.control.orchestrator import JobNotFound
from services.jobspec import JobSpecError

from .conftest import drain

S = control_pb2.JobState
pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("fails", ["create_job", "save_status"])
def test_a_journal_failure_after_allocation_kills_the_ranks_frees_the_slots_and_leaves_no_record(plane, monkeypatch, fails):
    a, b = plane.register("wa"), plane.register("wb")
    journal = plane.c.journal

    def refuse(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(journal, fails, refuse)
    with pytest.raises(OSError, match="disk full"):
        plane.submit(name="half", dp=2)
    monkeypatch.undo()
    launched = []
    for session in (a, b):
        commands = drain(session)
        assert [c.WhichOneof("command") for c in commands] == ["launch", "release"]
        launch, release = commands
        assert release.release.kill and release.release.job_id == launch.launch.job_id
        launched.append(launch.launch.job_id)
    job_id = launched[0]
    with pytest.raises(JobNotFound):
        plane.get(job_id)
    assert [j.job_id for j in plane.user(control_pb2.JobQuery()).jobs] == []
    assert [j.status.job_id for j in journal.load_jobs()] == []
    assert journal.events(job_id) == []
    # Every slot is free again: the next job of the same size is placed.
    assert plane.submit(name="whole", dp=2).state == S.WARMING_UP


def test_a_spec_value_that_fits_no_proto_field_is_refused_before_anything_is_allocated(plane):
    a = plane.register("wa")
    with pytest.raises(JobSpecError, match=r"^job.yaml: steps: 100000000000000000000000 does not fit a 64-bit integer"):
        plane.submit(dp=1, steps=10**23)
    assert drain(a) == []
    assert plane.submit(dp=1).state == S.WARMING_UP
