"""A recovery as a small state machine (issue 28 items 1-2): pure transitions of
(state, event) -> (new state, [effects]); recovery_waits.py's ``_apply`` and recovery.py
perform the effects.

Two parts. The recovery's own sequence: the policy's decision on a fault (``decided``: the
new incident and what it does: nothing more, stop, pause, or a recovery begun, held for
inspection or started), its relaunch refused by the recovery controller
(``relaunch_refused``: shrink, relaunch every rank instead of a rebuild, wait for capacity,
or fail) and every relaunched rank ready (``recovered``: the group started unless the
operator's pause outlives the fault, the fault ledger reset, RUNNING or PAUSED said). These
read the incident and return what is to be done; recovery.py performs it.

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
from services.control import fault_decision as fd
from services.control.orchestrator.effects import Record, ResetFaults, StartGroup, Status, Transition, changed
from services.control.orchestrator.job import (
    NO_CAPACITY,
    ORCH,
    RESTORING,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    VERIFYING,
    WAITING_CAPACITY,
    WAITING_STORE,
    JobState,
    _Incident,
)
from services.control.orchestrator.texts import _healed_text, restored_from_text
from services.jobspec import IN_PLACE_ACTIONS


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


# ------------------------------------------------------------ the recovery's own sequence


@dataclass(frozen=True)
class Terminate:
    """The job ends (``outcome``, its last message ``message``), its ranks killed."""

    outcome: int
    message: str


@dataclass(frozen=True)
class PauseJob:
    """The policy pauses the job (its ranks killed, parked until an operator resume)."""

    message: str


@dataclass(frozen=True)
class Spend:
    """One restart of ``fault_class``'s budget is spent."""

    fault_class: str


@dataclass(frozen=True)
class Strike:
    """``version`` is never loaded again (said by the Record that follows)."""

    version: str


@dataclass(frozen=True)
class NeverLoadDiverged:
    """The versions saved after ``bound`` (the last replica check that agreed) are struck."""

    bound: int


@dataclass(frozen=True)
class Begin:
    """``incident`` is the job's activity (superseding whatever ran: ``why`` says it) and the
    job's failing generation is forgotten."""

    incident: Any
    why: str


@dataclass(frozen=True)
class Freeze:
    """The recovery is held ``seconds`` for inspection before it starts (freeze.py)."""

    seconds: float


@dataclass(frozen=True)
class Recover:
    """The recovery starts at its first step (the store asked which versions are intact)."""


@dataclass(frozen=True)
class Facts:
    """What ``decided`` reads of the job when the decision came (a copy: read only)."""

    previous: Any  # the recovery in flight (None: none)
    step: int  # the job's last completed step
    world_size: int
    exited: frozenset[int]  # ranks of the failing generation seen ended
    lost: tuple[int, ...]  # the ranks a rebuild would replace (triage's ``_lost_ranks``)
    paused: bool  # the job is paused, or its pause is in flight (the operator's)
    unusable: frozenset[str]  # versions struck already
    frozen: bool  # the job is FAULT_FROZEN already
    hold: float  # seconds the policy holds the recovery for inspection (0: none)


def decided(decision: Any, cause: Any, facts: Facts, now: float) -> tuple[Any, list[Any]]:
    """The fault policy decided ``decision`` on ``cause`` (its "decision" event is journaled
    already): the new incident (None: none begins) and what is to be done, in order."""
    action, fault_class = decision.action, decision.fault_class
    if action in ("ignore", "skip_step", "skip_save"):
        return None, []
    if action == "stop":
        return None, [Terminate(decision.outcome, decision.final)]
    if action == "pause":
        return None, [PauseJob(decision.final)]
    effects: list[Any] = [Spend(fault_class)] if decision.spends else []
    if decision.strike and decision.strike not in facts.unusable:  # (struck already if its load's report came first)
        why = (
            "reproduced the replica divergence it was loaded to recover from: suspect"
            if fault_class == fd.REPLICA_DIVERGENCE
            else "fails its digest check on load"
        )
        effects += [
            Strike(decision.strike),
            Record(ORCH, "checkpoint", f"checkpoint {decision.strike} {why}; never loaded again"),
        ]
    if fault_class == fd.REPLICA_DIVERGENCE and decision.bound is not None:
        effects.append(NeverLoadDiverged(decision.bound))
    previous = facts.previous
    incident = _Incident(
        cause=cause,
        fault_class=fault_class,
        action=action,
        decided=now,
        at_step=facts.step,
        bound=decision.bound,
        exclude=list(decision.exclude),
        # The operator's pause outlives the fault: recovered, the job stays paused.
        paused=facts.paused or (previous is not None and previous.paused),
        reload=decision.in_place,
    )
    if action in IN_PLACE_ACTIONS:
        # Only the lost ranks end (the recovery kills them if they still run); the others
        # survive: their collective's failure, reported as they rebuild, is a consequence.
        # A rebuild during a rebuild also replaces the ranks the first one was replacing
        # (they hold no state yet: relaunched from a spare, they heal with the others).
        incident.lost = sorted(set(facts.lost) | set(previous.lost if previous is not None else ()))
        incident.dying.update(r for r in incident.lost if r not in facts.exited)
    else:
        # Every rank of the failing generation not yet seen ended will end (the recovery
        # kills it): its reports until then are consequences of this incident.
        incident.dying.update(r for r in range(facts.world_size) if r not in facts.exited)
    if previous is not None:
        incident.dying.update(previous.dying)
    effects.append(Begin(incident, decision.text))
    if facts.hold:  # inspect before acting (freeze.py): the recovery starts when the hold ends
        return incident, [*effects, Freeze(facts.hold)]
    if not facts.frozen:
        effects.append(
            Transition(
                JobState.FAULT_FROZEN, ORCH, f"recovering from {fd.named(fault_class, cause)} of rank {cause.rank}"
            )
        )
    return incident, [*effects, Recover()]


