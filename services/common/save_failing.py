"""A job's saves failing since its newest checkpoint (``JobStatus.save_failing``): L1-1 keeps it
from the store's typed failure events (``SnapshotFailed``), `surgectl status` names it in one
line and `surgectl down` says why a drain could not save. One text for both, from the typed
cause only (never from an exception's text): a store away and a store that answers but refuses
the write (a full disk) need different acts of the operator."""

from __future__ import annotations

from services.contract import control_pb2, route_pb2, store_pb2

Cause, WriteError, FailureCause = store_pb2.StoreFailureCause, route_pb2.WriteError, route_pb2.FailureCause

# What frees a refused write, by its WriteError (the operator's fix differs).
_FIX = {
    WriteError.WRITE_NO_SPACE: "free space at {where}",
    WriteError.WRITE_QUOTA: "raise the disk quota of {where}",
    WriteError.WRITE_PERMISSION: "let the store write to {where}",
    WriteError.WRITE_READ_ONLY: "mount {where} read-write",
    WriteError.WRITE_IO: "fix the device of {where}",
}


def note(sf: control_pb2.SaveFailing, msg: store_pb2.SnapshotFailed, now: float) -> None:
    """Count ``msg`` (a failed save) into ``sf``: one save per step (a save reported by more
    than one rank, or by its write and its commit, counts once); the last one's cause kept."""
    if not sf.failed or msg.step != sf.step:
        sf.failed += 1
    if sf.failed == 1 and not sf.since_unix:
        sf.first_step, sf.since_unix = msg.step, now
    sf.step, sf.cause, sf.reason = msg.step, msg.cause, " ".join(msg.reason.split())[:300]
    sf.failure = msg.failure.cause if msg.HasField("failure") else 0
    sf.write_error, sf.path = msg.write_error, msg.path


def refused(sf: control_pb2.SaveFailing) -> bool:
    """The store answered and a destination refused the bytes (disk full, quota, ...)."""
    return sf.cause == Cause.WRITE_REFUSED or sf.failure == FailureCause.FAILURE_WRITE_REFUSED


def why(sf: control_pb2.SaveFailing) -> str:
    """Why the last save failed, e.g. "the store answered but refused the write: no space at
    /x/checkpoints" or "the store did not answer (unreachable)"."""
    if not sf.failed:  # (none recorded: a save lost with a peer, or an older control's job)
        return "its save failed"
    if refused(sf):
        kind = (
            WriteError.Name(sf.write_error).removeprefix("WRITE_").lower().replace("_", " ") if sf.write_error else ""
        )
        at = f" at {sf.path}" if sf.path else ""
        return f"the store answered but refused the write: {kind or 'refused'}{at}"
    if sf.cause == Cause.UNREACHABLE or sf.failure == FailureCause.FAILURE_UNAVAILABLE:
        return "the store did not answer (unreachable)"
    if sf.cause == Cause.TIMEOUT or sf.failure == FailureCause.FAILURE_TIMEOUT:
        return "the store did not answer in time"
    name = Cause.Name(sf.cause).lower() if sf.cause else FailureCause.Name(sf.failure).removeprefix("FAILURE_").lower()
    return f"{name}: {sf.reason}" if sf.reason else name


def until(sf: control_pb2.SaveFailing) -> str:
    """When a save can go through again, e.g. "once there is free space at PATH": the
    operator's act, for the state the stack is really in."""
    if refused(sf):
        fix = _FIX.get(sf.write_error, "fix what refused the write at {where}")
        return "once you " + fix.format(where=sf.path or "the store's checkpoint directory")
    if sf.cause in (Cause.UNREACHABLE, Cause.TIMEOUT) or sf.failure in (
        FailureCause.FAILURE_UNAVAILABLE,
        FailureCause.FAILURE_TIMEOUT,
    ):
        return "once the store answers"
    return "once its saves go through"


def status_line(job_id: str, sf: control_pb2.SaveFailing, newest: str, paused: bool = False) -> str:
    """`surgectl status`'s line for a job whose saves fail, e.g. "checkpoint saves failing: j: 3
    saves failed (steps 400-500): the store answered but refused the write: no space at P;
    newest checkpoint j:4; the next save tries again (free space at P)". A ``paused`` job saves
    nothing by itself: what saves its step is said (was: "the next save tries again" of a job
    whose next save never came, a fresh user's trial)."""
    saves = f"{sf.failed} save{'s' if sf.failed != 1 else ''}"
    since = f"steps {sf.first_step}-{sf.step}" if sf.first_step and sf.first_step != sf.step else f"step {sf.step}"
    act = until(sf).removeprefix("once you ") if refused(sf) else until(sf)
    then = (
        f"paused, it saves nothing by itself: `surgectl stop {job_id}` or `surgectl down` saves its step, "
        f"`surgectl resume {job_id}` trains on to its next save ({act})"
        if paused
        else f"the next save tries again ({act})"
    )
    return f"checkpoint saves failing: {job_id}: {saves} failed ({since}): {why(sf)}; newest checkpoint {newest or 'none'}; {then}"
