"""Boundary commands by agreement (issue 28 item 4): the fold rule, its model check over
delivery orders and delays, and two real gloo ranks given every boundary command 5 s late
on one of them."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest
from rank_fakes import free_port

from services.common.boundary_commands import (
    WINDOW,
    HeldCommands,
    UnsequencedCommand,
    agreed,
    boundaries,
    slots,
)
from services.contract import engine_pb2
from services.rank.command_delay import DELAY_ENV, CommandDelay, parse_delays
from tests.rank_forks import run_ranks_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def fold(windows: list[list[int]]) -> list[int]:
    """What each rank reads from one all-reduce (sum) of every rank's slots."""
    summed = [sum(column) for column in zip(*(slots(w) for w in windows), strict=True)]
    return [agreed(w, summed, len(windows)) for w in windows]


def test_ranks_that_received_different_commands_agree_on_the_highest_every_rank_holds():
    # Rank 0 got commands 1..3, rank 1 only 1, rank 2 1..2: every rank agrees on 1.
    assert fold([[1, 2, 3], [1], [1, 2]]) == [1, 1, 1]
    assert fold([[1, 2, 3], [1, 2, 3], [1, 2, 3]]) == [3, 3, 3]
    assert fold([[5, 6], []]) == [0, 0]  # one rank holds none: nothing is agreed
    assert fold([[7]]) == [7]  # one rank: its own
    # A window of WINDOW numbers whose slots wrap (seq % WINDOW) still agrees on its prefix.
    assert fold([[6, 7, 8, 9], [6, 7]]) == [7, 7]
    assert len(slots([1, 2, 3, 4, 5])) == WINDOW and sum(slots([1, 2, 3, 4, 5])) == WINDOW  # capped


def test_a_rank_holds_a_command_once_counts_only_the_run_without_a_gap_and_hands_it_out_at_its_boundary():
    held = HeldCommands()
    with pytest.raises(UnsequencedCommand, match="PauseTraining.seq"):
        held.receive(engine_pb2.PauseTraining(job_id="j"))
    assert held.receive(engine_pb2.RevokeStandingOrder(order=7, seq=2))
    assert held.window() == []  # 1 has not come: 2 overtook it, so it waits
    assert held.receive(engine_pb2.PauseTraining(seq=1, checkpoint=True))
    assert not held.receive(engine_pb2.PauseTraining(seq=1))  # a copy (a restarted control's): dropped
    assert held.window() == [1, 2]
    held.agree(2)
    assert held.window() == [] and [m.seq for m in held.due(9)] == [1, 2]
    assert not held.receive(engine_pb2.StopTraining(seq=2))  # at or below the agreed: void
    assert held.receive(engine_pb2.StopTraining(seq=3, at_step=20))
    held.agree(3)
    assert held.due(19) == [] and [m.seq for m in held.due(20)] == [3]  # not before its at_step
    # A group (re)started at the job's number 5: what it held up to it is void.
    assert held.receive(engine_pb2.PauseTraining(seq=4))
    held.start(5)
    assert held.window() == [] and held.due(100) == []
    assert held.receive(engine_pb2.StopTraining(seq=6))
    assert held.take(engine_pb2.StopTraining, 0).seq == 6  # a paused rank's stop: agreed or not


def test_model_check_every_delivery_order_and_delay_gives_every_command_one_boundary():
    """The deadlock this rule removes is two ranks at different boundaries (a stop's save on
    one meeting the next step's all-reduce on the other). Over every way three commands can
    reach two ranks (each at step 1..4, in any order), and a sample of three ranks: each
    command takes effect at one boundary on every rank, the first step at which every rank
    held it and every command before it, and never before that."""
    worlds = [
        [dict(zip((1, 2, 3), a, strict=True)), dict(zip((1, 2, 3), b, strict=True))]
        for a in itertools.product(range(1, 5), repeat=3)
        for b in itertools.product(range(1, 5), repeat=3)
    ]
    worlds += [
        [dict(zip((1, 2, 3), (a, b, c), strict=True)) for a, b, c in ranks]
        for ranks in itertools.islice(itertools.product(itertools.permutations((1, 3, 5)), repeat=3), 0, None, 7)
    ]
    for arrivals in worlds:
        out = boundaries(arrivals, steps=12)
        for seq, at in out.items():
            assert len(set(at)) == 1, (arrivals, out)  # one boundary for every rank
            held_by_all = max(a[s] for a in arrivals for s in range(1, seq + 1))
            assert at[0] == held_by_all, (arrivals, out)


