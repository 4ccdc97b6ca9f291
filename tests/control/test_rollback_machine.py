"""A rollback in place as a table of transitions (services/control/orchestrator/
rollback_machine.py): each event gives the new ``_Reload`` (None: done) and the effects in
the order they are performed, without a bus, a port, a lock or a clock."""

from __future__ import annotations

from services.contract import Module, engine_pb2
from services.control.orchestrator import rollback_machine as rbm
from services.control.orchestrator.effects import Abandon, NoneReady, Record, ResetFaults, StartGroup, ToRanks
from services.control.orchestrator.job import ORCH, _Reload


def test_started_journals_the_pause_before_it_is_sent() -> None:
    pause = engine_pb2.PauseTraining(job_id="j", seq=3, checkpoint=False)
    state, (record, send) = rbm.started(_Reload("j:20", 20), pause, "after step 31")
    assert state.phase == rbm.PAUSING
    assert record == Record(
        ORCH,
        "decision",
        "rollback in place to checkpoint j:20 (step 20) by the operator: ranks pause after step 31 (no checkpoint), "
        "then load it into their live processes and train on from its step",
    )
    assert send == ToRanks(pause)


def test_all_paused_loads_the_version_into_the_live_ranks() -> None:
    state, effects = rbm.all_paused(_Reload("j:20", 20), "j", 31)
    assert state.phase == rbm.LOADING
    assert effects == [
        NoneReady(),
        Record(
            ORCH,
            "recovery",
            "all ranks paused after step 31; loading checkpoint j:20 (step 20) into their live processes",
        ),
        ToRanks(engine_pb2.ResumeTraining(job_id="j", reload_version="j:20")),
    ]


def test_all_ready_starts_the_group_and_leaves_the_later_versions_as_a_branch() -> None:
    versions = [(10, "j:10"), (20, "j:20"), (30, "j:30"), (40, "j:40")]
    reload = _Reload("j:20", 20, phase=rbm.LOADING, since=100.0)
    state, effects = rbm.all_ready(reload, versions, {"j:40"}, 2, 21, now=103.0)
    assert state is None
    assert effects[:3] == [Abandon(("j:30",)), StartGroup(), ResetFaults()]
    assert effects[3] == Record(
        Module.L2_TRAINING_LOOP,
        "recovery",
        "rollback in place done: all 2 ranks loaded checkpoint j:20 in their live processes (none relaunched) "
        "and go on from step 21, 3.0 s after it was asked; j:30 kept, never chosen by a recovery or a plain resume",
        status_message="rolled back in place to checkpoint j:20 at step 21",
    )


def test_all_ready_to_the_newest_abandons_nothing() -> None:
    _, effects = rbm.all_ready(_Reload("j:20", 20, since=0.0), [(20, "j:20")], set(), 2, 21, now=1.0)
    assert effects[0] == Abandon(())
    assert effects[3].message.endswith("1.0 s after it was asked")
