"""Issue 29 item 8 (footprint) on control (the real build(), node agents driven from the test):
a rank that logs too fast and a memory copy skipped for want of space are typed events that
L1-3 grades MINOR and L1-1 records; the job trains on."""

from __future__ import annotations

from services.contract import Module, control_pb2, route_pb2, store_pb2
from services.contract.relay import pack
from tests.control.test_orchestrator import start_job

JobState = control_pb2.JobState
MIB = 1 << 20


def messages(plane, job_id: str, kind: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == kind]


def test_a_rank_that_logs_too_fast_is_one_warning_naming_it_and_the_job_trains_on(plane):
    job_id, _, b = start_job(plane)
    flood = control_pb2.RankLogFlood(
        job_id=job_id, rank=1, worker_id="wb", pid=4242, bytes_per_second=12.5 * MIB,
        threshold_bytes_per_second=1 * MIB, window_seconds=10, max_file_bytes=64 * MIB, backups=3,
    )  # fmt: skip
    plane.c.sessions.on_worker_event(b, control_pb2.WorkerEvent(routed=pack(flood, Module.EXT_HARDWARE)))
    assert messages(plane, job_id, "fault") == [
        "MINOR rank_log_flood: rank 1 on wb logs 12.5 MiB/s over 10 s (warning above 1.0 MiB/s); "
        "its log is rotated at 64 MiB with 3 older files kept"
    ]
    assert messages(plane, job_id, "decision")[1:] == [
        "ignore rank_log_flood of rank 1 on wb: fault policy; 1 ignored so far"
    ]
    assert plane.get(job_id).state == JobState.RUNNING


def test_a_memory_copy_skipped_for_want_of_space_is_recorded_and_the_job_trains_on(plane):
    job_id, a, _ = start_job(plane)
    skipped = store_pb2.MemoryCopySkipped(
        job_id=job_id, rank=0, step=20, write_error=route_pb2.WRITE_NO_SPACE, needed_bytes=96 * MIB,
        free_bytes=40 * MIB, path="/dev/shm/surge-memory-wa-1/incoming/j.0",
    )  # fmt: skip
    plane.rank_event(a, job_id, 0, skipped=skipped)
    assert messages(plane, job_id, "fault") == [
        "MINOR memory_copy_skipped: rank 0: memory copy of step 20 skipped (WRITE_NO_SPACE): needs 96.0 MiB, "
        "40.0 MiB free in /dev/shm/surge-memory-wa-1/incoming/j.0; the next save tries again"
    ]
    assert plane.get(job_id).state == JobState.RUNNING
