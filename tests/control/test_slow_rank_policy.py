"""A slow rank through the in-process control plane (real fault detector, orchestrator and
sessions; ranks stood in for by their beats): named from the compute time its beats carry,
kept in the job's status, decided by ``fault_policy.actions.slow_rank`` (issue 29 item 2)."""

from __future__ import annotations

import pytest

from services.contract import control_pb2, worker_pb2

from .conftest import drain
from .test_fault_policy import commands, decisions, running

pytestmark = pytest.mark.timeout(60)


def beats(plane, sessions: dict, job_id: str, per_step: dict[int, float], steps: int, start: int = 0) -> None:
    """Beats every 3 s (one sample each) of 2 steps each from step ``start``: rank r computes
    ``per_step[r]`` s per step (forward only), on top of what it computed before (``_SUMS``)."""
    for i in range(1, steps + 1):
        for rank, seconds in per_step.items():
            step = start + 2 * i
            total = _SUMS[job_id, rank] = _SUMS.get((job_id, rank), 0.0) + 2 * seconds
            msg = worker_pb2.RankHeartbeat(
                job_id=job_id, rank=rank, step=step, stepping=True, forward_compute_seconds=total,
                unix_time=1000.0 + 3 * step / 2,
            )  # fmt: skip
            plane.rank_event(sessions[rank], job_id, rank, heartbeat=msg)


_SUMS: dict[tuple[str, int], float] = {}  # (job, rank) -> compute seconds so far


def test_a_slow_rank_is_in_the_status_ignored_by_default_and_cleared_when_it_recovers(plane):
    job_id, w = running(plane, "wa", "wb")
    on = {0: w["wa"], 1: w["wb"]}
    beats(plane, on, job_id, {0: 0.1, 1: 0.1}, steps=10)
    assert list(plane.get(job_id).slow_ranks) == []
    beats(plane, on, job_id, {0: 0.1, 1: 0.25}, steps=8, start=20)  # rank 1 at 2.5x from step 20 on
    s = plane.get(job_id)
    assert [(r.rank, r.worker_id) for r in s.slow_ranks] == [(1, "wb")]
    assert "rank 1 computes" in s.slow_ranks[0].detail
    assert decisions(plane, job_id) == ["ignore slow_rank of rank 1 on wb: fault policy; 1 ignored so far"]
    assert s.state == control_pb2.RUNNING
    # rank 1 back at its peer's pace
    beats(plane, on, job_id, {0: 0.1, 1: 0.1}, steps=10, start=36)
    assert list(plane.get(job_id).slow_ranks) == []
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[-1].startswith("slow_rank_cleared: rank 1 is no longer slow")


def test_replace_relaunches_the_slow_rank_off_its_node_and_the_survivor_keeps_its_process(plane):
    extra = "liveness: {attribution_seconds: 0}\nfault_policy: {actions: {slow_rank: replace}}"
    job_id, w = running(plane, "wa", "wb", "wc", extra=extra)
    beats(plane, {0: w["wa"], 1: w["wb"]}, job_id, {0: 0.1, 1: 0.3}, steps=10)
    assert decisions(plane, job_id) == [
        "replace after slow_rank of rank 1 on wb (restart 1 of 3 for slow_rank); excluding wb; survivors keep "
        "training, rank 1 is replaced and heals from a live peer"
    ]
    on_a, on_b, on_c = commands(w["wa"]), commands(w["wb"]), commands(w["wc"])
    assert [k for k, _ in on_a] == ["launch", "routed"] and on_a[1][1] == "RebuildParallelGroup"  # the survivor stays
    assert not on_a[0][1].ranks and [p.worker_id for p in on_a[0][1].link_probe.peers] == ["wc"]  # (its new peer)
    assert on_b[0][0] == "release" and list(on_b[0][1].ranks) == [1] and on_b[0][1].kill
    launch = [m for k, m in on_c if k == "launch"]
    assert [r.rank for r in launch[0].ranks] == [1] and launch[0].init.heal_from_peer  # on another node
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the slow process ends: its finding with it
    assert list(plane.get(job_id).slow_ranks) == []
    for session in w.values():
        drain(session)


def test_shrink_without_a_free_slot_off_the_slow_ranks_node_goes_on_at_a_smaller_data_parallel_size(plane):
    extra = "liveness: {attribution_seconds: 0}\nfault_policy: {actions: {slow_rank: shrink}}"
    job_id, w = running(plane, "wa", "wb", "wc", dp=3, extra=extra)
    beats(plane, {0: w["wa"], 1: w["wb"], 2: w["wc"]}, job_id, {0: 0.1, 1: 0.1, 2: 0.3}, steps=10)
    said = decisions(plane, job_id)
    assert said[0].startswith("shrink after slow_rank of rank 2 on wc (restart 1 of 3 for slow_rank); excluding wc")
    assert "no free slot for a replacement of rank 2" in said[1], said  # (its own node is left out)
    s = plane.get(job_id)
    assert (s.world_size, s.dp) == (2, 2)
    on_c = commands(w["wc"])
    assert on_c[0][0] == "release" and list(on_c[0][1].ranks) == [2] and on_c[0][1].kill
    assert not any(k == "launch" and m.ranks for k, m in on_c)  # (a launch of no rank: it probes no link of the job)
