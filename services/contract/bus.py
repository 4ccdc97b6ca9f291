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

Failures (issue 13: failures are data). An exception escaping a module's handler is that
module's failure: the bus builds the module's failure event (the route flagged ``failure``,
its ``failure`` field a typed ``surge.v1.Failure``: cause from the exception's type, the
message being handled, the module; ``services/contract/failures.py``) and publishes it from
that module to its routed receivers (L1-3 among them, here or through a relay). Then:

* ``command``: the commander gets :class:`ModuleFailed` carrying the event, not the raw error.
* ``publish``: the event goes on to its other receivers; the publisher gets nothing (an
  event's sender commands none of its receivers; their failure is L1's to decide). Data
  (``kind: DATA``, the data path's stages) is the exception: once its other receivers have
  it, the publisher gets the first receiver's ``ModuleFailed`` (as a commander does), so
  the stream it feeds ends at the stage that broke instead of going on without an item.

Passed on as raised, never published: :class:`BoundaryViolation` (reported as such), a
:class:`~services.contract.failures.Refusal` (the module's typed answer to a command it
cannot carry out as given: unknown job, bad configuration), an
:class:`~services.contract.failures.Unwind` (deliberate control flow, e.g. a cancelled
stream), a ``ModuleFailed`` from a deeper command (that module's failure is published; the
modules it unwinds through are not reported again), and what is not an ``Exception``
(``SystemExit``, ``KeyboardInterrupt``). A module with no failure event in the table (the
external endpoints) and a handler failing while its module's own failure event is being
delivered on that thread raise as before (logged). Test-only: ``injection.py`` makes a
named handler raise (``SURGE_FAULT_INJECT_HANDLER``), in any process.

``payload`` is the in-process tensor handle the seed speaks of ("携带 logits 张量句柄"):
tensors are never serialized into messages; they travel by reference next to them.

Modules do not get the bus. A composition root hands each module a :class:`CommandPort`
for every module it may command and an :class:`Emitter` for its own events.

Every delivery is counted per route (sender, message, receiver) and every refusal per
(sender, message, intended receiver) in a :class:`Traffic` ledger: by default the one of the
process (``TRAFFIC``), shared by all its buses, exported to Prometheus as
``surge_bus_messages_total{sender,message,receiver}`` and read by ``surgectl audit``
(``services/contract/audit.py``). The ledger holds counts only, never a message: there is
no API through which one module could read another's state.
"""

from __future__ import annotations

import contextvars
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import structlog
from google.protobuf.message import Message
from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily

from services.contract import injection, route_pb2
from services.contract.acting import acting
from services.contract.failures import (
    ModuleFailed,
    Refusal,
    Unwind,
    failure_event,
    failure_event_type,
    failure_of,
)
from services.contract.route_table import (
    RouteTable,
    default_table,
    handled_by,
    handler_name,
    message_class,
    module_name,
)

_log = structlog.get_logger("contract.bus")
# Modules whose failure event this thread is delivering: a handler of it that fails does not
# build another (no loop: L1-3's failure event is routed to L1-3).
_REPORTING: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("surge_bus_reporting", default=frozenset())

BOUNDARY_VIOLATIONS = Counter(
    "surge_boundary_violations_total",
    "Sends refused by the route table, by sending module and message.",
    ["sender", "message"],
)


# (sender, message full name, receiver); receiver 0 (MODULE_UNSPECIFIED) in a refusal
# means "any receiver": a publish by a module that may not send that event at all.
RouteKey = tuple[int, str, int]


@dataclass(frozen=True)
class TrafficSnapshot:
    """Counts at one instant: messages delivered and sends refused, per route."""

    sent: dict[RouteKey, int]
    refused: dict[RouteKey, int]


class Traffic:
    """Per-route counters of one process (or of one test). Thread-safe.

    The send path costs one dict increment under a lock; Prometheus reads the counts at
    scrape time (see ``_TrafficCollector``) instead of being updated on every send.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[RouteKey, int] = defaultdict(int)
        self._refused: dict[RouteKey, int] = defaultdict(int)

    def delivered(self, sender: int, message: str, receiver: int, n: int = 1) -> None:
        with self._lock:
            self._sent[(sender, message, receiver)] += n

    def refused(self, sender: int, message: str, receiver: int | None) -> None:
        with self._lock:
            self._refused[(sender, message, receiver or 0)] += 1

    def snapshot(self) -> TrafficSnapshot:
        with self._lock:
            return TrafficSnapshot(dict(self._sent), dict(self._refused))


TRAFFIC = Traffic()  # the process's ledger: every Bus counts here unless given its own


class _TrafficCollector:
    """Exports ``TRAFFIC`` as ``surge_bus_messages_total{sender,message,receiver}``."""

    def __init__(self, traffic: Traffic):
        self._traffic = traffic

    def describe(self):
        return [self._family()]

    def collect(self):
        family = self._family()
        for (sender, message, receiver), count in sorted(self._traffic.snapshot().sent.items()):
            family.add_metric([module_name(sender), message, module_name(receiver)], count)
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "surge_bus_messages",
            "Messages delivered by this process's buses, by route (sender, message, receiver).",
            labels=["sender", "message", "receiver"],
        )


