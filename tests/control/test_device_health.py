"""Issue 26 item 5 on control (the real build(), node agents driven from the test): a GPU's
memory pressure arrives at L1-2 as a resource event, a device's error is graded by L1-3 and
decided by L1-1 (an uncorrectable ECC error excludes the node: from that job's placement, and
cordoned by L1-2 for every job until its node agent registers again), and a job is admitted
only where its estimated memory per rank fits a registered slot."""

from __future__ import annotations

import textwrap

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.contract.relay import pack
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator import JobDoesNotFit
from services.jobspec import parse_job_spec
from services.memory_estimate import estimate_memory, human_bytes
from tests.control.conftest import Plane, drain, registration, settle, stop_plane
from tests.control.test_orchestrator import start_job

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
Error = engine_pb2.HardwareError.Error
GIB = 1 << 30

# About 3 B parameters: some 50 GiB a rank (fp32 weights, gradients and AdamW moments).
BIG = textwrap.dedent(
    """\
    name: big
    steps: 3
    model: {n_layers: 26, d_model: 3072, n_heads: 24, vocab_size: 32000}
    data: {dataset: x@v1, seq_len: 16, micro_batch_size: 1}
    parallel: {dp: 1}
    """
)


def hardware(plane, session, fact) -> None:
    """A fact of the node agent itself (EXT_HARDWARE), as its session carries it."""
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))


def messages(plane, job_id: str, kind: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == kind]


def test_device_memory_pressure_is_a_resource_event_of_the_jobs_on_that_worker(plane):
    job_id, a, b = start_job(plane)
    usage = engine_pb2.DeviceMemoryUsage(worker_id="wb", device=3, used_bytes=76 * GIB, total_bytes=80 * GIB)
    usage.under_pressure = True
    hardware(plane, b, usage)
    hardware(plane, b, usage)  # the same state again: nothing new
    usage.under_pressure, usage.used_bytes = False, 40 * GIB
    hardware(plane, b, usage)
    assert messages(plane, job_id, "resource") == [
        "memory pressure on wb cuda:3: 4.0 GiB of 80.0 GiB available",
        "memory pressure relieved on wb cuda:3: 40.0 GiB of 80.0 GiB available",
    ]
    assert plane.get(job_id).state == JobState.RUNNING  # recorded only


def test_an_uncorrectable_ecc_error_excludes_the_node_and_heat_is_a_warning(plane):
    job_id, a, b = start_job(plane)
    for rank, (worker, session) in enumerate((("wa", a), ("wb", b))):  # (as the agents state their ranks)
        state = control_pb2.RankProcessState(job_id=job_id, rank=rank, worker_id=worker, pid=100 + rank, state=1)
        hardware(plane, session, state)
    hot = engine_pb2.HardwareError(worker_id="wb", device=0, error=Error.THERMAL, detail="clocks throttled by heat")
    hardware(plane, b, hot)
    assert plane.get(job_id).state == JobState.RUNNING
    ecc = engine_pb2.HardwareError(worker_id="wb", device=0, error=Error.ECC_UNCORRECTABLE, count=1)
    ecc.detail = "uncorrectable ECC errors: 1 since the driver loaded"
    hardware(plane, b, ecc)
    assert messages(plane, job_id, "fault") == [
        "MINOR device_degraded: device 0 of wb: clocks throttled by heat",
        "SEVERE device_error: device 0 of wb: uncorrectable ECC errors: 1 since the driver loaded",
    ]
    decisions = messages(plane, job_id, "decision")[1:]  # (after the allocation)
    assert decisions == [
        "ignore device_degraded of rank 1 on wb: fault policy; 1 ignored so far",
        "exclude_node after device_error of rank 1 on wb (restart 1 of 3 for device_error); excluding wb",
    ]
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    (cordon,) = plane.user(control_pb2.JobQuery()).cordoned  # and no other job is placed there
    assert (cordon.worker_id, cordon.reason) == (
        "wb",
        "device_error: device 0 of wb: uncorrectable ECC errors: 1 since the driver loaded",
    )


def test_a_fatal_xid_is_a_device_error_and_another_xid_only_degraded():
    from services.control.fault_detector import device_fault_class

    assert device_fault_class(engine_pb2.HardwareError(error=Error.XID, xid=79)) == "device_error"
    assert device_fault_class(engine_pb2.HardwareError(error=Error.XID, xid=13)) == "device_degraded"
    assert device_fault_class(engine_pb2.HardwareError(error=Error.ECC_CORRECTED, count=9)) == "device_degraded"


def refusal(worker: str, host_gib: int) -> str:
    need = human_bytes(estimate_memory(parse_job_spec(BIG, "job.yaml")).total)
    return (
        f"memory per rank {need} (estimated) fits no registered slot for 1 rank: the largest is "
        f"{host_gib}.0 GiB, cpu of {worker} (host memory {host_gib}.0 GiB, 1 slot)"
    )


def test_a_job_whose_memory_per_rank_fits_no_registered_slot_is_refused_at_submit(plane):
    assert estimate_memory(parse_job_spec(BIG, "job.yaml")).total > 40 * GIB  # (what the test is about)
    a = plane.register("wa", memory=23 * GIB)
    with pytest.raises(JobDoesNotFit) as e:
        plane.user(control_pb2.SubmitJobRequest(spec_yaml=BIG, spec_path="big.yaml"))
    assert str(e.value) == "big.yaml: " + refusal("wa", 23)
    assert list(plane.user(control_pb2.JobQuery()).jobs) == [] and drain(a) == []  # nothing persisted, launched


