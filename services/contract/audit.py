"""What the contract layer of a process tells others: its route counts and its refusals.

Two things, both about the bus and neither about any module's state:

* **Audit** (``AuditService.Audit``, ``surgectl audit``): the per-route counts of the
  process's :class:`~services.contract.bus.Traffic` ledger as an ``AuditReport``.
  :func:`report_of` builds one, :func:`merge_reports` sums several (a node agent and its
  ranks), :class:`AuditServicer` serves one.
* **Violation reports** (``BoundaryViolationReported``, sent as ``EXT_CONTRACT`` to the
  fault detector): :class:`ViolationReporter` is the ``on_violation`` hook a composition
  root gives its buses. It logs the refusal and hands the report to the process's way up
  (control: its own bus; a rank: its node agent's session; data and store: none, they
  return the violation to the calling process instead, see :func:`abort_with_violation`
  and :func:`violation_from_rpc`).

The path up, level by level: rank -> RankSession -> node agent -> WorkerSession ->
control's session relay -> bus (EXT_CONTRACT -> L1_FAULT_DETECTOR).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from services.contract import audit_pb2, audit_pb2_grpc
from services.contract.bus import TRAFFIC, BoundaryViolation, Traffic

# Trailing metadata of a PERMISSION_DENIED that a service returns for a refused send: the
# serialized BoundaryViolationReported (gRPC "-bin" keys carry bytes).
VIOLATION_METADATA = "surge-violation-bin"
VIOLATION_MESSAGE = audit_pb2.BoundaryViolationReported.DESCRIPTOR.full_name

Deliver = Callable[[audit_pb2.BoundaryViolationReported], Any]


# ---------------------------------------------------------------- audit reports


def report_of(process: str, traffic: Traffic = TRAFFIC, request_id: int = 0) -> audit_pb2.AuditReport:
    """The ledger's counts as an ``AuditReport`` (routes and violations sorted by key)."""
    snap = traffic.snapshot()
    report = audit_pb2.AuditReport(process=process, id=request_id)
    for (sender, message, receiver), count in sorted(snap.sent.items()):
        report.routes.add(sender=sender, message=message, receiver=receiver, count=count)
    for (sender, message, receiver), count in sorted(snap.refused.items()):
        report.violations.add(sender=sender, message=message, receiver=receiver, count=count)
    return report


def merge_reports(
    process: str, reports: Iterable[audit_pb2.AuditReport], notes: Iterable[str] = ()
) -> audit_pb2.AuditReport:
    """Sum the counts of ``reports`` route by route into one report named ``process``;
    their notes are kept, followed by ``notes``."""
    routes: dict[tuple[int, str, int], int] = defaultdict(int)
    refused: dict[tuple[int, str, int], int] = defaultdict(int)
    kept: list[str] = []
    for r in reports:
        for c in r.routes:
            routes[(c.sender, c.message, c.receiver)] += c.count
        for c in r.violations:
            refused[(c.sender, c.message, c.receiver)] += c.count
        kept.extend(r.notes)
    merged = audit_pb2.AuditReport(process=process, notes=[*kept, *notes])
    for (sender, message, receiver), count in sorted(routes.items()):
        merged.routes.add(sender=sender, message=message, receiver=receiver, count=count)
    for (sender, message, receiver), count in sorted(refused.items()):
        merged.violations.add(sender=sender, message=message, receiver=receiver, count=count)
    return merged


class AuditServicer(audit_pb2_grpc.AuditServiceServicer):
    """``AuditService.Audit`` of one process.

    Args:
        report: builds the process's report for a request (default: ``report_of`` of the
            process ledger under ``process``).
    """

    SERVICE_NAME = audit_pb2.DESCRIPTOR.services_by_name["AuditService"].full_name

    def __init__(self, process: str, report: Callable[[audit_pb2.AuditRequest], audit_pb2.AuditReport] | None = None):
        self._report = report or (lambda request: report_of(process, request_id=request.id))

    def Audit(self, request: audit_pb2.AuditRequest, context: grpc.ServicerContext) -> audit_pb2.AuditReport:  # noqa: N802
        return self._report(request)


# ---------------------------------------------------------------- violation reports


