"""Silently wrong ranks on the real stack (issue 29 item 3): one rank's weights corrupted
(the test-only ``corrupt_weights`` injection: one element's top mantissa bit flipped after an
update) in a dp 2 job whose replicas are checked every 4 steps and saved every 2. The check
after the corruption finds the replicas different (replica_divergence, at dp 2 both suspect);
L1-1 rolls the job back to the version saved at the last check that agreed, in place (every
rank waits in its loop: the live ranks load it, issue 29 item 9), the version saved between
(its replicas already differed) is never loaded, and the job finishes. With the policy's
``ignore`` the ranks waiting for the decision train on and the job finishes.

The stack (control, store, data, two workers) is the one its group shares
(tests/shared_stacks.py).
"""

from __future__ import annotations

import pytest

from services.common.grpc_server import channel
from services.contract import Module, store_pb2, store_pb2_grpc

from .test_compound import committed_versions, services
from .test_recovery import JobOutcome, of_type
from .test_recovery import spec as recovery_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Corrupted after step 5's update: the save at step 6 holds diverged replicas, the check at
# step 8 (before that step's save) finds them; the last check that agreed was at step 4.
INJECT = "rdiv:corrupt_weights@5:rank=1,rdign:corrupt_weights@5:rank=1"


@pytest.fixture(scope="module")
def stack(shared_stack):
    """This module's turn on the stack its group shares (tests/shared_stacks.py)."""
    return shared_stack


def test_a_corrupted_replica_is_found_at_the_next_check_and_the_job_rolls_back_to_the_last_agreeing_version(stack):
    # Synchronous saves: step 6's version is committed before the check at step 8 runs.
    text = recovery_spec("rdiv", steps=16, every=2).replace("keep_last: 0}", "keep_last: 0, async: false}")
    assert "async: false" in text
    job = stack.submit(text + "integrity: {replica_check_every_steps: 4}\n")
    events = stack.events(job, timeout=240)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    faults = [m for m in of_type(events, "fault") if "replica_divergence" in m and "(consequence of" not in m]
    assert len(faults) == 1, faults
    # Found at the first check after the corruption (step 8), naming the tensor; at dp 2
    # nothing says which replica is right.
    assert "replicas differ after step 8 in tok_emb.weight: dp ranks 0, 1 differ and no majority" in faults[0]
    assert "last agreeing check: step 4" in faults[0]
    (decision,) = [m for m in of_type(events, "decision") if m.startswith("rollback after replica_divergence")]
    assert "back to a version at or before step 4, the last replica check that agreed" in decision
    decided = next(i for i, e in enumerate(events) if e.type == "decision" and e.message.startswith("rollback"))
    recovered = next(
        i for i, e in enumerate(events) if e.type == "state" and "recovered from replica_divergence" in e.message
    )
    # The diverged generation's commits: everything committed before the ranks came back. Saved
    # at steps 2, 4, 6; nothing at step 8: the check runs before that step's save, so a diverged
    # state is never saved at a check step. (Step 6's commit may be applied after the decision:
    # rank 0 reports it through its node agent, the divergence comes first from rank 1's; both
    # orders are correct, and rank 0's reload report always comes after its commit's. A rollback
    # that verifies the store before that report arrives records step 6's version as found
    # there, and the report, when it comes, adds nothing: ci21.)
    before = dict(committed_versions(events[:recovered], verified=True))
    assert sorted(before) == [2, 4, 6], before
    # The version of step 6 (saved between the agreeing check and the one that found the
    # divergence) is never loaded; the rollback resumes from step 4's.
    (never,) = [m for m in of_type(events, "checkpoint") if "after the last replica check that agreed" in m]
    assert before[6] in never and before[4] not in never and before[2] not in never
    # Every rank waited in its loop (the divergence fails none): the rollback is done in place,
    # the live ranks load step 4's version (issue 29 item 9); no process is relaunched.
    assert decided and "; in place: the live ranks load it, none is relaunched" in events[decided].message
    assert not [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert f"loading checkpoint {before[4]} into the 2 live ranks (none relaunched)" in of_type(events, "recovery")
    assert any(
        m.startswith("FAULT_FROZEN -> RUNNING: recovered from replica_divergence")
        and f"all 2 ranks loaded checkpoint {before[4]} in place (none relaunched) at step 4" in m
        for m in of_type(events, "state")
    ), of_type(events, "state")
    # The store's catalog knows it too: step 6's version was never covered by an agreeing
    # check (never `latest`); step 4's was, and so is the run's last (checked at the end).
    ch = channel(f"127.0.0.1:{services(stack.home)['store']['port']}", module=Module.EXT_USER)
    try:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        listed = stub.List(store_pb2.CheckpointQuery(job_id=job), timeout=30).checkpoints
        latest = stub.Load(store_pb2.LoadCheckpoint(version=f"{job}:latest"), timeout=30).info
    finally:
        ch.close()
    verified = {c.version: c.replica_verified for c in listed}
    assert (verified[before[6]], verified[before[4]]) == (False, True), verified
    assert latest.step == 16 and latest.replica_verified


def test_a_divergence_the_policy_ignores_lets_the_ranks_train_on_in_their_processes(stack):
    # `actions: {replica_divergence: ignore}`: reported only. The ranks wait in their loop for the
    # decision (the divergence fails none of them); the ignore's go-on (ResumeTraining.go_on_at_step)
    # lets them train on. Before it they waited for good, the job RUNNING with its step frozen.
    text = recovery_spec("rdign", steps=16, every=2).replace("keep_last: 0}", "keep_last: 0, async: false}")
    text += "integrity: {replica_check_every_steps: 4}\nfault_policy: {actions: {replica_divergence: ignore}}\n"
    job = stack.submit(text)
    events = stack.events(job, timeout=240)
    assert events[-1].status.outcome == JobOutcome.FINISHED, events[-1].message
    decisions = [m for m in of_type(events, "decision") if "replica_divergence" in m]
    assert decisions and all(m.startswith("ignore replica_divergence") for m in decisions), decisions
    faults = [m for m in of_type(events, "fault") if "replica_divergence" in m]
    assert faults and "replicas differ after step 8" in faults[0], faults
    assert not [m for m in of_type(events, "recovery") if "relaunched" in m or "loading checkpoint" in m]
