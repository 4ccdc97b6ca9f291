"""Inspect before acting (issue 29 item 9): with ``fault_policy.freeze_seconds`` a decided
relaunch is held while the ranks stay alive (FreezeTraining), until the hold runs out or the
operator thaws or stops the job; a control restarted during the hold keeps it. The decision
(``freeze_for``) is table-tested; the rest is driven in-process through the real bus, the test
standing in for the node agents and the store (fixtures of test_fault_policy.py)."""

from __future__ import annotations

import time

import pytest

from services.contract import control_pb2, engine_pb2
from services.control.__main__ import build
from services.control.fault_decision import Decision, freeze_for
from services.control.job_store import JobStore
from services.control.orchestrator import IllegalTransition
from services.jobspec import FaultPolicySpec, JobSpecError, parse_job_spec

from .conftest import Plane, drain, kinds, registration, spec_yaml, stop_plane, to_ranks
from .test_fault_policy import QUICK, REBUILD, commands, decisions, plane, running, saved, store  # noqa: F401

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def _decision(action: str, fault_class: str = "rank_exit") -> Decision:
    return Decision(fault_class, action, action, "", engine_pb2.STEP_RELAUNCH)


@pytest.mark.parametrize(
    ("policy", "action", "fault_class", "recovering", "held"),
    [
        ({}, "restart_ranks", "rank_exit", False, 0.0),  # off by default
        ({"freeze_seconds": 30}, "restart_ranks", "rank_exit", False, 30.0),
        ({"freeze_seconds": 30}, "rollback", "non_finite_loss", False, 30.0),
        ({"freeze_seconds": 30}, "exclude_node", "device_error", False, 30.0),
        ({"freeze_seconds": 30}, "restart_ranks", "rank_exit", True, 0.0),  # a fault during a recovery
        # One rule for every recovery that relaunches a rank: in place too (issue 29 item 9's gap).
        ({"freeze_seconds": 30}, "rebuild", "rank_exit", False, 30.0),
        ({"freeze_seconds": 30}, "shrink", "worker_lost", False, 30.0),
        ({"freeze_seconds": 30}, "rebuild", "slow_rank", False, 30.0),  # (slow_rank's replace)
        ({"freeze_seconds": 30}, "rebuild", "rank_exit", True, 0.0),  # a rank lost during a rebuild
        ({"freeze_seconds": 30, "freeze_classes": ["rank_exit"]}, "shrink", "worker_lost", False, 0.0),
        ({"freeze_seconds": 30}, "pause", "rank_oom", False, 0.0),
        ({"freeze_seconds": 30}, "skip_step", "gradient_overflow", False, 0.0),
        ({"freeze_seconds": 30}, "stop", "rank_exit", False, 0.0),
        ({"freeze_seconds": 30}, "ignore", "rank_exit", False, 0.0),
        ({"freeze_seconds": 30, "freeze_classes": ["rank_stalled"]}, "restart_ranks", "rank_exit", False, 0.0),
        ({"freeze_seconds": 30, "freeze_classes": ["rank_stalled"]}, "restart_ranks", "rank_stalled", False, 30.0),
    ],
)
def test_which_decisions_a_freeze_holds(policy, action, fault_class, recovering, held):
    assert freeze_for(FaultPolicySpec(**policy), _decision(action, fault_class), recovering=recovering) == held


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("fault_policy: {freeze_seconds: -1}", "fault_policy.freeze_seconds"),
        ("fault_policy: {freeze_seconds: 604801}", "fault_policy.freeze_seconds"),
        ("fault_policy: {freeze_classes: [rank_exitt]}", "freeze_classes: rank_exitt: unknown fault class"),
    ],
)
def test_a_bad_freeze_setting_is_one_line_naming_the_field(line, field):
    with pytest.raises(JobSpecError, match=field):
        parse_job_spec(spec_yaml(extra=line), "job.yaml")


HOLD = QUICK + "\nfault_policy: {freeze_seconds: 30}"


