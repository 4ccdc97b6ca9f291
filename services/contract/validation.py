"""Start-up validation of the contract: a process refuses to serve on a broken law.

Two checks, run by every composition root before it serves (and by the tests):

* :func:`validate_table` -- the route table itself: every top-level message of the service
  protos carries exactly one of ``option (surge.v1.route)`` and ``option (surge.v1.plumbing)``
  (a plumbing message is an envelope or helper that never travels on the bus); the table
  routes exactly the routed messages; every route has senders, receivers, a kind and a
  status (a route that is not IMPLEMENTED also has a reason, a DEFERRED one also what the
  reason rests on, ``tracked_by``), a receiver it says does not handle it (``not_handled``)
  is one of its receivers and has a reason, and it names only modules that
  exist (proto3 enums are open: an unknown number parses fine, so
  it is checked here).
* :func:`validate_wiring` -- one process's bus: every subscription is routed to the
  subscribing module (the bus also refuses it at subscribe time), every subscribing module
  is one the process says it hosts (or relays for), every hosted module is a known
  module that the table names, and every message a port handed out may send has a
  subscribed handler of its receiver (here or a relay standing in for it).

Both raise :class:`ContractError` with a one-line message naming the message or module.
A composition root prints that line and exits with :data:`EXIT_CONTRACT` (78, sysexits'
EX_CONFIG) before it serves -- see :func:`refuse`. (The bus's own start-up refusal,
``RouteError`` from ``subscribe`` or ``port``, is handled the same way.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor

from services.contract import route_pb2
from services.contract.route_table import PROTO_FILES, ROUTE_REASON, SEED_MODULES, RouteTable, default_table

EXIT_CONTRACT = 78  # EX_CONFIG: the process's configuration (here: the contract) is broken

KNOWN_MODULES: frozenset[int] = frozenset(
    v.number for v in route_pb2.Module.DESCRIPTOR.values if v.number != route_pb2.MODULE_UNSPECIFIED
)
_KINDS = frozenset({route_pb2.COMMAND, route_pb2.EVENT, route_pb2.DATA})
_STATUSES = frozenset({route_pb2.IMPLEMENTED, route_pb2.SEED_ONLY, route_pb2.DEFERRED})


class ContractError(RuntimeError):
    """The route table or a process's wiring breaks the contract (a bug, found at start-up)."""


def _name(module: int) -> str:
    if module in KNOWN_MODULES:
        return route_pb2.Module.Name(module)
    if module == route_pb2.MODULE_UNSPECIFIED:
        return "MODULE_UNSPECIFIED"
    return f"unknown module {module}"


def validate_table(table: RouteTable | None = None, files: Iterable[FileDescriptor] = PROTO_FILES) -> None:
    """Check ``table`` (default: the compiled protos') against the messages of ``files``.

    Raises:
        ContractError: a message with neither or both of route/plumbing, a routed message
            missing from the table (or a plumbing one in it), a route for a message the
            protos do not define, a route with no senders, no receivers or no kind, or a
            route naming a module that is not a ``surge.v1.Module``.
    """
    table = table if table is not None else default_table()
    messages: dict[str, bool] = {}  # full name -> marked plumbing
    for fd in files:
        for desc in fd.message_types_by_name.values():
            options = desc.GetOptions()
            routed = options.HasExtension(route_pb2.route)
            plumbing = options.HasExtension(route_pb2.plumbing)
            if routed and plumbing:
                raise ContractError(
                    f"{desc.full_name} has both a route and a plumbing option; it must have exactly one"
                )
            if not routed and not plumbing:
                raise ContractError(
                    f"{desc.full_name} has no route: give it option (surge.v1.route) or, if it never "
                    "travels between modules, option (surge.v1.plumbing) with the reason"
                )
            messages[desc.full_name] = plumbing
    for route in table.routes():
        if route.message not in messages:
            raise ContractError(f"the route table names {route.message}, which no service proto defines")
        if messages[route.message]:
            raise ContractError(f"{route.message} is plumbing but the route table routes it")
        if not route.senders:
            raise ContractError(f"{route.message} has a route with no senders")
        if not route.receivers:
            raise ContractError(f"{route.message} has a route with no receivers")
        if route.kind not in _KINDS:
            raise ContractError(f"{route.message} has a route with no kind (command, event or data)")
        if route.status not in _STATUSES:
            raise ContractError(f"{route.message} has a route with no status (IMPLEMENTED, SEED_ONLY or DEFERRED)")
        if not route.implemented and not route.reason.strip():
            raise ContractError(
                f'{route.message} is {route_pb2.RouteStatus.Name(route.status)} without a reason; say why in reason: "..."'
            )
        if route.status == route_pb2.DEFERRED and not route.tracked_by.get(ROUTE_REASON, "").strip():
            raise ContractError(
                f'{route.message} is DEFERRED without tracked_by; name the file or test its reason rests on: tracked_by: "path::Name"'
            )
        for module in sorted(route.senders | route.receivers):
            if module not in KNOWN_MODULES:
                raise ContractError(f"{route.message} names {_name(module)}, which is not a surge.v1.Module")
        for module, why in sorted(route.not_handled.items()):
            if module not in route.receivers:
                raise ContractError(
                    f"{route.message} says {_name(module)} does not handle it, but does not route it there"
                )
            if not why.strip():
                raise ContractError(
                    f'{route.message} says {_name(module)} does not handle it without a reason; say why in reason: "..."'
                )
    for name, plumbing in sorted(messages.items()):
        if not plumbing and table.route(name) is None:
            raise ContractError(f"{name} has no route in the route table")
    if tuple(files) == PROTO_FILES:
        validate_failure_events(table)


