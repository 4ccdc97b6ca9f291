"""User-facing errors: one line, actionable, non-zero exit."""

from __future__ import annotations

import grpc

from services.contract import control_pb2
from services.contract.failures import CAUSE_METADATA, REFUSAL_METADATA


class CliError(Exception):
    """An error the operator can fix; printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 1, status: grpc.StatusCode | None = None, unreachable: bool = False):
        super().__init__(message)
        self.code = code
        self.status = status  # the gRPC status it came from (from_rpc), else None
        self.unreachable = unreachable  # the service could not be reached (from_rpc)


# Statuses that mean the operator's input was refused (an unknown job, dataset or
# checkpoint, a bad field): exit 2 like every other bad-input error of surgectl.
BAD_INPUT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE)


def from_rpc(error: grpc.RpcError, service: str, address: str) -> CliError:
    """Map a gRPC failure to a one-line CliError naming the service and what to do."""
    code = error.code() if hasattr(error, "code") else None
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and _connect_failure(error):
        return CliError(f"{service} unreachable at {address} (is the stack up? run `surgectl up`)", unreachable=True)
    if code == grpc.StatusCode.CANCELLED:
        return CliError(f"{service} at {address} closed the call (was the stack stopped?)")
    if code == grpc.StatusCode.UNIMPLEMENTED:  # (gRPC's own "Method not found!": an older server)
        return CliError(
            f"{service} at {address} does not know this call: it runs an older Surge than this surgectl "
            "(`surgectl restart` the stack from this checkout, or use the surgectl that started it)",
            status=code,
        )
    details = error.details() if hasattr(error, "details") else str(error)
    return CliError(details or f"{service} call failed: {code}", code=2 if code in BAD_INPUT else 1, status=code)


def refusal_of(error: grpc.RpcError) -> int:
    """Why control refused a command, typed (``control_pb2.RefusalReason``, from the call's
    trailing metadata ``surge-refusal``); REFUSAL_UNSPECIFIED when it did not say."""
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error of no call (a local one): no reason
        trailers = ()
    for key, value in trailers:
        if key == REFUSAL_METADATA and value in control_pb2.RefusalReason.keys():  # noqa: SIM118 - an enum wrapper
            return control_pb2.RefusalReason.Value(value)
    return control_pb2.REFUSAL_UNSPECIFIED


def _connect_failure(error: grpc.RpcError) -> bool:
    """Whether the service could not be reached, rather than answered UNAVAILABLE itself: a
    Surge server that answers so says why, typed, in its trailing metadata
    (``surge-failure-cause``); a call that never reached one has no such answer. Never read
    from the status text."""
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error of no call (a local one): nothing answered
        trailers = ()
    return not any(key == CAUSE_METADATA for key, _ in trailers)