def test_a_queued_job_that_fits_no_worker_that_registers_ends_failed_saying_why(plane):
    job_id = plane.user(control_pb2.SubmitJobRequest(spec_yaml=BIG, spec_path="big.yaml")).job_id
    assert plane.get(job_id).state == JobState.STANDBY  # no worker yet: queued
    plane.register("wa", memory=23 * GIB)
    settle(lambda: plane.get(job_id).state, JobState.TERMINATED)
    s = plane.get(job_id)
    assert (s.outcome, s.message) == (JobOutcome.FAILED, "FAILED: refused: " + refusal("wa", 23))


def test_a_rank_goes_only_to_a_slot_its_memory_fits(plane):
    small = plane.register("small", memory=23 * GIB)
    big = plane.register("gpu", cuda=1, memory=64 * GIB)  # one 80 GiB device
    job_id = plane.user(control_pb2.SubmitJobRequest(spec_yaml=BIG, spec_path="big.yaml")).job_id
    assert plane.get(job_id).state == JobState.WARMING_UP
    assert drain(small) == []
    (launch,) = drain(big)
    (rank,) = launch.launch.ranks
    assert (rank.worker_id, rank.device, rank.memory_quota_bytes) == ("gpu", "cuda:0", 80 * GIB)


def register(plane, worker: str, incarnation: str):
    """A node agent's session, as an agent process of that incarnation registers it."""
    reg = registration(worker)
    reg.incarnation = incarnation
    return plane.c.sessions.open(reg)


def ecc_error(plane, session, worker: str) -> None:
    ecc = engine_pb2.HardwareError(worker_id=worker, device=0, error=Error.ECC_UNCORRECTABLE, count=2)
    ecc.detail = "uncorrectable ECC errors: 2 since the driver loaded"
    hardware(plane, session, ecc)


def cordoned(plane) -> list[tuple[str, str, str]]:
    listed = plane.user(control_pb2.JobQuery())
    return [(c.worker_id, c.incarnation, c.reason) for c in listed.cordoned]


ECC_REASON = "device_error: device 0 of wa: uncorrectable ECC errors: 2 since the driver loaded"


def test_a_fatal_device_error_on_an_idle_worker_takes_it_out_of_placement_for_every_job(plane):
    a, b = register(plane, "wa", "a-1"), register(plane, "wb", "b-1")
    hot = engine_pb2.HardwareError(worker_id="wa", device=0, error=Error.THERMAL, detail="clocks throttled by heat")
    hardware(plane, a, hot)
    assert cordoned(plane) == []  # (a warning cordons nothing)
    ecc_error(plane, a, "wa")  # no job anywhere yet
    assert cordoned(plane) == [("wa", "a-1", ECC_REASON)]
    first = plane.submit(name="one", dp=1)
    assert first.state == JobState.WARMING_UP  # placed, and not on wa (its first choice: registered first)
    assert drain(a) == [] and [c.launch.ranks[0].worker_id for c in drain(b)] == ["wb"]
    second = plane.submit(name="two", dp=1)  # wb is full, wa cordoned: nowhere to go
    assert second.state == JobState.STANDBY and drain(a) == []
    assert "(wa cordoned: device_error: device 0 of wa" in second.message, second.message


def test_the_worker_is_placeable_again_once_its_node_agent_registers_as_a_new_incarnation(plane):
    a = register(plane, "wa", "a-1")
    ecc_error(plane, a, "wa")
    job_id = plane.submit(dp=1).job_id
    assert plane.get(job_id).state == JobState.STANDBY
    a = register(plane, "wa", "a-1")  # the same agent reconnecting: still cordoned
    assert cordoned(plane) == [("wa", "a-1", ECC_REASON)] and plane.get(job_id).state == JobState.STANDBY
    a = register(plane, "wa", "a-2")  # restarted (or the node rebooted): a fault still there is sampled anew
    assert cordoned(plane) == []
    settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
    assert [c.WhichOneof("command") for c in drain(a)] == ["launch"]


def test_a_cordon_survives_a_control_restart_until_another_incarnation_registers(tmp_path, store_with_no_versions):
    db = tmp_path / "control.db"
    first = build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    try:
        ecc_error(Plane(first), register(Plane(first), "wa", "a-1"), "wa")
    finally:
        stop_plane(first)
    plane = Plane(build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        assert cordoned(plane) == [("wa", "a-1", ECC_REASON)]  # before the agent is back
        register(plane, "wa", "a-1")  # the agent outlived control: re-attaches as it was
        job_id = plane.submit(dp=1).job_id
        assert plane.get(job_id).state == JobState.STANDBY
        a = register(plane, "wa", "a-2")
        settle(lambda: plane.get(job_id).state, JobState.WARMING_UP)
        assert [c.WhichOneof("command") for c in drain(a)] == ["launch"]
        assert cordoned(plane) == [] and plane.c.journal.load_cordons() == []
    finally:
        stop_plane(plane.c)


def test_another_jobs_relaunch_goes_around_a_cordoned_worker(plane):
    b, a = register(plane, "wb", "b-1"), register(plane, "wa", "a-1")  # wb first: where ranks go first
    ecc = engine_pb2.HardwareError(worker_id="wb", device=0, error=Error.XID, xid=79, detail="Xid 79: fell off the bus")
    hardware(plane, b, ecc)
    job_id = plane.submit(dp=1).job_id
    assert drain(b) == [] and [c.launch.ranks[0].worker_id for c in drain(a)] == ["wa"]
    plane.rank_event(a, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    drain(a)
    plane.rank_exited(a, job_id, 0, exit_code=-9)  # not a device fault: its policy relaunches the rank
    assert messages(plane, job_id, "decision")[1:] == [
        "restart_ranks after rank_exit of rank 0 on wa (restart 1 of 3 for rank_exit)"
    ]
    assert drain(b) == []
    assert [c.WhichOneof("command") for c in drain(a)] == ["release", "launch"]
