"""The route table: who may send which message to whom, read from the proto `route` options.

A route exists for every message that declares ``option (surge.v1.route)``. Messages
marked ``option (surge.v1.plumbing)`` instead (helpers such as ``Device``, oneof envelopes)
are not module-to-module messages and cannot be sent on the bus. Every top-level message
carries exactly one of the two; ``validation.py`` checks that, and the table, at start-up.
The routes are the seed's allowed inputs and outputs: tests/contract/seed_routes.yaml
transcribes them and tests/contract/test_seed_routes.py holds this table to it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.message import Message

from services.contract import (
    audit_pb2,
    control_pb2,
    data_pb2,
    engine_pb2,
    route_pb2,
    store_pb2,
    worker_pb2,
)

PROTO_FILES: tuple[FileDescriptor, ...] = tuple(
    m.DESCRIPTOR for m in (control_pb2, engine_pb2, data_pb2, store_pb2, worker_pb2, audit_pb2)
)

SEED_MODULES: frozenset[int] = frozenset(v.number for v in route_pb2.Module.DESCRIPTOR.values if v.name[:1] == "L")


def module_name(module: int) -> str:
    """``route_pb2.Module`` value -> its name, e.g. 21 -> ``L2_TRAINING_LOOP``."""
    return route_pb2.Module.Name(module)


# The key of ``Route.tracked_by`` for what the route's own reason rests on.
ROUTE_REASON = 0


@dataclass(frozen=True)
class Route:
    message: str  # full proto name, e.g. "surge.v1.RunForward"
    senders: frozenset[int]
    receivers: frozenset[int]
    kind: int  # route_pb2.Kind
    seed: str
    # The receivers in the option's order: the order in which a published event reaches
    # them (the bus delivers in this order, whatever the order of subscription).
    delivery: tuple[int, ...] = ()
    status: int = route_pb2.ROUTE_STATUS_UNSPECIFIED  # IMPLEMENTED / SEED_ONLY / DEFERRED
    reason: str = ""  # why it is not IMPLEMENTED
    failure: bool = False  # this event is its sender's failure event
    # Receiver -> why it does not handle this route (Route.not_handled): no root subscribes it.
    not_handled: Mapping[int, str] = field(default_factory=dict, hash=False)
    # What a reason rests on, "path" or "path::Name" (Route.tracked_by, NotHandled.tracked_by):
    # ROUTE_REASON (0) for the route's own reason, else a receiver of ``not_handled``.
    tracked_by: Mapping[int, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # ``delivery`` always lists exactly ``receivers`` (a route built by hand may give
        # only the set: its receivers are then delivered in module-number order).
        order = [m for m in dict.fromkeys(self.delivery) if m in self.receivers]
        order += sorted(self.receivers - set(order))
        object.__setattr__(self, "delivery", tuple(order))

    @property
    def implemented(self) -> bool:
        return self.status == route_pb2.IMPLEMENTED


class RouteTable:
    """Immutable map: message full name -> Route."""

    def __init__(self, routes: dict[str, Route]):
        self._routes = dict(routes)

    @classmethod
    def from_proto(cls, files: tuple[FileDescriptor, ...] = PROTO_FILES) -> RouteTable:
        routes: dict[str, Route] = {}
        for fd in files:
            for desc in fd.message_types_by_name.values():
                route = _route_of(desc)
                if route is not None:
                    routes[route.message] = route
        return cls(routes)

    def route(self, message: type[Message] | Message | str) -> Route | None:
        return self._routes.get(_full_name(message))

    def allows(self, sender: int, message: type[Message] | Message | str, receiver: int) -> bool:
        route = self.route(message)
        return route is not None and sender in route.senders and receiver in route.receivers

    def routes(self) -> list[Route]:
        return sorted(self._routes.values(), key=lambda r: r.message)

    def commands_between(self, sender: int, receiver: int) -> list[Route]:
        return [r for r in self.routes() if sender in r.senders and receiver in r.receivers]


def message_class(name: str) -> type[Message]:
    """The generated class of the message with full name ``name`` (KeyError: none)."""
    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(name))


def handler_name(route: Route) -> str:
    """The method a receiver of ``route`` handles it with (``Bus.host``): a command by its
    verb, ``RunForward`` -> ``run_forward``; an event or data by ``on_`` + its name,
    ``StepCompleted`` -> ``on_step_completed``."""
    short = route.message.rsplit(".", 1)[-1]
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", short).lower()
    return snake if route.kind == route_pb2.COMMAND else f"on_{snake}"


@dataclass(frozen=True)
class Handled:
    """One message a module handles: its route, the handler's name, and whether the module
    must provide it (an event it may also get as the reply to something it sends the event's
    sender is handled only if the module says so by defining the method)."""

    route: Route
    name: str
    required: bool


def handled_by(table: RouteTable, module: int) -> list[Handled]:
    """What ``module`` handles: every IMPLEMENTED route to it, by handler name, except those
    whose route says ``module`` does not handle it (``not_handled``, with the reason)."""
    out = []
    for route in table.routes():
        if not route.implemented or module not in route.receivers or module in route.not_handled:
            continue
        if route.kind == route_pb2.COMMAND:
            required = True
        else:  # not required when it may be a reply: the module sends one of its senders
            # something (``Bus.command`` returns the receiver's answer, e.g. MetricsAck)
            required = not any(c.implemented for s in route.senders for c in table.commands_between(module, s))
        out.append(Handled(route, handler_name(route), required))
    return out


def _full_name(message: type[Message] | Message | str) -> str:
    if isinstance(message, str):
        return message
    return message.DESCRIPTOR.full_name


def _route_of(desc: Descriptor) -> Route | None:
    options = desc.GetOptions()
    if not options.HasExtension(route_pb2.route):
        return None
    r = options.Extensions[route_pb2.route]
    return Route(
        message=desc.full_name,
        senders=frozenset(r.senders),
        receivers=frozenset(r.receivers),
        kind=r.kind,
        seed=r.seed,
        delivery=tuple(dict.fromkeys(r.receivers)),
        status=r.status,
        reason=r.reason,
        failure=r.failure,
        not_handled={n.receiver: n.reason for n in r.not_handled},
        tracked_by={
            **({ROUTE_REASON: r.tracked_by} if r.tracked_by else {}),
            **{n.receiver: n.tracked_by for n in r.not_handled if n.tracked_by},
        },
    )


_DEFAULT: RouteTable | None = None


def default_table() -> RouteTable:
    """The table of the compiled protos (built once per process)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = RouteTable.from_proto()
    return _DEFAULT
