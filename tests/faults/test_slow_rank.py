"""A slow rank on the real stack (issue 29 item 2): two gloo ranks on two node agents; from
step ``SLOW_FROM`` on, rank 1's forward, backward and update take twice their time
(``SURGE_FAULT_INJECT`` ``slow_compute``: it sleeps inside its compute phases, so its
compute time really grows). Before that step, a normal run (a checkpoint every 50 steps): no
rank is named slow (false positives: 0). After it, rank 1 (and only it) is named
``slow_rank`` within 60 s, the default policy ignores it (reported: the job's events,
``surgectl status``, control's /metrics) and the job trains on, at the slow rank's pace,
until the test stops it (its step time depends on the host's load, 5x apart on the shared CI
host: a fixed step count would make the slow phase anything from 8 s to a minute).

A longer normal run: ``SURGE_SLOW_FROM=1500`` (1499 steps before the slowdown).

The stack is the one its group shares (tests/shared_stacks.py: two workers).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from services.contract import control_pb2
from tests.faults.test_recovery import cli, of_type

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SLOW_FROM = int(os.environ.get("SURGE_SLOW_FROM", "100"))
INJECT = f"tslowrank:slow_compute@{SLOW_FROM}:rank=1:factor=2"
JOB = """\
name: tslowrank
steps: 100000
seed: 0
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 64, micro_batch_size: 4}
parallel: {dp: 2}
optimizer: {lr: 3.0e-3, warmup_steps: 4}
checkpoint: {every_steps: 50, keep_last: 1, at_end: false}
eval: {every_steps: 0, at_end: false}
liveness: {heartbeat_interval_seconds: 0.5}
"""


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def slow_rank_findings(metrics: str) -> float:
    found = re.search(r"^surge_slow_rank_findings_total ([\d.e+]+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_rank_slowed_2x_is_named_ignored_by_default_and_the_job_trains_on(stack):
    findings = slow_rank_findings(stack.metrics())  # (the stack is shared: earlier modules' count)
    job = stack.submit(JOB)
    events, named_at, stopped = [], None, False
    for ev in stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=480):
        events.append(ev)
        if named_at is None and ev.type == "fault" and ev.message.startswith("MINOR slow_rank:"):
            named_at = time.monotonic()
            shown = cli(stack.home, "status", job)  # while it runs
            metrics = stack.metrics()
        if named_at is not None and not stopped and time.monotonic() - named_at > 5:  # (it trained on)
            stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job, no_checkpoint=True))
            stopped = True
    faults = of_type(events, "fault")
    print("\n".join(faults + of_type(events, "decision")))
    status = events[-1].status
    assert (status.state, status.outcome) == (control_pb2.TERMINATED, control_pb2.STOPPED), events[-1].message
    slow = [e for e in events if e.type == "fault" and e.message.startswith("MINOR slow_rank:")]
    assert len(slow) == 1, faults
    assert re.match(r"MINOR slow_rank: rank 1 computes [\d.]+x the median of its 1 peer rank\(s\)", slow[0].message)
    assert [r.rank for r in slow[0].status.slow_ranks] == [1]  # in the job's status from then on
    assert any(m.startswith("ignore slow_rank of rank 1 ") for m in of_type(events, "decision"))
    assert status.step > slow[0].status.step  # it trained on after the finding

    # Detection: from the end of the last step at full speed (rank 0's record) to the report.
    records = {r["step"]: r for r in stack.step_records(job) if r["rank"] == 0}
    began = records[SLOW_FROM - 1]["unix_time"]
    detection_s = slow[0].unix_time - began
    # (<= 0: named before it was slowed, a false positive.) The 60 s goal is a speed target,
    # measured on a quiet machine by bench/quiet_faults.py --slow-only; here, beside another
    # test on 2 loaded cores, only a bound that tells "found by this detector" from "never".
    assert 0 < detection_s < 240, detection_s
    last = max(records)
    step_s = (records[SLOW_FROM - 1]["unix_time"] - records[11]["unix_time"]) / (SLOW_FROM - 12)
    slow_step_s = (records[last]["unix_time"] - records[SLOW_FROM + 10]["unix_time"]) / (last - SLOW_FROM - 10)
    print(
        f"slow rank named {detection_s:.1f} s after it was slowed (steps {step_s:.3f} s -> {slow_step_s:.3f} s); "
        f"no finding in the {SLOW_FROM - 1} steps before"
    )

    assert shown.returncode == 0, shown.stderr
    assert "slow ranks" in shown.stdout and "rank 1 computes" in shown.stdout, shown.stdout
    assert slow_rank_findings(metrics) > findings, metrics
    ratio = re.search(rf'^surge_rank_slowdown_ratio{{job="{job}",rank="1"}} ([\d.]+)', metrics, re.M)
    assert ratio and float(ratio.group(1)) >= 1.5, metrics
