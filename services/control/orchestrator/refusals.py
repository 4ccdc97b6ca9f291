"""The refusals L1-1 answers an operator command with (typed, mapped to gRPC codes by the server)."""

from __future__ import annotations

from services.contract import control_pb2
from services.contract.failures import Refusal


class JobNotFound(LookupError, Refusal):
    """No job has this id (gRPC NOT_FOUND)."""


class JobDoesNotFit(ValueError, Refusal):
    """The job's estimated memory per rank fits no registered slot (gRPC INVALID_ARGUMENT):
    one line naming the estimate and the largest device; nothing is persisted."""


class NoStandingOrder(ValueError, Refusal):
    """`surgectl revoke` named a fault class the job holds no standing order for (gRPC
    INVALID_ARGUMENT): the operator's typo is refused, never a failure of L1-1 (a failure
    would be graded and decided on: the job ended over a wrong word)."""


class WorkerNotCordoned(ValueError, Refusal):
    """`surgectl uncordon` named a worker with no cordon (gRPC INVALID_ARGUMENT): one line
    naming it and those cordoned; a typo, never a failure of L1-1."""


class BadDeparture(ValueError, Refusal):
    """`surgectl drain` with no worker or a deadline that is not > 0 seconds (gRPC
    INVALID_ARGUMENT): one line naming it; nothing changed."""


class BadAnnotation(ValueError, Refusal):
    """`surgectl tag` / `note` with a malformed key, value or note, or a tag to remove the job
    does not have (gRPC INVALID_ARGUMENT): one line naming it; nothing changed."""


class RequestIdReused(ValueError, Refusal):
    """A submit's request id is the one an earlier submit of another spec text created a job
    with (gRPC INVALID_ARGUMENT): one line naming the request id and that job; nothing is
    persisted. Answering with that job would hand the operator a job of a spec they did not
    send; creating a second would break the id's promise (one job per request id)."""


class UnknownVersion(ValueError, Refusal):
    """`surgectl resume --from` named no committed checkpoint version of the job (gRPC
    INVALID_ARGUMENT): one line naming it and the job's versions; nothing changed. A typo
    or another job's version, the operator's input, not the job's state."""


class IllegalTransition(RuntimeError, Refusal):
    """The command does not apply to the job's current state (gRPC FAILED_PRECONDITION).
    ``refusal``: why, typed, where a client acts on it (``control_pb2.RefusalReason``; the
    server sends it in the call's trailing metadata)."""

    refusal = control_pb2.REFUSAL_UNSPECIFIED

    def __init__(self, message: str, refusal: int | None = None):
        super().__init__(message)
        if refusal is not None:
            self.refusal = refusal


class InsufficientResources(IllegalTransition):
    """The allocator cannot place the job's ranks; nothing was persisted."""

    refusal = control_pb2.REFUSED_NO_CAPACITY


class BadProfileRequest(ValueError, Refusal):
    """`surgectl profile` with a step count out of range (gRPC INVALID_ARGUMENT): one line
    naming the field; nothing sent."""


class BeyondHardLimit(ValueError, Refusal):
    """The job alone needs more slots than its team may ever hold (its hard limit, its nominal
    plus its borrow limit, its cohort's nominal; gRPC INVALID_ARGUMENT): one line naming the
    team, the quota's field and the bound; nothing is persisted."""