def test_a_killed_rank_with_a_freeze_holds_the_survivor_until_the_operator_thaws(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", extra=HOLD)
    v = saved(plane, w["wa"], job_id, 1, step=4)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)

    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN
    assert s.message.startswith("held for inspection after rank_exit of rank 1 until "), s.message
    assert s.message.endswith(
        f"(fault_policy.freeze_seconds): its ranks are alive and idle; then restart_ranks runs; `surgectl thaw "
        f"{job_id}` runs it now, `surgectl stop {job_id}` ends the job"
    ), s.message
    assert decisions(plane, job_id) == ["restart_ranks after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit)"]
    (freeze,) = [to_ranks(c) for c in drain(w["wa"])]  # no kill, no launch: only the hold
    assert isinstance(freeze, engine_pb2.FreezeTraining) and freeze.until_unix > time.time() + 25
    assert store.verified == 0  # (the recovery has not started)
    # The survivor's broken collective is a consequence, decided on no more.
    failed = engine_pb2.TrainingLoopFailed(step=3, fault_class="comm_error", detail="Connection closed by peer")
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert len(decisions(plane, job_id)) == 1

    s = plane.user(control_pb2.ResumeJobRequest(job_id=job_id, thaw_only=True))
    assert (s.state, s.message) == (JobState.FAULT_FROZEN, "recovering from rank_exit of rank 1")
    assert decisions(plane, job_id)[1] == "thawed by the operator: restart_ranks after rank_exit of rank 1 runs now"
    kill, launch = drain(w["wa"])
    assert (kill.release.kill, launch.launch.init.resume_version) == (True, v)
    assert launch.launch.init.hold_on_fault  # (a relaunched rank is held too)
    with pytest.raises(IllegalTransition, match="not held for inspection"):
        plane.user(control_pb2.ResumeJobRequest(job_id=job_id, thaw_only=True))


def test_the_hold_runs_out_and_the_decided_relaunch_runs(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", extra=QUICK + "\nfault_policy: {freeze_seconds: 0.3}")
    saved(plane, w["wa"], job_id, 1, step=4)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    assert kinds(drain(w["wa"])) == ["FreezeTraining"]
    deadline, cmds = time.monotonic() + 10, []  # (the test's own clock: the deadline pool's thread commands it)
    while "launch" not in kinds(cmds) and time.monotonic() < deadline:
        cmds += drain(w["wa"])
        time.sleep(0.05)
    assert kinds(cmds) == ["release", "launch"]
    assert (
        decisions(plane, job_id)[1]
        == "the hold for inspection ran out: restart_ranks after rank_exit of rank 1 runs now"
    )


def test_a_step_fault_held_keeps_its_verdict_until_the_thaw(plane, store):  # noqa: F811
    job_id, w = running(
        plane,
        "wa",
        "wb",
        extra=QUICK + "\nfault_policy: {freeze_seconds: 30, actions: {non_finite_loss: restart_ranks}}",
    )
    nan = dict(job_id=job_id, step=6, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, detail="training loss is nan")
    plane.rank_event(w["wa"], job_id, 0, step_fault=engine_pb2.StepFaultReported(rank=0, **nan))
    plane.rank_event(w["wb"], job_id, 1, step_fault=engine_pb2.StepFaultReported(rank=1, reminder=1, **nan))
    assert [kinds(drain(s)) for s in w.values()] == [["FreezeTraining"], ["FreezeTraining"]]  # no verdict yet
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id))  # (a plain resume thaws too)
    first = [to_ranks(c) for c in drain(w["wa"]) if c.WhichOneof("command") == "routed"]
    assert [(v.step, v.action) for v in first] == [(6, engine_pb2.STEP_RELAUNCH)]


