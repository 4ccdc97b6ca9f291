"""A rollback in place as a small state machine (issue 28 item 2; issue 29 item 9): pure
transitions of (state, event) -> (new state, [effects]) (effects.py), performed by
``_apply_effects``.

The state is the job's ``_Reload`` (None: none in flight). Its events: ``started`` (the
operator asked it; its PauseTraining is numbered), ``all_paused`` (every rank paused at the
boundary: they load the version into their live processes) and ``all_ready`` (every rank
loaded it: the group starts, and the versions committed after it become another branch).
No clock is read and no port is called (tests/control/test_rollback_machine.py).
"""

from __future__ import annotations

from services.contract import Module, engine_pb2
from services.control.orchestrator.effects import (
    Abandon,
    Effect,
    NoneReady,
    Record,
    ResetFaults,
    StartGroup,
    ToRanks,
    changed,
)
from services.control.orchestrator.job import ORCH, _Reload

PAUSING, LOADING = "pausing", "loading"


def started(reload: _Reload, pause: engine_pb2.PauseTraining, where: str) -> tuple[_Reload, list[Effect]]:
    """Asked (its ``pause``, numbered, takes effect ``where`` the ranks agree): journaled
    first, then sent."""
    text = (
        f"rollback in place to checkpoint {reload.version} (step {reload.step}) by the operator: ranks pause "
        f"{where} (no checkpoint), then load it into their live processes and train on from its step"
    )
    return changed(reload, phase=PAUSING), [Record(ORCH, "decision", text), ToRanks(pause)]


def all_paused(reload: _Reload, job_id: str, step: int) -> tuple[_Reload, list[Effect]]:
    """Every rank paused after ``step``: they load the version (ResumeTraining.reload_version)
    and report ready again."""
    text = (
        f"all ranks paused after step {step}; loading checkpoint {reload.version} (step {reload.step}) "
        "into their live processes"
    )
    load = ToRanks(engine_pb2.ResumeTraining(job_id=job_id, reload_version=reload.version))
    return changed(reload, phase=LOADING), [NoneReady(), Record(ORCH, "recovery", text), load]


def all_ready(
    reload: _Reload, versions: list[tuple[int, str]], abandoned: set[str], world_size: int, start_step: int, now: float
) -> tuple[None, list[Effect]]:
    """Every rank loaded the version and is ready at ``start_step``: started, the fault
    ledger reset, and the versions committed after it (``versions``: (step, version)) left
    as another branch."""
    later = tuple(sorted(v for s, v in versions if s > reload.step and v not in abandoned))
    then = f"; {', '.join(later)} kept, never chosen by a recovery or a plain resume" if later else ""
    message = (
        f"rollback in place done: all {world_size} ranks loaded checkpoint {reload.version} in "
        f"their live processes (none relaunched) and go on from step {start_step}, "
        f"{now - reload.since:.1f} s after it was asked{then}"
    )
    status = f"rolled back in place to checkpoint {reload.version} at step {start_step}"
    done = Record(Module.L2_TRAINING_LOOP, "recovery", message, status_message=status)
    return None, [Abandon(later), StartGroup(), ResetFaults(), done]
