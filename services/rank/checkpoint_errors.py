"""The rank's L5 checkpoint relay (``store_client.py``): its errors and their typed causes.

What a save, commit or load that failed raises (CheckpointError and its kinds, each with
the fault class and FailureCause it is graded by), how a store call's deadlines are set,
how a gRPC status or a write's error becomes a cause (never read from an error's text),
and ``init_from.hf``: a load of Hugging Face weights from this node's disk, the store not
asked (its refusal: WeightsMismatch).
"""

from __future__ import annotations

import os
import time
from typing import Any

import grpc
import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from services.compute.hf_format import HfFormatError, read_hf_tensors
from services.contract import store_pb2
from services.contract.failures import (
    FailureCause,
    Refusal,
    cause_of,
    write_refused,
    write_refused_from_rpc,
)
from services.state.chunk_store import ChunkIntegrityError
from services.state.snapshot import SLOT_META


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


# How long a store may leave a save's liveness probe unanswered (store_liveness.py: BeginSave
# and the wait for the previous commit are waited for while the store answers, not cut at
# this), and how long a rebuilt world waits for the old world's write and commit.
STORE_RPC_TIMEOUT_S = _env_seconds("SURGE_STORE_RPC_TIMEOUT_S", 10.0)
COMMIT_TIMEOUT_S = 600.0  # the manager hashes every file (in the background: the loop trains on)
LOAD_TIMEOUT_S = 60.0  # the store re-hashes nothing at load: the reader checks digests
# At the end of a run: how long the last commit may wait for the store (pending, or retried
# while unreachable). Below the default stall deadline (30 s): the rank has finished training.
FLUSH_RETRY_S = _env_seconds("SURGE_CHECKPOINT_FLUSH_RETRY_S", 20.0)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
STORE_CAUSE_METADATA = "surge-store-cause"  # trailing metadata of a refused Load (the store's verdict)
# gRPC status -> the typed cause of a store that could not be asked (never read from text).
OUTAGE_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: store_pb2.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: store_pb2.TIMEOUT,
}
log = structlog.get_logger()


class CheckpointError(RuntimeError):
    """A save or load that failed. ``failure_cause``: typed from what failed (the store's
    cause for a refused call, the write's error's type), FAILURE_IO by default; ``cause``:
    the StoreFailureCause SnapshotFailed carries (REJECTED: the store refused; 0: the
    failure was this rank's own, e.g. its write); ``step``: the save it belongs to (0: none)."""

    fault_class = "checkpoint_error"
    failure_cause = FailureCause.FAILURE_IO
    cause = store_pb2.STORE_FAILURE_UNSPECIFIED
    step = 0


class StoreUnavailable(CheckpointError):
    """The store could not be asked: ``cause`` UNREACHABLE (UNAVAILABLE) or TIMEOUT
    (DEADLINE_EXCEEDED)."""

    failure_cause = FailureCause.FAILURE_UNAVAILABLE

    def __init__(self, message: str, cause: int):
        super().__init__(message)
        self.cause = cause


class CheckpointWriteRefused(CheckpointError):
    """A destination refused the save's bytes: a full disk, a quota, a permission, a
    read-only filesystem, an I/O error (``write_error``: a ``WriteError``, typed from the
    errno where the write failed; ``path``: what was refused, "" if unknown), in this rank's
    write, another rank's (DCP gathers them) or the store's staging or commit. Nothing of
    that save is committed and the versions before it are intact. The relay reports it
    (SnapshotFailed{cause WRITE_REFUSED}; L1-3 grades it ``checkpoint_write_failed``) and does
    not raise it to the loop: the save is already lost, and whether the job goes on is
    L1-1's decision by its fault policy (default ``skip_save``), not this relay's."""

    fault_class = "checkpoint_write_failed"
    failure_cause = FailureCause.FAILURE_WRITE_REFUSED
    cause = store_pb2.WRITE_REFUSED

    def __init__(self, message: str, write_error: int, path: str = "", step: int = 0):
        super().__init__(message)
        self.write_error, self.path, self.step = write_error, path, step


def refused_by_store(message: str, e: grpc.RpcError) -> CheckpointWriteRefused:
    """The store refused a call because its own write was refused (its cause
    FAILURE_WRITE_REFUSED): which and where, from the call's trailing metadata."""
    kind, path = write_refused_from_rpc(e)
    return CheckpointWriteRefused(message, kind, path)


class CheckpointIntegrityError(CheckpointError):
    """A version's files do not match its manifest (the store refused it by its recorded
    verdict, or this rank's read found a file's digest wrong or the file gone); the
    orchestrator picks another (``StoreService.Verify`` says which are intact). ``cause``:
    ``store_pb2.CORRUPT`` or ``store_pb2.MISSING_FILE``; ``file``: the file, when known."""

    fault_class = "checkpoint_integrity"
    failure_cause = FailureCause.FAILURE_DATA_CORRUPT

    def __init__(self, message: str, cause: int = store_pb2.CORRUPT, file: str = ""):
        super().__init__(message)
        self.cause, self.file = cause, file


class WeightsMismatch(CheckpointError, Refusal):
    """``init_from`` weights that do not fit this job's model (a tensor missing, or of
    another shape): the spec's fault, the same on every retry; nothing was copied into the
    model. A refusal of the load as asked, not a failure of this relay: the loop gets it as
    raised and fails with it (``config_error``, graded fatal: the job stops), and no
    SnapshotFailed is published (the orchestrator acts on those itself, for a recovery's
    load; a start's would leave the job waiting)."""

    fault_class = "config_error"
    failure_cause = FailureCause.FAILURE_INVALID_INPUT


