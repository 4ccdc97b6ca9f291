"""Decisions on faults (issue 4): one decision per incident, by the job's fault policy, with
restart budgets per class; recoveries commanded to the recovery controller and executed by
the allocator on the node-agent sessions. Driven in-process through the real bus and relays,
with the test standing in for the node agents and for the store's verification."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from services.contract import Module, control_pb2, engine_pb2, route_pb2, store_pb2, worker_pb2
from services.control.__main__ import build
from services.control.fault_decision import JobView, decide
from services.control.job_store import JobStore
from services.control.orchestrator import (
    CONSEQUENCE_DETAIL_CHARS,
    IllegalTransition,
    checkpoint_text,
    restored_from_text,
)
from services.control.store_relay import StoreRelay
from services.jobspec import FaultPolicySpec, JobSpecError, parse_job_spec

from .conftest import Plane, drain, kinds, registration, settle, spec_yaml, stop_plane, to_ranks

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)
# No attribution window: reports reach the orchestrator at once (the detector's own tests
# cover the window).
QUICK = "liveness: {attribution_seconds: 0}"


@pytest.fixture
def store(monkeypatch):
    """Stands in for the store's verdicts on every version of a job (VerifyCheckpoints:
    ``verdicts``, (version, step, ok)), answered in the call. ``down``: the store cannot be
    reached (answered SnapshotFailed UNREACHABLE, as the gRPC relay does)."""
    seen = SimpleNamespace(verdicts=[], verified=0, down=False, scrubbed=[])

    def verify(self, msg, payload=None):
        seen.verified += 1
        if seen.down:
            return store_pb2.SnapshotFailed(
                job_id=msg.job_id,
                operation="verify",
                cause=store_pb2.UNREACHABLE,
                reason="store s:1: UNAVAILABLE: connection refused",
            )
        return store_pb2.CheckpointVerification(
            job_id=msg.job_id,
            versions=[
                store_pb2.CheckpointVerdict(
                    info=store_pb2.CheckpointInfo(version=v, step=step, job_id=msg.job_id),
                    ok=ok,
                    reason="" if ok else f"checkpoint {v}: __0_0.distcp: sha256 mismatch",
                )
                for v, step, ok in seen.verdicts
            ],
        )

    monkeypatch.setattr(StoreRelay, "verify_checkpoints", verify)
    monkeypatch.setattr(
        StoreRelay, "scrub_checkpoints", lambda self, msg, payload=None: seen.scrubbed.append(msg.job_id)
    )
    return seen


def resumes(session) -> list[str]:
    """The versions the ranks launched on ``session`` were told to load, in order."""
    return [c.launch.init.resume_version for c in drain(session) if c.WhichOneof("command") == "launch"]


@pytest.fixture
def plane(tmp_path, store):
    journal = JobStore(tmp_path / "control.db")
    yield Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    journal.close()


def running(plane: Plane, *workers: str, dp: int = 2, extra: str = QUICK):
    """A DP job on the first ``dp`` workers, every rank started: RUNNING."""
    sessions = {w: plane.register(w) for w in workers}
    job_id = plane.submit(dp=dp, steps=20, extra=extra).job_id
    for rank, w in enumerate(workers[:dp]):
        plane.rank_event(sessions[w], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    for s in sessions.values():
        drain(s)
    return job_id, sessions


def saved(plane: Plane, session, job_id: str, n: int, step: int) -> str:
    version = f"{job_id}:{n}"
    plane.rank_event(session, job_id, 0, saved=store_pb2.SaveCompleted(version=version, step=step))
    return version


def restarted(plane: Plane, job_id: str, placed: dict, start_step: int, read: dict | None = None) -> None:
    """The relaunched ranks report ready (restored at ``start_step``; ``read``: rank -> the
    bytes its load read per source)."""
    for rank, session in placed.items():
        started = engine_pb2.TrainingLoopStarted(
            rank=rank, start_step=start_step, restored_bytes_from=(read or {}).get(rank, {})
        )
        plane.rank_event(session, job_id, rank, started=started)


def decisions(plane: Plane, job_id: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == "decision"][1:]  # [0]: the allocation


def test_a_killed_rank_is_restarted_from_the_newest_checkpoint_and_the_job_resumes(plane, store):
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    saved(plane, w["wa"], job_id, 2, step=8)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)

    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.FAULT_FROZEN, JobOutcome.OUTCOME_UNSPECIFIED)
    assert decisions(plane, job_id) == ["restart_ranks after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit)"]
    assert store.verified == 1
    for session, rank in ((w["wa"], 0), (w["wb"], 1)):
        kill, launch = drain(session)
        assert (kill.release.job_id, kill.release.kill) == (job_id, True)
        assert [r.rank for r in launch.launch.ranks] == [rank]
        assert launch.launch.init.resume_version == f"{job_id}:2"

    # Rank 0 read its chunks from its node's memory and rank 1's from the peer's; rank 1 all
    # from its own node's memory: the event sums them per source.
    read = {0: {"memory": 700_000, "peer": 300_000}, 1: {"memory": 1_000_000}}
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=8, read=read)
    s = plane.get(job_id)
    assert (s.state, s.step) == (JobState.RUNNING, 8)
    assert s.message.startswith(
        f"recovered from rank_exit of rank 1: all 2 ranks restored from checkpoint {job_id}:2, read from "
        "memory (own node) 1.7 MB + the peer's memory 300 KB, at step 8 "
    ), s.message
    assert kinds(drain(w["wa"])) == ["StartTraining"]
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=9, loss=2.0, tokens=64))
    (first,) = [e.message for e in plane.events(job_id) if e.message.startswith("first step after the recovery")]
    assert first.startswith("first step after the recovery from rank_exit of rank 1: step 9, ")


def test_the_survivors_failure_and_the_kills_are_consequences_not_new_decisions(plane):
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the first fault: the incident's cause
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="comm_error", detail="Connection closed by peer")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)  # the survivor, blocked in the all-reduce
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)  # killed by the recovery
    assert len(decisions(plane, job_id)) == 1
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[1].endswith("(consequence of rank 1's rank_exit)")
    assert faults[2].endswith("(consequence of rank 1's rank_exit)")
    assert plane.get(job_id).state == JobState.FAULT_FROZEN


def test_a_rank_the_recovery_killed_is_the_ranks_end_not_a_fault(plane):
    # fresh36 F8: the recovery's kill of the survivor (released, then killed) was listed as
    # "fault ... rank_released, expected: ...", so `events --type fault` showed two faults per
    # incident; the README says a released rank's end is type `rank`.
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the incident's cause
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True, detail="signal 9")
    events = plane.events(job_id)
    faults = [e.message for e in events if e.type == "fault"]
    assert len(faults) == 1 and "rank_exit" in faults[0], faults
    ends = [e.message for e in events if e.type == "rank" and "ended after its release" in e.message]
    assert len(ends) == 1 and ends[0].startswith("rank 0 ended after its release: rank 0 on worker wa ended"), ends
    assert ends[0].endswith("(consequence of rank 1's rank_exit)"), ends


def test_a_consequence_line_has_no_grade_and_a_clipped_detail(plane):
    # After every rebuild the survivor's broken collective was printed "SEVERE comm_error:"
    # with gloo's whole text, twice (L3 and L2-2): read as a new failure. It is now marked
    # expected, and its detail cut to the first CONSEQUENCE_DETAIL_CHARS characters.
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5517: Connection reset " * 5
    plane.rank_event(
        w["wa"], job_id, 0, failed=engine_pb2.TrainingLoopFailed(step=3, fault_class="comm_error", detail=gloo)
    )
    consequence = [e.message for e in plane.events(job_id) if e.type == "fault"][1]
    assert consequence.startswith("comm_error, expected: ") and "SEVERE" not in consequence, consequence
    assert consequence.endswith("… (consequence of rank 1's rank_exit)"), consequence
    detail = consequence.removeprefix("comm_error, expected: ").removesuffix(" (consequence of rank 1's rank_exit)")
    assert len(detail) == CONSEQUENCE_DETAIL_CHARS and detail.startswith("rank 0 failed at step 3: RuntimeError: "), (
        detail
    )


def test_a_fault_of_the_relaunched_generation_is_a_new_incident(plane):
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)  # the kill of the survivor: a consequence
    failed = engine_pb2.TrainingLoopFailed(fault_class="comm_error", detail="rendezvous timed out")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)  # the relaunched rank 0 fails: new
    assert decisions(plane, job_id)[1] == "restart_ranks after comm_error of rank 0 (restart 1 of 3 for comm_error)"


def test_an_exhausted_restart_budget_fails_the_job_with_the_reason(plane):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {restarts: {rank_exit: 1}}")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=0)
    assert plane.get(job_id).state == JobState.RUNNING
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # again: the budget is spent
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert s.message.startswith(
        "FAILED: restart budget for rank_exit exhausted (1 of 1 used); last fault: SEVERE rank_exit"
    )
    assert (
        decisions(plane, job_id)[-1]
        == "stop after rank_exit of rank 1 on wb: restart budget for rank_exit exhausted (1 of 1 used)"
    )


def test_an_oom_kill_is_relaunched_once_then_pauses_the_job_with_a_hint_and_a_resume_relaunches_it(
    plane, store, tmp_path
):
    job_id, w = running(plane, "wa", "wb")
    store.verdicts = [(saved(plane, w["wa"], job_id, 1, step=4), 4, True)]
    oom = {"cause": control_pb2.EXIT_OOM_KILLED, "oom_counter_read": True}
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9, **oom)
    assert decisions(plane, job_id)[-1] == "restart_ranks after rank_oom of rank 1 on wb (restart 1 of 1 for rank_oom)"
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True)
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    assert plane.get(job_id).state == JobState.RUNNING
    for s in w.values():
        drain(s)

    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9, **oom)  # again, with the same configuration
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.PAUSED, JobOutcome.OUTCOME_UNSPECIFIED)  # never FAILED
    hint = (
        "paused: rank_oom again with the same configuration; lower data.micro_batch_size, or enable "
        "parallel.activation_checkpointing or parallel.data_parallel: fsdp2"
    )
    assert s.message == hint
    assert decisions(plane, job_id)[-1].startswith("pause after rank_oom of rank 1 on wb: out of memory again")
    (release,) = [c for c in drain(w["wa"]) if c.WhichOneof("command") == "release"]
    assert release.release.kill  # the survivor's slot is freed at once
    # Its survivor's end is no new fault of the paused job.
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=1, cause=control_pb2.EXIT_ERROR)
    assert plane.get(job_id).state == JobState.PAUSED and not decisions(plane, job_id)[-1].startswith("restart")

    # A restarted control keeps it paused, with the hint.
    stop_plane(plane.c)
    plane = Plane(
        build(JobStore(tmp_path / "control.db"), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    )
    try:
        s = plane.get(job_id)
        assert (s.state, s.message) == (JobState.PAUSED, hint)
        w = {name: plane.register(name) for name in w}
        # The operator (having changed what the hint says, or not) resumes it: relaunched from
        # its newest checkpoint, with the budgets anew.
        s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
        assert s.state == JobState.WARMING_UP
        assert resumes(w["wa"]) == [f"{job_id}:1"]
    finally:
        stop_plane(plane.c)


def test_a_worker_rejoining_does_not_reset_the_budget(plane):
    job_id, w = running(
        plane,
        "wa",
        "wb",
        extra=QUICK + "\nfault_policy: {restarts: {worker_lost: 1}, actions: {worker_lost: exclude_node}}",
    )
    spare = plane.register("wc")
    plane.c.sessions.close(w["wb"])  # wb's node agent is gone: worker_lost, exclude it
    assert (
        decisions(plane, job_id)[0]
        == "exclude_node after worker_lost of rank 1 on wb (restart 1 of 1 for worker_lost); excluding wb"
    )
    placed = {0: w["wa"], 1: spare}
    assert [[r.rank for r in c.launch.ranks] for c in drain(spare)] == [[1]]
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    restarted(plane, job_id, placed, start_step=0)
    back = plane.register("wb")  # the node agent comes back under the same id
    drain(back)
    plane.c.sessions.close(spare)  # and another one goes
    s = plane.get(job_id)
    assert (s.outcome, "restart budget for worker_lost exhausted (1 of 1 used)" in s.message) == (
        JobOutcome.FAILED,
        True,
    )


def test_rollback_skips_checkpoints_after_the_faulting_step_and_ones_that_do_not_verify(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=2)
    v2 = saved(plane, w["wa"], job_id, 2, step=4)  # does not verify
    v3 = saved(plane, w["wa"], job_id, 3, step=6)  # after the faulting step
    store.verdicts = [(v1, 2, True), (v2, 4, False), (v3, 6, True)]
    failed = engine_pb2.TrainingLoopFailed(
        step=5, fault_class="non_finite_loss", detail="training loss is nan at step 6"
    )
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert decisions(plane, job_id) == ["rollback after non_finite_loss of rank 0 (restart 1 of 3 for non_finite_loss)"]
    events = [e.message for e in plane.events(job_id)]
    assert any(m.startswith(f"checkpoint {v2} at step 4 fails verification (") for m in events)
    recovery = [e.message for e in plane.events(job_id) if e.type == "recovery"]
    assert f"to resume from checkpoint {v1}" in recovery[0]
    assert resumes(w["wb"]) == [v1]


def test_a_fault_whose_policy_is_stop_fails_the_job_and_kills_the_ranks(plane):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {actions: {non_finite_loss: stop}}")
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="non_finite_loss", detail="loss is nan")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert s.message == "FAILED: FATAL non_finite_loss: rank 0 failed at step 3: loss is nan"
    assert decisions(plane, job_id) == ["stop after non_finite_loss of rank 0: fault policy"]
    assert [(c.release.job_id, c.release.kill) for c in drain(w["wb"])] == [(job_id, True)]


def test_a_failed_job_with_a_checkpoint_says_where_resume_continues_from(plane, store):
    """As a stopped job's end says it (an operator's trial: a FAILED job gave no hint)."""
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {actions: {non_finite_loss: stop}}")
    saved(plane, w["wa"], job_id, 1, step=2)
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="non_finite_loss", detail="loss is nan")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert s.message == (
        "FAILED: FATAL non_finite_loss: rank 0 failed at step 3: loss is nan; "
        f"`surgectl resume {job_id}` continues from checkpoint {job_id}:1 (step 2)"
    )


def test_an_ignored_fault_is_recorded_and_counted_and_nothing_else_happens(plane):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {actions: {SEVERE: ignore}}")
    for _ in range(2):
        plane.rank_event(w["wa"], job_id, 0, failed=engine_pb2.TrainingLoopFailed(fault_class="comm_error"))
    assert decisions(plane, job_id) == [
        "ignore comm_error of rank 0: fault policy; 1 ignored so far",
        "ignore comm_error of rank 0: fault policy; 2 ignored so far",
    ]
    assert plane.get(job_id).state == JobState.RUNNING
    assert drain(w["wa"]) == [] and drain(w["wb"]) == []


def test_exclude_node_without_enough_slots_elsewhere_waits_for_capacity_then_the_policy_fails_the_job(plane):
    job_id, w = running(
        plane,
        "wa",
        "wb",
        extra=QUICK + "\nfault_policy: {actions: {worker_lost: exclude_node}, capacity_wait_seconds: 0.6}",
    )
    plane.c.sessions.close(w["wb"])
    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN
    assert s.message.startswith(
        "waiting for capacity to resume from scratch: needs 2 ranks, 1 free "
        "(placing the ranks (fresh start): 1 is free on 1 registered worker (excluding wb)); "
        "retry 1 in 0.5 s, the fault policy decides after 1 s"
    )
    deadline = time.monotonic() + 10
    while plane.get(job_id).state != JobState.TERMINATED and time.monotonic() < deadline:
        time.sleep(0.05)
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.FAILED)
    assert s.message.startswith("FAILED: waiting for capacity to resume from scratch") and s.message.endswith(
        "every checkpoint is kept"
    )


def test_a_stop_during_a_recovery_ends_the_job_stopped(plane):
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    s = plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert s.message == "STOPPED: stopped by the operator; its ranks were being recovered"
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=0)  # too late: nothing starts
    assert plane.get(job_id).state == JobState.TERMINATED


def test_a_rank_that_exits_cleanly_before_finishing_is_a_lost_rank(plane):
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wa"], job_id, 0, exit_code=0)
    assert decisions(plane, job_id) == ["restart_ranks after rank_exit of rank 0 on wa (restart 1 of 3 for rank_exit)"]


def test_faults_detection_latency_decisions_and_recovery_time_are_exported(plane):
    from prometheus_client import REGISTRY

    def sample(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    keys = (
        ("surge_faults_total", {"grade": "SEVERE", "class": "rank_exit", "role": "cause"}),
        ("surge_fault_detection_latency_seconds_count", {"class": "rank_exit"}),
        ("surge_fault_decisions_total", {"class": "rank_exit", "action": "restart_ranks"}),
        ("surge_recovery_seconds_count", {"class": "rank_exit"}),
    )
    before = [sample(n, **lab) for n, lab in keys]
    job_id, w = running(plane, "wa", "wb")
    died = control_pb2.RankExited(job_id=job_id, rank=1, exit_code=-9, unix_time=time.time() - 0.25)
    plane.c.sessions.on_worker_event(w["wb"], control_pb2.WorkerEvent(rank_exited=died))
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=0)
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    after = [sample(n, **lab) for n, lab in keys]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1, 1]
    latency = sample("surge_fault_detection_latency_seconds_sum", **{"class": "rank_exit"})
    assert latency >= 0.25  # from the exit the node agent reaped, not from the report


def test_a_clean_end_and_a_release_are_not_counted_as_faults_but_an_early_clean_exit_is(plane):
    # (session 35's trial: every successful job added rank_exit_clean MEDIUM, every preempted
    # rank rank_released MINOR, and an alert on MEDIUM fired on every successful job)
    from prometheus_client import REGISTRY

    def faults() -> dict:
        return {
            (s.labels["class"], s.labels["grade"], s.labels["role"]): s.value
            for metric in REGISTRY.collect()
            if metric.name == "surge_faults"
            for s in metric.samples
            if s.name == "surge_faults_total"
        }

    before = faults()
    job_id, w = running(plane, "wa", "wb")
    plane.rank_event(w["wa"], job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=20))
    plane.rank_exited(w["wa"], job_id, 0, exit_code=0)  # rank 0 done, rank 1 still running
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9, released=True)  # an exit control asked for
    assert faults() == before
    other, v = running(plane, "wc", "wd")
    plane.rank_exited(v["wc"], other, 0, exit_code=0)  # never finished: a lost rank, a fault
    after = faults()
    cause = ("rank_exit_clean", "MEDIUM", "cause")
    assert after.get(cause, 0) - before.get(cause, 0) == 1


@pytest.mark.parametrize(
    "section, error",
    [
        ("fault_policy: {actions: {rank_exit: reboot}}", "job.yaml: fault_policy.actions.rank_exit: Input should be "),
        (
            "fault_policy: {actions: {Severe: stop}}",
            "job.yaml: fault_policy.actions.Severe: unknown fault class (known: MINOR, MEDIUM, SEVERE, FATAL, ",
        ),
        (
            "fault_policy: {restarts: {rank_exit: -1}}",
            "job.yaml: fault_policy: restarts.rank_exit must be >= 0, got -1",
        ),
        (
            "liveness: {heartbeat_interval_seconds: 2}",
            "job.yaml: liveness: heartbeat_timeout_seconds (3.0) must be at least twice heartbeat_interval_seconds (2.0)",
        ),
    ],
)
def test_a_bad_fault_policy_or_liveness_section_is_one_line_naming_the_field(section, error):
    from services.jobspec import JobSpecError, parse_job_spec

    from .conftest import spec_yaml

    with pytest.raises(JobSpecError) as e:
        parse_job_spec(spec_yaml(extra=section))
    # (a prefix for the list of actions: the set of actions grows, e.g. skip_step)
    # (an unknown class: a prefix, the known classes follow)
    known = error.endswith("(known: MINOR, MEDIUM, SEVERE, FATAL, ")
    assert (
        str(e.value) == error
        or (error.endswith("should be ") and str(e.value).startswith(error) and str(e.value).endswith("got 'reboot'"))
        or (known and str(e.value).startswith(error) and "rank_exit" in str(e.value) and "\n" not in str(e.value))
    )


def test_a_class_entry_beats_a_grade_entry_which_beats_the_defaults():
    from services.jobspec import parse_job_spec

    from .conftest import spec_yaml

    policy = parse_job_spec(
        spec_yaml(extra="fault_policy: {actions: {SEVERE: stop, worker_lost: ignore}}")
    ).fault_policy
    assert policy.action_for("worker_lost", "SEVERE") == "ignore"  # class entry
    assert policy.action_for("rank_exit", "SEVERE") == "stop"  # grade entry over the class default
    assert policy.action_for("non_finite_loss", "FATAL") == "rollback"  # class default
    assert policy.action_for("model_error", "FATAL") == "stop"  # grade default
    assert policy.action_for("something_new", "MINOR") == "ignore"


def test_a_load_that_failed_for_want_of_the_store_does_not_strike_the_version(plane, store):
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    saved(plane, w["wa"], job_id, 2, step=8)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    # The relaunched rank 0 could not load :2: the store did not answer. Nothing says its
    # bytes are wrong (the class the rank named is checkpoint_error, not checkpoint_integrity).
    failed = engine_pb2.TrainingLoopFailed(step=8, fault_class="checkpoint_error", detail="store: Load: UNAVAILABLE")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert (
        decisions(plane, job_id)[1] == "rollback after checkpoint_error of rank 0 (restart 1 of 3 for checkpoint_error)"
    )
    relaunched = [m for m in (e.message for e in plane.events(job_id)) if m.startswith("ranks killed and relaunched")]
    assert [m.split("resume from ")[1].split(";")[0] for m in relaunched] == [f"checkpoint {job_id}:2"] * 2


def test_recovery_names_a_version_the_store_verified_even_if_its_completion_report_never_arrived(plane, store):
    # The save at step 8 was committed by the store while rank 1 was dying: its SaveCompleted
    # never reached control. The store's Verify knows it; the recovery resumes from it.
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(f"{job_id}:1", 4, True), (f"{job_id}:2", 8, True)]
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert store.verified == 1
    events = [e.message for e in plane.events(job_id)]
    assert (
        f"checkpoint {job_id}:2 at step 8 verified: committed by the store, its completion report never arrived"
        in events
    )
    (relaunch,) = [m for m in events if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job_id}:2;" in relaunch


def test_a_version_that_fails_the_stores_verification_is_never_named(plane, store):
    # The newest version's files are incomplete (its background save was cut short, or a
    # shard's bytes flipped): Verify says so and the previous good one is named at once.
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    saved(plane, w["wa"], job_id, 2, step=8)
    store.verdicts = [(f"{job_id}:1", 4, True), (f"{job_id}:2", 8, False)]
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    events = [e.message for e in plane.events(job_id)]
    assert any(m.startswith(f"checkpoint {job_id}:2 at step 8 fails verification (") for m in events)
    (relaunch,) = [m for m in events if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {job_id}:1;" in relaunch


def test_a_checkpoint_integrity_failure_of_the_relaunched_ranks_rolls_back_by_the_checkpoint_error_policy(plane, store):
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, step=4)
    saved(plane, w["wa"], job_id, 2, step=8)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    failed = engine_pb2.TrainingLoopFailed(
        step=8, fault_class="checkpoint_integrity", detail=f"checkpoint {job_id}:2: __0_0.distcp: sha256 mismatch"
    )
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert (
        decisions(plane, job_id)[1]
        == "rollback after checkpoint_error (checkpoint_integrity) of rank 0 (restart 1 of 3 for checkpoint_error)"
    )
    relaunched = [m for m in (e.message for e in plane.events(job_id)) if m.startswith("ranks killed and relaunched")]
    assert [m.split("resume from ")[1].split(";")[0] for m in relaunched] == [
        f"checkpoint {job_id}:2",
        f"checkpoint {job_id}:1",
    ]


def test_every_skipped_step_is_an_event_with_its_reason_and_counted(plane):
    from prometheus_client import REGISTRY

    def count(reason: str) -> float:
        return REGISTRY.get_sample_value("surge_skipped_steps_total", {"reason": reason}) or 0.0

    before = count("non_finite_loss"), count("overflow")
    job_id, w = running(plane, "wa", "wb")
    for n, reason in ((5, "non_finite_loss"), (6, ""), (7, "overflow")):
        step = engine_pb2.StepCompleted(step=n, loss=float("nan") if reason else 2.0, skipped=bool(reason), tokens=64)
        if reason and "skip_reason" in engine_pb2.StepCompleted.DESCRIPTOR.fields_by_name:
            step.skip_reason = reason
        plane.rank_event(w["wa"], job_id, 0, step=step)
    skips = [e.message for e in plane.events(job_id) if e.type == "skip"]
    if "skip_reason" in engine_pb2.StepCompleted.DESCRIPTOR.fields_by_name:
        assert skips == [
            "step 5 skipped (non_finite_loss): no update applied; loss nan",
            "step 7 skipped (overflow): no update applied; loss nan",
        ]
        assert (count("non_finite_loss"), count("overflow")) == (before[0] + 1, before[1] + 1)
    else:  # (the loop's field not built yet: every skip reads as an overflow)
        assert len(skips) == 2
    assert plane.get(job_id).train_loss == 2.0  # a skipped step's loss is not shown as the job's loss


def test_a_standing_order_the_orchestrator_withdraws_reaches_every_rank_with_one_boundary_and_is_journaled(plane):
    # No input asks L1-1 for a withdrawal yet (see Orchestrator._withdraw_standing_order): its
    # own path, called as a handler of such a request would call it.
    job_id, w = running(plane, "wa", "wb")
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=5, loss=2.0, tokens=64))
    seq = plane.c.orchestrator._withdraw_standing_order(job_id, 1)
    assert seq == 1  # the job's first boundary command: no step named, the ranks agree on one
    for session in w.values():
        assert [to_ranks(c) for c in drain(session)] == [engine_pb2.RevokeStandingOrder(job_id=job_id, order=1, seq=1)]
    assert decisions(plane, job_id)[-1] == (
        "standing order 1 (skip_step for gradient_overflow) revoked at the next step boundary every rank agrees on "
        "(command #1 to the ranks)"
    )
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=8, loss=2.0, tokens=64, commands_agreed=1))
    assert "standing order 1 (skip_step for gradient_overflow) revoked after step 8" in [
        e.message for e in plane.events(job_id)[-2:]
    ]  # where agreed
    plane.user(control_pb2.StopJobRequest(job_id=job_id, no_checkpoint=True))
    plane.rank_exited(w["wa"], job_id, 0, exit_code=0), plane.rank_exited(w["wb"], job_id, 1, exit_code=0)
    with pytest.raises(IllegalTransition, match="no ranks to revoke an order of"):
        plane.c.orchestrator._withdraw_standing_order(job_id, 1)


def test_a_recovery_says_that_its_relaunched_ranks_hold_the_withdrawn_order_again(plane):
    # (a fresh user's revoked order came back with a relaunch, unannounced)
    job_id, w = running(plane, "wa", "wb")
    plane.c.orchestrator._withdraw_standing_order(job_id, 1)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=1)
    said = [
        e.message for e in plane.events(job_id) if e.type == "recovery" and "withdrawn by the operator" in e.message
    ]
    assert said == [
        "standing order 1 (skip_step for gradient_overflow) withdrawn by the operator: the ranks this recovery "
        f"launches get the fault policy's orders again (`surgectl revoke {job_id} CLASS` withdraws it again)"
    ], said


def test_a_rebuild_in_place_keeps_a_withdrawal_and_launches_the_replacement_without_that_order(plane, store):
    # The survivor keeps its process, and with it the withdrawal it agreed on: the replacement
    # launched beside it holds the same orders (before: the policy's, so on an fp16 overflow the
    # replacement skipped by its order while the survivor waited for L1-1's verdict).
    job_id, w = running(plane, "wa", "wb", extra=REBUILD)
    seq = plane.c.orchestrator._withdraw_standing_order(job_id, 1)
    plane.rank_event(
        w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=8, loss=2.0, tokens=64, commands_agreed=seq)
    )
    drain(w["wa"]), drain(w["wb"])
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert decisions(plane, job_id)[-1].startswith("rebuild after rank_exit of rank 1 on wb"), decisions(plane, job_id)
    (launch,) = [m for k, m in commands(w["wb"]) if k == "launch"]
    assert launch.init.heal_from_peer and [o.id for o in launch.init.standing_orders] == []
    assert not [e.message for e in plane.events(job_id) if "withdrawn by the operator" in e.message]
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        started = engine_pb2.TrainingLoopStarted(rank=rank, start_step=8, rebuild_generation=1, healed=rank == 1)
        plane.rank_event(session, job_id, rank, started=started)
    assert plane.get(job_id).state == JobState.RUNNING
    assert plane.c.orchestrator._withdraw_standing_order(job_id, 1) == seq  # (still withdrawn: nothing sent)
    assert "RevokeStandingOrder" not in [k for s in w.values() for k in kinds(drain(s))]


@pytest.mark.parametrize("saved_at, again", [(4, True), (6, False)])
def test_a_stop_of_ranks_paused_at_a_step_no_commit_holds_asks_them_to_save_it_again(plane, saved_at, again):
    # A fresh user's trial: the pause's save failed (the store stopped), the store came back, and
    # `stop` saved nothing: each paused rank had marked its step saved. Control knows better.
    job_id, w = running(plane, "wa", "wb")
    plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=6, loss=2.0, tokens=64))
    saved(plane, w["wa"], job_id, 1, step=saved_at)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=6))
    assert plane.get(job_id).state == JobState.PAUSED
    for session in w.values():
        drain(session)
    plane.user(control_pb2.StopJobRequest(job_id=job_id))
    stops = [to_ranks(c) for s in w.values() for c in drain(s) if c.WhichOneof("command") == "routed"]
    assert [(m.checkpoint, m.save_again) for m in stops if isinstance(m, engine_pb2.StopTraining)] == [
        (True, again),
        (True, again),
    ], stops


def test_a_restarted_control_answers_a_reminder_with_the_journaled_verdict_and_keeps_a_withdrawal(tmp_path, store):
    # Rank 0 reports a NaN loss at step 6 (policy: ignore); control decides and dies. Rank 1
    # never got the verdict: its reminder reaches the restarted control, which sends the same
    # verdict again instead of deciding (and counting an ignore) afresh.
    db = tmp_path / "control.db"
    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {actions: {non_finite_loss: ignore}}")
    nan = dict(job_id=job_id, step=6, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, detail="training loss is nan")
    plane.rank_event(w["wa"], job_id, 0, step_fault=engine_pb2.StepFaultReported(rank=0, **nan))
    (verdict,) = [to_ranks(c) for c in drain(w["wb"])]
    assert (verdict.step, verdict.action) == (6, engine_pb2.STEP_APPLY)
    at = plane.c.orchestrator._withdraw_standing_order(job_id, 1)
    journal.close()

    journal = JobStore(db)
    plane = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    w = {}
    for rank, name in enumerate(("wa", "wb")):  # the node agents re-attach the ranks they still run
        reg = registration(name)
        reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=rank)]))
        w[name] = plane.c.sessions.open(reg)
    plane.rank_event(w["wb"], job_id, 1, step_fault=engine_pb2.StepFaultReported(rank=1, reminder=1, **nan))
    assert [[to_ranks(c) for c in drain(s)] for s in w.values()] == [[verdict], [verdict]]  # (by job, to every rank)
    assert decisions(plane, job_id)[1:] == [
        "standing order 1 (skip_step for gradient_overflow) revoked at the next step boundary every rank agrees on "
        "(command #1 to the ranks)",
        "verdict on non_finite_loss at step 6 sent again: rank 1 still waits after 0 s",
    ]
    assert plane.c.orchestrator._withdraw_standing_order(job_id, 1) == at  # these ranks have it already
    assert [kinds(drain(s)) for s in w.values()] == [[], []]
    journal.close()


def test_a_version_the_stores_scrub_finds_corrupt_is_struck_and_the_next_recovery_skips_it(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1, v2 = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    plane.c.bus.publish(
        Module.L5_CHECKPOINT_MANAGER,
        store_pb2.CheckpointCorrupt(
            job_id=job_id, version=v2, step=8, cause=store_pb2.CORRUPT, reason=f"checkpoint {v2}: __0_0.distcp: sha256"
        ),
    )
    events = [e.message for e in plane.events(job_id)]
    assert (
        f"checkpoint {v2} at step 8 found corrupt by the store's scrub (checkpoint {v2}: __0_0.distcp: sha256); "
        "never loaded" in events
    )
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert resumes(w["wa"]) == [v1]  # (v1 was never struck: only the scrubbed version is)


def test_the_store_unreachable_during_a_recovery_strikes_nothing_and_the_job_waits_then_resumes(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1, v2 = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    store.down = True
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN and s.message.startswith("waiting for the store (unreachable: ")
    assert resumes(w["wa"]) == []  # nothing relaunched while the versions cannot be verified
    store.down, store.verdicts = False, [(v1, 4, True), (v2, 8, True)]
    deadline = time.monotonic() + 10
    while not any(m.startswith("ranks killed and relaunched") for m in (e.message for e in plane.events(job_id))):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert resumes(w["wa"]) == [v2]  # the newest: nothing was struck while the store was away
    events = [e.message for e in plane.events(job_id)]
    assert not any("fails verification" in m or "unusable" in m for m in events)
    assert any(m.startswith("the store answered after ") for m in events)


def test_a_second_rank_dying_while_the_recovery_waits_for_the_store_is_a_consequence_not_a_second_restart(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.down = True
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)  # the survivor dies too, during the wait
    assert decisions(plane, job_id) == ["restart_ranks after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit)"]
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[-1].endswith("(consequence of rank 1's rank_exit)")
    store.down, store.verdicts = False, [(v1, 4, True)]
    deadline, seen = time.monotonic() + 10, []
    while not seen and time.monotonic() < deadline:  # the next retry of the verification relaunches
        seen = resumes(w["wa"])
        time.sleep(0.05)
    assert seen == [v1]
    assert len(decisions(plane, job_id)) == 1  # one incident, one restart spent


@pytest.mark.parametrize("action, outcome", [("stop", "failed"), ("restart_ranks", "relaunched")])
def test_a_store_unreachable_past_store_wait_seconds_is_decided_by_the_policy(plane, store, action, outcome):
    job_id, w = running(
        plane,
        "wa",
        "wb",
        extra=QUICK + f"\nfault_policy: {{store_wait_seconds: 0.6, actions: {{store_unreachable: {action}}}}}",
    )
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.down = True
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    deadline = time.monotonic() + 10
    while not any(d.startswith(f"{action} after store_unreachable") for d in decisions(plane, job_id)):
        assert time.monotonic() < deadline, decisions(plane, job_id)
        time.sleep(0.05)
    # (The decision is journaled before it ends: its commands and its status follow it.)
    if outcome == "failed":
        settle(lambda: (plane.get(job_id).state, plane.get(job_id).outcome), (JobState.TERMINATED, JobOutcome.FAILED))
        assert plane.get(job_id).message.endswith(
            f"every checkpoint is kept; `surgectl resume {job_id}` continues from checkpoint {v1} (step 4)"
        ), plane.get(job_id).message
    else:  # goes on with the version reported, unverified: the ranks check its digests as they load it
        launched: list[str] = []
        settle(lambda: launched.extend(resumes(w["wa"])) or launched, [v1])
        assert plane.get(job_id).state == JobState.FAULT_FROZEN
    assert store.verified >= 2  # asked again while it waited


def relay_snapshot_failed(job_id, operation, cause, failure_cause, handled, said, *, detail=None, **fields):
    """L5-1's failure event as rank 0's store relay sends it: the store's cause and the typed
    failure of the command it was handling."""
    failure = route_pb2.Failure(
        cause=failure_cause, module=Module.L5_CHECKPOINT_MANAGER, operation=handled, job_id=job_id, rank=0,
        detail=detail or said,
    )  # fmt: skip
    return store_pb2.SnapshotFailed(
        job_id=job_id, operation=operation, cause=cause, rank=0, reason=said, failure=failure, **fields
    )


@pytest.mark.parametrize("policy", ["", "\nfault_policy: {actions: {snapshot_failed: stop}}"], ids=["default", "stop"])
def test_a_skipped_save_is_one_record_unless_the_policy_decides_on_snapshot_failed(plane, store, policy):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + policy)
    said = "store at s:1: BeginSave: DEADLINE_EXCEEDED"
    # As the rank's store relay sends it: L5-1's failure event, typed by the store's cause.
    failed = relay_snapshot_failed(
        job_id, "save", store_pb2.TIMEOUT, route_pb2.FAILURE_TIMEOUT, "surge.v1.SaveCheckpoint", said, step=5
    )
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=failed)
    events = [(e.type, e.message) for e in plane.events(job_id)]
    assert (
        "checkpoint",
        f"checkpoint save failed (timeout: {said}); training continues, the next interval tries again",
    ) in events
    if not policy:  # L1-3 graded it MINOR, L1-1 ignored it: no second record of the one skipped save
        assert [t for t, _ in events if t == "fault"] == [] and decisions(plane, job_id) == []
        assert plane.get(job_id).state == JobState.RUNNING
    else:  # the operator's policy decides on L1-3's grade
        assert [m for t, m in events if t == "fault"] == [
            f"MINOR snapshot_failed: L5_CHECKPOINT_MANAGER (rank 0) failed handling surge.v1.SaveCheckpoint: {said}"
        ]
        assert decisions(plane, job_id) == ["stop after snapshot_failed of rank 0: fault policy"]
        assert plane.get(job_id).outcome == JobOutcome.FAILED


def test_a_jobs_failed_saves_are_counted_once_each_with_their_typed_cause_until_a_commit(plane, store):
    """``JobStatus.save_failing`` (what `surgectl status` names in one line, and `down` says
    of a refused drain): each failed save once (its write and its commit, or ranks, report one
    save alike), its typed cause and path kept; the next commit clears it; a save lost with a
    peer is the recovery's to tell, not counted (F7 of a fresh SRE's trial: nothing said)."""
    job_id, w = running(plane, "wa", "wb")
    saved(plane, w["wa"], job_id, 1, 4)
    said = "[Errno 28] No space left on device"
    for at in (6, 6, 8):  # (step 6 reported twice: one save)
        refused = relay_snapshot_failed(
            job_id, "save", store_pb2.WRITE_REFUSED, route_pb2.FAILURE_WRITE_REFUSED, "surge.v1.CommitCheckpoint",
            said, step=at, write_error=route_pb2.WRITE_NO_SPACE, path="/h/ck/staging",
        )  # fmt: skip
        plane.rank_event(w["wa"], job_id, 0, snapshot_failed=refused)
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 9))  # (a peer's: not counted)
    f = plane.get(job_id).save_failing
    assert (f.failed, f.first_step, f.step, f.cause, f.write_error, f.path) == (
        2, 6, 8, store_pb2.WRITE_REFUSED, route_pb2.WRITE_NO_SPACE, "/h/ck/staging"
    )  # fmt: skip
    assert f.reason == said and f.since_unix > 0
    saved(plane, w["wa"], job_id, 2, 10)
    assert not plane.get(job_id).HasField("save_failing")


# Liveness whose attribution window (orchestrator._attribution_window) is 2 s.
SHORT_WINDOW = "attribution_seconds: 0, heartbeat_interval_seconds: 0.25, heartbeat_timeout_seconds: 0.5"
SHORT_BEATS = f"liveness: {{{SHORT_WINDOW}}}"
BROKEN = "CommunicationFailed: all_reduce failed: RuntimeError"
THEN = "training continues, the next interval tries again"


def broken_save(job_id: str, step: int, operation: str = "save") -> store_pb2.SnapshotFailed:
    """No store cause (the store answered): a peer died in the save's (or load's) collectives."""
    handled = f"surge.v1.{operation.capitalize()}Checkpoint"
    return relay_snapshot_failed(job_id, operation, 0, route_pb2.FAILURE_COMMUNICATION, handled, BROKEN, step=step)


def checkpoint_records(plane: Plane, job_id: str) -> list[str]:
    return [e.message for e in plane.events(job_id) if e.type == "checkpoint"]


def test_a_save_broken_with_no_fault_in_sight_is_recorded_by_its_typed_cause_once_its_window_passed(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=SHORT_BEATS)
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 10))
    # Held while its cause may still be on its way (a lost node agent's session, a silence).
    assert checkpoint_records(plane, job_id) == []
    until = time.monotonic() + 10
    while not checkpoint_records(plane, job_id) and time.monotonic() < until:
        time.sleep(0.05)
    # The line names the typed failure (a fresh-user trial once read "unknown" there).
    assert checkpoint_records(plane, job_id) == [f"checkpoint save failed (communication: {BROKEN}); {THEN}"]
    assert plane.get(job_id).state == JobState.RUNNING


@pytest.mark.parametrize("operation", ["save", "load"])
@pytest.mark.parametrize("order", ["fault-first", "save-first"])
def test_a_save_broken_by_a_peer_s_death_is_recorded_as_that_fault_s_consequence_in_either_order(
    plane, store, order, operation
):
    # The CI run that found it: a rank SIGKILLed during a save (or its node lost a moment
    # before its session closed) left "checkpoint save failed" with no cause among the
    # recovery's records, read as a second failure of the store.
    job_id, w = running(plane, "wa", "wb", extra=SHORT_BEATS + "\nfault_policy: {actions: {rank_exit: rollback}}")
    saved(plane, w["wa"], job_id, 1, step=4)
    if order == "fault-first":
        plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
        plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 10, operation))
    else:
        plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 10, operation))
        time.sleep(0.5)  # within the window: the fault comes after the save broke
        plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    expected = f"checkpoint {operation} failed, expected: {BROKEN} (consequence of rank 1's rank_exit)"
    until = time.monotonic() + 10
    while expected not in checkpoint_records(plane, job_id) and time.monotonic() < until:
        time.sleep(0.05)
    assert [m for m in checkpoint_records(plane, job_id) if "failed" in m] == [expected]
    # One fault, one decision: the broken save is none of its own.
    assert decisions(plane, job_id) == ["rollback after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit)"]


def test_a_load_that_found_corrupt_bytes_has_the_store_rescrub_and_its_findings_are_struck(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1, v2 = saved(plane, w["wa"], job_id, 1, step=4), saved(plane, w["wa"], job_id, 2, step=8)
    said = f"checkpoint {v2}: __0_0.distcp: sha256 mismatch"
    # As the rank's checkpoint relay sends it: L5-1's failure event, with its typed failure.
    failed = relay_snapshot_failed(
        job_id, "load", store_pb2.CORRUPT, route_pb2.FAILURE_DATA_CORRUPT, "surge.v1.LoadCheckpoint",
        said, version=v2, detail=f"CheckpointIntegrityError: {said}",
    )  # fmt: skip
    plane.c.bus.publish(Module.L5_CHECKPOINT_MANAGER, failed)
    assert store.scrubbed == [job_id]
    # L1-1 reads it first (the route's order): records it, strikes the version (a finding about
    # its bytes) and has the store rescrub. L1-3 grades it (issue 13: every failure event routed
    # to it) as checkpoint_error (subclass checkpoint_integrity), and L1-1 decides it by the
    # policy (rollback): the ranks, which wait for L1 after a failure, relaunch from v1.
    messages = [e.message for e in plane.events(job_id)]
    assert f"checkpoint load of {v2} failed (corrupt: {said})" in messages
    assert messages.count(f"checkpoint {v2} fails its digest check on load; never loaded again") == 1
    assert [d for d in decisions(plane, job_id)] and decisions(plane, job_id)[-1].startswith(
        "rollback after checkpoint_error"
    )
    # The rescrub's answer names v2 again: already struck, nothing more happens.
    answer = store_pb2.CheckpointScrubbed(
        job_id=job_id,
        newly_corrupt=[
            store_pb2.CheckpointCorrupt(
                job_id=job_id, version=v2, step=8, cause=store_pb2.CORRUPT, reason="sha256 mismatch"
            )
        ],
    )
    plane.c.bus.publish(Module.L5_CHECKPOINT_MANAGER, answer)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # (the killed generation's exit)
    assert resumes(w["wa"]) == [v1]


@pytest.mark.parametrize(
    "asked, after",
    [
        (("drain",), JobState.RUNNING),  # (the drain's own pause: the recovery ends the drain)
        (("pause", "drain"), JobState.PAUSED),  # (the operator's pause, taken over by the drain: kept)
    ],
    ids=["drain", "pause-then-drain"],
)
def test_a_rank_lost_during_a_drain_is_recovered_running_unless_the_operator_had_paused_it(plane, store, asked, after):
    # A fresh user's trial: a rank SIGKILLed just after `surgectl down` said "draining"; `down`
    # said "not drained: control continues its recovery after `up`", and after `up` the job
    # recovered "paused, as before the fault" with drained false: PAUSED, resumed by nothing.
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    for what in asked:
        plane.user(control_pb2.PauseJobRequest(job_id=job_id, drain=what == "drain"))
    assert plane.get(job_id).draining
    drain(w["wa"]), drain(w["wb"])
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # (before the pause's boundary)
    assert resumes(w["wa"]) == [v1]
    drain(w["wb"])
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    s = plane.get(job_id)
    assert (s.state, s.drained, s.draining) == (after, False, False), s.message
    started = kinds(drain(w["wa"])) == ["StartTraining"]
    assert started == (after == JobState.RUNNING), s.message


def test_a_paused_job_whose_rank_dies_is_recovered_and_stays_paused_until_the_operator_resumes(plane, store):
    job_id, w = running(plane, "wa", "wb")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=6))
    assert plane.get(job_id).state == JobState.PAUSED
    drain(w["wa"]), drain(w["wb"])
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert resumes(w["wa"]) == [v1]
    drain(w["wb"])
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    s = plane.get(job_id)
    assert s.state == JobState.PAUSED and s.message.endswith("paused, as before the fault (resume continues it)")
    assert drain(w["wa"]) == []  # no StartTraining: the operator paused it
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert plane.get(job_id).state == JobState.RUNNING
    assert kinds(drain(w["wa"])) == ["StartTraining"]


def test_the_recovery_event_names_where_the_ranks_read_their_chunks():
    assert restored_from_text({"memory": 5_000_000}) == "read from memory (own node)"
    assert restored_from_text({"peer": 1_466_208, "memory": 0}) == "read from the peer's memory"
    assert restored_from_text({"store": 42}) == "read from the store"
    assert restored_from_text({"store": 20_000, "peer": 300_000, "memory": 1_200_000}) == (
        "read from memory (own node) 1.2 MB + the peer's memory 300 KB + the store 20 KB"
    )
    assert restored_from_text({}) == ""  # a version of plain files, or ranks that do not say


def test_a_checkpoint_event_says_what_its_save_wrote():
    base = store_pb2.SaveCompleted(
        version="J:1", step=40, bytes=1_466_208, files=88, written_bytes=1_466_000, baseline=True
    )
    assert checkpoint_text(base) == "checkpoint J:1 at step 40 (1.5 MB, baseline; 1466208 bytes, 88 files)"
    delta = store_pb2.SaveCompleted(version="J:2", step=80, bytes=1_466_208, files=88, written_bytes=120_000)
    text = checkpoint_text(delta)
    assert (
        text == "checkpoint J:2 at step 80 (1.5 MB total, 120 KB written (8.2 % new), delta; 1466208 bytes, 88 files)"
    )
    most = store_pb2.SaveCompleted(version="J:3", step=90, bytes=10_000_000, files=9, written_bytes=9_970_000)
    assert "(10 MB total, 10 MB written (99.7 % new), delta;" in checkpoint_text(most)  # (not "10 MB of 10 MB")
    full = store_pb2.SaveCompleted(version="J:4", step=99, bytes=10_000_000, files=9, written_bytes=10_000_000)
    assert (
        checkpoint_text(full)
        == "checkpoint J:4 at step 99 (10 MB, delta: every chunk changed; 10000000 bytes, 9 files)"
    )
    # What the fault tests parse (tests/faults/test_compound.py, test_store_outage.py).
    version, rest = text[len("checkpoint ") :].split(" at step ", 1)
    assert (version, int(rest.split(" ", 1)[0]), " bytes, " in text) == ("J:2", 80, True)
    plain = store_pb2.SaveCompleted(version="J:3", step=90, bytes=2048, files=3)
    assert checkpoint_text(plain) == "checkpoint J:3 at step 90 (2.0 KB; 2048 bytes, 3 files)"


# ---------------------------------------------------------------- rebuild in place (issue 16)
# The survivors keep their processes, only the lost rank is killed and replaced (healing from
# a live peer), every live rank gets the fresh rendezvous; anything that cannot be rebuilt
# falls back to restart_ranks.

REBUILD = (
    "liveness: {attribution_seconds: 0}\n"
    "fault_policy: {actions: {rank_exit: rebuild, rank_stalled: rebuild, worker_lost: rebuild}}"
)


def commands(session) -> list[tuple[str, object]]:
    """(kind, message) of every command queued on an in-process node-agent session."""
    out = []
    for cmd in drain(session):
        kind = cmd.WhichOneof("command")
        out.append((kind, cmd.routed.type.rsplit(".", 1)[-1] if kind == "routed" else getattr(cmd, kind)))
    return out


def test_a_lost_rank_is_replaced_in_place_and_the_survivors_get_the_new_rendezvous(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=REBUILD)
    saved(plane, w["wa"], job_id, 1, step=4)
    drain(w["wa"])
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)

    assert decisions(plane, job_id) == [
        "rebuild after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit); survivors keep training, "
        "rank 1 is replaced and heals from a live peer"
    ]
    assert store.verified == 0  # nothing is loaded: no checkpoint to verify
    on_a, on_b = commands(w["wa"]), commands(w["wb"])
    # The survivor's node is not told to release anything: only the rendezvous reaches it.
    assert [k for k, _ in on_a] == ["routed"] and on_a[0][1] == "RebuildParallelGroup"
    (kill, launch, routed) = on_b
    assert kill[0] == "release" and list(kill[1].ranks) == [1] and kill[1].kill
    assert launch[0] == "launch"
    (assignment,) = launch[1].ranks
    assert (assignment.rank, assignment.world_size) == (1, 2)
    assert launch[1].init.heal_from_peer and launch[1].init.resume_version == ""
    assert launch[1].init.rebuild_in_place
    assert routed == ("routed", "RebuildParallelGroup")
    recovery = [e.message for e in plane.events(job_id) if e.type == "recovery"]
    assert recovery[-1] == (
        f"rebuild in place commanded (generation 1, rendezvous 127.0.0.1:{assignment.master_port}): "
        "replacement for rank(s) 1 launched on wb, the survivors keep their processes"
    ), recovery[-1]

    # The survivor's collective failed under it: a consequence, not a second decision.
    broken = engine_pb2.ParallelTopologyError(rank=0, fault_class="comm_error", detail="Connection closed by peer")
    broken.failure.cause = 7  # FAILURE_COMMUNICATION
    plane.rank_event(w["wa"], job_id, 0, broken=broken)
    assert len(decisions(plane, job_id)) == 1

    for rank, session, source in ((0, w["wa"], 0), (1, w["wb"], 0)):
        started = engine_pb2.TrainingLoopStarted(
            rank=rank, start_step=6, rebuild_generation=1, healed=True, healed_from_rank=source
        )
        plane.rank_event(session, job_id, rank, started=started)
    s = plane.get(job_id)
    assert (s.state, s.step) == (JobState.RUNNING, 6)
    assert (
        "group of 2 rebuilt in place: rank 1 healed from rank 0's memory, 1 rank kept its process at step 6"
        in s.message
    ), s.message
    assert kinds(drain(w["wa"])) == ["StartTraining"]


def test_tokens_seen_counts_the_steps_a_recovery_replays_again_and_says_so(plane, capsys):
    # fresh37b #8: tokens_seen is the tokens processed, not unique tokens; the summary says so
    # (README: `surgectl status`; control.proto JobStatus.tokens_seen).
    from services.cli import render

    job_id, w = running(plane, "wa", "wb")
    for n in (1, 2, 3):
        plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64))
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # (no checkpoint: restarted from scratch)
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=0)
    for n in (1, 2):  # replayed
        plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64))
    s = plane.get(job_id)
    assert (s.state, s.step, s.tokens_seen) == (JobState.RUNNING, 2, 5 * 64), s
    capsys.readouterr()
    render.console.print(render.summary_table(s, render.History()))
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "tokens seen" in line]
    assert "tokens seen (replays counted again)" in row and "320" in row, row


def test_a_step_that_arrives_after_the_fault_of_a_rebuild_counts_once(plane):
    # Rank 0 completed step 6 just before the kill; its record came after the fault report.
    # The survivors keep step 6 (they resume after it), so it counts: tokens and the journal
    # (a trial's "tokens seen" was one step short after two rebuilds). Old or repeated
    # records do not count again, and a restart_ranks recovery ignores records as before.
    job_id, w = running(plane, "wa", "wb", extra=REBUILD)
    for n in range(1, 6):
        plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64))
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    for n in (6, 6, 5):
        plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64))
    s = plane.get(job_id)
    assert (s.state, s.step, s.tokens_seen) == (JobState.FAULT_FROZEN, 6, 6 * 64)

    job_id, w = running(plane, "wc", "wd")  # restart_ranks: what comes after the fault is rolled back
    plane.rank_event(w["wc"], job_id, 0, step=engine_pb2.StepCompleted(step=1, loss=2.0, tokens=64))
    plane.rank_exited(w["wd"], job_id, 1, exit_code=-9)
    plane.rank_event(w["wc"], job_id, 0, step=engine_pb2.StepCompleted(step=2, loss=2.0, tokens=64))
    assert (plane.get(job_id).step, plane.get(job_id).tokens_seen) == (1, 64)


def rebuilt_after_step_6(plane, start_step: int):
    """A dp 2 job control heard step 6 of, rank 1 killed, the group rebuilt in place and
    started at ``start_step`` (the survivor's own step): RUNNING again."""
    job_id, w = running(plane, "wa", "wb", extra=REBUILD.replace("attribution_seconds: 0", SHORT_WINDOW))
    for n in range(1, 7):
        plane.rank_event(w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=n, loss=2.0, tokens=64))
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        started = engine_pb2.TrainingLoopStarted(rank=rank, start_step=start_step, rebuild_generation=1, healed=True)
        plane.rank_event(session, job_id, rank, started=started)
    assert plane.get(job_id).state == JobState.RUNNING
    return job_id, w