def violation_event(
    error: BoundaryViolation, process: str, job_id: str = "", rank: int = 0
) -> audit_pb2.BoundaryViolationReported:
    """The report of one refused send, stamped now."""
    return audit_pb2.BoundaryViolationReported(
        process=process,
        sender=error.sender,
        message=error.message,
        receiver=error.receiver or 0,
        detail=str(error),
        job_id=job_id,
        rank=rank,
        detected_unix=time.time(),
    )


def abort_with_violation(context: grpc.ServicerContext, error: BoundaryViolation, process: str) -> None:
    """End an RPC whose request was refused by the route table: PERMISSION_DENIED with the
    one-line violation as details and the report as trailing metadata, so the caller's
    relay can report it up (this process has no channel up)."""
    event = violation_event(error, process)
    context.set_trailing_metadata(((VIOLATION_METADATA, event.SerializeToString()),))
    context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))


def violation_from_rpc(error: BaseException) -> audit_pb2.BoundaryViolationReported | None:
    """The violation a service returned with PERMISSION_DENIED, or None for any other error."""
    if not isinstance(error, grpc.RpcError) or not hasattr(error, "trailing_metadata"):
        return None
    try:
        if error.code() != grpc.StatusCode.PERMISSION_DENIED:
            return None
        metadata = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a half-formed error object (e.g. a cancelled call)
        return None
    for key, value in metadata:
        if key == VIOLATION_METADATA:
            event = audit_pb2.BoundaryViolationReported()
            event.ParseFromString(value)
            return event
    return None


class ViolationReporter:
    """The ``on_violation`` hook of a process's buses, and its relay of remote refusals.

    Each violation is logged and, when the process has a way up, handed to ``deliver`` on
    this reporter's own thread: the violating module may be mid-decision holding its
    locks, and the report may come back to it (fault detector -> orchestrator). With
    ``inline`` (a ``deliver`` that only queues, like a rank's session) it is handed over
    at once, so it goes up before the failure the violation causes.

    Args:
        process: names the process in every report ("control", "rank 1 of job j", ...).
        log: a structlog logger.
        deliver: sends one report up; None where the process has no channel up (data,
            store: they return the violation to the caller instead).
        job_id, rank: stamped on reports that carry none (a rank's own).
        inline: call ``deliver`` on the reporting thread (it must never block or call
            back into a module).
    """

    def __init__(
        self,
        process: str,
        log: Any,
        deliver: Deliver | None = None,
        *,
        job_id: str = "",
        rank: int = 0,
        inline: bool = False,
    ):
        self._process, self._log, self._deliver, self._inline = process, log, deliver, inline
        self._job_id, self._rank = job_id, rank
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, error: BoundaryViolation) -> None:
        """A bus of this process refused a send (the bus already counted it)."""
        self._log.error("boundary violation", error=str(error))
        if error.message == VIOLATION_MESSAGE:
            return  # the report itself was refused: reporting it again would loop
        self._send(violation_event(error, self._process, self._job_id, self._rank))

    def relay(self, event: audit_pb2.BoundaryViolationReported) -> None:
        """Send up a violation another process refused on this process's request."""
        self._log.error("boundary violation in a called service", process=event.process, error=event.detail)
        self._send(event)

    def relay_rpc_error(self, error: BaseException) -> None:
        """For relays: report the violation a failed call carries (if it carries one)."""
        event = violation_from_rpc(error)
        if event is not None:
            self.relay(event)

    def _send(self, event: audit_pb2.BoundaryViolationReported) -> None:
        if self._deliver is None:
            return
        if not event.job_id and self._job_id:
            event.job_id, event.rank = self._job_id, self._rank
        if self._inline:
            self._deliver_one(event)
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="violation-reporter", daemon=True)
                self._thread.start()
        self._queue.put(event)

    def _run(self) -> None:
        while True:
            self._deliver_one(self._queue.get())

    def _deliver_one(self, event: audit_pb2.BoundaryViolationReported) -> None:
        try:
            self._deliver(event)
        except Exception:  # noqa: BLE001 - keep reporting the next ones
            self._log.exception("boundary violation report not delivered", error=event.detail)
