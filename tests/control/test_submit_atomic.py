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


def test_the_allocator_frees_every_slot_of_an_allocation_whose_launch_failed_half_way():
    from services.contract import engine_pb2
    from services.control.resource_allocator import ResourceAllocator
    from services.jobspec import parse_job_spec, spec_to_json

    from .conftest import registration, spec_yaml

    sent = []

    def hardware(msg, worker_id):
        sent.append((type(msg).__name__, worker_id))
        if isinstance(msg, control_pb2.LaunchRanks) and worker_id == "wb" and msg.job_id == "j1":
            raise ConnectionError("wb's session is gone")

    allocator = ResourceAllocator(hardware=hardware, emit=lambda *a: None)
    for w in ("wa", "wb"):
        allocator.on_worker_registration(registration(w, slots=1))
    spec = parse_job_spec(spec_yaml(dp=2))
    init = engine_pb2.InitJob(job_id="j1", spec_json=spec_to_json(spec))
    with pytest.raises(ConnectionError):
        allocator.allocate_resources(control_pb2.AllocateResources(job_id="j1", world_size=2, backend="gloo", init=init))
    # What submit_job does on any failure after the allocation:
    allocator.release_resources(control_pb2.ReleaseResources(job_id="j1", kill=True))
    assert sent == [("LaunchRanks", "wa"), ("LaunchRanks", "wb"), ("ReleaseRanks", "wa"), ("ReleaseRanks", "wb")]
    init.job_id = "j2"
    ready = allocator.allocate_resources(control_pb2.AllocateResources(job_id="j2", world_size=2, backend="gloo", init=init))
    assert isinstance(ready, control_pb2.ResourcesReady) and sorted(ready.worker_ids) == ["wa", "wb"]
