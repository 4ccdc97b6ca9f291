"""A job's one activity in flight (issue 28 item 1) and the one rule for a second one.

A job holds at most one activity (``_Job.activity``): a recovery (``_Incident``), a resize
(``_Scale``), a rollback in place (``_Reload``) or an operator resume asking the store
(``_Resume``); a recovery done and awaiting its first step (``_Recovered``) is held there too,
idle: whatever is asked starts and replaces it. What happens when something arrives while one is in flight is decided here,
by ``admit``, and nowhere else: it is started, folded into the one in flight (the same ask
again: answered with the job's status), refused with a one-line reason, or it supersedes
the one in flight (a fault: the recovery replaces whatever ran, which the caller says in the
job's events). ``admit`` is pure (table-tested in tests/control/test_activity.py);
``begin`` / ``moved`` / ``end`` are the only writers of the slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.control.orchestrator.job import _Incident, _Job, _Recovered, _Reload, _Resume, _Scale

Activity = _Incident | _Scale | _Reload | _Resume | _Recovered


@dataclass(frozen=True)
class ScaleAsk:
    """An operator's `surgectl scale` (0: the job's own micro-batch size / grad accumulation)."""

    dp: int
    micro_batch_size: int = 0
    grad_accum: int = 0


@dataclass(frozen=True)
class ReloadAsk:
    """An operator's rollback in place to ``version`` ("": the newest usable one)."""

    version: str = ""


@dataclass(frozen=True)
class ResumeAsk:
    """An operator's resume that relaunches the job's ranks (it asks the store first)."""


@dataclass(frozen=True)
class PauseAsk:
    """An operator's pause or drain: no activity of its own (a recovery keeps it as
    ``_Incident.paused``), but its boundary would race a resize's or a rollback's pause."""


@dataclass(frozen=True)
class StopAsk:
    """An operator's stop at a step boundary: no activity of its own; only a resize refuses
    it (its ranks pause for the resize: the stop's boundary would never come)."""


@dataclass(frozen=True)
class ForceDownAsk:
    """`surgectl down --force`: the job parked at once, its ranks killed with the stack; only
    a resize refuses it (its layout is half changed until its ranks report ready)."""


Ask = _Incident | ScaleAsk | ReloadAsk | ResumeAsk | PauseAsk | StopAsk | ForceDownAsk

# What a refused ask is told to do once the resize in flight is done.
_AFTER_RESIZE = {
    StopAsk: "stop it once its events say the resize is done (seconds)",
    ForceDownAsk: "`surgectl down --force` again once its events say the resize is done (seconds)",
}


START, FOLD, REFUSE, SUPERSEDE = "start", "fold", "refuse", "supersede"


@dataclass(frozen=True)
class Admission:
    """``admit``'s answer: ``verdict`` (START, FOLD, REFUSE, SUPERSEDE), the one-line
    ``reason`` of a refusal, and the activity a superseding one replaces."""

    verdict: str
    reason: str = ""
    previous: Activity | None = None


def _busy(job_id: str, current: Activity, ask: Ask) -> str:
    """The one-line refusal naming what is in flight and what to do (the texts the tests and
    the CLI know)."""
    if isinstance(current, _Reload):
        return (
            f"job {job_id} is being rolled back in place to {current.version}; try again once its events say it is done"
        )
    if isinstance(current, _Scale):
        return f"job {job_id} is being resized to dp {current.spec.parallel.dp} ({current.why}); " + _AFTER_RESIZE.get(
            type(ask), "try again once its events say it is done"
        )
    if isinstance(current, _Incident):
        return f"job {job_id} is recovering from {current.fault_class}; try again after it"
    return f"job {job_id} is already being resumed"


def _same_scale(current: _Scale, ask: ScaleAsk) -> bool:
    target = current.spec
    return (
        ask.dp == target.parallel.dp
        and ask.micro_batch_size in (0, target.data.micro_batch_size)
        and ask.grad_accum in (0, target.data.grad_accum)
    )


def admit(job_id: str, current: Activity | None, ask: Ask) -> Admission:
    """What ``ask`` gets while ``current`` is in flight (None: nothing is).

    - A fault's recovery supersedes anything: the ranks a resize, a rollback or an earlier
      recovery worked with are being replaced (a recovery in flight is folded into the new
      one by the caller: its dying and lost ranks carry over).
    - The same resize or rollback asked again (a `surgectl scale` cut short and run again)
      is folded into the one in flight.
    - Anything else while one is in flight is refused, naming it; a pause is only refused by
      a resize or a rollback (whose own pause it would race); a recovery keeps it. A stop
      and a forced down are only refused by a resize (a rollback's pause becomes the stop's;
      a recovery is ended by a stop, continued after a forced down's `up`).
    """
    if isinstance(current, _Recovered):  # (idle: only its first step's record waits)
        current = None
    if isinstance(ask, _Incident):
        return Admission(SUPERSEDE if current is not None else START, previous=current)
    if current is None:
        return Admission(START)
    if isinstance(ask, ScaleAsk) and isinstance(current, _Scale) and _same_scale(current, ask):
        return Admission(FOLD)
    if isinstance(ask, ReloadAsk) and isinstance(current, _Reload) and ask.version in ("", current.version):
        return Admission(FOLD)
    if isinstance(ask, PauseAsk) and isinstance(current, _Incident | _Resume):
        return Admission(START)
    if isinstance(ask, StopAsk | ForceDownAsk) and not isinstance(current, _Scale):
        return Admission(START)
    return Admission(REFUSE, _busy(job_id, current, ask))


def idle(job: _Job) -> bool:
    """Nothing in flight (a recovery awaiting only its first step counts as nothing)."""
    return job.activity is None or isinstance(job.activity, _Recovered)


# Whose event "every rank of the group is ready" is (``ready_for``).
STARTED, RECOVERED, SCALED, RELOADED = "started", "recovered", "scaled", "reloaded"


def ready_for(activity: Activity | None) -> str:
    """Which machine's event it is when every rank of the job reports ready, by the activity
    in flight: a recovery's (RECOVERED: recovery_machine's ``recovered``), a resize whose
    group is rebuilding (SCALED: resize_machine's ``all_ready``), a rollback loading in place
    (RELOADED: rollback_machine's ``all_ready``); else the job's own start (STARTED: a first
    start or an operator resume's relaunch, whose activity ended once it was placed). A resize
    or a rollback in another phase has no ranks to report ready: their ready reports are a
    start's."""
    if isinstance(activity, _Incident):
        return RECOVERED
    if isinstance(activity, _Scale) and activity.phase == "rebuilding":
        return SCALED
    if isinstance(activity, _Reload) and activity.phase == "loading":
        return RELOADED
    return STARTED


def begin(job: _Job, activity: Activity) -> Activity | None:
    """Put ``activity`` in the job's slot (its admission already decided); the activity it
    supersedes, if any."""
    previous, job.activity = job.activity, activity
    return previous


def moved(job: _Job, before: Activity, after: Activity) -> None:
    """The activity in flight went from ``before`` to ``after`` (a machine's transition
    returns a new state); nothing if ``before`` is no longer the job's (superseded)."""
    if job.activity is before:
        job.activity = after


def end(job: _Job, activity: Activity | type | None = None) -> None:
    """Clear the slot if it holds ``activity`` (an instance: that one; a class: one of that
    kind; None: whatever it holds). An activity that was superseded meanwhile (a resume whose
    store answer came after a fault) leaves its successor in place."""
    current = job.activity
    if activity is None or current is activity or (isinstance(activity, type) and isinstance(current, activity)):
        job.activity = None
