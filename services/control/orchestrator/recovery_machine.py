"""A recovery's waits as a small state machine (issue 28 item 2): pure transitions of
(state, event) -> (new state, [effects]); recovery.py's ``_apply`` performs the effects.

A recovery step that cannot go on (the store cannot be asked, no slot is free) waits: it
says what it waits for, retries its step with backoff, and past the fault policy's limit
for that wait the policy decides. The state is the part of ``_Incident`` the waits own
(``Waits``); the events are ``asked`` (the store is asked to verify the versions),
``blocked`` (the step cannot go on, again), ``answered`` (the store's verdicts came),
``placed`` (the ranks were placed) and ``gave_up`` (the policy's decision on a wait went on). No
clock is read here: ``now`` comes with each event, so a table test (tests/control/
test_recovery_machine.py) gives every transition without a bus, a timer or a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.contract import Module
from services.control.orchestrator.effects import Record, Status, changed
from services.control.orchestrator.job import (
    NO_CAPACITY,
    ORCH,
    RESTORING,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    VERIFYING,
    WAITING_CAPACITY,
    WAITING_STORE,
)


@dataclass(frozen=True)
class Waits:
    """What a recovery's waits keep (``_Incident``'s fields of the same names)."""

    phase: str  # the recovery step in flight
    waiting_for: str = ""  # the wait state the step is in ("" none; kept across its retries)
    waiting_since: float = 0.0  # when that wait began (monotonic seconds)
    asked_since: float = 0.0  # when the store was first asked (its wait counts from it)
    retries: int = 0  # retries of the current step


@dataclass(frozen=True)
class Retry:
    """Command the step of ``phase`` again after ``delay`` seconds (a timer)."""

    delay: float
    phase: str


@dataclass(frozen=True)
class GiveUp:
    """The wait ran past its limit: the fault policy decides ``fault_class`` (``why``)."""

    fault_class: str
    why: str


# (Record, Status: effects.py's; Retry, GiveUp: the incident's own, recovery_waits.py's ``_apply``)
Effect = Record | Status | Retry | GiveUp


def waits_of(incident: Any) -> Waits:
    """The waits' state as an ``_Incident`` holds it."""
    return Waits(incident.phase, incident.waiting_for, incident.waiting_since, incident.asked_since, incident.retries)


def asked(state: Waits, now: float) -> Waits:
    """The recovery asks the store to verify the versions: a new step, no wait yet; the
    store's wait counts from now."""
    return changed(state, phase=VERIFYING, retries=0, waiting_for="", asked_since=now)


def blocked(
    state: Waits, phase: str, fault_class: str, limit_s: float, what: str, now: float
) -> tuple[Waits, list[Effect]]:
    """The step of ``phase`` cannot go on (``what`` it waits for): enter that wait, or stay
    in it one more retry (backoff doubling from RETRY_FIRST_S, capped at RETRY_MAX_S and at
    what is left of ``limit_s``); past ``limit_s`` of waiting, give up to the policy's
    ``fault_class``."""
    state = changed(state, phase=phase)
    if state.waiting_for != phase:
        # The store's wait counts from the first question (its first timeout took a deadline
        # already: the fresh-user trial saw an 8 s budget give up after 22 s).
        since = state.asked_since if phase == WAITING_STORE and state.asked_since else now
        state = changed(state, waiting_for=phase, waiting_since=since, retries=0)
    waited = now - state.waiting_since
    if waited >= limit_s:
        return state, [GiveUp(fault_class, f"{what}: gave up after {waited:.0f} s")]
    retries = state.retries + 1
    delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (retries - 1), max(0.0, limit_s - waited))
    message = f"{what}; retry {retries} in {delay:.1f} s, the fault policy decides after {limit_s:.0f} s"
    # (the status says it at every retry; the event log only at the first: no flood)
    said = Record(ORCH, "recovery", message, status_message=message) if retries == 1 else Status(message)
    return changed(state, retries=retries), [said, Retry(delay, phase)]


def answered(state: Waits, now: float) -> tuple[Waits, list[Effect]]:
    """The store's verdicts came: a wait for the store ends (said); the recovery goes on."""
    if state.waiting_for != WAITING_STORE:
        return state, []
    waited = now - state.waiting_since
    said = f"the store answered after {waited:.1f} s of waiting; the recovery goes on"
    return changed(state, waiting_for=""), [Record(Module.L5_CHECKPOINT_MANAGER, "recovery", said)]


def placed(state: Waits, now: float) -> tuple[Waits, list[Effect]]:
    """The ranks were placed and relaunched: the recovery waits for them to report ready;
    a wait for capacity ends (said)."""
    waited = now - state.waiting_since
    said = Record(Module.L1_RESOURCE_ALLOCATOR, "recovery", f"capacity came back after {waited:.1f} s of waiting")
    ended = [said] if state.waiting_for == WAITING_CAPACITY else []
    return changed(state, phase=RESTORING, retries=0, waiting_for=""), ended


def gave_up(state: Waits, fault_class: str) -> Waits:
    """The policy decided to go on after a wait of ``fault_class``: waiting for capacity
    starts a new period (nothing else can place the ranks); waiting for the store does not
    (the recovery goes on without its verdicts)."""
    return changed(state, waiting_for="") if fault_class == NO_CAPACITY else state
