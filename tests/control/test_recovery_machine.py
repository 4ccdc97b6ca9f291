"""A recovery's waits as a table (services/control/orchestrator/recovery_machine.py): each
transition is (state, event, now) -> (new state, effects), checked without a bus, a timer,
a lock or a clock."""

from __future__ import annotations

import pytest

from services.contract import Module
from services.control.orchestrator import recovery_machine as rm
from services.control.orchestrator.effects import Record, Status
from services.control.orchestrator.job import (
    NO_CAPACITY,
    ORCH,
    PLACING,
    RESTORING,
    STORE_UNREACHABLE,
    VERIFYING,
    WAITING_CAPACITY,
    WAITING_STORE,
)


def first(message: str) -> Record:
    """A wait's first message: an event in the job's log and its status."""
    return Record(ORCH, "recovery", message, status_message=message)


STORE = (WAITING_STORE, STORE_UNREACHABLE, 8.0, "waiting for the store")
CAPACITY = (WAITING_CAPACITY, NO_CAPACITY, 60.0, "waiting for capacity")

# (name, state, the wait entered, now, new state, effects)
BLOCKED = [
    (
        "the store's first failure: a wait counted from the first question",
        rm.Waits(VERIFYING, asked_since=100.0),
        STORE,
        103.0,
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, asked_since=100.0, retries=1),
        [
            first("waiting for the store; retry 1 in 0.5 s, the fault policy decides after 8 s"),
            rm.Retry(0.5, WAITING_STORE),
        ],
    ),
    (
        "a later retry: said in the status only, the backoff doubled",
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, asked_since=100.0, retries=2),
        STORE,
        104.0,
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, asked_since=100.0, retries=3),
        [
            Status("waiting for the store; retry 3 in 2.0 s, the fault policy decides after 8 s"),
            rm.Retry(2.0, WAITING_STORE),
        ],
    ),
    (
        "the backoff never runs past the limit",
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=5),
        STORE,
        107.5,
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=6),
        [
            Status("waiting for the store; retry 6 in 0.5 s, the fault policy decides after 8 s"),
            rm.Retry(0.5, WAITING_STORE),
        ],
    ),
    (
        "past the limit: the policy decides",
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=6),
        STORE,
        108.4,
        rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=6),
        [rm.GiveUp(STORE_UNREACHABLE, "waiting for the store: gave up after 8 s")],
    ),
    (
        "no capacity: its wait counts from now, not from the store's question",
        rm.Waits(PLACING, asked_since=100.0),
        CAPACITY,
        130.0,
        rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=130.0, asked_since=100.0, retries=1),
        [
            first("waiting for capacity; retry 1 in 0.5 s, the fault policy decides after 60 s"),
            rm.Retry(0.5, WAITING_CAPACITY),
        ],
    ),
    (
        "the backoff is capped",
        rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=100.0, retries=9),
        CAPACITY,
        120.0,
        rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=100.0, retries=10),
        [
            Status("waiting for capacity; retry 10 in 4.0 s, the fault policy decides after 60 s"),
            rm.Retry(4.0, WAITING_CAPACITY),
        ],
    ),
]


@pytest.mark.parametrize(
    ("state", "wait", "now", "new", "effects"), [c[1:] for c in BLOCKED], ids=[c[0] for c in BLOCKED]
)
def test_blocked(state, wait, now, new, effects) -> None:
    assert rm.blocked(state, *wait, now) == (new, effects)


def test_asked_starts_a_step_and_the_store_clock() -> None:
    state = rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=5.0, asked_since=1.0, retries=4)
    assert rm.asked(state, 50.0) == rm.Waits(VERIFYING, "", waiting_since=5.0, asked_since=50.0, retries=0)


def test_answered_ends_only_a_wait_for_the_store() -> None:
    waiting = rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=3)
    assert rm.answered(waiting, 112.5) == (
        rm.Waits(WAITING_STORE, "", waiting_since=100.0, retries=3),
        [
            Record(
                Module.L5_CHECKPOINT_MANAGER,
                "recovery",
                "the store answered after 12.5 s of waiting; the recovery goes on",
            )
        ],
    )
    first_time = rm.Waits(VERIFYING)
    assert rm.answered(first_time, 112.5) == (first_time, [])  # (nothing was waited for: nothing said)


def test_placed_restores_and_ends_a_wait_for_capacity() -> None:
    waiting = rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=100.0, retries=7)
    assert rm.placed(waiting, 130.0) == (
        rm.Waits(RESTORING, "", waiting_since=100.0, retries=0),
        [Record(Module.L1_RESOURCE_ALLOCATOR, "recovery", "capacity came back after 30.0 s of waiting")],
    )
    assert rm.placed(rm.Waits(PLACING), 130.0) == (rm.Waits(RESTORING), [])


def test_gave_up_starts_a_new_period_only_for_capacity() -> None:
    capacity = rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=100.0, retries=7)
    assert rm.gave_up(capacity, NO_CAPACITY).waiting_for == ""
    store = rm.Waits(WAITING_STORE, WAITING_STORE, waiting_since=100.0, retries=7)
    assert rm.gave_up(store, STORE_UNREACHABLE) == store


def test_a_wait_entered_again_after_it_ended_counts_afresh() -> None:
    """Capacity came back, then went again: a new wait, from retry 1 and from now."""
    state, _ = rm.placed(rm.Waits(WAITING_CAPACITY, WAITING_CAPACITY, waiting_since=100.0, retries=7), 130.0)
    state, effects = rm.blocked(state, *CAPACITY, 200.0)
    assert (state.waiting_since, state.retries) == (200.0, 1)
    assert isinstance(effects[0], Record) and effects[1] == rm.Retry(0.5, WAITING_CAPACITY)
