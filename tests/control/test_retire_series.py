"""L1-1 retires a job's metric series on the store (issue 31 item 6): its end (FINISHED, FAILED,
STOPPED) and a relaunch of its ranks send RetireMetricSeries to L5-2 through control's store
relay, after the decision's journal write; its end (only) RetireCheckpointSeries to L5-1. Why:
a rank killed without its loop's end (SIGKILL, a lost node) never sends StopLogCollection, and
its series stayed on the store's /metrics (L5-1's of every job, ended or not).
In-process, through the real bus and relays; the test stands in for the node agents and the
store (tests/observability/test_cluster_gauges.py has the real stack)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.store_relay import StoreRelay

from .conftest import drain
from .test_fault_policy import QUICK, plane, restarted, running, store  # noqa: F401 (fixtures)

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def retired(monkeypatch) -> list[tuple[str, str, bool]]:
    """(job, reason, ended) of each RetireMetricSeries control's store relay got (patched
    before the plane is built)."""
    got: list[tuple[str, str, bool]] = []
    monkeypatch.setattr(
        StoreRelay,
        "retire_metric_series",
        lambda self, msg, payload=None: got.append((msg.job_id, msg.reason, msg.ended)),
    )
    return got


@pytest.fixture
def retired_checkpoints(monkeypatch) -> list[tuple[str, str]]:
    """(job, reason) of each RetireCheckpointSeries (L1-1 -> L5-1) control's store relay got."""
    got: list[tuple[str, str]] = []
    monkeypatch.setattr(
        StoreRelay,
        "retire_checkpoint_series",
        lambda self, msg, payload=None: got.append((msg.job_id, msg.reason)),
    )
    return got


def test_a_killed_rank_s_relaunch_and_the_failed_end_retire_the_job_s_series(
    retired,
    retired_checkpoints,
    plane,  # noqa: F811
):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {restarts: {rank_exit: 1}}")
    assert retired == []  # a running job's series are its own
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # SIGKILL: no StopLogCollection from it
    assert retired == [(job_id, "relaunch", False)]
    assert retired_checkpoints == []  # a relaunch resumes from the job's checkpoints: L5-1's stay
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=0)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the budget is spent: FAILED
    assert plane.get(job_id).outcome == JobOutcome.FAILED
    assert retired == [(job_id, "relaunch", False), (job_id, "FAILED", True)]
    assert retired_checkpoints == [(job_id, "FAILED")]  # the job's end: L5-1's go too


def test_a_finished_and_a_stopped_job_retire_their_series(retired, retired_checkpoints, plane):  # noqa: F811
    job_id, w = running(plane, "wa", "wb")
    for rank, worker in ((0, "wa"), (1, "wb")):
        plane.rank_event(w[worker], job_id, rank, finished=engine_pb2.TrainingLoopFinished(rank=rank, step=20))
    assert plane.get(job_id).outcome == JobOutcome.FINISHED
    assert retired == [(job_id, "FINISHED", True)]
    assert retired_checkpoints == [(job_id, "FINISHED")]

    for s in w.values():
        drain(s)
    other = plane.submit(dp=1, steps=20, extra=QUICK).job_id
    plane.user(control_pb2.StopJobRequest(job_id=other))
    plane.rank_exited(w["wa"], other, 0, exit_code=-9)  # its rank went before its stop's boundary
    s = plane.get(other)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert retired[1:] == [(other, "STOPPED", True)]
    assert retired_checkpoints[1:] == [(other, "STOPPED")]


def test_a_preempted_job_s_series_are_retired_as_it_waits_in_the_queue(monkeypatch, tmp_path, store_with_no_versions):
    """Session 35: a preempted job waited STANDBY for 14 minutes while the store still exported
    its tokens/s and step (Prometheus saw a queued job as training). Leaving RUNNING for the
    queue retires its series like an end (``queued``: whatever comes meanwhile), not its
    checkpoints' (it continues from them); it comes back by recording when it runs again."""
    from .test_preemption import low_running, make_plane, preempt_to_the_boundary, stop_plane

    got: list[tuple[str, str, bool, bool]] = []
    monkeypatch.setattr(
        StoreRelay,
        "retire_metric_series",
        lambda self, msg, payload=None: got.append((msg.job_id, msg.reason, msg.ended, msg.queued)),
    )
    checkpoints: list[str] = []
    monkeypatch.setattr(
        StoreRelay, "retire_checkpoint_series", lambda self, msg, payload=None: checkpoints.append(msg.job_id)
    )
    p = make_plane(tmp_path / "control.db")
    try:
        low, a, b = low_running(p)
        assert got == []
        preempt_to_the_boundary(p, low, a, b)
        assert p.get(low).state == JobState.STANDBY
        assert got == [(low, "queued", False, True)]
        assert checkpoints == []  # (its versions are what it continues from)
    finally:
        stop_plane(p.c)
