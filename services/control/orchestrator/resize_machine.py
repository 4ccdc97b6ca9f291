"""A resize of a running job as a small state machine (issue 28 item 2): pure transitions of
(state, event) -> (new state, [effects]) (effects.py), performed by ``_apply_effects``.

The state is the job's ``_Scale`` (None: no resize in flight). Its events: ``started`` (the
operator or a grow-back asked it; its PauseTraining is numbered), ``all_paused`` (every rank
paused at the boundary: the rebuild is asked of L1-4), ``rebuild_refused`` (L1-4 could not
place it: the ranks go on at the old size), ``rebuild_commanded`` (the kept ranks rebuild
their group with the new ones) and ``all_ready`` (every rank of the new group is ready: it
starts). No clock is read (``now`` comes with an event) and no port is called: the table
test (tests/control/test_resize_machine.py) runs it without a bus.
"""

from __future__ import annotations

from services.contract import Module, control_pb2, engine_pb2
from services.control.orchestrator.effects import (
    Effect,
    NoneReady,
    Record,
    ResetFaults,
    StartGroup,
    TakeLayout,
    ToRanks,
    changed,
)
from services.control.orchestrator.job import ORCH, _Scale
from services.control.orchestrator.layout import _layout_change, _layout_msg
from services.control.orchestrator.texts import _kept_text
from services.jobspec import JobSpec

PAUSING, REBUILDING = "pausing", "rebuilding"


def started(scale: _Scale, old: JobSpec, pause: engine_pb2.PauseTraining, where: str) -> tuple[_Scale, list[Effect]]:
    """Asked (its ``pause``, numbered, takes effect ``where`` the ranks agree): journaled
    first, then sent (a restarted control sends it again from the journal)."""
    text = (
        f"{scale.why}: {_layout_change(old, scale.spec)}; ranks pause {where}, then rebuild their group at the new "
        "size (the ranks that stay keep their processes, new ranks heal from a live peer)"
    )
    return changed(scale, phase=PAUSING), [Record(ORCH, "decision", text), ToRanks(pause)]


def all_paused(scale: _Scale, job_id: str) -> tuple[_Scale, control_pb2.StartRecovery]:
    """Every rank paused: the rebuild at the new layout is asked of L1-4 (whose answer is the
    next event: ``rebuild_refused`` or ``rebuild_commanded``)."""
    ask = control_pb2.StartRecovery(
        job_id=job_id,
        reason=f"{scale.why}: dp {scale.old_dp} -> {scale.spec.parallel.dp}",
        in_place=True,
        layout=_layout_msg(scale.spec),
    )
    return changed(scale, phase=REBUILDING), ask


def rebuild_refused(scale: _Scale, job_id: str, reason: str, step: int) -> tuple[None, list[Effect]]:
    """L1-4 could not place the new layout: the paused ranks go on at the old size."""
    text = (
        f"{scale.why} to dp {scale.spec.parallel.dp} not done: {reason}; "
        f"the ranks go on at dp {scale.old_dp} from step {step}"
    )
    return None, [
        ToRanks(engine_pb2.ResumeTraining(job_id=job_id)),
        Record(Module.L1_RECOVERY_CONTROLLER, "scale", text),
    ]


def rebuild_commanded(scale: _Scale, job_id: str) -> tuple[_Scale, list[Effect]]:
    """L1-4 placed it: the layout is the job's, the paused ranks leave their pause into the
    rebuild (the relaunch's record is the caller's: it names the reply's workers)."""
    resume = ToRanks(engine_pb2.ResumeTraining(job_id=job_id, rebuild=True))
    return scale, [NoneReady(), TakeLayout(scale.spec), resume]


def all_ready(scale: _Scale, start_step: int, now: float) -> tuple[None, list[Effect]]:
    """Every rank of the new group is ready at ``start_step``: started, the fault ledger
    reset (a new group), and the resize said done."""
    healed = sorted((r, src) for r, src in scale.healed_from.items() if r >= scale.old_dp)  # (the new ranks)
    how = ", ".join(f"rank {r} healed from rank {src}'s memory" for r, src in healed)
    kept = min(scale.old_dp, scale.spec.parallel.dp)
    change = f"dp {scale.old_dp} -> {scale.spec.parallel.dp}"
    message = (
        f"{scale.why} done: {change} at step {start_step}"
        + (f" ({how})" if how else "")
        + f"; {_kept_text(kept)}; {now - scale.since:.1f} s after it was asked; training resumed"
    )
    status = f"{scale.why} done at step {start_step}: {change}"
    return None, [StartGroup(), ResetFaults(), Record(ORCH, "scale", message, status_message=status)]