def test_a_stop_during_the_hold_ends_the_job_without_the_relaunch(plane, store):  # noqa: F811
    job_id, w = running(plane, "wa", "wb", extra=HOLD)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    drain(w["wa"])
    s = plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert (s.state, s.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert "held for inspection (killed; the decided recovery did not run)" in s.message
    assert kinds(drain(w["wa"])) == ["release"]


def test_a_control_restarted_during_the_hold_keeps_it_and_then_runs_the_relaunch(tmp_path, store):  # noqa: F811
    db = tmp_path / "control.db"
    journal = JobStore(db)
    ctl = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    job_id, w = running(ctl, "wa", "wb", extra=HOLD)
    saved(ctl, w["wa"], job_id, 1, step=4)
    ctl.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    until = ctl.get(job_id).message
    stop_plane(ctl.c)

    journal = JobStore(db)
    ctl = Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0))
    try:
        s = ctl.get(job_id)
        assert (s.state, s.message) == (JobState.FAULT_FROZEN, until)
        reg = registration("wa")  # the survivor's node agent re-attaches the rank it still runs
        reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=0)]))
        wa = ctl.c.sessions.open(reg)
        ctl.register("wb")
        ctl.user(control_pb2.ResumeJobRequest(job_id=job_id, thaw_only=True))
        assert "launch" in kinds(drain(wa))
        assert ctl.get(job_id).message == "recovering from rank_exit of rank 1"
    finally:
        ctl.user(control_pb2.StopJobRequest(job_id=job_id))
        stop_plane(ctl.c)


def test_a_held_replica_divergence_is_rolled_back_in_place_once_thawed(plane, store):  # noqa: F811
    extra = QUICK + "\nintegrity: {replica_check_every_steps: 4}\nfault_policy: {freeze_seconds: 30}"
    job_id, w = running(plane, "wa", "wb", extra=extra)
    v1 = saved(plane, w["wa"], job_id, 1, step=4)
    store.verdicts = [(v1, 4, True)]
    detail = "data-parallel replicas differ after step 8 in tok_emb.weight: dp ranks 0, 1 differ"
    failed = engine_pb2.TrainingLoopFailed(step=8, fault_class="replica_divergence", detail=detail)
    plane.rank_event(w["wa"], job_id, 0, failed=failed)
    assert decisions(plane, job_id)[0].endswith("; in place: the live ranks load it, none is relaunched")
    assert kinds(drain(w["wa"])) == ["FreezeTraining"]
    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, thaw_only=True))
    (reload,) = [to_ranks(c) for c in drain(w["wa"])]
    assert reload.reload_version == v1


def test_a_rebuild_in_place_is_held_too_then_thaws_its_survivors_and_replaces_the_lost_rank(plane, store):  # noqa: F811
    extra = REBUILD.replace("worker_lost: rebuild}", "worker_lost: rebuild}, freeze_seconds: 30")
    job_id, w = running(plane, "wa", "wb", "wc", dp=3, extra=extra)
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)

    s = plane.get(job_id)
    assert s.state == JobState.FAULT_FROZEN
    assert "then rebuild runs; `surgectl thaw" in s.message, s.message
    assert decisions(plane, job_id) == [
        "rebuild after rank_exit of rank 1 on wb (restart 1 of 3 for rank_exit); survivors keep training, "
        "rank 1 is replaced and heals from a live peer"
    ]
    # Only the hold: no replacement launched, no rendezvous, the survivors alive and idle.
    held = {n: [to_ranks(c) for c in drain(w[n])] for n in ("wa", "wc")}
    assert all(len(v) == 1 and isinstance(v[0], engine_pb2.FreezeTraining) and not v[0].thaw for v in held.values())
    assert kinds(drain(w["wb"])) in ([], ["FreezeTraining"])  # (the lost rank's node)
    # A survivor's broken group during the hold is a consequence, decided on no more.
    broken = engine_pb2.ParallelTopologyError(rank=0, fault_class="comm_error", detail="Connection closed by peer")
    broken.failure.cause = 7  # FAILURE_COMMUNICATION
    plane.rank_event(w["wa"], job_id, 0, broken=broken)
    assert len(decisions(plane, job_id)) == 1

    plane.user(control_pb2.ResumeJobRequest(job_id=job_id, thaw_only=True))
    assert decisions(plane, job_id)[1] == "thawed by the operator: rebuild after rank_exit of rank 1 runs now"
    on_a, on_b, on_c = commands(w["wa"]), commands(w["wb"]), commands(w["wc"])
    # The survivors get the rebuild's rendezvous and are thawed (in either order: the thaw goes
    # after the decision's journal write); neither is killed.
    thaws = [to_ranks(c) for c in drain(w["wa"])]  # (none left: `commands` drained them)
    for on in (on_a, on_c):
        assert sorted(m for _, m in on) == ["FreezeTraining", "RebuildParallelGroup"], on
    assert not thaws and "release" not in [k for k, _ in on_a + on_c]
    assert [k for k, _ in on_b if k != "routed"] == ["release", "launch"], on_b
    launch = [m for k, m in on_b if k == "launch"][0]
    assert [r.rank for r in launch.ranks] == [1] and launch.init.heal_from_peer


