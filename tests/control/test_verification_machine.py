"""A recovery's verification and placement steps as a table (services/control/orchestrator/
verification_machine.py): the store's verdicts in, what the job learns out (a version struck
for its bytes, one committed it never heard of); the store not asked (wait) or refusing
(choose among the versions reported); the version a relaunch loads; a rollback loaded into the
live ranks; a relaunch overdue reported. No bus, no lock, no clock."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control.orchestrator import verification_machine as vm
from services.control.orchestrator.effects import Record, ToRanks
from services.control.orchestrator.job import ORCH
from services.jobspec import FaultPolicySpec

L5 = Module.L5_CHECKPOINT_MANAGER
UNREACHABLE, TIMEOUT, REJECTED = store_pb2.UNREACHABLE, store_pb2.TIMEOUT, store_pb2.REJECTED


def verdict(version: str, step: int, ok: bool = True, cause: int = 0, reason: str = "") -> store_pb2.CheckpointVerdict:
    return store_pb2.CheckpointVerdict(
        info=store_pb2.CheckpointInfo(version=version, step=step), ok=ok, cause=cause, reason=reason
    )


def struck(version: str, step: int, reason: str) -> list:
    return [
        vm.Strike(version),
        Record(L5, "checkpoint", f"checkpoint {version} at step {step} fails verification ({reason}); never loaded"),
    ]


def learnt(version: str, step: int) -> list:
    said = f"checkpoint {version} at step {step} verified: committed by the store, its completion report never arrived"
    return [vm.Learn(step, version), Record(L5, "checkpoint", said)]


KNOWN = ((4, "j:1"), (8, "j:2"))


@pytest.mark.parametrize(
    ("verdicts", "abandoned", "unusable", "effects"),
    [
        pytest.param([verdict("j:1", 4), verdict("j:2", 8)], (), (), [], id="all-known-and-ok"),
        pytest.param(
            [verdict("j:2", 8, ok=False, cause=store_pb2.VERDICT_CORRUPT, reason="digest mismatch")],
            (),
            (),
            struck("j:2", 8, "digest mismatch"),
            id="corrupt-struck",
        ),
        pytest.param(
            [verdict("j:2", 8, ok=False, cause=store_pb2.VERDICT_MISSING_FILE, reason="no shard 1")],
            (),
            (),
            struck("j:2", 8, "no shard 1"),
            id="missing-file-struck",
        ),
        pytest.param(
            [verdict("j:2", 8, ok=False, reason="hash")],
            (),
            (),
            struck("j:2", 8, "hash"),
            id="untyped-old-store-struck",
        ),
        pytest.param(
            [verdict("j:2", 8, ok=False, cause=store_pb2.VERDICT_CORRUPT, reason="x")],
            (),
            ("j:2",),
            [],
            id="struck-already-said-once",
        ),
        pytest.param(
            [verdict("j:2", 8, ok=False, cause=store_pb2.VERDICT_CORRUPT, reason="x")] * 2,
            (),
            (),
            struck("j:2", 8, "x"),
            id="twice-in-one-answer-struck-once",
        ),
        pytest.param(
            [verdict("j:2", 8, ok=False, cause=store_pb2.VERDICT_OK, reason="busy")],
            (),
            (),
            [],
            id="a-failure-not-of-its-bytes-strikes-nothing",
        ),
        pytest.param([verdict("j:3", 12)], (), (), learnt("j:3", 12), id="committed-report-lost-learnt"),
        pytest.param([verdict("j:3", 12)] * 2, (), (), learnt("j:3", 12), id="learnt-once"),
        pytest.param([verdict("j:3", 12)], ("j:3",), (), [], id="another-branch-never-learnt"),
        pytest.param(
            [verdict("j:3", 12, ok=False, cause=store_pb2.VERDICT_CORRUPT, reason="x")],
            ("j:3",),
            (),
            [],
            id="another-branch-never-struck",
        ),
    ],
)
def test_verified(verdicts, abandoned, unusable, effects):
    assert vm.verified(verdicts, KNOWN, frozenset(abandoned), frozenset(unusable)) == effects


@pytest.mark.parametrize(
    ("cause", "effects"),
    [
        (UNREACHABLE, [vm.WaitStore("waiting for the store (unreachable: s:1 down) to verify the checkpoints")]),
        (TIMEOUT, [vm.WaitStore("waiting for the store (timeout: s:1 down) to verify the checkpoints")]),
        (
            REJECTED,
            [
                Record(
                    L5, "recovery", "checkpoint verification refused (s:1 down); choosing among the versions reported"
                ),
                vm.Place(),
            ],
        ),
    ],
)
def test_verification_failed(cause, effects):
    assert vm.verification_failed(cause, "s:1 down") == effects


VERSIONS = ((4, "j:1"), (8, "j:2"), (12, "j:3"))


@pytest.mark.parametrize(
    ("unusable", "bound", "version"),
    [
        ((), None, "j:3"),
        (("j:3",), None, "j:2"),
        ((), 9, "j:2"),  # a rollback's bound: none after the faulting step
        ((), 8, "j:2"),  # (at the bound is allowed)
        (("j:1",), 7, ""),  # nothing usable within the bound
        (("j:1", "j:2", "j:3"), None, ""),
    ],
)
def test_pick_version(unusable, bound, version):
    assert vm.pick_version(VERSIONS, unusable, bound) == version
    assert vm.pick_version((), unusable, bound) == ""


def test_reload_live_says_it_commands_the_load_and_arms_the_restore_deadline():
    assert vm.reload_live("j", "j:2", 4) == [
        Record(ORCH, "recovery", "loading checkpoint j:2 into the 4 live ranks (none relaunched)"),
        ToRanks(engine_pb2.ResumeTraining(job_id="j", reload_version="j:2")),
        vm.ArmRestore(in_place=False),
    ]


@pytest.mark.parametrize(
    ("action", "started", "missing", "rank"),
    [
        ("restart_ranks", {0, 2}, [1, 3], 1),  # a relaunch's: its first missing rank
        ("restart_ranks", {0, 1, 2, 3}, [], 0),
        ("rebuild", {0, 2}, [1, 3], 3),  # a rebuild's: the rank it replaces (3), never a survivor
    ],
)
def test_overdue_report(action, started, missing, rank):
    assert vm.missing(4, started) == missing
    report = vm.overdue_report("j", action, 3, missing, "not ready", 5.0)
    assert report == control_pb2.FaultReport(
        job_id="j",
        grade=control_pb2.SEVERE,
        fault_class="recovery_timeout",
        source=Module.L1_RECOVERY_CONTROLLER,
        rank=rank,
        detected_unix=5.0,
        occurred_unix=5.0,
        detail="not ready",
    )


@pytest.mark.parametrize(
    ("fault_class", "again"),
    [("rank_silent", True), ("rank_exit", True), ("rank_stalled", True), ("rank_released", False)],
)
def test_a_fault_while_a_restored_recovery_waits_relaunches_it_again_unless_control_asked_for_the_exit(
    fault_class, again
):
    cause = control_pb2.FaultReport(job_id="j", rank=1, fault_class="rank_exit")
    effects = vm.resumed_fault(cause, "rank_exit", fault_class, 0, f"SEVERE {fault_class}: x")
    fault = Record(
        Module.L1_FAULT_DETECTOR,
        "fault",
        f"SEVERE {fault_class}: x (during the recovery from rank 1's rank_exit, resumed after a control restart)",
    )
    if not again:
        assert effects == [fault]
        return
    assert effects == [
        fault,
        vm.RelaunchAgain(),
        Record(
            ORCH,
            "decision",
            "relaunch again for the recovery from rank_exit of rank 1 interrupted by the control restart: the "
            f"relaunched ranks are not all there ({fault_class} of rank 0); no further restart spent",
        ),
    ]


SCRATCH = "restart from scratch after rank_exit of rank 1: "
NONE_YET = "no checkpoint was committed yet (fault policy no_checkpoint: restart_from_scratch)"


@pytest.mark.parametrize(
    ("action", "reload", "version", "versions", "no_checkpoint", "effects"),
    [
        pytest.param(
            "restart_ranks",
            False,
            "j:2",
            2,
            "restart_from_scratch",
            [vm.Relaunch("j:2", "checkpoint j:2")],
            id="relaunch",
        ),
        pytest.param(
            "rebuild", False, "", 0, "stop", [vm.Relaunch("", "a live peer's memory")], id="rebuild-loads-none"
        ),
        pytest.param(
            "restart_ranks",
            False,
            "",
            0,
            "restart_from_scratch",
            [
                vm.Counted("rank_exit", "restart_from_scratch"),
                Record(ORCH, "recovery", SCRATCH + NONE_YET),
                vm.Relaunch("", "scratch"),
            ],
            id="from-scratch",
        ),
        pytest.param(
            "restart_ranks",
            False,
            "",
            3,
            "stop",
            [
                vm.Counted("rank_exit", "stop"),
                Record(
                    ORCH,
                    "decision",
                    "stop after rank_exit of rank 1: none of its 3 committed checkpoints verifies (fault policy "
                    "no_checkpoint: stop)",
                ),
                vm.Stop(
                    control_pb2.FAILED,
                    "none of its 3 committed checkpoints verifies; not restarted from scratch (no_checkpoint: stop); "
                    "every checkpoint is kept",
                ),
            ],
            id="stop",
        ),
        pytest.param("rollback", True, "j:1", 2, "stop", [vm.ReloadInPlace("j:1")], id="reload-in-place"),
        pytest.param(
            "rollback",
            True,
            "",
            0,
            "restart_from_scratch",
            [
                vm.Counted("rank_exit", "restart_from_scratch"),
                Record(ORCH, "recovery", SCRATCH + NONE_YET),
                Record(ORCH, "recovery", "no version to load in place: every rank is relaunched"),
                vm.NoReload(),
                vm.Relaunch("", "scratch"),
            ],
            id="reload-with-nothing-to-load-relaunches",
        ),
    ],
)
def test_placement(action, reload, version, versions, no_checkpoint, effects):
    policy = FaultPolicySpec(no_checkpoint=no_checkpoint)
    got = vm.placement(
        action=action, fault_class="rank_exit", rank=1, reload=reload, version=version, versions=versions, policy=policy
    )
    assert got == effects


def test_relaunched():
    from services.jobspec import at_data_parallel_size, parse_job_spec

    from .conftest import spec_yaml

    spec = parse_job_spec(spec_yaml(dp=4))
    dp2 = at_data_parallel_size(spec, 2, source="shrink")
    assert vm.relaunched(None, 4, False, "checkpoint j:2") == [vm.Placed("checkpoint j:2"), vm.ArmRestore(False)]
    assert vm.relaunched(dp2, 4, True, "a live peer's memory") == [
        vm.Shrunk(dp2),
        vm.Placed("a live peer's memory"),
        vm.ArmRestore(True),
    ]
    assert vm.relaunched(dp2, 2, True, "x") == [vm.Placed("x"), vm.ArmRestore(True)]  # (shrunk already: the same size)
