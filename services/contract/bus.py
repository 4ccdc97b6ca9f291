"""The contract bus: the only way modules inside one process talk to each other.

Every send is checked against the route table (``route_table.py``). A send that the table
does not allow raises :class:`BoundaryViolation`, is counted in
``surge_boundary_violations_total{sender,message}`` and is reported to the process's
violation hook (which relays it up as a fault). Every receiver gets its own copy of the
message, so what one receiver does to its copy cannot change what another sees.

Two verbs, matching the seed's two kinds of messages:

* ``command(sender, receiver, msg, payload)``: a commander tells exactly one executor to
  act; the executor's reply (an event routed back to the commander) is returned.
* ``publish(sender, msg, payload)``: an event (or data) to every subscribed receiver the
  route names.

``payload`` is the in-process tensor handle the seed speaks of ("携带 logits 张量句柄"):
tensors are never serialized into messages; they travel by reference next to them.

Modules do not get the bus. A composition root hands each module a :class:`CommandPort`
for every module it may command and an :class:`Emitter` for its own events.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from prometheus_client import Counter

from services.contract.route_table import RouteTable, default_table, module_name

BOUNDARY_VIOLATIONS = Counter(
    "surge_boundary_violations_total",
    "Sends refused by the route table, by sending module and message.",
    ["sender", "message"],
)


class BoundaryViolation(RuntimeError):
    """A module tried to send a message the route table does not allow."""

    def __init__(self, sender: int, message: str, receiver: int | None):
        self.sender, self.message, self.receiver = sender, message, receiver
        to = module_name(receiver) if receiver is not None else "any receiver"
        super().__init__(
            f"boundary violation: {module_name(sender)} may not send {message} to {to}"
        )


class RouteError(ValueError):
    """A composition root wired something the route table does not allow (start-up check)."""


@dataclass(frozen=True)
class Reply:
    message: Message | None
    payload: Any = None


Handler = Callable[[Message, Any], "Reply | Message | None"]


class Bus:
    """Route-checked in-process dispatch. Thread-safe for sends; subscribe at start-up."""

    def __init__(
        self,
        table: RouteTable | None = None,
        *,
        on_violation: Callable[[BoundaryViolation], None] | None = None,
    ):
        self._table = table or default_table()
        self._handlers: dict[tuple[str, int], Handler] = {}
        self._receivers: dict[str, list[int]] = defaultdict(list)
        self._on_violation = on_violation
        self._lock = threading.Lock()
        self.sent: dict[tuple[int, str, int], int] = defaultdict(int)  # route -> count

    @property
    def table(self) -> RouteTable:
        return self._table

    def subscribe(self, module: int, message_type: type[Message], handler: Handler) -> None:
        """Register ``module`` as a receiver of ``message_type``.

        Raises:
            RouteError: the table does not route ``message_type`` to ``module``, or the
                module already subscribed to it.
        """
        name = message_type.DESCRIPTOR.full_name
        route = self._table.route(name)
        if route is None:
            raise RouteError(f"{name} has no route option; it cannot travel on the bus")
        if module not in route.receivers:
            raise RouteError(f"{module_name(module)} subscribes to {name}, which is not routed to it")
        if (name, module) in self._handlers:
            raise RouteError(f"{module_name(module)} subscribed to {name} twice")
        self._handlers[(name, module)] = handler
        self._receivers[name].append(module)

    def command(self, sender: int, receiver: int, msg: Message, payload: Any = None) -> Reply:
        """Send a command to one executor and return its reply.

        Raises:
            BoundaryViolation: the route table does not allow sender -> msg -> receiver, or
                the reply is not routed from the receiver back to the sender.
            LookupError: no handler of ``receiver`` is subscribed to ``msg``'s type.
        """
        name = msg.DESCRIPTOR.full_name
        self._check(sender, name, receiver)
        handler = self._handlers.get((name, receiver))
        if handler is None:
            raise LookupError(f"{module_name(receiver)} is not wired to receive {name} in this process")
        reply = _as_reply(handler(_copy(msg), payload))
        if reply.message is not None:
            self._check(receiver, reply.message.DESCRIPTOR.full_name, sender)
        return reply

    def publish(self, sender: int, msg: Message, payload: Any = None) -> int:
        """Deliver an event to every subscribed receiver its route names; returns how many.

        Raises:
            BoundaryViolation: ``sender`` is not an allowed sender of ``msg``.
        """
        name = msg.DESCRIPTOR.full_name
        route = self._table.route(name)
        if route is None or sender not in route.senders:
            self._violation(sender, name, None)
        delivered = 0
        for receiver in self._receivers.get(name, ()):
            self._count(sender, name, receiver)
            self._handlers[(name, receiver)](_copy(msg), payload)
            delivered += 1
        return delivered

    def port(self, sender: int, receiver: int) -> CommandPort:
        """A handle through which ``sender`` may command ``receiver`` (and nothing else).

        Raises:
            RouteError: the table has no command from ``sender`` to ``receiver`` at all.
        """
        if not self._table.commands_between(sender, receiver):
            raise RouteError(f"{module_name(sender)} may not command {module_name(receiver)}")
        return CommandPort(self, sender, receiver)

    def emitter(self, sender: int) -> Emitter:
        return Emitter(self, sender)

    def _check(self, sender: int, name: str, receiver: int) -> None:
        if not self._table.allows(sender, name, receiver):
            self._violation(sender, name, receiver)
        self._count(sender, name, receiver)

    def _count(self, sender: int, name: str, receiver: int) -> None:
        with self._lock:
            self.sent[(sender, name, receiver)] += 1

    def _violation(self, sender: int, name: str, receiver: int | None) -> None:
        error = BoundaryViolation(sender, name, receiver)
        BOUNDARY_VIOLATIONS.labels(module_name(sender), name).inc()
        if self._on_violation is not None:
            self._on_violation(error)
        raise error


class CommandPort:
    """What a module holds instead of a reference to a module it may command."""

    def __init__(self, bus: Bus, sender: int, receiver: int):
        self._bus, self._sender, self._receiver = bus, sender, receiver

    def __call__(self, msg: Message, payload: Any = None) -> Reply:
        return self._bus.command(self._sender, self._receiver, msg, payload)

    def __repr__(self) -> str:
        return f"CommandPort({module_name(self._sender)} -> {module_name(self._receiver)})"


class Emitter:
    """What a module holds to publish its own events (the sender is fixed)."""

    def __init__(self, bus: Bus, sender: int):
        self._bus, self._sender = bus, sender

    def __call__(self, msg: Message, payload: Any = None) -> int:
        return self._bus.publish(self._sender, msg, payload)


def _copy(msg: Message) -> Message:
    clone = type(msg)()
    clone.CopyFrom(msg)
    return clone


def _as_reply(result: Reply | Message | None) -> Reply:
    if isinstance(result, Reply):
        return result
    return Reply(result)