REGISTRY.register(_TrafficCollector(TRAFFIC))


class BoundaryViolation(RuntimeError):
    """A module tried to send a message the route table does not allow."""

    def __init__(self, sender: int, message: str, receiver: int | None):
        self.sender, self.message, self.receiver = sender, message, receiver
        to = module_name(receiver) if receiver is not None else "any receiver"
        super().__init__(f"boundary violation: {module_name(sender)} may not send {message} to {to}")


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
        traffic: Traffic | None = None,
    ):
        """Args:
        table: the route table (default: the compiled protos').
        on_violation: called with each refused send before it is raised (the process's
            reporter: it logs the violation and relays it up as a fault). It must not
            raise; if it does, the error is logged and the violation still raised.
        traffic: where deliveries and refusals are counted (default: ``TRAFFIC``, the
            process's ledger).
        """
        self._table = table or default_table()
        self._handlers: dict[tuple[str, int], Handler] = {}
        # message -> its subscribed receivers in the route's delivery order (not the order
        # of subscription): the table says who hears an event first.
        self._receivers: dict[str, tuple[int, ...]] = {}
        # (sender, receiver) of every port handed out -> the messages its ports may send
        # (validate_wiring checks each has a handler in this process)
        self._ports: dict[tuple[int, int], frozenset[str]] = {}
        self._on_violation = on_violation
        self._traffic = traffic if traffic is not None else TRAFFIC

    @property
    def table(self) -> RouteTable:
        return self._table

    @property
    def traffic(self) -> Traffic:
        return self._traffic

    def snapshot(self) -> TrafficSnapshot:
        """Counts of the ledger this bus writes to (shared by every bus of the process
        unless the bus was given its own)."""
        return self._traffic.snapshot()

    def subscribe(self, module: int, message_type: type[Message], handler: Handler) -> None:
        """Register ``module`` as a receiver of ``message_type``.

        Raises:
            RouteError: the table does not route ``message_type`` to ``module``, or the
                module already subscribed to it.
        """
        self._subscribe(module, message_type.DESCRIPTOR.full_name, handler)

    def _subscribe(self, module: int, name: str, handler: Handler) -> None:
        route = self._table.route(name)
        if route is None:
            raise RouteError(f"{name} has no route option; it cannot travel on the bus")
        if module not in route.receivers:
            raise RouteError(f"{module_name(module)} subscribes to {name}, which is not routed to it")
        if (name, module) in self._handlers:
            raise RouteError(f"{module_name(module)} subscribed to {name} twice")
        self._handlers[(name, module)] = handler
        self._receivers[name] = tuple(m for m in route.delivery if (name, m) in self._handlers)

    def host(self, module: int, obj: object, *, not_handled: Mapping[type[Message], str] | None = None) -> None:
        """Subscribe ``obj`` as ``module``: every IMPLEMENTED route to ``module`` goes to the
        method the table names (``route_table.handler_name``: a command by its verb,
        ``RunForward`` -> ``run_forward``; an event or data by ``on_`` + its name). A route
        whose option says ``module`` does not handle it (``not_handled``, with the reason) is
        not subscribed. A failure event (``failure: true``) without its own method goes to
        ``on_failure`` if ``obj`` has one. An event ``module`` may also get as the reply to something it sends the event's
        sender is subscribed only if ``obj`` defines its method. The generated Protocols in
        ``services/contract/handlers.py`` list what each module must define.

        Args:
            not_handled: messages routed to ``module`` that this object does not handle, each
                with the reason (the route names the module, the implementation does not
                need it, e.g. data that arrives as a command's payload instead).

        Raises:
            RouteError (one line naming the module and the message): a required handler
                missing; a method named like the handler of a message not routed to
                ``module``; a ``not_handled`` entry that ``obj`` handles after all, or that
                is not an implemented route to ``module``.
        """
        who = f"{module_name(module)} ({type(obj).__name__})"
        skip = {t.DESCRIPTOR.full_name: why for t, why in (not_handled or {}).items()}
        handled = handled_by(self._table, module)
        for h in handled:
            method = getattr(obj, h.name, None)
            if h.route.message in skip:
                if method is not None:
                    raise RouteError(f"{who} handles {h.route.message} with {h.name}, but is hosted as not handling it")
                continue
            if method is None and h.route.failure:
                method = getattr(obj, "on_failure", None)
            if method is None:
                if h.required:
                    raise RouteError(f"{who} has no handler {h.name} for {h.route.message}, which is routed to it")
                continue
            self.subscribe(module, message_class(h.route.message), method)
        mine = {h.route.message for h in handled}
        mine |= {r.message for r in self._table.routes() if r.implemented and module in r.not_handled}
        for route in self._table.routes():
            if module in route.not_handled and callable(getattr(type(obj), handler_name(route), None)):
                raise RouteError(
                    f"{who} handles {route.message} with {handler_name(route)}, "
                    "but its route says it does not (not_handled)"
                )
        for name in sorted(set(skip) - mine):
            raise RouteError(f"{who} is hosted as not handling {name}, which is not an implemented route to it")
        for route in self._table.routes():
            if (
                route.message not in mine
                and module not in route.receivers
                and callable(getattr(type(obj), handler_name(route), None))
            ):
                raise RouteError(
                    f"{who} has a handler {handler_name(route)} for {route.message}, which is not routed to it"
                )

    def subscriptions(self) -> list[tuple[str, int]]:
        """(message full name, module) of every subscription, in subscription order."""
        return list(self._handlers)

    def ports(self) -> list[tuple[int, int]]:
        """(sender, receiver) of every port handed out, in order."""
        return list(self._ports)

    def port_commands(self) -> dict[tuple[int, int], frozenset[str]]:
        """(sender, receiver) of every port handed out -> the full names of the messages
        those ports may send (what ``validate_wiring`` requires a handler for)."""
        return dict(self._ports)

    def command(self, sender: int, receiver: int, msg: Message, payload: Any = None) -> Reply:
        """Send a command to one executor and return its reply.

        Raises:
            BoundaryViolation: the route table does not allow sender -> msg -> receiver, or
                the reply is not routed from the receiver back to the sender.
            LookupError: no handler of ``receiver`` is subscribed to ``msg``'s type.
        """
        name = msg.DESCRIPTOR.full_name
        self.check(sender, name, receiver)
        handler = self._handlers.get((name, receiver))
        if handler is None:
            raise LookupError(f"{module_name(receiver)} is not wired to receive {name} in this process")
        self._traffic.delivered(sender, name, receiver)
        reply = _as_reply(self._run(receiver, name, handler, msg, payload))
        if reply.message is not None:
            reply_name = reply.message.DESCRIPTOR.full_name
            self.check(receiver, reply_name, sender)
            self._traffic.delivered(receiver, reply_name, sender)
        return reply

    def publish(self, sender: int, msg: Message, payload: Any = None) -> int:
        """Deliver an event to every subscribed receiver its route names, in the route's
        order (``receivers`` of the option), whatever the order of subscription; returns how many.

        Raises:
            BoundaryViolation: ``sender`` is not an allowed sender of ``msg``.
            ModuleFailed: ``msg`` is data and a receiver failed on it (its failure event is
                published; the other receivers got ``msg``).
        """
        name = msg.DESCRIPTOR.full_name
        route = self._table.route(name)
        if route is None or sender not in route.senders:
            self._violation(sender, name, None)
        delivered, broken = 0, None
        for receiver in self._receivers.get(name, ()):
            self._traffic.delivered(sender, name, receiver)
            try:
                self._run(receiver, name, self._handlers[(name, receiver)], msg, payload)
            except ModuleFailed as failed:
                # Published as the receiver's failure event; an event's sender commands nobody.
                # Data is a stage of a stream: a stage that failed on an item broke the stream
                # (what it hands on would silently lack that item), so its sender stops.
                if route.kind == route_pb2.DATA and broken is None:
                    broken = failed
            delivered += 1
        if broken is not None:
            raise broken
        return delivered

    def _run(self, receiver: int, name: str, handler: Handler, msg: Message, payload: Any) -> Any:
        """Run ``receiver``'s handler of ``msg`` on its behalf (``acting``). An exception
        escaping it is the receiver's failure (see "Failures" in the module docstring).

        Raises:
            ModuleFailed: the handler raised; the receiver's failure event is published.
            BoundaryViolation, Refusal, Unwind, ModuleFailed (from a deeper command), and
            whatever is not an ``Exception``: as raised.
        """
        with acting(receiver):
            try:
                injection.check(receiver, name)
                return handler(_copy(msg), payload)
            except (BoundaryViolation, ModuleFailed, Refusal, Unwind):
                raise
            except Exception as error:
                failed = self._failed(receiver, name, msg, error)
                if failed is None:
                    raise
                raise failed from error

    def _failed(self, module: int, name: str, msg: Message, error: Exception) -> ModuleFailed | None:
        """Publish ``module``'s failure event for ``error`` (raised handling ``name``) and
        return what its commander gets; None when no event can be built (a module with no
        failure event in the table, or one already reporting its own failure on this thread:
        the raw error goes on, logged)."""
        reporting = _REPORTING.get()
        event_type = failure_event_type(self._table, module)
        failure = failure_of(error, module, name, msg)
        where = {
            "module": module_name(module),
            "operation": name,
            "job_id": failure.job_id,
            "cause": route_pb2.FailureCause.Name(failure.cause),
            "error": failure.detail,
        }
        if event_type is None or module in reporting:
            _log.error("handler failed; no failure event", **where, exc_info=error)
            return None
        event = failure_event(self._table, module, failure, msg, error)
        heard = 0
        if not getattr(error, "failure_reported", False):  # (else the module published it itself)
            token = _REPORTING.set(reporting | {module})
            try:
                heard = self.publish(module, event)
            except Exception:  # a receiver of the failure event failed in turn: logged, the first failure stands
                _log.exception("failure event not delivered", **where)
            finally:
                _REPORTING.reset(token)
        _log.warning("module failed", **where, failure_event=event.DESCRIPTOR.name, receivers_here=heard)
        return ModuleFailed(event, failure, error)

    def check(self, sender: int, message: str, receiver: int) -> None:
        """Refuse ``sender -> message -> receiver`` unless the table allows it.

        Every send is checked here; a relay also calls it for a request from another
        process that it cannot hand to any port (the remote sender may command nobody
        there), so that refusal is counted and reported like any other.

        Raises:
            BoundaryViolation: not allowed (after counting it and calling ``on_violation``).
        """
        if not self._table.allows(sender, message, receiver):
            self._violation(sender, message, receiver)

    def refuse(self, sender: int, message: str, receiver: int | None) -> NoReturn:
        """Refuse a send the table may allow but the caller may not make (a relay: the far
        process claims a module it does not host); counted and reported like :meth:`check`'s.

        Raises:
            BoundaryViolation: always.
        """
        self._violation(sender, message, receiver)

    def port(self, sender: int, receiver: int, commands: Iterable[type[Message]] | None = None) -> CommandPort:
        """A handle through which ``sender`` may command ``receiver`` (and nothing else),
        typed by the messages it sends: ``commands`` (each routed from ``sender`` to
        ``receiver`` and IMPLEMENTED; an event the receiver answers, e.g. StepCompleted ->
        MetricsAck, counts), by default every IMPLEMENTED route from ``sender`` to
        ``receiver``. A message outside them is refused when sent (:meth:`refuse`), and
        ``validate_wiring`` refuses a process where one of them has no subscribed handler,
        so a port that could only fail at its first send fails at start-up instead.

        Raises:
            RouteError: the table has no command from ``sender`` to ``receiver`` at all, or
                a message of ``commands`` is not an implemented route between them.
        """
        between = self._table.commands_between(sender, receiver)
        if not between:
            raise RouteError(f"{module_name(sender)} may not command {module_name(receiver)}")
        if commands is None:
            names = frozenset(r.message for r in between if r.implemented)
        else:
            names = frozenset(t.DESCRIPTOR.full_name for t in commands)
            implemented = {r.message for r in between if r.implemented}
            for name in sorted(names - implemented):
                raise RouteError(
                    f"{module_name(sender)}'s port to {module_name(receiver)} sends {name}, "
                    "which is not an implemented route between them"
                )
        self._ports[(sender, receiver)] = self._ports.get((sender, receiver), frozenset()) | names
        return CommandPort(self, sender, receiver, names)

    def emitter(self, sender: int) -> Emitter:
        return Emitter(self, sender)

    def _violation(self, sender: int, name: str, receiver: int | None) -> NoReturn:
        error = BoundaryViolation(sender, name, receiver)
        BOUNDARY_VIOLATIONS.labels(module_name(sender), name).inc()
        self._traffic.refused(sender, name, receiver)
        if self._on_violation is not None:
            try:
                self._on_violation(error)
            except Exception:  # the hook must not hide the violation it reports
                _log.exception("boundary violation hook failed", error=str(error))
        raise error


class CommandPort:
    """What a module holds instead of a reference to a module it may command: one sender,
    one receiver, and the messages it may send (``commands``)."""

    def __init__(self, bus: Bus, sender: int, receiver: int, commands: frozenset[str]):
        self._bus, self._sender, self._receiver = bus, sender, receiver
        self.commands = commands

    def __call__(self, msg: Message, payload: Any = None) -> Reply:
        """Send ``msg`` and return the receiver's reply (routed back, checked by the bus).

        Raises:
            BoundaryViolation: ``msg`` is not one of this port's commands (or the table
                refuses it).
        """
        name = msg.DESCRIPTOR.full_name
        if name not in self.commands:
            self._bus.refuse(self._sender, name, self._receiver)
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
