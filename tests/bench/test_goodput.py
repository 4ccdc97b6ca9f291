"""The pure parts of `make bench-goodput` (bench/goodput.py): the fault schedule, the final
lineage of a step log with rollbacks, ETTR, steps lost per fault and time to the first new
step. Synthetic step logs only; nothing is started and no time is measured."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO))

from bench import goodput  # noqa: E402


def _steps(steps, t0: float, dt: float = 1.0, step_s: float = 0.8, **extra) -> list[dict]:
    """Records of ``steps`` completing every ``dt`` seconds from ``t0`` + ``dt``."""
    return [{"step": s, "unix_time": t0 + (i + 1) * dt, "step_seconds": step_s, **extra} for i, s in enumerate(steps)]


def test_schedule_rotates_and_leaves_an_interval_to_recover():
    assert goodput.schedule(600, 120, ["kill", "node", "stop"]) == [
        (120, "kill"),
        (240, "node"),
        (360, "stop"),
        (480, "kill"),
    ]
    assert [k for _, k in goodput.schedule(240, 55, ["kill", "node", "stop"])] == ["kill", "node", "stop"]
    assert goodput.schedule(100, 120, ["kill"]) == []


def test_lineage_keeps_the_last_completion_of_a_replayed_step():
    # Steps 1-10, then a rollback to the checkpoint at 5: steps 6-12 again.
    recs = _steps(range(1, 11), 0) + _steps(range(6, 13), 20)
    final = goodput.lineage(recs)
    assert [r["step"] for r in final] == list(range(1, 13))
    assert [r["unix_time"] for r in final if r["step"] >= 6] == [21.0 + i for i in range(7)]  # the redone ones


def test_lineage_drops_steps_lost_at_the_end_of_the_run():
    # Rolled back to 5 and the window ended at step 7: steps 8-10 of the old run are lost.
    recs = _steps(range(1, 11), 0) + _steps([6, 7], 20)
    assert [r["step"] for r in goodput.lineage(recs)] == [1, 2, 3, 4, 5, 6, 7]


def test_analyze_a_checkpoint_restart_and_an_in_place_rebuild():
    # 0-10 s: steps 1-10. Fault at 10.5 s, recovery begins at 12 s (detection / restart),
    # the run resumes from the checkpoint at step 5: steps 6-20 at 16..30 s. A second fault
    # at 40.5 s between steps, resumed in place at step 21 (nothing replayed). Window 0-60 s.
    recs = _steps(range(1, 11), 0) + _steps(range(6, 21), 15) + _steps(range(21, 31), 40.6)
    faults = [
        {"kind": "kill", "t_fault": 10.5, "t_split": 12.0},
        {"kind": "stop", "t_fault": 40.5, "t_split": 41.0},
    ]
    r = goodput.analyze(recs, faults, 0.0, 60.0)
    assert r["final_step"] == 30
    assert r["productive_steps"] == 30  # steps 6-10 count once
    assert r["steps_completed"] == 35
    assert r["steps_redone_or_lost"] == 5
    assert r["ettr"] == pytest.approx(30 * 0.8 / 60)
    f1, f2 = r["faults"]
    assert (f1["step_at_fault"], f1["first_new_step"], f1["steps_lost"]) == (10, 6, 5)
    assert f1["first_new_step_s"] == pytest.approx(16.0 - 10.5)
    assert (f2["step_at_fault"], f2["first_new_step"], f2["steps_lost"]) == (20, 21, 0)
    assert f2["first_new_step_s"] == pytest.approx(41.6 - 40.5)
    assert r["faults_recovered"] == 2
    assert r["steps_lost"]["values"] == [5.0, 0.0]
    # Before the first fault: 9 step times of 0.8 s over the 9 s from step 1 to step 10.
    assert r["steady_step_share_before_faults"] == pytest.approx(0.8)


def test_a_fault_during_a_rollback_counts_only_the_current_runs_steps():
    # Fault 1 at step 10 rolls back to 5; fault 2 hits at step 8 (before step 10 was redone)
    # and rolls back to 5 again: 3 steps lost by fault 2, not 5.
    recs = _steps(range(1, 11), 0) + _steps([6, 7, 8], 15) + _steps(range(6, 10), 30)
    faults = [{"kind": "kill", "t_fault": 10.5, "t_split": 12.0}, {"kind": "kill", "t_fault": 18.5, "t_split": 20.0}]
    f1, f2 = goodput.analyze(recs, faults, 0.0, 40.0)["faults"]
    assert f1["steps_lost"] == 5
    assert (f2["step_at_fault"], f2["steps_lost"]) == (8, 3)


def test_unrecovered_and_undetected_faults_and_the_window():
    recs = _steps(range(1, 11), 0) + _steps([11, 12], 100)  # steps 11-12 after the window
    faults = [{"kind": "stop", "t_fault": 10.5, "t_split": None}]
    r = goodput.analyze(recs, faults, 0.0, 50.0)
    (f,) = r["faults"]
    assert not f["recovered"] and f["first_new_step_s"] is None and f["steps_lost"] is None
    assert f["not_recovered_within_s"] == pytest.approx(39.5)
    assert r["final_step"] == 10
    assert r["faults_recovered"] == 0 and r["steps_lost"]["n"] == 0


def test_skipped_steps_are_not_productive():
    recs = _steps(range(1, 5), 0) + _steps([5], 4, skipped=True)
    assert goodput.analyze(recs, [], 0.0, 10.0)["productive_step_s"] == pytest.approx(4 * 0.8)


def test_survivors_kept_and_the_report():
    assert goodput.survivors_kept({0: 10, 1: 11}, {0: 10, 1: 99}, {1}) is True
    assert goodput.survivors_kept({0: 10, 1: 11}, {0: 12, 1: 99}, {1}) is False
    assert goodput.survivors_kept({1: 11}, {1: 99}, {1}) is None
    recs = _steps(range(1, 11), 0) + _steps(range(6, 21), 15)
    fault = {"kind": "kill", "at_s": 10, "t_fault": 10.5, "t_split": 12.0, "detect_s": 1.5, "lost_ranks": [1]}
    fault.update(pids_before={0: 10, 1: 11}, pids_after={0: 12, 1: 13})  # a relaunch: rank 0 is new
    r = goodput.analyze(recs, [fault], 0.0, 40.0)
    assert r["faults"][0]["survivors_kept_pids"] is False and r["faults_with_survivors"] == 1
    unrecovered = goodput.analyze(recs[:10], [dict(fault, pids_after={0: 10, 1: 11})], 0.0, 40.0)
    assert unrecovered["faults"][0]["survivors_kept_pids"] is None  # not compared before a recovery
    config = {
        "minutes": 1,
        "interval_s": 10,
        "faults": ["kill"],
        "ckpt_every": 5,
        "heartbeat_timeout_s": 10,
        "collective_timeout_s": 30,
        "max_restarts": 3,
    }
    text = goodput.report({"config": config, "systems": {"torchrun": r}})
    assert "| torchrun | 40.0 % |" in text
    assert "| torchrun | 10 | kill | 1.5 | - | 5.5 | 5 | changed |" in text
