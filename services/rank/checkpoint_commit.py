"""The rank's L5 checkpoint relay (``store_client.py``): the background write and commit,
the store calls, and the reports of a failed save (BackgroundCommit, a part of StoreClient;
``_reported``: how its commands' handlers report their own errors first).

An asynchronous save's DCP write runs on the relay's own thread; rank 0's ``CommitSave``
is chained on it there (a failed write is never committed). A commit that cannot reach the
store is kept for the final flush to retry; a refused one is raised (now, or at the next
save or flush).

Every SnapshotFailed this relay sends carries its ``failure`` typed: by the error's type
(a refused call: the cause the store sent in ``surge-failure-cause``, else its status code's;
a failed write: what the write raised) or, with no error of its own (another rank's
BeginSave failed), by the store cause; ``failure.operation`` names the command (Save-,
Commit- or FlushCheckpoint). An error a save, commit or flush raises is reported so first,
once (the bus then publishes no second, untyped one).
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message
from torch.distributed.checkpoint.api import CheckpointException

from services.contract import Module, route_pb2, store_pb2
from services.contract.bus import BoundaryViolation
from services.contract.failures import FailureCause, ModuleFailed, Refusal, Unwind, cause_of, failure_of, one_line
from services.rank.checkpoint_errors import (
    _STORE_CAUSES,
    COMMIT_TIMEOUT_S,
    OUTAGE_CAUSES,
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointWriteRefused,
    StoreUnavailable,
    _refusal_cause,
    _write_failed,
    refused_by_store,
)
from services.rank.store_liveness import StoreSilent

log = structlog.get_logger()


def _reported(handled: str):
    """A save, commit or flush handler (``handled``: its command) whose error is reported
    first, as this module's failure event for it: SnapshotFailed{operation "save", the
    store's cause when the store refused, the save's step}, its ``failure`` typed by the
    error; so the bus, which passes the error on, does not build one of its own (operation
    '', no store cause). What the bus passes on untouched (a refusal, an unwind, a deeper
    module's failure, a violation) is not this module's failure. (A decorator, not a
    wrapper method: the handler's own frame keeps its name, which the exception register's
    communication sites name.)"""

    def wrap(fn):
        @functools.wraps(fn)
        def handler(self: BackgroundCommit, msg: Message, payload: Any = None) -> Any:
            try:
                return fn(self, msg, payload)
            except (BoundaryViolation, ModuleFailed, Refusal, Unwind):
                raise
            except Exception as e:
                if not getattr(e, "failure_reported", False):
                    mine = isinstance(e, CheckpointError)
                    self._report(
                        "save",
                        e.cause if mine else store_pb2.STORE_FAILURE_UNSPECIFIED,
                        str(e) if mine else one_line(e),
                        step=(e.step if mine else 0) or getattr(msg, "step", 0),
                        job_id=msg.job_id,
                        rank=getattr(msg, "rank", 0),
                        handled=handled,
                        error=e,
                    )
                raise

        return handler

    return wrap


class BackgroundCommit:
    """StoreClient's part that settles a save's background write and commit, calls the
    store and reports a failed save (its state: StoreClient.__init__)."""

    def _commit_after(self, write: Future, msg: store_pb2.CommitCheckpoint) -> store_pb2.SaveCompleted | None:
        try:
            write.result()  # a failed write (of any rank: DCP gathers them) is never committed
        except (Exception, CheckpointException) as e:
            refused = _write_failed(e, msg.step)
            if not isinstance(refused, CheckpointWriteRefused):
                raise
            self._refused(refused, msg.job_id, 0, "surge.v1.CommitCheckpoint")  # (this is rank 0)
            return None
        return self._commit_now(msg)

    def _commit_now(self, msg: store_pb2.CommitCheckpoint, report: bool = True) -> store_pb2.SaveCompleted | None:
        try:
            done = self._rpc("CommitSave", self._stub.CommitSave, msg, COMMIT_TIMEOUT_S)
        except StoreUnavailable as e:
            self._failed_commit = msg  # its staging stays on disk: the final flush retries it
            if report:
                self._report(
                    "save",
                    e.cause,
                    f"{e}; training continues, saved again at the next interval",
                    step=msg.step,
                    job_id=msg.job_id,
                    handled="surge.v1.CommitCheckpoint",
                    error=e,
                )
            return None
        except CheckpointWriteRefused as e:  # the store's own write refused: reported, the loop goes on
            e.step = msg.step
            if report:
                self._refused(e, msg.job_id, 0, "surge.v1.CommitCheckpoint")
            return None
        except CheckpointError as e:  # refused: raised (now, or from the background at the next save or flush)
            e.step = msg.step
            raise
        self._failed_commit = None
        self._emit(done)  # SaveCompleted up to L1
        log.info(
            "checkpoint_committed",
            version=done.version,
            step=done.step,
            bytes=done.bytes,
            commit_s=round(done.seconds, 4),
        )
        return done

    def _settle_write(self) -> None:
        """Wait for this rank's write in flight; raise its failure as CheckpointError."""
        write, self._write = self._write, None
        if write is None:
            return
        try:
            write.result()
        except (Exception, CheckpointException) as e:  # the background write failed (disk full, a peer died)
            raise _write_failed(e, self._write_step) from None

    def _commit_settled(self, bound_s: float, breaker: bool = True) -> tuple[int, str] | None:
        """Wait for rank 0's background commit while the store answers, up to ``bound_s``
        (``store_liveness.py``: a store that is slow, not gone, is waited for). Returns
        (cause, reason) if it still waits for a store that stopped answering (TIMEOUT,
        UNREACHABLE) or for one that answered but not this commit within ``bound_s``
        (TIMEOUT), else None. ``breaker`` False: waited for even while the store is known
        silent (``StoreLiveness.wait``: the run's end).

        Raises:
            CheckpointError: the commit was refused, or the write under it failed.
        """
        commit = self._commit
        if commit is None:
            return None
        try:
            self._liveness.wait(commit, bound_s, "the previous save's CommitSave", breaker)
        except StoreSilent as e:
            return e.cause, f"the previous save's commit is still waiting: {e}"
        try:
            commit.result()  # (done: the wait above returned)
        except CheckpointError:
            self._commit = None
            raise
        except (Exception, CheckpointException) as e:
            self._commit = None
            raise _write_failed(e, self._commit_step) from None
        self._commit = None
        return None

    def _refused(self, error: CheckpointWriteRefused, job_id: str, rank: int, handled: str) -> None:
        """A save whose bytes a destination refused: logged on every rank, reported once per
        save by rank 0 (every rank learns of it: DCP gathers the ranks' write results, the
        ranks agree on a refused BeginSave, rank 0 commits). Never raised to the loop: the
        save is lost whatever is decided, and L1-1 decides what follows (fault policy,
        ``checkpoint_write_failed``); the next save writes a fresh staging directory."""
        log.warning(
            "checkpoint_write_refused",
            step=error.step,
            write_error=route_pb2.WriteError.Name(error.write_error),
            path=error.path,
            error=str(error),
        )
        if rank != 0:
            return
        with self._refused_lock:
            if error.step == self._refused_step:  # (the write's and the commit's side of one save)
                return
            self._refused_step = error.step
        self._report(
            "save", error.cause, str(error), step=error.step, job_id=job_id, rank=rank, handled=handled, error=error
        )

    def _report(
        self,
        operation: str,
        cause: int,
        reason: str,
        *,
        step: int = 0,
        job_id: str = "",
        rank: int = 0,
        version: str = "",
        handled: str = "",
        error: BaseException | None = None,
    ) -> None:
        """SnapshotFailed up to L1 (RankEvent{snapshot_failed}), its ``failure`` typed by
        ``error``'s type (else by the store ``cause``) and naming the command ``handled``
        (default: the ``operation``'s); never raises. With the ``error`` about to be raised:
        the event is this module's failure event for it (the bus does not publish another:
        ``failure_reported``)."""
        try:
            failed = store_pb2.SnapshotFailed(
                job_id=job_id or version.rpartition(":")[0],
                version=version,
                operation=operation,
                reason=" ".join(reason.split())[:400],
                cause=cause,
                step=step,
                rank=rank,
            )
            if isinstance(error, CheckpointWriteRefused):  # which refusal, and where, typed
                failed.write_error, failed.path = error.write_error, error.path
            handled = handled or f"surge.v1.{operation.capitalize()}Checkpoint"
            if error is not None:
                failed.failure.CopyFrom(failure_of(error, Module.L5_CHECKPOINT_MANAGER, handled))
                error.failure_reported = True
            else:
                failed.failure.CopyFrom(
                    route_pb2.Failure(
                        cause=_STORE_CAUSES.get(cause, FailureCause.FAILURE_INTERNAL),
                        detail=failed.reason,
                        operation=handled,
                        module=Module.L5_CHECKPOINT_MANAGER,
                    )
                )
            failed.failure.job_id = failed.failure.job_id or failed.job_id
            if not failed.failure.HasField("rank"):
                failed.failure.rank = rank
            self._emit(failed)
        except Exception as e:  # noqa: BLE001 - a report must not turn a skipped save into a fault
            log.error("snapshot_failed_not_reported", error=f"{type(e).__name__}: {e}")

    def _rpc(self, name: str, method, msg, timeout: float, live: bool = False, breaker: bool = True):
        """``method(msg)`` with a deadline of ``timeout``; ``live``: no fixed deadline, the
        call is waited for while the store answers, up to ``timeout`` (``store_liveness.py``;
        ``breaker`` False: sent even while its breaker is open).

        Raises:
            StoreUnavailable: the store could not be asked, or stopped answering (typed cause).
            CheckpointIntegrityError: a Load the store refused for the version's bytes.
            CheckpointError: any other refusal (cause REJECTED).
        """
        try:
            if live:
                return self._liveness.call(name, method, msg, timeout, breaker=breaker)
            return method(msg, timeout=timeout)
        except StoreSilent as e:
            silent = StoreUnavailable(str(e), e.cause)
            silent.failure_cause = e.failure_cause
            raise silent from None
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            code = e.code()
            details = " ".join((e.details() or "").split())
            text = f"store at {self._address}: {name}: {code.name}: {details}"
            if code in OUTAGE_CAUSES:
                error: CheckpointError = StoreUnavailable(text, OUTAGE_CAUSES[code])
            elif cause_of(e) == FailureCause.FAILURE_WRITE_REFUSED:  # the store's write was refused
                error = refused_by_store(text, e)
            elif name == "Load" and code == grpc.StatusCode.FAILED_PRECONDITION:
                raise CheckpointIntegrityError(text, _refusal_cause(e)) from None
            else:
                error = CheckpointError(text)
                error.cause = store_pb2.REJECTED
            # Typed as the store typed it (its surge-failure-cause), else by the status code.
            error.failure_cause = cause_of(e)
            raise error from None