def test_a_survivor_s_save_dropped_with_the_old_group_is_that_fault_s_consequence_though_reported_after_it(plane):
    # The survivor's relay learns its step-6 save died with the old group only at its next
    # save, long after the rebuild recovered (CI: the rbsave test found no record at all).
    job_id, w = rebuilt_after_step_6(plane, start_step=6)
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 6))
    assert checkpoint_records(plane, job_id) == [
        f"checkpoint save failed, expected: {BROKEN} (consequence of rank 1's rank_exit)"
    ]
    # A save of the new group (step 8) broken with no fault in sight: its own failure, once
    # its window passed.
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 8))
    until = time.monotonic() + 10
    while len(checkpoint_records(plane, job_id)) < 2 and time.monotonic() < until:
        time.sleep(0.05)
    assert checkpoint_records(plane, job_id)[1:] == [f"checkpoint save failed (communication: {BROKEN}); {THEN}"]
    assert len(decisions(plane, job_id)) == 1


def test_an_old_groups_save_is_that_faults_consequence_though_control_had_not_heard_of_its_step(plane):
    """A rank's steps reach control up to a beat late (they ride its heartbeat): the survivor
    saved step 8 in the old group while control knew step 6 when it decided. The rebuilt
    group started at step 8, so that save was the old group's (CI, test_netns_bed: "the save of
    step 220 was dropped with the replaced group" recorded as a failure of its own)."""
    job_id, w = rebuilt_after_step_6(plane, start_step=8)
    plane.rank_event(w["wa"], job_id, 0, snapshot_failed=broken_save(job_id, 8))
    assert checkpoint_records(plane, job_id) == [
        f"checkpoint save failed, expected: {BROKEN} (consequence of rank 1's rank_exit)"
    ]
    assert len(decisions(plane, job_id)) == 1


