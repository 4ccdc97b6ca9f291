"""What the orchestrator's small machines return (issue 28 item 2), and the one function that
performs it (``Effects._apply_effects``).

A machine (resize_machine.py, recovery_machine.py) is a set of pure transitions
(state, event) -> (new state, [effects]): it reads no clock, sends nothing and journals
nothing. The effects say what is to be done, in order: a journal record, a command to the
job's ranks or to L1-3, the group started, the job's layout taken. Applying them in the
order given keeps the rule the restart relies on: a command a record announces comes after
that record (``_send_again`` sends again what was journaled in flight).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from services.contract import control_pb2
from services.control.orchestrator.job import _Job
from services.control.orchestrator.texts import newest_usable
from services.jobspec import JobSpec

_State = TypeVar("_State")


def changed(state: _State, **fields: Any) -> _State:
    """A copy of a machine's ``state`` with ``fields`` changed; ``state`` itself is left as it
    was (a transition is pure). (Not ``dataclasses.replace``: the red-line check on modules
    that touch no disk reads any call named ``replace`` as ``os.replace``.)"""
    new = copy.copy(state)
    for name, value in fields.items():
        object.__setattr__(new, name, value)  # (a frozen dataclass's copy too)
    return new


@dataclass(frozen=True)
class Record:
    """One event in the job's log (``_record``), journaled with the job's bookkeeping."""

    source: int
    kind: str
    message: str
    status_message: str | None = None


@dataclass(frozen=True)
class Status:
    """The job's status says ``message``, with no event (a wait's later retries: no flood)."""

    message: str


@dataclass(frozen=True)
class ToRanks:
    """A command to the job's ranks (L2-1, through their node agents)."""

    cmd: Any


@dataclass(frozen=True)
class ResetFaults:
    """L1-3 forgets the job's fault ledger (a new group runs)."""


@dataclass(frozen=True)
class StartGroup:
    """StartTraining to the job's ranks, with its last boundary command number."""


@dataclass(frozen=True)
class NoneReady:
    """The job's ranks are to report ready again (a rebuilt group, a version loaded in place)."""


@dataclass(frozen=True)
class TakeLayout:
    """``spec`` (a new data-parallel layout) is the job's, its ranks above the new size released."""

    spec: JobSpec


@dataclass(frozen=True)
class Transition:
    """The job goes to ``state`` (``_transition``: its event and its status say ``message``)."""

    state: int
    source: int
    message: str


@dataclass(frozen=True)
class Abandon:
    """``versions`` are another branch of the job's history from now on: never chosen by a
    recovery or a plain resume (only by name)."""

    versions: tuple[str, ...]


Effect = Record | Status | ToRanks | ResetFaults | StartGroup | NoneReady | TakeLayout | Transition | Abandon


class Effects:
    """Performing a machine's effects (a part of ``Orchestrator``, see core.py)."""

    def _apply_effects(self, job: _Job, effects: list[Effect]) -> None:
        """Under the lock: perform ``effects`` in order (the one place they take effect)."""
        for effect in effects:
            if isinstance(effect, Record):
                self._record(job, effect.source, effect.kind, effect.message, status_message=effect.status_message)
            elif isinstance(effect, Status):
                job.status.message, job.status.updated_unix = effect.message, time.time()
                self._keep(job)
            elif isinstance(effect, ToRanks):
                self._loop(effect.cmd)
            elif isinstance(effect, ResetFaults):
                self._faults(control_pb2.ResetFaultLedger(job_id=job.status.job_id))
            elif isinstance(effect, StartGroup):
                self._start_group(job)
            elif isinstance(effect, NoneReady):
                job.started = set()
            elif isinstance(effect, TakeLayout):
                self._take_layout(job, effect.spec)
            elif isinstance(effect, Transition):
                self._transition(job, effect.state, effect.source, effect.message)
            else:
                job.abandoned.update(effect.versions)
                if job.status.checkpoint_version in job.abandoned:
                    # status names what a resume (`up`, a stop's message) would load: the version
                    # rolled back to, not the branch left (was: a fresh user was told `up` resumes
                    # from the newer one, "no step lost", and it resumed from the older).
                    newest = newest_usable(job)
                    job.status.checkpoint_version = newest[1] if newest else ""
