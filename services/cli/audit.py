"""`surgectl audit`: the live permission matrix of a running stack.

Every service process answers ``AuditService.Audit`` with the per-route counts of its
buses (a worker adds those of its rank processes). This module asks each one, then lays
the counts over the route table: every route that carried messages (with the processes
that carried them), every refused send (a violation: not in the table), and every route
of the table that nothing used yet.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import grpc

from services.cli import stack
from services.cli.errors import CliError
from services.common.grpc_server import channel
from services.contract import Module, audit_pb2, audit_pb2_grpc, route_pb2
from services.contract.route_table import RouteTable, default_table, module_name

AUDIT_TIMEOUT_S = 15.0  # a worker waits up to 2 s for its ranks


@dataclass
class RouteRow:
    sender: str
    message: str
    receiver: str
    kind: str  # COMMAND | EVENT | DATA, "" for a violation
    count: int = 0
    by_process: dict[str, int] = field(default_factory=dict)


@dataclass
class AuditView:
    processes: list[str]  # the processes that answered
    used: list[RouteRow]  # routes of the table that carried messages
    violations: list[RouteRow]  # refused sends (not in the table)
    unused: list[RouteRow]  # routes of the table nothing used yet
    notes: list[str]  # unreachable services, ranks that did not answer

    def as_dict(self) -> dict:
        rows = lambda rs: [r.__dict__ for r in rs]  # noqa: E731
        return {
            "processes": self.processes,
            "routes": rows(self.used),
            "violations": rows(self.violations),
            "unused": rows(self.unused),
            "notes": self.notes,
        }


def targets() -> dict[str, str]:
    """Service name -> address: the local stack's processes (``stack.json``), else the
    SURGE_<SERVICE>_ADDRESS variables (compose / many machines; workers then unknown).

    Raises:
        CliError: neither is there.
    """
    procs = stack.read_stack()
    if procs:
        return {name: p.address for name, p in procs.items()}
    found = {
        s: os.environ[f"SURGE_{s.upper()}_ADDRESS"]
        for s in ("control", "data", "store")
        if os.environ.get(f"SURGE_{s.upper()}_ADDRESS")
    }
    if not found:
        raise CliError("no local stack is running (run `surgectl up`) and no SURGE_<SERVICE>_ADDRESS is set")
    return found


def collect(
    addresses: dict[str, str], timeout_s: float = AUDIT_TIMEOUT_S
) -> tuple[list[audit_pb2.AuditReport], list[str]]:
    """Ask every service; returns the reports and one note per service that did not answer."""
    reports, notes = [], []
    for name, address in addresses.items():
        with channel(address, module=Module.EXT_USER) as ch:
            try:
                reports.append(audit_pb2_grpc.AuditServiceStub(ch).Audit(audit_pb2.AuditRequest(), timeout=timeout_s))
            except grpc.RpcError as e:
                notes.append(f"{name} at {address} did not answer: {e.code().name}: {e.details()}")
    if not reports:
        raise CliError("no service answered the audit: " + "; ".join(notes))
    return reports, notes


def view(reports: list[audit_pb2.AuditReport], notes: list[str] = (), table: RouteTable | None = None) -> AuditView:
    """Lay the reports' counts over the route table (pure; see the module docstring)."""
    table = table or default_table()
    sent: dict[tuple[int, str, int], dict[str, int]] = defaultdict(dict)
    refused: dict[tuple[int, str, int], dict[str, int]] = defaultdict(dict)
    all_notes = list(notes)
    for r in reports:
        for c in r.routes:
            by = sent[(c.sender, c.message, c.receiver)]
            by[r.process] = by.get(r.process, 0) + c.count
        for c in r.violations:
            by = refused[(c.sender, c.message, c.receiver)]
            by[r.process] = by.get(r.process, 0) + c.count
        all_notes.extend(r.notes)

    def row(key: tuple[int, str, int], by: dict[str, int], kind: str) -> RouteRow:
        sender, message, receiver = key
        return RouteRow(
            module_name(sender), message, module_name(receiver), kind, sum(by.values()), dict(sorted(by.items()))
        )

    used, unused = [], []
    for route in table.routes():
        kind = route_pb2.Kind.Name(route.kind)
        for s in sorted(route.senders):
            for t in sorted(route.receivers):
                by = sent.pop((s, route.message, t), None)
                (used if by else unused).append(row((s, route.message, t), by or {}, kind))
    # Counted but not in this CLI's table: a service built from other protos. Shown, marked.
    used += [row(k, by, "?") for k, by in sorted(sent.items())]
    violations = [row(k, by, "") for k, by in sorted(refused.items())]
    return AuditView(sorted(r.process for r in reports), used, violations, unused, all_notes)