def load_hf_weights(msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> store_pb2.CheckpointLoaded:
    """``init_from.hf``: read the model slot of ``payload`` (a load template's dict, read
    into in place) from the Hugging Face directory ``msg.hf_directory`` on this node
    (safetensors: no pickle; names and shapes by services/compute/hf_format.py), as a load
    of step 0. The store is not asked: the directory is no version of its catalog.

    Raises:
        WeightsMismatch: a tensor the model needs is missing or of another shape, a file
            cannot be read, or the template holds more than the model slot (one line
            naming it); nothing of the template is changed then.
    """
    t0 = time.perf_counter()
    where = msg.hf_directory
    try:
        if set(payload) != {"model"}:
            raise HfFormatError(f"init_from.hf: {where}: holds weights only, asked for {sorted(payload)}")
        model = payload["model"]
        wanted = {k: v for k, v in model.items() if k != SLOT_META}
        tensors = read_hf_tensors(where, wanted)
    except (HfFormatError, OSError) as e:
        raise WeightsMismatch(" ".join(str(e).split()) if isinstance(e, HfFormatError) else _one_line(e)) from None
    model.update(tensors)
    model[SLOT_META] = torch.tensor([0], dtype=torch.int64)  # read as a version of step 0
    log.info("hf_weights_loaded", directory=where, tensors=len(wanted), seconds=round(time.perf_counter() - t0, 4))
    return store_pb2.CheckpointLoaded(info=store_pb2.CheckpointInfo(version=f"hf:{where}", step=0, path=where))


# The store's cause of a failed save -> the FailureCause of a report with no error of its own
# (another rank's BeginSave failed; the previous commit still waits for the store).
_STORE_CAUSES = {
    store_pb2.UNREACHABLE: FailureCause.FAILURE_UNAVAILABLE,
    store_pb2.TIMEOUT: FailureCause.FAILURE_TIMEOUT,
    store_pb2.CORRUPT: FailureCause.FAILURE_DATA_CORRUPT,
    store_pb2.MISSING_FILE: FailureCause.FAILURE_DATA_CORRUPT,
    store_pb2.REJECTED: FailureCause.FAILURE_INVALID_INPUT,
    store_pb2.WRITE_REFUSED: FailureCause.FAILURE_WRITE_REFUSED,
}


# What an old world's dropped save may say of itself beyond "its group is gone": the store's
# or the disk's own failures. Anything else it raised (a ValueError of a group destroyed
# under its collectives, an internal error) is an artifact of the replaced group.
_STORAGE_CAUSES = frozenset(
    {
        FailureCause.FAILURE_WRITE_REFUSED,
        FailureCause.FAILURE_IO,
        FailureCause.FAILURE_UNAVAILABLE,
        FailureCause.FAILURE_TIMEOUT,
        FailureCause.FAILURE_DATA_CORRUPT,
        FailureCause.FAILURE_EXHAUSTED,
    }
)


def _dropped(error: CheckpointError, own: int = FailureCause.FAILURE_INTERNAL) -> CheckpointError:
    """An old world's save dropped at a rebuild, typed ``FAILURE_COMMUNICATION`` (so that L1
    records it as the consequence of the fault that broke the group) unless its own error's
    type (``own``) is a storage failure: its collectives ran on the group the rebuild replaced."""
    if own not in _STORAGE_CAUSES:
        error.failure_cause = FailureCause.FAILURE_COMMUNICATION
    return error


def _write_failed(e: BaseException, step: int) -> CheckpointError:
    """A save's write that failed, typed by what it raised (I/O unless that says more): a
    refused write (by its errno, in this rank's error or in any rank's DCP gathered) is
    CheckpointWriteRefused."""
    if isinstance(e, CheckpointWriteRefused):
        return e
    refused = write_refused(e)
    if refused is not None:
        where = f" ({refused.path})" if refused.path else ""
        text = f"checkpoint write refused: {refused.strerror or _one_line(refused)}{where}"
        return CheckpointWriteRefused(text, refused.write_error, refused.path, step)
    error = CheckpointError(f"checkpoint write failed: {_one_line(e)}")
    cause = cause_of(e)
    if cause != FailureCause.FAILURE_INTERNAL:
        error.failure_cause = cause
    error.step = step
    return error


def _digest_failure(e: BaseException):
    """(raised on this rank, the ShardDigestMismatch) if ``e`` is one (or DCP's wrapping of
    one, from any rank), else None."""
    from services.compute.inference import ShardDigestMismatch

    kinds = (ShardDigestMismatch, ChunkIntegrityError)
    if isinstance(e, kinds):
        return True, e
    if isinstance(e, CheckpointException):
        me = dist.get_rank() if dist.is_initialized() else 0
        found = sorted(
            ((r, exc) for r, (exc, _) in e.failures.items() if isinstance(exc, kinds)), key=lambda pair: pair[0]
        )
        if found:
            rank, exc = found[0]
            return rank == me, exc
    return None


def _refusal_cause(e: grpc.RpcError) -> int:
    """The store's typed verdict on a refused Load (trailing metadata), CORRUPT if absent."""
    for key, value in e.trailing_metadata() or ():
        if key == STORE_CAUSE_METADATA:
            try:
                return store_pb2.StoreFailureCause.Value(value)
            except ValueError:
                break
    return store_pb2.CORRUPT


def _one_line(e: BaseException) -> str:
    """The last line of an error that names its cause (DCP wraps a rank's traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
