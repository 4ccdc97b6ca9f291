"""`surgectl profile` at L1-1 (issue 31 item 3): a running job's profile is a numbered boundary
command to every rank; each rank's ProfileRecorded lands in the job's status (journaled) and
events, a failed one as a line, never a fault; a bad step count or a job not running is
refused in one line and nothing is sent."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.control.orchestrator.profiles import PROFILE_MAX_STEPS, PROFILES_KEPT
from services.control.orchestrator.refusals import BadProfileRequest, IllegalTransition

from .conftest import Plane, drain, to_ranks
from .test_fault_policy import QUICK, running

pytestmark = pytest.mark.timeout(30)
JobState = control_pb2.JobState


def profile(plane, job_id: str, steps: int) -> control_pb2.JobStatus:
    return plane.user(control_pb2.ProfileJobRequest(job_id=job_id, steps=steps))


def recorded(plane, session, job_id: str, rank: int, seq: int, **kw) -> None:
    msg = engine_pb2.ProfileRecorded(job_id=job_id, rank=rank, seq=seq, first_step=6, last_step=7, **kw)
    plane.rank_event(session, job_id, rank, profile=msg)


def test_a_profile_goes_to_every_rank_numbered_and_their_reports_are_kept_across_a_restart(plane, tmp_path):
    job_id, w = running(plane, "wa", "wb", dp=2)
    s = profile(plane, job_id, 2)
    (asked,) = s.profiles
    assert (asked.steps, asked.ranks, len(asked.recorded)) == (2, 2, 0) and asked.seq >= 1
    for session in w.values():
        (cmd,) = [to_ranks(c) for c in drain(session)]
        assert cmd == engine_pb2.ProfileSteps(job_id=job_id, steps=2, seq=asked.seq)

    files = [f"metrics/{job_id}/profiles/cmd{asked.seq}/rank0.trace.json.gz"]
    recorded(plane, w["wa"], job_id, 0, asked.seq, files=files, bytes=2_500_000, seconds=0.42)
    recorded(plane, w["wb"], job_id, 1, asked.seq, error="OSError: [Errno 28] No space left on device")
    recorded(plane, w["wb"], job_id, 1, asked.seq, error="again")  # (a second report of a rank: dropped)
    recorded(plane, w["wb"], job_id, 1, asked.seq + 5)  # (a profile the status does not name: dropped)
    s = plane.get(job_id)
    assert s.state == JobState.RUNNING  # (a failed profile is no fault)
    (info,) = s.profiles
    assert [(r.rank, list(r.files), r.error) for r in info.recorded] == [
        (0, files, ""),
        (1, [], "OSError: [Errno 28] No space left on device"),
    ]
    said = [e.message for e in plane.events(job_id) if e.type == "profile"]
    assert said == [
        f"profile #{asked.seq}: the next 2 steps of every rank, from the step boundary every rank agrees on "
        f"(command #{asked.seq} to the ranks)",
        f"rank 0: profile #{asked.seq} of steps 6-7 stored, 2.5 MB (0.42 s profiled): {files[0]}",
        f"rank 1: profile #{asked.seq} not recorded: OSError: [Errno 28] No space left on device",
    ]
    journal = JobStore(tmp_path / "control.db")
    try:
        again = Plane(build(journal, data_address="127.0.0.1:7001", store_address="127.0.0.1:7002"))
        assert list(again.get(job_id).profiles) == list(s.profiles)
    finally:
        journal.close()


def test_the_status_keeps_the_newest_profiles_and_numbers_follow_the_other_boundary_commands(plane):
    job_id, w = running(plane, "wa", "wb", dp=2)
    seqs = [profile(plane, job_id, 1).profiles[-1].seq for _ in range(PROFILES_KEPT + 2)]
    assert seqs == list(range(seqs[0], seqs[0] + PROFILES_KEPT + 2))  # (no gap: ranks agree on them in order)
    assert [p.seq for p in plane.get(job_id).profiles] == seqs[2:]
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    pause = [to_ranks(c) for c in drain(w["wa"])][-1]
    assert isinstance(pause, engine_pb2.PauseTraining) and pause.seq == seqs[-1] + 1


@pytest.mark.parametrize("steps", [0, PROFILE_MAX_STEPS + 1, 2**32 - 1])
def test_a_step_count_out_of_range_is_refused_naming_it(plane, steps):
    job_id, w = running(plane, "wa", "wb", dp=2)
    with pytest.raises(BadProfileRequest, match=rf"steps: {steps} is not in 1\.\.{PROFILE_MAX_STEPS}"):
        profile(plane, job_id, steps)
    assert not drain(w["wa"]) and not plane.get(job_id).profiles


def test_a_job_not_running_is_refused(plane):
    plane.register("wa")
    job_id = plane.submit(dp=1, steps=5).job_id  # (WARMING_UP: its ranks have not started)
    with pytest.raises(IllegalTransition, match="only a running job's steps can be profiled"):
        profile(plane, job_id, 1)
    assert not plane.get(job_id).profiles


def lost_lines(plane, job_id: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == "profile" and " lost: " in e.message]


def test_a_profile_whose_ranks_are_relaunched_is_lost_and_stays_so_across_a_restart(plane, tmp_path):
    """Rank 0 killed while a profile is outstanding: the recovery relaunches the ranks, which
    never report it (the old code: `recorded: []` forever, the CLI waiting until its timeout)."""
    job_id, w = running(plane, "wa", "wb", dp=2)
    done = profile(plane, job_id, 1).profiles[-1].seq
    recorded(plane, w["wa"], job_id, 0, done)
    recorded(plane, w["wb"], job_id, 1, done)  # (complete: never lost)
    seq = profile(plane, job_id, 3).profiles[-1].seq
    recorded(plane, w["wb"], job_id, 1, seq)  # one rank of two reported
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    assert "launch" in [c.WhichOneof("command") for c in drain(w["wa"])]  # (relaunched)
    info = {p.seq: p for p in plane.get(job_id).profiles}
    assert (info[done].lost, info[seq].lost) == ("", "ranks relaunched (rank_exit of rank 0)")
    assert lost_lines(plane, job_id) == [f"profile #{seq} lost: ranks relaunched (rank_exit of rank 0)"]
    journal = JobStore(tmp_path / "control.db")
    try:
        again = Plane(build(journal, data_address="127.0.0.1:7001", store_address="127.0.0.1:7002"))
        assert [p.lost for p in again.get(job_id).profiles] == ["", "ranks relaunched (rank_exit of rank 0)"]
    finally:
        journal.close()


def test_a_profile_outstanding_when_its_job_ends_is_lost_with_the_jobs_outcome(plane):
    job_id, w = running(plane, "wa", "wb", dp=2, extra=QUICK + "\nfault_policy: {restarts: {rank_exit: 0}}")
    seq = profile(plane, job_id, 2).profiles[-1].seq
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, control_pb2.FAILED)
    assert s.profiles[-1].lost == "job FAILED"
    assert lost_lines(plane, job_id) == [f"profile #{seq} lost: job FAILED"]
