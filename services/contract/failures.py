"""Failures as data: an exception's typed cause, and the failure event a module publishes.

Seed 000 gives every module a failure event (ForwardFailed, ShardError, ...; the route flagged
``failure: true``, checked by ``validation.py``) and the fault detector (L1-3) grades what
arrives. This file turns what Python raises into what L1-3 reads:

* :func:`cause_of` -- the ``surge.v1.FailureCause`` of an exception, from its TYPE only (and,
  for a gRPC error, its status code or the cause a Surge server put in its trailing
  metadata); never from its text. In order: a ``failure_cause`` attribute the exception carries (a FailureCause value; named so, not
  ``cause``, because other typed exceptions carry a StoreFailureCause as ``cause``) (a
  module's own typed exceptions, :class:`ModuleFailed`); the type tables below; the
  exception's explicit ``__cause__`` (``raise X from e``) when its own type says nothing;
  :data:`FAILURE_INTERNAL` otherwise.
* :func:`failure_of` -- the ``surge.v1.Failure`` of an exception raised in a module's handler.
* :func:`failure_event` -- a module's failure event (the route table names it) carrying it.
* :class:`ModuleFailed` -- what a commander gets from the bus when the module it commanded
  failed (the event is already published), instead of the raw exception.
* :class:`Refusal` -- a module's typed *answer* to a command it cannot carry out as given
  (unknown job, illegal transition, bad configuration): not a failure of the module, so the
  bus hands it to the commander unchanged and publishes nothing.
* ``failure_reported`` -- an exception attribute a module sets when it published its
  failure event for that error itself (with its own fields, e.g. SnapshotFailed's store
  cause): the bus does not publish a second one.
* :class:`WriteRefused`, :func:`write_refused` -- a write a destination refused (a full disk,
  a quota, a permission, a read-only filesystem, an I/O error), typed by the ``errno`` at the
  place the write failed (``FAILURE_WRITE_REFUSED`` and a ``WriteError``), never by its text.
* :class:`Unwind` -- control flow that crosses the bus on purpose (a cancelled stream): not
  a failure either.
* :func:`collective`, :func:`set_collective_probe`, :func:`communicator_failed` -- a
  collective or point-to-point call that raised is a communication failure whatever its type
  (gloo raises a plain ``RuntimeError`` when a peer died): typed where it is known to be one
  (inside :func:`collective`, or while the process says it waits in a collective: a rank's
  phase marker, which L3-5 sets around its all-reduces and DDP's wait in L3-4's backward).
  Once one failed in this process, an exception of no more specific type raised after it
  is taken as its consequence (the communicator is broken).

What grades a cause (fault class, grade) is the fault detector's rule table, keyed by
(failure event, cause): ``services/control/fault_detector/rules.py``.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

from services.contract import route_pb2

FailureCause = C = route_pb2.FailureCause
FAILURE_INTERNAL = C.FAILURE_INTERNAL

# The trailing-metadata key a Surge gRPC server sets on an aborted call: the FailureCause's
# name, so the client's cause is the server's, not a guess from the status code.
CAUSE_METADATA = "surge-failure-cause"
# The trailing-metadata key of a refused operator command: the refusal's typed reason
# (a ``surge.v1.RefusalReason`` name, control.proto), for a client that acts on it.
REFUSAL_METADATA = "surge-refusal"
# Trailing metadata of a call refused because a write was (FAILURE_WRITE_REFUSED): the
# WriteError's name and the path refused, so the caller's report says both, typed.
WRITE_ERROR_METADATA = "surge-write-error"
WRITE_PATH_METADATA = "surge-write-path"
_DETAIL_CHARS = 400


class Refusal(Exception):
    """Mixin: the module refuses the command as given; the commander gets it as raised.

    A refusal is the module's answer (the seed's 拒绝), the same on every retry of the same
    command; the module did not fail. Cause: ``FAILURE_INVALID_INPUT`` unless the class
    says otherwise (``failure_cause`` attribute)."""

    failure_cause = C.FAILURE_INVALID_INPUT


class Unwind(Exception):
    """Mixin: control flow that unwinds through a handler on purpose (a cancelled stream);
    the bus re-raises it unchanged. Not a failure: it is never published."""


# errno of a refused write -> its WriteError (route.proto). Only where a write failed: EACCES or
# EIO on a read says something else, so no errno is read as a refused write by cause_of.
WRITE_ERRNOS: dict[int, int] = {
    errno.ENOSPC: route_pb2.WRITE_NO_SPACE,
    errno.EDQUOT: route_pb2.WRITE_QUOTA,
    errno.EACCES: route_pb2.WRITE_PERMISSION,
    errno.EPERM: route_pb2.WRITE_PERMISSION,
    errno.EROFS: route_pb2.WRITE_READ_ONLY,
    errno.EIO: route_pb2.WRITE_IO,
}


# WriteError -> the errno it stands for (a refusal typed in another process, carried here).
_ERRNO_OF = {
    route_pb2.WRITE_NO_SPACE: errno.ENOSPC,
    route_pb2.WRITE_QUOTA: errno.EDQUOT,
    route_pb2.WRITE_PERMISSION: errno.EACCES,
    route_pb2.WRITE_READ_ONLY: errno.EROFS,
    route_pb2.WRITE_IO: errno.EIO,
}


class WriteRefused(OSError):
    """A destination refused a write: ``write_error`` (a ``WriteError``, from the errno) and
    ``path`` (what was being written, "" if the error did not say). Cause
    ``FAILURE_WRITE_REFUSED``: the bytes were not stored, nothing stored before is touched."""

    failure_cause = C.FAILURE_WRITE_REFUSED

    def __init__(self, errno_: int, strerror: str, path: str, write_error: int):
        super().__init__(errno_, strerror, path or None)
        self.write_error = write_error
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:  # (DCP gathers a rank's error to the others pickled)
        return type(self), (self.errno, self.strerror, self.path, self.write_error)


def write_refused(exc: BaseException) -> WriteRefused | None:
    """``exc`` as a :class:`WriteRefused` if it is (or holds) an ``OSError`` whose errno a
    refused write raises (``WRITE_ERRNOS``), else None. Call it where a write failed only.
    Looks through ``__cause__`` / ``__context__`` and, for an error that gathers several
    (torch.distributed.checkpoint's ``CheckpointException.failures``: rank -> (error,
    traceback); read by duck typing, no torch import), each gathered error, lowest rank first."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, WriteRefused):
            return e
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            path = e.filename if isinstance(e.filename, str) else ""
            return WriteRefused(e.errno, e.strerror or "", path, WRITE_ERRNOS[e.errno])
        kind = getattr(e, "write_error", 0)
        if _own_cause(e) == C.FAILURE_WRITE_REFUSED and kind in _ERRNO_OF:
            # Typed where the write failed, in another process (a store's refusal that a
            # relay carried): its WriteError and path, the errno the kind stands for.
            return WriteRefused(_ERRNO_OF[kind], os.strerror(_ERRNO_OF[kind]), str(getattr(e, "path", "")), kind)
        gathered = getattr(e, "failures", None)
        if isinstance(gathered, dict):
            for _, failure in sorted(gathered.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else 1 << 30):
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


