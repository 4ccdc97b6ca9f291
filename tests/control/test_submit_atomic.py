"""A submit that fails after its ranks were allocated leaves nothing behind (issue 12, part 8):
no rank (killed, slots free), no journal record, no job; the next submit is placed.

The journal's error escapes the orchestrator's handler, so (issue 13, failures are data) the
bus publishes L1-1's failure event, OrchestratorFailed, to L1-3 and the operator gets
ModuleFailed: one line naming the module, the typed cause and the error (what control's gRPC
server answers, INTERNAL), the OSError as its ``error``."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, route_pb2
from services.contract.failures import ModuleFailed
from services.control.orchestrator import JobNotFound
from services.jobspec import JobSpecError

from .conftest import drain

JobState = control_pb2.JobState
FAILED_EVENT = "surge.v1.OrchestratorFailed"
pytestmark = pytest.mark.timeout(30)


def test_a_journal_failure_after_allocation_kills_the_ranks_frees_the_slots_and_leaves_no_record(plane, monkeypatch):
    a, b = plane.register("wa"), plane.register("wb")
    journal = plane.c.journal

    def refuse(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(journal, "save_status", refuse)  # the job's first event: after the launch
    before = graded(plane)
    with pytest.raises(ModuleFailed) as failed:
        plane.submit(name="half", dp=2)
    monkeypatch.undo()
    assert str(failed.value) == (
        "L1_ORCHESTRATOR failed (FAILURE_IO) handling surge.v1.SubmitJobRequest: OSError: disk full (injected)"
    )
    assert isinstance(failed.value.error, OSError) and failed.value.module == Module.L1_ORCHESTRATOR
    # L1-3 read L1-1's failure event (a job that never came to be: nothing to grade) and did not fail on it.
    after = graded(plane)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
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
    assert plane.submit(name="whole", dp=2).state == JobState.WARMING_UP


def test_a_journal_that_refuses_the_new_job_fails_the_submit_before_anything_is_allocated(plane, monkeypatch):
    a = plane.register("wa")
    monkeypatch.setattr(plane.c.journal, "create_job", lambda *args: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(
        ModuleFailed, match="^L1_ORCHESTRATOR failed [(]FAILURE_IO[)] .*: OSError: disk full$"
    ) as failed:
        plane.submit(dp=1)
    assert failed.value.failure_cause == route_pb2.FAILURE_IO
    assert drain(a) == []
    monkeypatch.undo()
    assert plane.submit(dp=1).state == JobState.WARMING_UP


def graded(plane) -> tuple[int, int]:
    """(L1-1's failure events delivered to L1-3, L1-3's own failure events) so far."""
    sent = plane.c.bus.traffic.snapshot().sent
    return (
        sent.get((Module.L1_ORCHESTRATOR, FAILED_EVENT, Module.L1_FAULT_DETECTOR), 0),
        sent.get((Module.L1_FAULT_DETECTOR, "surge.v1.FaultDetectorFailed", Module.L1_FAULT_DETECTOR), 0),
    )


def test_a_control_killed_between_the_launch_and_the_first_event_finds_the_job_and_a_stop_releases_its_ranks(tmp_path):
    # What the journal holds when control died right after launching the ranks: the job in
    # STANDBY (journaled before the launch), no event.
    from services.control.__main__ import build
    from services.control.job_store import JobStore
    from services.jobspec import parse_job_spec, spec_to_json

    from .conftest import Plane, spec_yaml

    db = tmp_path / "control.db"
    journal = JobStore(db)
    journal.create_job(
        control_pb2.JobStatus(job_id="orphan-1", name="orphan", state=JobState.STANDBY, world_size=1),
        spec_to_json(parse_job_spec(spec_yaml(name="orphan", dp=1))),
    )
    journal.close()
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    assert plane.get("orphan-1").state == JobState.FAULT_FROZEN  # visible, not ranks of an unknown job
    a = plane.register("wa")  # its node agent re-attaches (the rank still runs there)
    s = plane.user(control_pb2.StopJobRequest(job_id="orphan-1"))
    assert (s.state, s.outcome) == (JobState.TERMINATED, control_pb2.STOPPED)
    assert [(c.release.job_id, c.release.kill) for c in drain(a)] == [("orphan-1", True)]
    journal.close()


def test_a_spec_value_that_fits_no_proto_field_is_refused_before_anything_is_allocated(plane):
    a = plane.register("wa")
    with pytest.raises(JobSpecError, match=r"^job.yaml: steps: 100000000000000000000000 does not fit a 64-bit integer"):
        plane.submit(dp=1, steps=10**23)
    assert drain(a) == []
    assert plane.submit(dp=1).state == JobState.WARMING_UP


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
        allocator.allocate_resources(
            control_pb2.AllocateResources(job_id="j1", world_size=2, backend="gloo", init=init)
        )
    # What submit_job does on any failure after the allocation:
    allocator.release_resources(control_pb2.ReleaseResources(job_id="j1", kill=True))
    assert sent == [("LaunchRanks", "wa"), ("LaunchRanks", "wb"), ("ReleaseRanks", "wa"), ("ReleaseRanks", "wb")]
    init.job_id = "j2"
    ready = allocator.allocate_resources(
        control_pb2.AllocateResources(job_id="j2", world_size=2, backend="gloo", init=init)
    )
    assert isinstance(ready, control_pb2.ResourcesReady) and sorted(ready.worker_ids) == ["wa", "wb"]