def test_the_old_guessed_boundary_is_what_the_model_would_reject():
    # The rule it replaces: control names step + 2 when it sends; a rank that gets the command
    # after that step has passed it stops later than its peer (the hang this issue reports).
    sent_at, delay_steps = 10, 5
    named = sent_at + 2
    old = [named, max(named, sent_at + delay_steps)]  # rank 0 on time, rank 1 late
    assert len(set(old)) == 2
    new = boundaries([{1: sent_at}, {1: sent_at + delay_steps}], steps=30)[1]
    assert len(set(new)) == 1 and new[0] == sent_at + delay_steps


def test_the_delay_hook_is_off_unless_set_and_parses_its_entries(monkeypatch):
    monkeypatch.delenv(DELAY_ENV, raising=False)
    t0 = time.monotonic()
    CommandDelay.from_env(1).hold("surge.v1.PauseTraining")
    assert time.monotonic() - t0 < 0.05
    assert parse_delays("PauseTraining+StopTraining:5:rank=1,RevokeStandingOrder:2", 1) == {
        "PauseTraining": 5.0,
        "StopTraining": 5.0,
    }
    assert parse_delays("RevokeStandingOrder:2", 0) == {"RevokeStandingOrder": 2.0}
    # ``job``: that job's ranks only (its name: the id less its suffix); none: every job's.
    scoped = "PauseTraining:5:rank=1:job=tintr,StopTraining:2:rank=1"
    assert parse_delays(scoped, 1, "tintr-0a1b2c") == {"PauseTraining": 5.0, "StopTraining": 2.0}
    assert (
        parse_delays(scoped, 1, "tintr2-0a1b2c") == parse_delays(scoped, 1, "crestart-0a1b2c") == {"StopTraining": 2.0}
    )
    with pytest.raises(ValueError, match="SURGE_COMMAND_DELAY: 'Pause:x'"):
        parse_delays("Pause:x", 0)


DELAY_S = 5.0


@pytest.mark.timeout(240)
def test_pause_stop_scale_and_revoke_delivered_5_s_late_to_one_rank_take_effect_at_one_boundary(tmp_path):
    """Two gloo ranks (tests/engine/boundary_rank_main.py): each boundary command reaches rank 1
    5 s after rank 0. Both ranks keep training meanwhile and put it in force at the same step,
    the pause's and the stop's checkpoints meet in their collectives (no hang), and nothing
    fails. The scale's part is its pause without a checkpoint (the rebuild after it:
    tests/engine/test_resize_in_place.py)."""
    port = free_port()
    env = {**os.environ, DELAY_ENV: f"PauseTraining+StopTraining+RevokeStandingOrder:{DELAY_S:g}:rank=1"}
    t0 = time.monotonic()
    run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
        [[str(HERE / "boundary_rank_main.py"), str(r), str(port), str(tmp_path)] for r in (0, 1)],
        timeout=200,
        tail=3000,
        cwd=REPO,
        env=env,
    )
    wall = time.monotonic() - t0
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"]  # every step's agreed number, the same on both ranks
    first = {seq: next(step for step, a in r0["steps"] if a >= seq) for seq in (1, 2, 3, 4)}
    assert r0["revoked"] == r1["revoked"] == {"7": first[1]}  # the revoke: one boundary
    assert r0["paused"] == r1["paused"] == [first[2], first[3]]  # the pause, the scale's pause
    assert r0["finished"] == r1["finished"] == [first[4], True]  # the stop
    assert r0["committed"] == [first[2], first[4]]  # both checkpoints saved: their collectives met
    for seq in (1, 2, 3, 4):
        # Rank 0 had the command seconds before rank 1 and kept training until rank 1 held it.
        assert r1["handed"][str(seq)] > r0["handed"][str(seq)], (seq, r0["handed"], r1["handed"])
        assert first[seq] > r0["handed"][str(seq)]
    assert wall >= 4 * DELAY_S  # the delays happened
