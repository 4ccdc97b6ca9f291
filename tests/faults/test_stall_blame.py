"""The survivor is not blamed (issue 4, detection): on real processes, rank 1's host hangs
(its node agent and rank 1 SIGSTOPped: nobody is left to say the rank stopped) while rank 0
waits for it in the gradient all-reduce. Rank 0 keeps beating (side thread) but makes no
progress, and its stall deadline (1 s) fires long before rank 1's silence deadline (3 s after
its last beat; `heartbeat_timeout_running_seconds` 3 s, as the agent had stated it running).
Such a short stall deadline also fires on ordinary hiccups of a loaded machine, so once the
incident is recovered the operator stops the job. The incident must still be named after
rank 1, the rank that failed first; rank 0's stall, which its beats say happened in a
collective, is recorded as a consequence (``rank_stalled_in_collective``, issue 12 part 5).
The host's agent is continued once the fault is reported (rank 1 stays stopped), so that
the recovery can release rank 1 there."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.contract import control_pb2
from tests.conftest import kill_all
from tests.faults.test_recovery import causes, of_type, parent_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = """\
name: tblame
steps: 400
seed: 0
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 64, micro_batch_size: 4}
parallel: {dp: 2}
optimizer: {lr: 3.0e-3, warmup_steps: 4}
checkpoint: {every_steps: 50, keep_last: 0}
eval: {every_steps: 0, batches: 2, at_end: false}
liveness: {heartbeat_interval_seconds: 0.5, heartbeat_timeout_seconds: 3.0, heartbeat_timeout_running_seconds: 3.0,
           stall_min_seconds: 1.0, stall_step_factor: 1.0, attribution_seconds: 0.5}
"""


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def test_a_rank_on_a_hung_host_is_blamed_not_its_stalled_peer_whose_stall_deadline_fired_first(stack):
    job = stack.submit(JOB)
    stack.wait_step(job, 20)
    (pid,) = stack.rank_pids(job, 1)
    agent = parent_pid(pid)
    stopped = time.time()
    os.kill(agent, signal.SIGSTOP)
    os.kill(pid, signal.SIGSTOP)
    agent_stopped = True
    events = []
    try:
        stream = stack.stub.WatchJob(control_pb2.JobQuery(job_id=job, follow=True), timeout=240)
        for ev in stream:
            events.append(ev)
            if ev.type == "fault" and agent_stopped:
                os.kill(agent, signal.SIGCONT)
                agent_stopped = False
            if ev.message.startswith("first step after the recovery"):
                stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job))
    finally:
        if agent_stopped:
            os.kill(agent, signal.SIGCONT)
        kill_all([pid])
    faults = [e for e in events if e.type == "fault"]
    assert faults, "no fault was reported"
    cause = faults[0]
    # The hung host's node agent is named (its beats and the rank's it relays stopped together:
    # nobody stated the rank stopped), for rank 1 (session 34: no longer rank 1's own silence).
    assert cause.message.startswith("SEVERE worker_lost (agent_silent): the node agent of "), cause.message
    assert "rank 1's heartbeats, which it relays, stopped with it" in cause.message, cause.message
    decision = of_type(events, "decision")[1]
    assert decision.startswith("restart_ranks after worker_lost (agent_silent) of rank 1")
    # Rank 0 was seen stalled before rank 1's silence was declared, and is not blamed for it.
    stalls = [e for e in faults if e.message.startswith("rank_stalled_in_collective, expected: rank 0 ")]
    assert stalls, [e.message for e in faults]
    assert all(e.message.endswith("(consequence of rank 1's worker_lost)") for e in stalls)
    first_incident = events[: [e.message for e in events].index(decision)]
    assert causes(first_incident, "SEVERE rank_stalled") == []
    assert any(e.message.startswith("first step after the recovery from worker_lost of rank 1") for e in events)
    stalled_for = float(stalls[0].message.split("no step progress for ")[1].split(" s")[0])
    print(cause.message)
    print(
        f"stall blame: rank 0 stalled {stalled_for:.1f} s (deadline 1 s) yet rank 1's host's silence, declared "
        f"{cause.unix_time - stopped:.2f} s after the SIGSTOP, named the incident"
    )
    assert events[-1].status.state == control_pb2.TERMINATED
