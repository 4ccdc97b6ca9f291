"""The static deadlock check of pipeline schedules (seed commentary 2.4), no processes."""

from __future__ import annotations

import pytest

from services.engine.schedule_check import (
    Action,
    ScheduleError,
    check_schedule,
    from_torch_order,
    gpipe_actions,
    one_f_one_b_actions,
    schedule_actions,
)

SIZES = [(1, 1), (2, 1), (2, 2), (2, 4), (3, 3), (3, 7), (4, 4), (4, 8), (8, 16)]


def _flat(steps):
    return [a for s in steps for a in (s if isinstance(s, tuple) else (s,))]


@pytest.mark.parametrize("stages,microbatches", SIZES)
def test_gpipe_passes_for_several_sizes(stages, microbatches):
    rounds = check_schedule(gpipe_actions(stages, microbatches), num_stages=stages, num_microbatches=microbatches)
    # Fill-drain critical path: every stage's forwards and backwards, each with a p2p step.
    assert rounds >= 2 * microbatches + 2 * (stages - 1)


@pytest.mark.parametrize("stages,microbatches", [(s, m) for s, m in SIZES if m >= s])
def test_1f1b_passes_for_several_sizes(stages, microbatches):
    rounds = check_schedule(one_f_one_b_actions(stages, microbatches), num_stages=stages, num_microbatches=microbatches)
    assert rounds >= 2 * microbatches


def test_1f1b_keeps_at_most_stages_minus_rank_micro_batches_in_flight():
    # The point of 1F1B (Narayanan et al. 2021): stage s holds <= S - s activations.
    stages, n = 4, 8
    for rank, steps in one_f_one_b_actions(stages, n).items():
        live = peak = 0
        for a in _flat(steps):
            live += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak == stages - rank


def test_torch_gpipe_ir_lowered_by_torch_passes():
    from torch.distributed.pipelining.schedules import ScheduleGPipe, _add_send_recv

    sched = ScheduleGPipe.__new__(ScheduleGPipe)  # the IR needs only these two fields
    sched._num_stages, sched._n_microbatches = 3, 4
    order = sched._get_pipeline_order()
    lowered = _add_send_recv({r: [a for a in order[r] if a is not None] for r in order}, lambda s: s, 3)
    assert check_schedule(from_torch_order(lowered), num_stages=3, num_microbatches=4) > 0


def test_torch_1f1b_ir_is_refused_because_its_last_stage_skips_micro_batch_0():
    # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last stage's forwards from 1
    # (a bug of the IR only; the runtime follows _step_microbatches, mirrored by ours).
    from torch.distributed.pipelining.schedules import Schedule1F1B

    sched = Schedule1F1B.__new__(Schedule1F1B)
    sched._num_stages, sched._n_microbatches = 2, 4
    with pytest.raises(ScheduleError, match=r"rank 1 step 6 \(1F4\): 1F4 is outside 2 stages x 4 micro-batches"):
        check_schedule(from_torch_order(sched._get_pipeline_order()), num_stages=2, num_microbatches=4)


def test_1f1b_with_its_fused_send_recv_split_send_first_deadlocks_and_names_the_cycle():
    # Both neighbours send before they receive: under blocking p2p each waits for the other.
    actions = {r: _flat(steps) for r, steps in one_f_one_b_actions(2, 4).items()}
    with pytest.raises(ScheduleError) as err:
        check_schedule(actions, num_stages=2, num_microbatches=4)
    assert str(err.value) == (
        "schedule deadlock: rank 0 step 3 (0SEND_F1) blocks in 0SEND_F1 waiting for rank 1; "
        "rank 1 blocks in 1SEND_B0 (step 3) waiting for rank 0 (cycle back to rank 0)"
    )


def test_sends_in_a_different_order_than_the_receives_are_refused():
    # GPipe, 2 stages: the last stage runs its backwards in the order 1, 0, so its first
    # gradient message is micro-batch 1's where rank 0 receives micro-batch 0's first.
    actions = gpipe_actions(2, 2)
    r1 = actions[1]
    k = r1.index(Action("B", 1, 0))
    r1[k:] = [Action("B", 1, 1), Action("SEND_B", 1, 1), Action("B", 1, 0), Action("SEND_B", 1, 0)]
    with pytest.raises(ScheduleError, match="p2p matches in posting order") as err:
        check_schedule(actions, num_stages=2, num_microbatches=2)
    assert "message 0 is 1SEND_B1" in str(err.value) and "receives 0RECV_B0" in str(err.value)