def test_the_last_rank_holding_the_state_lost_during_the_rebuild_falls_back_to_relaunching_every_rank(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=REBUILD)
    saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(f"{job_id}:1", 4, True)]
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    drain(w["wa"]), drain(w["wb"])
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)  # the healing source dies mid-transfer
    assert decisions(plane, job_id)[1] == (
        "restart_ranks after rank_exit of rank 0 on wa (restart 2 of 3 for rank_exit); restart_ranks instead of "
        "rebuild: no rank that held the state survives (rebuild after rank_exit of rank 1)"
    )
    for session in (w["wa"], w["wb"]):
        launches = [m for k, m in commands(session) if k == "launch"]
        assert [m.init.resume_version for m in launches] == [f"{job_id}:1"]
        assert not launches[0].init.heal_from_peer


def test_a_replacement_lost_while_it_starts_is_replaced_again_and_the_survivors_stay(plane, store):
    job_id, w = running(plane, "wa", "wb", "wc", dp=3, extra=REBUILD)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    for session in w.values():
        drain(session)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)  # the replacement dies before it healed
    assert decisions(plane, job_id)[1] == (
        "rebuild after rank_exit of rank 1 on wb (restart 2 of 3 for rank_exit); survivors keep training, "
        "rank 1 is replaced and heals from a live peer"
    )
    on_a, on_b = commands(w["wa"]), commands(w["wb"])
    assert [k for k, _ in on_a] == ["routed"]  # the survivors only get the next rendezvous
    assert [k for k, _ in on_b] == ["release", "launch", "routed"]
    assert list(on_b[1][1].ranks[0:1])[0].rank == 1 and on_b[1][1].init.heal_from_peer
    # Then a survivor is lost too: rank 2 still holds the state, so it is rebuilt again.
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    assert decisions(plane, job_id)[2].startswith("rebuild after rank_exit of rank 0 on wa (restart 3 of 3")
    relaunched = sorted(r.rank for k, m in commands(w["wa"]) + commands(w["wb"]) if k == "launch" for r in m.ranks)
    assert relaunched == [0, 1]  # both have nothing to lose: rank 1 never healed
    assert [k for k, _ in commands(w["wc"])] == ["routed", "routed"]  # rank 2 is never released


