"""What a node's departure with notice does to one job (issue 30 item 5): a pure function of
the deadline, the job's last measured save and step time, and whether it has a committed
checkpoint. No clock, no lock, no port here: table-tested in
tests/control/test_departure_plan.py; departure.py acts on the answer."""

from __future__ import annotations

from dataclasses import dataclass

from services.contract import store_pb2

# A save not measured yet (the job has committed none in this control's lifetime) is taken as
# this long: a departure with less notice than that is not bet on an unmeasured save.
DEFAULT_SAVE_SECONDS = 10.0
# The measured save is weighed with this factor: a save slows down with the store's load and
# the checkpoint's growth, and one that misses the deadline loses more than it saves.
SAVE_FACTOR = 1.5
# Steps until the boundary every rank agrees on (the pause's all-reduce: the command is folded
# into the next step's all-reduce once every rank holds it; two or three steps in practice).
BOUNDARY_STEPS = 3
# Beyond the save: the commit's events reaching control, the kill of the ranks that follows.
FIXED_MARGIN_SECONDS = 2.0

CHECKPOINT = "checkpoint"  # checkpoint at an agreed boundary, then move: nothing lost
FROM_NEWEST = "from_newest"  # too short for a save: move now, from the newest checkpoint
FALLBACK = "fallback"  # too short, and nothing to resume from: the deadline's kill decides


@dataclass(frozen=True)
class DeparturePlan:
    action: str  # CHECKPOINT, FROM_NEWEST or FALLBACK
    needed_seconds: float  # what a checkpoint at a boundary was estimated to take
    estimate: str  # how that was estimated, for the job's event


def needed_seconds(save_seconds: float, step_seconds: float) -> tuple[float, str]:
    """The time a checkpoint at an agreed boundary needs before the node goes, and how it was
    estimated (for people)."""
    save = save_seconds if save_seconds > 0 else DEFAULT_SAVE_SECONDS
    measured = "last save" if save_seconds > 0 else "no save measured yet, taken as"
    need = BOUNDARY_STEPS * max(step_seconds, 0.0) + SAVE_FACTOR * save + FIXED_MARGIN_SECONDS
    how = (
        f"{need:.1f} s needed: {BOUNDARY_STEPS} steps of {step_seconds:.2f} s to the boundary, "
        f"{SAVE_FACTOR:g} x {measured} {save:.1f} s, {FIXED_MARGIN_SECONDS:g} s margin"
    )
    return need, how


def plan_departure(deadline_seconds: float, save_seconds: float, step_seconds: float, has_checkpoint: bool):
    """The plan for one running job whose node leaves in ``deadline_seconds``: a checkpoint
    when the deadline leaves time for one (``needed_seconds``); else the newest committed
    checkpoint (its ranks read it from the nodes' memory copies where they hold it), the steps
    after it lost; else (no checkpoint at all) nothing to move to: the ranks' end at the
    deadline is the job's worker_departed fault, as without notice."""
    need, how = needed_seconds(save_seconds, step_seconds)
    if deadline_seconds >= need:
        return DeparturePlan(CHECKPOINT, need, how)
    return DeparturePlan(FROM_NEWEST if has_checkpoint else FALLBACK, need, how)


def save_seconds(step_unix: tuple[int, float], msg: store_pb2.SaveCompleted, now: float) -> float:
    """A committed save's duration as control sees it: from rank 0's report of the step it
    saved (``step_unix``: the last step applied and its time) to the commit's arrival; the
    manager's own verify and commit time where that step's report is not the last one seen
    (a save of an earlier step, or a time not stated)."""
    step, unix = step_unix
    if step == msg.step and unix > 0 and now >= unix:
        return max(msg.seconds, now - unix)
    return msg.seconds