@contextmanager
def writing(path: Any = "") -> Iterator[None]:
    """Around a write to ``path``: an ``OSError`` that a refused write raises
    (``WRITE_ERRNOS``) leaves as :class:`WriteRefused` (naming ``path`` when the error named
    none); any other error as it is."""
    try:
        yield
    except WriteRefused:
        raise
    except OSError as e:
        refused = write_refused(e)
        if refused is None:
            raise
        if not refused.path and path:
            refused.path = str(path)
        raise refused from e


def write_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming the refused write behind ``exc`` (its WriteError and path),
    if ``exc`` is typed ``FAILURE_WRITE_REFUSED``; else none."""
    if cause_of(exc) != C.FAILURE_WRITE_REFUSED:
        return ()
    refused = write_refused(exc)
    if refused is None:
        return ()
    return (
        (WRITE_ERROR_METADATA, route_pb2.WriteError.Name(refused.write_error)),
        (WRITE_PATH_METADATA, refused.path),
    )


def write_refused_from_rpc(e: Any) -> tuple[int, str]:
    """(WriteError, path) a refused call's trailing metadata names (``write_metadata``);
    (WRITE_ERROR_UNSPECIFIED, "") if it names none."""
    kind, path = route_pb2.WRITE_ERROR_UNSPECIFIED, ""
    try:
        for key, value in e.trailing_metadata() or ():
            if key == WRITE_ERROR_METADATA and value in route_pb2.WriteError.keys():  # noqa: SIM118 - an enum wrapper
                kind = route_pb2.WriteError.Value(value)
            elif key == WRITE_PATH_METADATA:
                path = str(value)
    except Exception:  # noqa: BLE001, S110 - a local error without metadata: none named
        pass
    return kind, path


class CommunicationFailed(RuntimeError):
    """A collective or point-to-point call raised (its error is ``__cause__``)."""

    failure_cause = C.FAILURE_COMMUNICATION
    fault_class = "comm_error"


class RendezvousFailed(RuntimeError):
    """The process group could not be formed (its store, its port, a peer that never came).

    ``port_in_use``: the rendezvous port was taken (errno ``EADDRINUSE`` from a bind probe,
    typed data): a fresh port fixes it."""

    failure_cause = C.FAILURE_RENDEZVOUS

    def __init__(self, message: str, *, port_in_use: bool = False):
        super().__init__(message)
        self.port_in_use = port_in_use
        self.fault_class = "port_in_use" if port_in_use else "comm_error"


class ModuleFailed(RuntimeError):
    """A module's handler raised: its failure event (already published) and the error.

    What the bus raises to the commander instead of the raw exception. ``failure_cause`` and
    ``fault_class`` are the original's (``fault_class`` only when it declared one), so a
    caller that reports it further (the training loop's TrainingLoopFailed) keeps the type.

    Attributes:
        event: the module's failure event (e.g. ``ForwardFailed``), as published.
        failure: its ``failure`` field (``surge.v1.Failure``).
        error: the exception the handler raised.
    """

    def __init__(self, event: Message, failure: route_pb2.Failure, error: BaseException):
        self.event, self.failure, self.error = event, failure, error
        self.failure_cause = failure.cause
        self.module = failure.module
        self.fault_class = getattr(error, "fault_class", None)
        who = route_pb2.Module.Name(failure.module) if failure.module in route_pb2.Module.values() else "?"
        super().__init__(
            f"{who} failed ({C.Name(failure.cause)}) handling {failure.operation or 'a call'}: {failure.detail}"
        )


# ---------------------------------------------------------------- the communicator's health

_broken = threading.Event()


def communicator_failed() -> None:
    """Record that a collective of this process failed (its communicator is broken)."""
    _broken.set()


def communicator_broken() -> bool:
    """Whether a collective of this process failed (until :func:`communicator_reset`)."""
    return _broken.is_set()


def communicator_reset() -> None:
    """A new process group replaced the broken one (and tests)."""
    _broken.clear()


_in_collective: list[Any] = []


def set_collective_probe(probe: Any) -> None:
    """``probe()`` says whether this process waits in a collective now (a rank: its phase
    marker's PHASE_COLLECTIVE, entered by L3-5 around its all-reduces and DDP's wait). An
    exception of no more specific type raised meanwhile is a communication failure: gloo
    raises a plain RuntimeError when a peer died, inside DDP's reducer where no wrapper
    reaches. None removes it."""
    _in_collective[:] = [probe] if probe is not None else []


def _waiting_in_collective() -> bool:
    try:
        return bool(_in_collective and _in_collective[0]())
    except Exception:  # noqa: BLE001 - a probe must not turn one failure into another
        return False


def communication_failed(op: str, error: BaseException) -> BaseException:
    """What a torch.distributed call ``op`` that raised ``error`` raises instead (the
    communication guard wraps every call): :class:`CommunicationFailed`, this process's
    communicator recorded broken; a typed Surge failure or a refusal as it is."""
    if isinstance(error, (Refusal, Unwind, CommunicationFailed, RendezvousFailed)):
        return error
    if op in _RENDEZVOUS_OPS:  # no communicator existed yet: none is broken
        return RendezvousFailed(f"{op} failed: {type(error).__name__}")
    communicator_failed()
    return CommunicationFailed(f"{op} failed: {type(error).__name__}")


# Calls that form the default process group: a failure there is the rendezvous's.
_RENDEZVOUS_OPS = frozenset({"init_process_group"})


@contextmanager
def collective() -> Iterator[None]:
    """Around a collective or point-to-point call: whatever it raises (other than a typed
    Surge failure, a refusal or process control) is :class:`CommunicationFailed`, and this
    process's communicator is recorded broken."""
    try:
        yield
    except (Refusal, Unwind, CommunicationFailed):
        raise
    except Exception as e:
        communicator_failed()
        raise CommunicationFailed(f"collective failed: {type(e).__name__}") from e


# ---------------------------------------------------------------- cause by type


def cause_of(exc: BaseException) -> int:
    """The ``FailureCause`` of ``exc``, from its type (see the module docstring)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = _own_cause(e)
        if cause is None:
            cause = _by_type(e)
        if cause is not None:
            return cause
        e = e.__cause__
    if _waiting_in_collective():
        communicator_failed()
        return C.FAILURE_COMMUNICATION
    return C.FAILURE_COMMUNICATION if communicator_broken() else FAILURE_INTERNAL


def _own_cause(e: BaseException) -> int | None:
    cause = getattr(e, "failure_cause", None)
    if isinstance(cause, int) and not isinstance(cause, bool) and cause in C.values() and cause != 0:
        return cause
    return None


# gRPC status code name -> cause, when the server did not say (CAUSE_METADATA).
_GRPC_CAUSES: dict[str, int] = {
    "UNAVAILABLE": C.FAILURE_UNAVAILABLE,
    "CANCELLED": C.FAILURE_UNAVAILABLE,
    "DEADLINE_EXCEEDED": C.FAILURE_TIMEOUT,
    "INVALID_ARGUMENT": C.FAILURE_INVALID_INPUT,
    "NOT_FOUND": C.FAILURE_INVALID_INPUT,
    "ALREADY_EXISTS": C.FAILURE_INVALID_INPUT,
    "FAILED_PRECONDITION": C.FAILURE_INVALID_INPUT,
    "OUT_OF_RANGE": C.FAILURE_EXHAUSTED,
    "RESOURCE_EXHAUSTED": C.FAILURE_EXHAUSTED,
    "UNIMPLEMENTED": C.FAILURE_UNSUPPORTED,
    "DATA_LOSS": C.FAILURE_IO,
}


def _by_type(e: BaseException) -> int | None:
    torch = sys.modules.get("torch")  # not loaded: the exception cannot be one of its types
    if torch is not None:
        if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
            return C.FAILURE_OUT_OF_MEMORY
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            if isinstance(e, getattr(dist, "DistStoreError", ())):
                return C.FAILURE_RENDEZVOUS
            if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError
                return C.FAILURE_COMMUNICATION
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        return _grpc_cause(e)
    if isinstance(e, MemoryError):
        return C.FAILURE_OUT_OF_MEMORY
    if isinstance(e, TimeoutError):  # (an OSError: before it)
        return C.FAILURE_TIMEOUT
    if isinstance(e, ConnectionError):
        return C.FAILURE_UNAVAILABLE
    if isinstance(e, OSError):
        return C.FAILURE_RENDEZVOUS if e.errno == errno.EADDRINUSE else C.FAILURE_IO
    if isinstance(e, NotImplementedError):
        return C.FAILURE_UNSUPPORTED
    # A configuration or command the code cannot use. (A bug that raises one is graded as
    # the user's input; both are the same on every retry.)
    if isinstance(e, (ValueError, TypeError, KeyError)):
        return C.FAILURE_INVALID_INPUT
    return None


def _grpc_cause(e: Any) -> int:
    try:
        for key, value in e.trailing_metadata() or ():
            if key == CAUSE_METADATA and value in C.keys():  # noqa: SIM118 - an enum wrapper, not a dict
                return C.Value(value)
    except Exception:  # noqa: BLE001, S110 - an error without metadata (e.g. a local one): by its code
        pass
    code = e.code()
    return _GRPC_CAUSES.get(getattr(code, "name", ""), C.FAILURE_INTERNAL)


def cause_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a server aborting a call because of ``exc``: its cause, typed
    (and, for a refused write, which and where: ``write_metadata``)."""
    return ((CAUSE_METADATA, C.Name(cause_of(exc))), *write_metadata(exc))


# ---------------------------------------------------------------- the failure event


def one_line(exc: BaseException) -> str:
    """``Type: first line of its text`` for people (never parsed)."""
    details = getattr(exc, "details", None)
    if callable(details) and callable(getattr(exc, "code", None)):  # a gRPC error: its status, not its repr
        try:
            return f"{exc.code().name}: {' '.join(str(details()).split())}"[:_DETAIL_CHARS]
        except Exception:  # noqa: BLE001, S110 - a local RpcError without a status: as any error
            pass
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:_DETAIL_CHARS]