def test_no_slot_for_the_replacement_falls_back_to_relaunching_every_rank_from_the_checkpoint(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=REBUILD)
    saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(f"{job_id}:1", 4, True)]
    # The node agent of rank 1 is lost: its slot is withdrawn, and no other slot is free.
    plane.c.sessions.close(w["wb"])
    events = [e.message for e in plane.events(job_id)]
    assert any(
        "restart_ranks instead of rebuild" in m and "no free slot for a replacement of rank 1" in m for m in events
    ), events
    assert plane.get(job_id).state == JobState.FAULT_FROZEN  # waiting for capacity for both ranks


def test_rebuild_is_refused_at_submit_for_a_plan_whose_state_is_not_whole_on_a_peer():
    base = spec_yaml(dp=2, extra="fault_policy: {actions: {rank_exit: rebuild}}")
    for parallel, why in (
        ("{dp: 2, data_parallel: fsdp2}", "needs data_parallel ddp"),
        ("{dp: 1, tp: 2}", "needs tp = pp = 1"),
    ):
        text = base.replace("parallel: {dp: 2, backend: auto, threads_per_rank: 1}", f"parallel: {parallel}")
        with pytest.raises(JobSpecError, match=f"fault_policy.actions.rank_exit: rebuild {why}"):
            parse_job_spec(text)
    parse_job_spec(base.replace("dp: 2,", "dp: 1,"))  # dp 1 is the decision's to refuse (a resume may change dp)
    with pytest.raises(JobSpecError, match="actions.non_finite_loss: rebuild applies only to a lost rank"):
        parse_job_spec(spec_yaml(dp=2, extra="fault_policy: {actions: {non_finite_loss: rebuild}}"))