def test_receive_posted_before_its_sender_is_ready_deadlocks():
    # Rank 0 waits for B0's gradient before sending micro-batch 1's activations, but
    # rank 1 (GPipe) runs both forwards before any backward: a two-rank cycle.
    actions = gpipe_actions(2, 2)
    r0 = actions[0]
    recv = r0.pop(r0.index(Action("RECV_B", 0, 0)))
    r0.insert(r0.index(Action("SEND_F", 0, 1)), recv)
    deadlock = r"^schedule deadlock: rank 0 step 3 \(0RECV_B0\) blocks in 0RECV_B0 waiting for rank 1; rank 1 blocks in 1RECV_F1"
    with pytest.raises(ScheduleError, match=deadlock):
        check_schedule(actions, num_stages=2, num_microbatches=2)


def test_missing_receive_is_refused_naming_the_send():
    actions = gpipe_actions(3, 2)
    actions[2].remove(Action("RECV_F", 2, 1))
    with pytest.raises(ScheduleError, match=r"2F1 runs before 2RECV_F1 on rank 2"):
        check_schedule(actions, num_stages=3, num_microbatches=2)


def test_an_action_posted_twice_is_refused():
    actions = gpipe_actions(2, 2)
    actions[0].append(Action("SEND_F", 0, 1))
    with pytest.raises(ScheduleError, match="appears twice"):
        check_schedule(actions, num_stages=2, num_microbatches=2)


def test_send_without_receive_is_refused():
    # Rank 1 gets micro-batch 1 some other way (here: never receives, never computes it on
    # this rank), so rank 0's send would block forever.
    actions = {
        0: [Action("F", 0, 0), Action("SEND_F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0)],
        1: [Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0)],
    }
    with pytest.raises(ScheduleError, match=r"1F0 runs before 1RECV_F0"):
        check_schedule(actions, num_stages=2, num_microbatches=1)
    actions[1].insert(0, Action("RECV_F", 1, 0))
    assert check_schedule(actions, num_stages=2, num_microbatches=1) > 0
    actions[0].remove(Action("SEND_F", 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 1 step 0 \(1RECV_F0\): 1RECV_F0 has no matching 0SEND_F0 on rank 0"):
        check_schedule(actions, num_stages=2, num_microbatches=1)


def test_malformed_schedules_are_refused_with_the_field_named():
    with pytest.raises(ScheduleError, match=r"rank 0 never runs 0B1"):
        a = gpipe_actions(2, 2)
        a[0] = [x for x in a[0] if x not in (Action("B", 0, 1), Action("RECV_B", 0, 1))]
        check_schedule(a, num_stages=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="stage 1 belongs to rank 1"):
        a = gpipe_actions(2, 1)
        a[0].append(Action("F", 1, 0))
        check_schedule(a, num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="expected action lists for ranks"):
        check_schedule({0: []}, num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match="compute action 0F0 inside a send/receive batch"):
        check_schedule({0: [(Action("F", 0, 0),), Action("B", 0, 0)]}, num_stages=1, num_microbatches=1)
    with pytest.raises(ScheduleError, match="parallel.pipeline_schedule: expected one of"):
        schedule_actions("zero-bubble", 2, 2)
    with pytest.raises(ScheduleError, match="1f1b needs microbatches >= stages"):
        schedule_actions("1f1b", 4, 2)


def test_batched_send_and_receive_between_neighbours_complete_together():
    # The fused step that makes 1F1B safe: each side posts send + receive as one batch.
    a = {
        0: [Action("F", 0, 0), (Action("SEND_F", 0, 0), Action("RECV_B", 0, 0)), Action("B", 0, 0)],
        1: [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0)],
    }
    assert check_schedule(a, num_stages=2, num_microbatches=1) > 0


def test_parallel_strategy_refuses_a_failing_schedule_before_any_process_group(monkeypatch):
    import torch.distributed as dist

    from services.contract import engine_pb2
    from services.engine import parallel_strategy
    from services.jobspec import ModelSpec, ParallelSpec

    def broken(schedule, stages, microbatches):  # 1F1B with its fused send/recv split apart
        return {r: _flat(s) for r, s in one_f_one_b_actions(stages, microbatches).items()}

    monkeypatch.setattr("services.engine.schedule_check.schedule_actions", broken)
    pushed = []
    strategy = parallel_strategy.ParallelStrategy(
        pushed.append,
        pushed.append,
        pushed.append,
        model=ModelSpec(n_layers=4, d_model=64, n_heads=4, tie_embeddings=False),
        parallel=ParallelSpec(pp=2, pipeline_schedule="1f1b", microbatches=4),
    )
    msg = engine_pb2.RankAssignment(
        rank=0, world_size=2, backend="gloo", device="cpu", master_addr="127.0.0.1", master_port=1
    )
    with pytest.raises(ScheduleError, match=r"^schedule deadlock: rank 0 step 3 \(0SEND_F1\)"):
        strategy.rank_assignment(msg)
    assert pushed == [] and not dist.is_initialized()
