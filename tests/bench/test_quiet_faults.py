"""The parsing of `make bench-quiet-faults` (bench/quiet_faults.py): which event is a finding,
whom and what it names, whether an exit's cause matches what was done, a run's steady step
time. Synthetic events and step records only; nothing is started and no time is measured."""

from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO))

from bench import quiet_faults as q  # noqa: E402


def _ev(message: str, kind: str = "fault", t: float = 0.0) -> dict:
    return {"type": kind, "message": message, "unix_time": t}


SLOW = (
    "MINOR slow_rank: rank 1 computes 1.95x the median of its 1 peer rank(s) per step at step 337 "
    "(0.094 s per step over its last 8 intervals)"
)
DIVERGED = (
    "SEVERE replica_divergence: replicas differ after step 30 in tok_emb.weight: dp ranks 0, 1 differ "
    "and no majority; last agreeing check: step 20"
)


def test_findings_are_counted_by_kind_and_consequences_are_not_new_mismatches():
    events = [
        _ev("RUNNING", "state"),
        _ev(SLOW),
        _ev(DIVERGED),
        _ev("SEVERE replica_divergence: ... (consequence of replica_divergence of rank 0)"),
        _ev("slow_rank: rank 1 ...", "decision"),  # (a decision, not a finding)
    ]
    assert q.count_findings(events) == {"faults": 3, "slow_rank": 1, "replica_divergence": 1}
    assert q.count_findings([_ev("RUNNING", "state")]) == {"faults": 0, "slow_rank": 0, "replica_divergence": 0}


def test_the_first_cause_skips_consequences_and_other_types():
    events = [
        _ev("x rank_silent (consequence of rank_exit)", t=1),
        _ev("SEVERE rank_silent: rank 1 on worker worker-2", "decision", t=2),
        _ev("SEVERE rank_silent: rank 1 on worker worker-2 ...", t=3),
    ]
    assert q.first_cause(events, "rank_silent")["unix_time"] == 3
    assert q.first_cause(events, "slow_rank:") is None


def test_what_a_finding_names():
    assert q.named_slow_rank(SLOW) == 1
    assert q.named_slow_rank("MINOR slow_rank_cleared: ...") is None
    assert q.divergence_step_and_tensor(DIVERGED) == (30, "tok_emb.weight")
    assert q.divergence_step_and_tensor("replicas agree") == (None, None)


def test_an_exit_cause_is_right_only_for_a_rank_exit_naming_what_was_done():
    kill = "SEVERE rank_exit: rank 1 on worker worker-0 ended (signal 9): killed by SIGKILL (sender unknown)"
    assert q.exit_cause_right("SIGKILL", kill)
    assert not q.exit_cause_right("SIGTERM", kill)
    assert q.exit_cause_right("MemoryError", "SEVERE rank_exit: rank 1 ...: MemoryError (exit code 7)")
    assert not q.exit_cause_right("SIGKILL", "SEVERE rank_silent: rank 1 killed by SIGKILL")


def test_steady_step_time_is_rank_0s_from_the_warm_step_with_a_replayed_step_counted_once():
    recs = [{"rank": 0, "step": s, "unix_time": 100.0 + s * 0.5} for s in range(1, 41)]
    recs += [{"rank": 1, "step": s, "unix_time": 500.0 + s} for s in range(1, 41)]  # (rank 1: not read)
    recs.append({"rank": 0, "step": 40, "unix_time": 100.0 + 40 * 0.5})  # (a replay of the last step)
    assert q.steady_step_s(recs, warm=20) == 0.5
    assert q.steady_step_s(recs[:20], warm=20) is None


def test_first_times_keep_a_replayed_steps_first_completion():
    recs = [{"rank": 0, "step": 25, "unix_time": 10.0}, {"rank": 0, "step": 25, "unix_time": 30.0}]
    recs.append({"rank": 1, "step": 25, "unix_time": 5.0})
    assert q.first_times(recs) == {25: 10.0}
    assert q.first_times(recs, rank=1) == {25: 5.0}


def test_check_overhead_is_the_gap_after_each_check_step_beyond_the_others():
    # Steps of 0.1 s; the boundary after every 10th step takes 0.02 s more (the check).
    t, recs = 0.0, []
    for s in range(1, 101):
        t += 0.1 + (0.02 if (s - 1) % 10 == 0 and s > 1 else 0.0)
        recs.append({"rank": 0, "step": s, "unix_time": t})
    got = q.check_overhead(recs, every=10, warm=20)
    assert got["n"] == 8 and abs(got["excess_s"] - 0.02) < 1e-9
    assert abs(got["cost_pct"] - 2.0) < 1e-6  # 0.02 s per 10 steps of 0.1 s
    assert q.check_overhead(recs[:21], every=10, warm=20) is None
