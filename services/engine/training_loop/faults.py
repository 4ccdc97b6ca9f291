"""The loop's own faults: ``TrainingFault`` (a class L1 understands), ``_Released`` (L1-1's
verdict ends the loop), the class a data failure is repeated with, and ``classify_fault`` (what
a rank's TrainingLoopFailed says)."""

from __future__ import annotations

from services.contract import data_pb2, engine_pb2, route_pb2
from services.contract.bus import BoundaryViolation
from services.jobspec import DATA_OUTAGE

_DETAIL_CHARS = 400


class TrainingFault(RuntimeError):
    """A fault the loop reports with a class L1 understands (e.g. "data_unavailable")."""

    def __init__(self, fault_class: str, detail: str):
        super().__init__(detail)
        self.fault_class = fault_class


def _data_fault_class(msg: data_pb2.DatasetUnavailable) -> str:
    """The class the loop repeats L4-1's failure with: the data service unreachable (typed by
    its cause) is ``data_outage``, decided as L1-3 grades the relay's own report of it (by
    default a pause, never FAILED), whichever of the two reaches control first; a version whose
    bytes changed (a shard that fails its digest, e.g. as a resumed stream opens it) is
    ``data_corrupt``, which the policy pauses on too (issue 29 item 7); else a version that went
    away, ``data_unavailable``."""
    cause = msg.failure.cause
    if cause == route_pb2.FAILURE_UNAVAILABLE:
        return DATA_OUTAGE
    return "data_corrupt" if cause == route_pb2.FAILURE_DATA_CORRUPT else "data_unavailable"


class _Released(Exception):
    """L1-1's verdict on a step fault ends this loop (the job stops, or its ranks are
    relaunched): it steps no further and reports nothing more."""

    def __init__(self, verdict: engine_pb2.StepVerdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:_DETAIL_CHARS]


def classify_fault(exc: BaseException) -> tuple[str, str]:
    """(fault_class, one-line detail) for an exception raised in a rank. The class is the
    one a typed exception declares (``fault_class``: TrainingFault's, CheckpointError's,
    RendezvousFailed's, a ModuleFailed's original's), or ``boundary_violation``; otherwise ""
    (L1-3 classes it by the failure's typed cause: ``services/contract/failures.py``). Never
    read from the exception's text."""
    fault_class = getattr(exc, "fault_class", None)
    if fault_class:
        return fault_class, _one_line(exc)
    detail = f"{type(exc).__name__}: {_one_line(exc)}"[:_DETAIL_CHARS]
    if isinstance(exc, BoundaryViolation):
        return "boundary_violation", detail
    return "", detail