_origin: dict[str, Any] = {}


def set_origin(job_id: str = "", rank: int | None = None) -> None:
    """The job (and rank) this process works for, once known (a rank's composition root):
    stamped on the failures its modules report when the handled message names no job."""
    _origin.clear()
    if job_id:
        _origin["job_id"] = job_id
    if rank is not None:
        _origin["rank"] = rank


def failure_of(
    exc: BaseException, module: int, operation: str = "", handled: Message | None = None
) -> route_pb2.Failure:
    """The ``Failure`` of ``module`` raising ``exc`` while handling ``operation`` (a message's
    full name; ``handled`` the message itself, whose ``job_id`` / ``rank`` fields say where).
    A :class:`ModuleFailed` keeps the failure it carries (the module that failed first)."""
    if isinstance(exc, ModuleFailed):
        f = route_pb2.Failure()
        f.CopyFrom(exc.failure)
        return f
    f = route_pb2.Failure(
        cause=cause_of(exc),
        detail=one_line(exc),
        exception=f"{type(exc).__module__}.{type(exc).__qualname__}",
        operation=operation,
        module=module,
        job_id=_origin.get("job_id", ""),
    )
    if "rank" in _origin:
        f.rank = _origin["rank"]
    if handled is not None:
        fields = handled.DESCRIPTOR.fields_by_name
        job = fields.get("job_id")
        if job is not None and job.type == job.TYPE_STRING and not _repeated(job) and handled.job_id:
            f.job_id = handled.job_id
        rank = fields.get("rank")
        if rank is not None and rank.type in (rank.TYPE_UINT32, rank.TYPE_INT32) and not _repeated(rank):
            f.rank = handled.rank
    return f


