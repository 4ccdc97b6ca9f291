"""Issue 26 item 5 on control (the real build(), node agents driven from the test): a GPU's
memory pressure arrives at L1-2 as a resource event, a device's error is graded by L1-3 and
decided by L1-1 (an uncorrectable ECC error excludes the node), and a job is admitted only
where its estimated memory per rank fits a registered slot."""

from __future__ import annotations

import textwrap

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.contract.relay import pack
from services.control.orchestrator import JobDoesNotFit
from services.jobspec import parse_job_spec
from services.memory_estimate import estimate_memory, human_bytes
from tests.control.conftest import drain, settle
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