def test_rebuild_is_for_lost_ranks_only_and_falls_back_when_it_cannot_be_done():
    # A grade holds faults of every kind (FATAL's default is stop): rebuild is named per class.
    with pytest.raises(ValueError, match="actions.SEVERE: rebuild applies only to a lost rank"):
        FaultPolicySpec(actions={"SEVERE": "rebuild"})
    policy = FaultPolicySpec(actions={"rank_exit": "rebuild"})
    loss = control_pb2.FaultReport(fault_class="rank_exit", grade=control_pb2.SEVERE, rank=1, detail="x")
    assert decide(policy, JobView(restarts={}, ignored={}), loss).action == "rebuild"
    paused = decide(policy, JobView(restarts={}, ignored={}, no_rebuild="the job is PAUSED, not training"), loss)
    assert paused.action == "restart_ranks" and paused.text.endswith("the job is PAUSED, not training")


def test_a_replica_divergence_rolls_back_to_the_last_agreeing_check_and_a_version_that_reproduces_it_is_struck(
    plane, store
):
    """Issue 29 item 3: checks every 4 steps; found at step 12 -> back to a version at or
    before step 8 (step 10's is never loaded); found again at the first check after the
    recovery from step 8's version -> that version is suspect, struck, and the job goes back
    to step 4's. Every rank waits in its loop (none failed): each rollback is done in place,
    the live ranks load the version (issue 29 item 9)."""
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nintegrity: {replica_check_every_steps: 4}")
    v1, v2, v3 = (saved(plane, w["wa"], job_id, n, step=s) for n, s in ((1, 4), (2, 8), (3, 10)))
    store.verdicts = [(v1, 4, True), (v2, 8, True), (v3, 10, True)]
    detail = "data-parallel replicas differ after step 12 in tok_emb.weight: dp rank 1 differs from the majority"
    failed = engine_pb2.TrainingLoopFailed(step=12, fault_class="replica_divergence", detail=detail)
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert decisions(plane, job_id) == [
        "rollback after replica_divergence of rank 0 (restart 1 of 3 for replica_divergence); back to a version "
        "at or before step 8, the last replica check that agreed; in place: the live ranks load it, none is "
        "relaunched"
    ]
    events = [e.message for e in plane.events(job_id)]
    assert f"checkpoint {v3} saved after the last replica check that agreed (step 8); never loaded" in events
    assert reloads(w["wb"]) == [v2]  # (no kill, no launch)
    assert f"loading checkpoint {v2} into the 2 live ranks (none relaunched)" in events
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=8)
    s = plane.get(job_id)
    assert s.state == JobState.RUNNING
    assert s.message.startswith(
        f"recovered from replica_divergence of rank 0: all 2 ranks loaded checkpoint {v2} in place (none relaunched) "
        "at step 8"
    ), s.message
    # The first check after step 8's version (at 12) fails again: that version reproduces it.
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert decisions(plane, job_id)[1].endswith(
        f"; {v2} reproduced the divergence: suspect, never loaded again; in place: the live ranks load it, none is "
        "relaunched"
    )
    events = [e.message for e in plane.events(job_id)]
    assert (
        f"checkpoint {v2} reproduced the replica divergence it was loaded to recover from: suspect; never loaded again"
        in events
    )
    assert reloads(w["wb"]) == [v1]


