"""A resize as a table of transitions (services/control/orchestrator/resize_machine.py): each
event gives the new ``_Scale`` (None: the resize is over) and the effects, in the order they
are performed, without a bus, a port, a lock or a clock."""

from __future__ import annotations

from services.contract import Module, engine_pb2
from services.control.orchestrator import resize_machine as rzm
from services.control.orchestrator.effects import NoneReady, Record, ResetFaults, StartGroup, TakeLayout, ToRanks
from services.control.orchestrator.job import ORCH, _Scale
from services.jobspec import at_data_parallel_size, parse_job_spec

from .conftest import spec_yaml

SPEC = parse_job_spec(spec_yaml(dp=2))
TO_DP4 = at_data_parallel_size(SPEC, 4, source="--dp 4")


def scale(**kw) -> _Scale:
    return _Scale(TO_DP4, "scale by the operator", old_dp=2, since=100.0, **kw)


def test_started_journals_the_pause_before_it_is_sent() -> None:
    pause = engine_pb2.PauseTraining(job_id="j", seq=4, checkpoint=False)
    state, effects = rzm.started(scale(), SPEC, pause, "at the first step boundary every rank agrees on")
    assert state.phase == rzm.PAUSING
    assert [type(e) for e in effects] == [Record, ToRanks]  # (the record first: ``_send_again`` relies on it)
    record, send = effects
    assert (record.source, record.kind) == (ORCH, "decision")
    assert record.message.startswith("scale by the operator: ")
    assert "parallel.dp 2 -> 4" in record.message and "ranks pause at the first step boundary" in record.message
    assert send.cmd is pause


def test_all_paused_asks_l1_4_for_a_rebuild_at_the_new_layout() -> None:
    state, ask = rzm.all_paused(scale(), "j")
    assert state.phase == rzm.REBUILDING
    assert ask.job_id == "j" and ask.in_place
    assert ask.reason == "scale by the operator: dp 2 -> 4"
    assert (ask.layout.dp, ask.layout.micro_batch_size, ask.layout.grad_accum) == (
        4,
        TO_DP4.data.micro_batch_size,
        TO_DP4.data.grad_accum,
    )


def test_a_refused_rebuild_resumes_the_ranks_at_the_old_size() -> None:
    state, effects = rzm.rebuild_refused(scale(phase=rzm.REBUILDING), "j", "1 slot free, 2 needed", 17)
    assert state is None
    resume, record = effects
    assert resume == ToRanks(engine_pb2.ResumeTraining(job_id="j"))
    assert (record.source, record.kind) == (Module.L1_RECOVERY_CONTROLLER, "scale")
    assert record.message == (
        "scale by the operator to dp 4 not done: 1 slot free, 2 needed; the ranks go on at dp 2 from step 17"
    )


def test_a_commanded_rebuild_takes_the_layout_then_resumes_into_it() -> None:
    s = scale(phase=rzm.REBUILDING)
    state, effects = rzm.rebuild_commanded(s, "j")
    assert state is s
    assert effects == [NoneReady(), TakeLayout(TO_DP4), ToRanks(engine_pb2.ResumeTraining(job_id="j", rebuild=True))]


def test_all_ready_starts_the_group_and_names_the_healed_ranks() -> None:
    s = scale(phase=rzm.REBUILDING, healed_from={3: 1, 2: 0, 1: 0})  # (rank 1 was kept: not named)
    state, effects = rzm.all_ready(s, 40, now=112.5)
    assert state is None
    assert effects[:2] == [StartGroup(), ResetFaults()]
    record = effects[2]
    assert (record.source, record.kind) == (ORCH, "scale")
    assert record.message == (
        "scale by the operator done: dp 2 -> 4 at step 40 (rank 2 healed from rank 0's memory, rank 3 healed from rank 1's memory); "
        "2 ranks kept their processes; 12.5 s after it was asked; training resumed"
    )
    assert record.status_message == "scale by the operator done at step 40: dp 2 -> 4"


def test_a_shrink_keeps_the_new_size_and_heals_none() -> None:
    down = _Scale(at_data_parallel_size(SPEC, 1, source="--dp 1"), "grow back", old_dp=2, since=0.0)
    _, effects = rzm.all_ready(down, 5, now=1.0)
    assert "dp 2 -> 1 at step 5; 1 rank kept its process;" in effects[2].message