def failure_event(
    table: Any,
    module: int,
    failure: route_pb2.Failure,
    handled: Message | None = None,
    error: BaseException | None = None,
) -> Message:
    """``module``'s failure event (the route table's) carrying ``failure``.

    Fields the event shares by name and type with the message being handled (``job_id``,
    ``rank``, ``step``, ...) are copied from it, so L1-3 knows the job (typed fields, not
    text); a ``detail`` or ``reason`` string field gets the failure's one line; a
    ``fault_class`` field gets the class ``error``'s type declares (its ``fault_class``
    attribute, e.g. RendezvousFailed's ``port_in_use``), when it declares one.

    Raises:
        LookupError: the table names no failure event for ``module`` (validation.py
            refuses such a table at start-up).
    """
    event_type = failure_event_type(table, module)
    if event_type is None:
        raise LookupError(f"{route_pb2.Module.Name(module)} has no failure event in the route table")
    event = event_type()
    event.failure.CopyFrom(failure)
    fields = event.DESCRIPTOR.fields_by_name
    if handled is not None:
        for f in handled.DESCRIPTOR.fields:
            mine = fields.get(f.name)
            if (
                mine is None
                or f.name == "failure"
                or mine.type != f.type
                or _repeated(f)
                or _repeated(mine)
                or f.message_type is not None
                or mine.enum_type is not f.enum_type
            ):
                continue
            setattr(event, f.name, getattr(handled, f.name))
    job = fields.get("job_id")
    if job is not None and job.type == job.TYPE_STRING and not event.job_id:
        event.job_id = failure.job_id
    rank = fields.get("rank")
    if rank is not None and rank.type == rank.TYPE_UINT32 and failure.HasField("rank") and not event.rank:
        event.rank = failure.rank
    for name in ("detail", "reason"):
        f = fields.get(name)
        if f is not None and f.type == f.TYPE_STRING and not getattr(event, name):
            setattr(event, name, failure.detail)
    declared = getattr(error, "fault_class", None)
    f = fields.get("fault_class")
    if f is not None and f.type == f.TYPE_STRING and isinstance(declared, str) and declared:
        event.fault_class = declared
    return event


def failure_route(table: Any, module: int) -> Any:
    """The route of ``module``'s failure event in ``table`` (None if it has none)."""
    found = [r for r in table.routes() if r.failure and module in r.senders]
    return found[0] if len(found) == 1 else None


def failure_event_type(table: Any, module: int) -> type[Message] | None:
    """The message class of ``module``'s failure event in ``table`` (None if it has none)."""
    route = failure_route(table, module)
    if route is None:
        return None
    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(route.message))


def message_class(full_name: str) -> type[Message]:
    """The generated class of a message by its full name (``surge.v1.RunForward``)."""
    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(full_name))


def failure_events_to(table: Any, receiver: int) -> list[type[Message]]:
    """Message classes of every failure event ``table`` routes to ``receiver`` (by name)."""
    pool = descriptor_pool.Default()
    return [
        message_factory.GetMessageClass(pool.FindMessageTypeByName(r.message))
        for r in table.routes()
        if r.failure and receiver in r.receivers
    ]


def _repeated(field: Any) -> bool:
    return bool(field.is_repeated)