def test_a_commit_of_the_diverged_replicas_applied_after_the_rollback_decision_is_never_loaded(plane, store):
    """Rank 1's divergence report (found at step 8) can reach control before rank 0's commit of
    step 6, which came up another node agent's stream: the rollback is decided with step 4's
    version, and step 6's commit, applied after it, is struck as saved after the last agreeing
    check, never the one loaded (CI saw this order on a loaded machine)."""
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nintegrity: {replica_check_every_steps: 4}")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(v1, 4, True)]
    detail = "data-parallel replicas differ after step 8 in tok_emb.weight: dp ranks 0, 1 differ and no majority"
    failed = engine_pb2.TrainingLoopFailed(step=8, fault_class="replica_divergence", detail=detail)
    plane.rank_event(w["wb"], job_id, 1, failed=failed)
    assert decisions(plane, job_id)[0].endswith(
        "at or before step 4, the last replica check that agreed; in place: the live ranks load it, none is relaunched"
    )
    v2 = saved(plane, w["wa"], job_id, 2, step=6)  # (rank 0's commit, applied late)
    events = [e.message for e in plane.events(job_id)]
    assert f"checkpoint {v2} saved after the last replica check that agreed (step 4); never loaded" in events
    assert reloads(w["wa"]) == [v1]
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    s = plane.get(job_id)
    assert s.state == JobState.RUNNING and f"loaded checkpoint {v1} in place" in s.message, s.message
    assert s.checkpoint_version == v1, s.checkpoint_version  # (not the struck one, committed last)