def validate_failure_events(table: RouteTable) -> None:
    """Every seed module has exactly one failure event (a route flagged ``failure: true``):
    sent by it alone, an EVENT, routed to L1-3, with a field ``failure`` of type
    ``surge.v1.Failure`` (what the bus fills when the module's handler raises, and what
    L1-3 grades: services/contract/failures.py).

    Raises:
        ContractError: a seed module with none or several, or a failure route that is not so.
    """
    found: dict[int, list[str]] = {m: [] for m in SEED_MODULES}
    for route in table.routes():
        if not route.failure:
            continue
        if len(route.senders) != 1 or not route.senders <= SEED_MODULES:
            raise ContractError(f"{route.message} is a failure event but is not sent by exactly one seed module")
        if route.kind != route_pb2.EVENT:
            raise ContractError(f"{route.message} is a failure event but not an EVENT")
        if route_pb2.L1_FAULT_DETECTOR not in route.receivers:
            raise ContractError(f"{route.message} is a failure event but is not routed to L1_FAULT_DETECTOR")
        desc = descriptor_pool.Default().FindMessageTypeByName(route.message)
        field = desc.fields_by_name.get("failure")
        if field is None or field.message_type is None or field.message_type.full_name != "surge.v1.Failure":
            raise ContractError(
                f"{route.message} is a failure event without a field `failure` of type surge.v1.Failure"
            )
        found[next(iter(route.senders))].append(route.message)
    for module, events in sorted(found.items()):
        if len(events) != 1:
            raise ContractError(
                f"{_name(module)} has {len(events)} failure events ({', '.join(events) or 'none'}); "
                "every seed module has exactly one (route option `failure: true`)"
            )


def validate_wiring(bus, hosted_modules: Iterable[int]) -> None:
    """Check one process's bus against its table.

    Args:
        bus: a :class:`services.contract.bus.Bus`, fully wired (after every subscribe).
        hosted_modules: the modules this process hosts, and those its relays stand in for
            (e.g. control's session relay receives L2-1's commands for the remote ranks).

    Raises:
        ContractError: a hosted module that is not a known module or that no route names;
            a subscription whose message has no route or is not routed to its module, or
            by a module the process does not host; a port handed out (``Bus.port``) that
            may send a message no subscribed handler of its receiver takes (it would fail
            only at its first send).
    """
    table: RouteTable = bus.table
    hosted = set(hosted_modules)
    named = set()
    for route in table.routes():
        named |= route.senders | route.receivers
    for module in sorted(hosted):
        if module not in KNOWN_MODULES:
            raise ContractError(f"this process hosts {_name(module)}, which is not a surge.v1.Module")
        if module not in named:
            raise ContractError(f"this process hosts {_name(module)}, which no route in the table names")
    for name, module in sorted(_subscriptions(bus), key=lambda s: (s[1], s[0])):
        route = table.route(name)
        if route is None:
            raise ContractError(f"{_name(module)} subscribes to {name}, which has no route")
        if module not in route.receivers:
            raise ContractError(f"{_name(module)} subscribes to {name}, which is not routed to it")
        if module not in hosted:
            raise ContractError(f"{_name(module)} subscribes to {name}, but this process does not host {_name(module)}")
    subscribed = set(_subscriptions(bus))
    port_commands = getattr(bus, "port_commands", None)
    for (sender, receiver), names in sorted((port_commands() if callable(port_commands) else {}).items()):
        for name in sorted(names):
            if (name, receiver) not in subscribed:
                raise ContractError(
                    f"{_name(sender)} holds a port to send {name} to {_name(receiver)}, "
                    f"but no handler of {_name(receiver)} for it is subscribed in this process"
                )


def _subscriptions(bus) -> list[tuple[str, int]]:
    """(message full name, module) of every subscription on ``bus``."""
    public = getattr(bus, "subscriptions", None)
    if callable(public):
        return list(public())
    return list(bus._handlers)  # noqa: SLF001 - the bus has no public listing (yet)


def refuse(service: str, error: Exception) -> int:
    """Print ``error`` as the one line a refused start-up shows; returns the exit status
    (:data:`EXIT_CONTRACT`) for the composition root's ``main`` to return."""
    print(f"{service}: refusing to start: {error}", file=sys.stderr, flush=True)
    return EXIT_CONTRACT
