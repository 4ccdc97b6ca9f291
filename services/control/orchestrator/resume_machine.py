"""An operator resume from a checkpoint as a small state machine (issue 28 item 1): pure
transitions of (state, event) -> (new state, [effects]), performed by resume.py.

The state is the job's ``_Resume`` activity (job.py), its ``phase``: ``asking`` (the store is
asked which versions verify, outside the decision lock), ``placing`` (a version chosen, the
ranks asked of the allocator), ``queued`` (they do not fit now, or jobs queued ahead come
first: it waits in the queue as a submit does) and ``relaunched`` (placed: the placement
started the new generation). Its events: ``answered`` (the store's verdicts, or the versions control
knows of) and ``allocated`` (the allocator's answer). A refusal is an effect (``Refuse``: one
line for the operator, nothing changed), never an exception of the machine. No clock is
read and no port is called (tests/control/test_resume_machine.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.control.orchestrator.effects import changed
from services.control.orchestrator.job import _Resume
from services.control.orchestrator.texts import _version_number

ASKING, PLACING, QUEUED, RELAUNCHED = "asking", "placing", "queued", "relaunched"


@dataclass(frozen=True)
class Candidate:
    """A version the resume may load: its step, whether it verifies (and is not struck by a
    corrupt report), and the store's reason when it does not."""

    step: int
    version: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Refuse:
    """The operator's resume is refused with ``text`` (IllegalTransition; ``resources``: its
    ranks fit no registered slot, InsufficientResources); nothing changed."""

    text: str
    resources: bool = False
    unknown: bool = False  # the version named is none of the job's (the operator's input: UnknownVersion)


@dataclass(frozen=True)
class Place:
    """Ask the allocator for the job's ranks to load ``version`` (``step``)."""

    step: int
    version: str


@dataclass(frozen=True)
class Queue:
    """Wait in the queue (STANDBY) to relaunch from ``version`` once the ranks fit; ``why``:
    what it waits for; ``beyond``: it needs more ranks than the registered workers have."""

    step: int
    version: str
    why: str
    beyond: bool = False


ResumeEffect = Refuse | Place | Queue


def answered(
    resume: _Resume,
    job_id: str,
    candidates: Iterable[Candidate],
    from_version: str,
    abandoned: Iterable[str],
    held: str,
) -> tuple[_Resume, list[ResumeEffect]]:
    """The versions are known (``candidates``): the one named (``from_version``) if it
    verifies, else the newest that verifies and is not of an abandoned branch; then placed
    now, or queued when ``held`` (why the queue comes first; "": it does not)."""
    candidates, abandoned = list(candidates), set(abandoned)
    if not candidates:
        return resume, [Refuse(f"job {job_id} has no checkpoint to resume from; submit again")]
    if from_version:
        named = [c for c in candidates if c.version == from_version]
        if not named:
            return resume, [
                Refuse(
                    f"--from {from_version}: not a committed checkpoint of {job_id} "
                    f"(its versions: {', '.join(c.version for c in candidates)})",
                    unknown=True,
                )
            ]
        chosen = named[0]
        if not chosen.ok:
            return resume, [
                Refuse(f"--from {from_version}: fails verification ({chosen.reason or 'struck'}); never loaded")
            ]
    else:
        usable = [c for c in candidates if c.ok and c.version not in abandoned]
        if not usable:
            why = "; ".join(f"{c.version}: {c.reason or 'struck'}" for c in candidates)
            return resume, [Refuse(f"job {job_id}: no checkpoint verifies ({why}); submit again")]
        chosen = max(usable, key=lambda c: (c.step, _version_number(c.version)))
    new = changed(resume, step=chosen.step, version=chosen.version)
    if held:
        return changed(new, phase=QUEUED), [Queue(chosen.step, chosen.version, held)]
    return changed(new, phase=PLACING), [Place(chosen.step, chosen.version)]


def allocated(
    resume: _Resume, job_id: str, fits: bool, nowhere: str = "", why: str = "", beyond: bool = False
) -> tuple[_Resume, list[ResumeEffect]]:
    """The allocator answered: ``fits`` (placed: the placement started the new generation,
    nothing more to do), or not now (``why`` it waits, ``beyond`` the registered workers), or
    ``nowhere`` (its ranks fit no registered slot: refused)."""
    if fits:
        return changed(resume, phase=RELAUNCHED), []
    if nowhere:
        return resume, [Refuse(f"cannot resume {job_id}: {nowhere}", resources=True)]
    return changed(resume, phase=QUEUED), [Queue(resume.step, resume.version, why, beyond)]