def test_a_replica_divergence_with_a_rank_gone_relaunches_every_rank_and_says_why(plane, store):
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nintegrity: {replica_check_every_steps: 4}")
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(v1, 4, True)]
    plane.c.orchestrator._jobs[job_id].exited.add(1)  # (rank 1's exit, seen before the divergence's report)
    detail = "data-parallel replicas differ after step 8 in tok_emb.weight: dp ranks 0, 1 differ"
    plane.rank_event(
        w["wa"],
        job_id,
        0,
        failed=engine_pb2.TrainingLoopFailed(step=8, fault_class="replica_divergence", detail=detail),
    )
    assert decisions(plane, job_id)[0].endswith("; every rank relaunched, not loaded in place: rank(s) 1 exited")
    assert resumes(w["wa"]) == [v1]


def reloads(session) -> list[str]:
    """The versions the live ranks on ``session`` were told to load in place, in order."""
    return [
        m.reload_version
        for m in (to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed")
        if isinstance(m, engine_pb2.ResumeTraining) and m.reload_version
    ]


def test_a_changed_dataset_shard_pauses_the_job_even_while_its_ranks_start_and_a_late_ready_is_ignored(plane):
    # Issue 29 item 7: at a resume the ranks' streams open the shard before every rank is ready
    # (WARMING_UP). The pause used to be refused there (WARMING_UP -> PAUSED not allowed), and
    # the job went on to RUNNING.
    w = {name: plane.register(name) for name in ("wa", "wb")}
    job_id = plane.submit(dp=2, steps=20, extra=QUICK).job_id
    assert plane.get(job_id).state == JobState.WARMING_UP
    changed = (
        "dataset tiny@v1: shard train.bin changed since it was prepared (sha256 9f3c0a1b2c3d…, manifest ab12cd34ef56…)"
    )
    plane.rank_event(
        w["wa"], job_id, 0, failed=engine_pb2.TrainingLoopFailed(fault_class="data_corrupt", detail=changed)
    )
    s = plane.get(job_id)
    assert (s.state, s.outcome) == (JobState.PAUSED, JobOutcome.OUTCOME_UNSPECIFIED)
    assert s.message.startswith("paused: data_corrupt: ") and changed in s.message
    assert s.message.endswith(
        "put the version's files back as prepared (or prepare a new version), "
        f"then `surgectl resume {job_id}` continues it from its newest checkpoint"
    )
    assert decisions(plane, job_id)[-1] == (
        "pause after data_corrupt of rank 0: fault policy; put the version's files back as prepared "
        "(or prepare a new version)"
    )
    plane.rank_event(w["wb"], job_id, 1, started=engine_pb2.TrainingLoopStarted(rank=1))
    assert plane.get(job_id).state == JobState.PAUSED


def test_a_policy_pause_during_a_resize_ends_the_resize_and_a_resume_relaunches_the_job(plane, store):
    """Out of memory again while the ranks pause for a resize: the policy pauses the job (its
    ranks killed), and the resize ends with them; the operator's resume relaunches the job
    (was: the resize stayed the job's activity and refused the resume, "being resized")."""
    job_id, w = running(plane, "wa", "wb", dp=2, extra="")
    store.verdicts = [(saved(plane, w["wa"], job_id, 1, step=4), 4, True)]
    oom = {"cause": control_pb2.EXIT_OOM_KILLED, "oom_counter_read": True}
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9, **oom)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True)
    restarted(plane, job_id, {0: w["wa"], 1: w["wb"]}, start_step=4)
    assert plane.get(job_id).state == JobState.RUNNING
    for session in w.values():
        drain(session)
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    assert [c for c in drain(w["wa"]) if c.WhichOneof("command") == "routed" and "PauseTraining" in c.routed.type]
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9, **oom)  # again, with the same configuration
    s = plane.get(job_id)
    assert (s.state, s.dp) == (JobState.PAUSED, 2)
    assert decisions(plane, job_id)[-1].startswith("pause after rank_oom of rank 1 on wb")
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9, released=True)
    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id))
    assert s.state == JobState.WARMING_UP, s.message
    assert decisions(plane, job_id)[-1].startswith(f"resume PAUSED from checkpoint {job_id}:1 (step 4)")


