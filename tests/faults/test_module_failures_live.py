"""Failures are data across processes (issue 13 part 3, acceptance), on the real stack:
control, the store, the data service, two node agents and real rank processes.

A failure is injected (``SURGE_FAULT_INJECT_HANDLER``, the bus's handler injection, set for
the whole stack) in a handler of a module in each process that hosts modules away from
control: a rank's forward unit (L3-3), the data service's shuffler (L4-3) and the store's
metrics logger (L5-2). Each becomes that module's typed failure event in its own process,
crosses to control by its name (a rank's session; the data stream's and the store call's
trailing metadata, then the rank's session), is graded by L1-3 by (event, cause) and decided
by L1-1 per the job's default policy; the job's events say the decision and its end shows it
taken. The in-process version for all 20 modules: tests/control/test_module_failures.py.

Which job meets which fault: the data service fails its first ShufflePlan (``times=1``, in
that process), so the data job runs first and alone; the store's rule fires only in the store
(``in=services.store``: the rank's store relay is L5-2 on its own bus too) on the first
EvalCompleted, which only the store job sends (early: a report for a job already ended is
dropped); the forward unit fails at the 41st forward of a rank process, which only the longest
job reaches (the store job's 20 steps and 10 evaluations make 30).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from tests.faults.test_recovery import finished, metric, of_type, running_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
RULES = ";".join(
    (
        "handler:L4_SHUFFLER:ShufflePlan:times=1:cause=FAILURE_IO",
        "handler:L5_METRICS_LOGGER:EvalCompleted:in=services.store",
        "handler:L3_FORWARD_UNIT:RunForward:after=40:cause=FAILURE_OUT_OF_MEMORY",
    )
)
JOBS = ("mfdata", "mfstore", "mfrank")

JOB = """\
name: {name}
steps: {steps}
seed: 0
model: {{n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}}
data: {{dataset: tiny@v1, seq_len: 32, micro_batch_size: 2}}
parallel: {{dp: 1}}
optimizer: {{lr: 3.0e-3, warmup_steps: 2}}
checkpoint: {{every_steps: 0, at_end: false}}
eval: {{every_steps: {eval_every}, at_end: false, batches: 1}}
"""


def job(name: str, steps: int, *, eval_every: int = 0) -> str:
    return JOB.format(name=name, steps=steps, eval_every=eval_every)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(
        tmp_path_factory.mktemp("surge-module-failures"), ("json",), JOBS, env={"SURGE_FAULT_INJECT_HANDLER": RULES}
    ) as s:
        yield s


def failures(stack) -> dict[tuple[str, str, str], float]:
    """L1-1's count of graded module failure events: (event, cause, class) -> reports."""
    text = stack.metrics()
    out = {}
    for line in text.splitlines():
        m = re.match(r"surge_module_failures_total\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels["event"], labels["cause"], labels["class"]] = float(m.group(2))
    return out


def heard_by_loop(home: Path, job_id: str, event: str) -> bool:
    """The rank's loop logged the failure event routed to it (TrainingLoop.on_failure)."""
    for log in home.rglob(f"{job_id}.rank*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "failure_event_heard" in line and event in line:
                return True
    return False


def test_a_failure_in_a_rank_a_data_and_a_store_module_reaches_l1_3_typed_and_l1_1_decides(stack):
    t0 = time.monotonic()
    # Data (L4-3, in the data service): its first ShufflePlan fails with an I/O error. The
    # stream ends with ShuffleFailed in its trailers; the rank puts it on its bus as L4-3:
    # up to L1-3 (data_io_error, SEVERE), and to the loop, which only hears it and waits.
    # L1-1: restart_ranks; the relaunched rank's stream is served, and the job finishes.
    data = stack.submit(job("mfdata", 3))
    events = stack.events(data)
    (fault,) = [m for m in of_type(events, "fault") if "(consequence of" not in m]
    assert fault.startswith("SEVERE data_io_error: L4_SHUFFLER (rank 0) failed handling surge.v1.ShufflePlan: "), fault
    assert re.match(r"restart_ranks after data_io_error of rank 0 ", of_type(events, "decision")[1]), events
    finished(events)
    assert heard_by_loop(stack.home, data, "ShuffleFailed")

    # Store (L5-2, in the store) and rank (L3-3, in a rank process), side by side.
    store_job = stack.submit(job("mfstore", 20, eval_every=2))
    rank_job = stack.submit(job("mfrank", 45))
    events = stack.events(store_job)
    # L5-2's LogWriteFailed came back with the failed Record stream, went up the rank's
    # session as L5-2: log_write_failed, MINOR; L1-1 ignores it (the rank resent the record).
    (fault,) = of_type(events, "fault")
    assert fault.startswith(
        "MINOR log_write_failed: L5_METRICS_LOGGER (rank 0) failed handling surge.v1.EvalCompleted: "
    ), fault
    assert of_type(events, "decision")[1].startswith("ignore log_write_failed of rank 0 "), events
    finished(events)
    events = stack.events(rank_job)
    # L3-3's ForwardFailed (out of memory, typed by the rule) at the rank's 41st forward:
    # FATAL; L1-1 stops the job.
    faults = [m for m in of_type(events, "fault") if "(consequence of" not in m]
    assert faults[0].startswith(
        "FATAL out_of_memory: L3_FORWARD_UNIT (rank 0) failed handling surge.v1.RunForward: "
    ), faults
    assert of_type(events, "decision")[1].startswith("stop after out_of_memory of rank 0 "), events
    status = events[-1].status
    assert (status.state, status.outcome, status.step) == (JobState.TERMINATED, JobOutcome.FAILED, 40), events[
        -1
    ].message

    # What L1-1 received: each report names the failure event and its typed cause.
    graded = failures(stack)
    assert graded.get(("ShuffleFailed", "FAILURE_IO", "data_io_error")) == 1, graded
    assert graded.get(("LogWriteFailed", "FAILURE_INTERNAL", "log_write_failed")) == 1, graded
    assert graded.get(("ForwardFailed", "FAILURE_OUT_OF_MEMORY", "out_of_memory")) == 1, graded
    assert (
        metric(stack.metrics(), "surge_fault_decisions_total", **{"class": "data_io_error", "action": "restart_ranks"})
        == 1
    )
    print(f"three legs: {time.monotonic() - t0:.1f} s after the stack was up")