def test_a_slow_rank_replaced_under_a_hold_is_frozen_alive_until_the_hold_runs_out(plane, store):  # noqa: F811
    from .test_slow_rank_policy import beats

    extra = "liveness: {attribution_seconds: 0}\nfault_policy: {actions: {slow_rank: replace}, freeze_seconds: 0.3}"
    job_id, w = running(plane, "wa", "wb", "wc", extra=extra)
    beats(plane, {0: w["wa"], 1: w["wb"]}, job_id, {0: 0.1, 1: 0.3}, steps=10)
    assert decisions(plane, job_id)[0].startswith("replace after slow_rank of rank 1 on wb")
    # Both ranks held, the slow one included (alive: the one an operator would py-spy).
    assert kinds(drain(w["wa"])) == ["FreezeTraining"] and kinds(drain(w["wb"])) == ["FreezeTraining"]
    deadline, on_a, on_b = time.monotonic() + 10, [], []
    while (len(on_a) < 3 or not any(k == "release" for k, _ in on_b)) and time.monotonic() < deadline:
        on_a, on_b = on_a + commands(w["wa"]), on_b + commands(w["wb"])
        time.sleep(0.05)
    assert decisions(plane, job_id)[1] == "the hold for inspection ran out: rebuild after slow_rank of rank 1 runs now"
    # The survivor: thawed (it steps on, then rebuilds), its new probe peers (wc), the rendezvous.
    assert sorted(k if k != "routed" else m for k, m in on_a) == ["FreezeTraining", "RebuildParallelGroup", "launch"]
    release = [m for k, m in on_b if k == "release"][0]
    assert list(release.ranks) == [1] and release.kill
    launched = [m for k, m in commands(w["wc"]) if k == "launch"]
    assert [r.rank for r in launched[0].ranks] == [1]


def test_an_ignored_replica_divergence_lets_the_waiting_ranks_go_on(plane, store):  # noqa: F811
    # The ranks wait in their loop for the decision on a divergence (issue 29 items 3 and 9): an
    # ignore used to leave them there for good, the job RUNNING with its step frozen.
    extra = QUICK + "\nintegrity: {replica_check_every_steps: 4}\nfault_policy: {actions: {replica_divergence: ignore}}"
    job_id, w = running(plane, "wa", "wb", extra=extra)
    detail = "data-parallel replicas differ after step 8 in tok_emb.weight: dp ranks 0, 1 differ"
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        failed = engine_pb2.TrainingLoopFailed(step=8, fault_class="replica_divergence", detail=detail)
        plane.rank_event(session, job_id, rank, failed=failed)
    assert decisions(plane, job_id)[0].startswith("ignore replica_divergence of rank 0")
    assert plane.get(job_id).state == JobState.RUNNING
    deadline, got = time.monotonic() + 10, []
    while not got and time.monotonic() < deadline:  # (after the decision's journal write)
        got += [to_ranks(c) for c in drain(w["wa"])]
        time.sleep(0.05)
    time.sleep(0.3)
    got += [to_ranks(c) for c in drain(w["wa"])]
    assert len(got) == len(decisions(plane, job_id)), (got, decisions(plane, job_id))  # one per report decided
    assert got and all(isinstance(m, engine_pb2.ResumeTraining) and m.go_on_at_step == 8 for m in got), got
    assert not any(m.reload_version or m.rebuild for m in got)