@pytest.mark.parametrize("exit_first", [True, False], ids=["exit first", "failure first"])
def test_a_ranks_own_failure_and_its_exit_are_one_incident_in_either_order(plane, store, exit_first):
    # Session 38 (order43): a rank's exit reaches control through its node agent's process
    # watcher, its loop's failure through its own stream: either may come first. With the exit
    # first, the failure (its rank no longer dying: its end was the cause) was decided as a
    # second fault, a second restart spent. The store is down so the relaunch waits unplaced.
    job_id, w = running(plane, "wa", "wb")
    store.down = True
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="port_in_use", detail="address in use")
    reports = [
        lambda: plane.rank_exited(w["wb"], job_id, 1, exit_code=1),
        lambda: plane.rank_event(w["wb"], job_id, 1, failed=failed),
    ]
    for report in reports if exit_first else reversed(reports):
        report()
    made = decisions(plane, job_id)
    assert len(made) == 1, made
    assert plane.get(job_id).state == JobState.FAULT_FROZEN
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert len(faults) == 2 and faults[1].endswith(
        "(consequence of rank 1's " + ("rank_exit)" if exit_first else "port_in_use)")
    ), faults


def test_a_failed_generations_ready_report_after_the_fault_is_not_counted_for_the_relaunch(plane, store):
    # Session 38 (order43): a relaunched rank (rank 1) reports ready a moment after its peer
    # (rank 0) died, so after the second incident began: counted, the next relaunch's group
    # was "all ready" once the new rank 0 alone reported, and started without the new rank 1.
    job_id, w = running(plane, "wa", "wb")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)  # killed by the recovery: a consequence
    assert plane.get(job_id).state == JobState.FAULT_FROZEN  # relaunched (the store answered at once)
    store.down = True  # the second recovery's relaunch waits unplaced
    plane.rank_exited(w["wa"], job_id, 0, exit_code=1)  # the relaunched rank 0 dies: a new incident
    plane.rank_event(w["wb"], job_id, 1, started=engine_pb2.TrainingLoopStarted(rank=1))  # its peer, late
    assert len(decisions(plane, job_id)) == 2
    for s in w.values():
        drain(s)  # (the first relaunch's commands)
    store.down = False
    deadline, placed = time.monotonic() + 10, False
    while not placed and time.monotonic() < deadline:  # the next retry of the verification relaunches
        placed = any(c.WhichOneof("command") == "launch" for s in w.values() for c in drain(s))
        time.sleep(0.05)
    assert placed, [e.message for e in plane.events(job_id)]
    plane.rank_event(w["wa"], job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN, [e.message for e in plane.events(job_id)]
    plane.rank_event(w["wb"], job_id, 1, started=engine_pb2.TrainingLoopStarted(rank=1))
    assert plane.get(job_id).state == JobState.RUNNING


def test_a_survivors_collective_held_past_the_relaunch_and_its_replaced_exit_are_one_incident(plane, store):
    # Session 38 (order43), the rest of CI stop 43's class: the survivor's broken collective
    # reaches L1-3 after the cause was decided and is held for its attribution window; the
    # relaunch is placed meanwhile and kills the survivor, whose exit is stated replaced and so
    # published at once (not behind its held symptom): it took the survivor's dying count, and
    # the collective, released after it with no generation (the relay stamped none on the
    # incarnation it admitted), was not known replaced: decided as a second fault.
    from services.contract.relay import pack

    from .test_fencing import launched

    w = {n: plane.register(n) for n in ("wa", "wb")}
    job_id = plane.submit(dp=2, steps=20, extra="liveness: {attribution_seconds: 8}").job_id
    first = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
    for rank, (n, _) in first.items():
        plane.rank_event(w[n], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    store.down = True  # the relaunch waits for the store
    plane.rank_exited(w[first[1][0]], job_id, 1, exit_code=-9, generation=first[1][1])  # the cause
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="comm_error", detail="Connection closed by peer")
    ev = worker_pb2.RankEvent(
        job_id=job_id, rank=0, generation=first[0][1], routed=pack(failed, Module.L2_TRAINING_LOOP)
    )
    plane.c.sessions.on_worker_event(w[first[0][0]], control_pb2.WorkerEvent(rank_event=ev))  # held by L1-3
    store.down = False
    deadline, second = time.monotonic() + 10, {}
    while not second and time.monotonic() < deadline:  # the next retry of the verification relaunches
        second = {r.rank: (n, r.generation) for n, s in w.items() for r in launched(drain(s))}
        time.sleep(0.05)
    assert second, [e.message for e in plane.events(job_id)]
    plane.rank_exited(w[first[0][0]], job_id, 0, exit_code=-9, generation=first[0][1])  # killed: replaced
    said = "rank 0 failed at step 3: Connection closed by peer"
    deadline, symptom = time.monotonic() + 20, []
    while not symptom and time.monotonic() < deadline:  # L1-3's window ends
        symptom = [e.message for e in plane.events(job_id) if e.type == "fault" and said in e.message]
        time.sleep(0.05)
    events = [e.message for e in plane.events(job_id)]
    assert len(symptom) == 1, events
    assert len(decisions(plane, job_id)) == 1, events
    assert symptom[0].endswith("(consequence of rank 1's rank_exit)"), events


def test_a_ranks_step_fault_after_its_exit_is_the_incidents_consequence(plane, store):
    # Session 38 (order43): a rank blocked on a step fault, then killed: its exit (its node
    # agent's watcher) came before its StepFaultReported (its own stream), which was decided
    # as a second fault (a rollback during the restart).
    job_id, w = running(plane, "wa", "wb")
    store.down = True  # the relaunch waits unplaced
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    nan = dict(job_id=job_id, step=6, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, detail="training loss is nan")
    plane.rank_event(w["wb"], job_id, 1, step_fault=engine_pb2.StepFaultReported(rank=1, **nan))
    made = decisions(plane, job_id)
    assert len(made) == 1, made
    faults = [e.message for e in plane.events(job_id) if e.type == "fault"]
    assert faults[-1].endswith("(consequence of rank 1's rank_exit)"), faults