@dataclass(frozen=True)
class Refusal:
    """The recovery controller's RecoveryFailed, as the machine reads it."""

    reason: str
    requested: int  # ranks the relaunch needed (0: not said)
    available: int  # free slots it found
    no_placement: bool  # its cause is RECOVERY_NO_PLACEMENT (capacity, not a broken step)


@dataclass(frozen=True)
class Shrink:
    """Place the job again at ``spec``, a smaller data-parallel layout (issue 16's shrink)."""

    spec: Any


@dataclass(frozen=True)
class RelaunchAll:
    """A rebuild in place cannot keep its survivors: every rank is relaunched from the newest
    checkpoint (the recovery starts again at its first step, action ``restart_ranks``)."""


@dataclass(frozen=True)
class WaitCapacity:
    """No slot for the relaunch: wait (``blocked``) for capacity, saying ``what``."""

    what: str


@dataclass(frozen=True)
class Fail:
    """The recovery cannot go on: the job ends FAILED (``reason``), its ranks killed."""

    reason: str


@dataclass(frozen=True)
class Ended:
    """The incident is over (its timer cancelled, the slot freed, the job's last incident);
    ``held``: the job stays paused (the operator's pause outlives the fault), else its first
    step after the recovery is awaited (``_Job.recovered``)."""

    held: bool


Refused = Shrink | RelaunchAll | WaitCapacity | Fail


def relaunch_refused(
    incident: Any, refusal: Refusal, *, smaller: Any, smaller_text: str, dp: int, world_size: int, source: str
) -> list[Record | Refused]:
    """The relaunch of ``incident`` (read only) was refused. ``smaller``: the layout the job
    could shrink to with the slots left (None: none, or not asked: the incident is no
    unshrunk ``shrink``), ``smaller_text`` its change as text; ``dp``: the job's size now;
    ``source``: where the relaunch would have loaded from. In order: a shrink when ranks to
    launch did not fit (not when the placement is unknown), a rebuild's fallback to a full
    relaunch, a wait for capacity, else the end."""
    who = f"{incident.fault_class} of rank {incident.cause.rank}"
    if (
        incident.action == "shrink"
        and incident.shrunk is None
        and smaller is not None
        and refusal.requested > refusal.available
    ):
        said = (
            f"shrink after {who}: {refusal.reason}; the job goes on at {smaller_text}, and grows back to dp {dp} "
            "when slots return"
        )
        return [Record(ORCH, "decision", said), Shrink(smaller)]
    if incident.action in IN_PLACE_ACTIONS:
        # The survivors cannot be kept (no slot for a replacement, the placement unknown
        # after a control restart): every rank is relaunched from the newest checkpoint.
        said = (
            f"restart_ranks instead of rebuild after {who}: {refusal.reason}; every rank relaunched from the "
            "newest checkpoint"
        )
        return [Record(ORCH, "decision", said), RelaunchAll()]
    if refusal.no_placement:
        needs = f"needs {refusal.requested or world_size} ranks, {refusal.available} free"
        return [WaitCapacity(f"waiting for capacity to resume from {source}: {needs} ({refusal.reason})")]
    return [Fail(f"recovery failed: {refusal.reason}")]


def restored_text(incident: Any, world_size: int) -> str:
    """What the recovery of ``incident`` restored, e.g. "all 2 ranks restored from checkpoint
    J:3, read from memory (own node),"."""
    if incident.action in IN_PLACE_ACTIONS:
        return _healed_text(incident, world_size)
    if incident.reload:
        return f"all {world_size} ranks loaded checkpoint {incident.version} in place (none relaunched)"
    source = f"checkpoint {incident.version}" if incident.version else "scratch"
    read = restored_from_text(incident.restored_from) if incident.version else ""
    source += f", {read}," if read else ""
    return f"all {world_size} ranks restored from {source}"


def recovered(incident: Any, world_size: int, start_step: int, *, seconds: float) -> list[Any]:
    """Every relaunched (or rebuilt, or reloaded) rank of ``incident`` is ready at
    ``start_step``, ``seconds`` after the decision: the recovery is over. The operator's pause
    outlives the fault (``incident.paused``): the job stays PAUSED, its ranks waiting for a
    resume; else the group starts and the job runs again."""
    held = bool(incident.paused)
    what = f"recovered from {fd.named(incident.fault_class, incident.cause)} of rank {incident.cause.rank}: "
    what += f"{restored_text(incident, world_size)} at step {start_step}"
    if held:
        said = Transition(JobState.PAUSED, ORCH, f"{what}; paused, as before the fault (resume continues it)")
        return [Ended(held=True), ResetFaults(), said]
    said = Transition(JobState.RUNNING, ORCH, f"{what} {seconds:.1f} s after the decision; training resumed")
    return [StartGroup(), Ended(held=False), ResetFaults(), said]
