"""Crossing a process: any routed message travels by its full proto name, in one envelope.

A process boundary is a gRPC stream or call (a rank's RankSession to its node agent, the
agent's WorkerSession to control, a rank's calls to the data and store services). Instead of
one envelope field per message type (a hand-written map to keep in step with the table),
every routed message crosses as ``surge.v1.Routed{type, body, sender, receiver}``, and the
route table is checked on both sides:

* out (:meth:`Link.forward`, subscribed on this process's bus as the module beyond the link):
  the route lets ``sender`` send the message and names a receiver beyond the link;
* in (:meth:`Link.deliver`): the far process may speak for ``sender`` (a rank cannot claim
  to be L1_ORCHESTRATOR), the route lets ``sender`` send it and names ``receiver`` (a
  command) or some receiver at all (an event); then it goes on this process's bus as if
  ``sender`` had sent it here: ``Bus.command`` (its reply is returned) or ``Bus.publish``.

So adding an event that crosses takes a message, a route and a handler; no relay changes.

Map:
    pack / unpack        the envelope, the message class found by name in the descriptor pool
    Link                 one process's side of one boundary: the modules beyond it, the
                         modules it speaks for, how an envelope goes out
    Link.stand_in        subscribe ``forward`` for every route from ``near`` to ``beyond``
    Link.deliver         an envelope that came in -> this process's bus
    Outbox, routed_trailers, routed_from_rpc
                         a called service's events for the caller's side, returned with the
                         call's end (trailing metadata ``surge-routed-bin``): the data and
                         store services have no stream up, their caller relays them
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from services.contract import route_pb2
from services.contract.bus import BoundaryViolation, Bus, Reply, RouteError
from services.contract.route_table import RouteTable, default_table, module_name

Routed = route_pb2.Routed
_log = structlog.get_logger("contract.relay")
# Where a forwarded envelope goes: (envelope, the message it carries, the bus payload). The
# transport picks the stream from the message (a job's sessions) or the payload (a worker id).
Send = Callable[[Routed, Message, Any], None]

ANY = route_pb2.MODULE_UNSPECIFIED  # Routed.receiver of an event: every receiver beyond the link
# Which modules live in which process (the seed's layers; the composition roots host them).
L1 = frozenset(
    {
        route_pb2.L1_ORCHESTRATOR,
        route_pb2.L1_RESOURCE_ALLOCATOR,
        route_pb2.L1_FAULT_DETECTOR,
        route_pb2.L1_RECOVERY_CONTROLLER,
    }
)  # control
RANK = frozenset(
    {  # a rank process of the worker service
        route_pb2.L2_TRAINING_LOOP,
        route_pb2.L2_PARALLEL_STRATEGY,
        route_pb2.L2_OPTIMIZER,
        route_pb2.L2_MIXED_PRECISION,
        route_pb2.L3_SHARD_LOADER,
        route_pb2.L3_OPERATOR_ADAPTER,
        route_pb2.L3_FORWARD_UNIT,
        route_pb2.L3_BACKWARD_UNIT,
        route_pb2.L3_GRADIENT_REDUCTION,
    }
)
L4 = frozenset(
    {
        route_pb2.L4_DATASET_VERSIONS,
        route_pb2.L4_PREFETCHER,
        route_pb2.L4_SHUFFLER,
        route_pb2.L4_FILTER,
        route_pb2.L4_BATCH_PACKER,
    }
)  # data
L5 = frozenset({route_pb2.L5_CHECKPOINT_MANAGER, route_pb2.L5_METRICS_LOGGER})  # store


# Trailing metadata of a call: the routed events (serialized ``Routed``, one value each) that
# the called service's modules sent to modules on the caller's side while serving it.
ROUTED_METADATA = "surge-routed-bin"


class RelayError(ValueError):
    """An envelope that cannot be read: unknown type, or a body that does not parse."""


def pack(msg: Message, sender: int, receiver: int = ANY, table: RouteTable | None = None) -> Routed:
    """``msg`` in an envelope from ``sender`` (to ``receiver``, for a command).

    Raises:
        BoundaryViolation: the table has no route for ``msg`` from ``sender`` (to
            ``receiver``, when one is named).
    """
    _check(table or default_table(), sender, msg.DESCRIPTOR.full_name, receiver)
    return Routed(type=msg.DESCRIPTOR.full_name, body=msg.SerializeToString(), sender=sender, receiver=receiver)


def message_class(name: str) -> type[Message]:
    """The generated class of the message whose full proto name is ``name``.

    Raises:
        RelayError: no such message is compiled into this process.
    """
    try:
        return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(name))
    except KeyError:
        raise RelayError(f"relayed message of unknown type {name!r}") from None


def unpack(routed: Routed) -> Message:
    """The message an envelope carries (its route is not checked here: see :class:`Link`).

    Raises:
        RelayError: unknown type, or a body that is not that message.
    """
    msg = message_class(routed.type)()
    try:
        msg.ParseFromString(routed.body)
    except DecodeError:
        raise RelayError(f"relayed {routed.type} from {module_name(routed.sender)}: the body does not parse") from None
    return msg


def _check(table: RouteTable, sender: int, name: str, receiver: int) -> None:
    route = table.route(name)
    if route is None or sender not in route.senders or (receiver != ANY and receiver not in route.receivers):
        raise BoundaryViolation(sender, name, receiver or None)


def stamp_origin(msg: Message, *, job_id: str = "", rank: int | None = None, worker_id: str = "") -> None:
    """Set on ``msg`` where it comes from, as the transport that carried it knows it (the
    session a node agent opened, the rank its hello named), never its content: an empty
    ``job_id`` and an unset ``rank`` (also in a ``failure`` part) get the sender's; a
    ``worker_id`` field always gets the carrying node's (an agent speaks only for its own)."""
    fields = msg.DESCRIPTOR.fields_by_name
    targets = [msg]
    if "failure" in fields and msg.DESCRIPTOR.fields_by_name["failure"].message_type is not None:
        targets.append(msg.failure)
    for target in targets:
        tf = target.DESCRIPTOR.fields_by_name
        if job_id and "job_id" in tf and not target.job_id:
            target.job_id = job_id
        if rank is not None and "rank" in tf and tf["rank"].type == tf["rank"].TYPE_UINT32:
            unset = not target.HasField("rank") if tf["rank"].has_presence else not target.rank
            if unset:
                target.rank = rank
    if worker_id and "worker_id" in fields:
        msg.worker_id = worker_id


class Link:
    """One process's side of one process boundary.

    Args:
        bus: this process's bus (commands and events that came in go on it; the stand-ins
            that send out are subscribed on it).
        name: names the boundary in errors ("rank session", "node agent worker-1").
        near: the modules of this process (and the relays it hosts) whose messages may go
            out over this link: an envelope's sender is one of them.
        beyond: the modules that live beyond the link: an outgoing message is routed to one
            of them.
        speaks: the modules the far process may send as (default: ``beyond``); an incoming
            envelope from any other sender is a boundary violation.
        send: puts one envelope on the wire (must not block on the far side; a queue).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        name: str,
        near: Iterable[int],
        beyond: Iterable[int],
        speaks: Iterable[int] | None = None,
        send: Send | None = None,
    ):
        self._bus, self.name, self._send = bus, name, send
        self.near, self.beyond = frozenset(near), frozenset(beyond)
        self.speaks = frozenset(speaks) if speaks is not None else self.beyond
        self._table = bus.table

    # ------------------------------------------------------------------ out

    def stand_in(
        self,
        kinds: Iterable[int] = (route_pb2.COMMAND, route_pb2.EVENT),
        skip: Iterable[type[Message]] = (),
        where: Callable[[Any], bool] | None = None,
    ) -> list[tuple[str, int]]:
        """Subscribe :meth:`forward` on the bus for every implemented route of ``kinds`` from a module
        of ``near`` to a module ``beyond`` the link: a command as each such receiver; an
        event (or data) once, as the first such receiver in the route's order (the far
        side delivers it to all of them). ``skip``: messages this process carries some
        other way (set-up plumbing); ``where``: only the routes it accepts (e.g. failure
        events). Returns the (message, module) subscriptions made.

        Raises:
            RouteError: a route has several senders in ``near``: the envelope could not say
                which one sent it.
        """
        skipped = {m.DESCRIPTOR.full_name for m in skip}
        made: list[tuple[str, int]] = []
        for route in self._table.routes():
            if not route.implemented or route.kind not in kinds or route.message in skipped:
                continue  # a route that is not IMPLEMENTED is not wired anywhere
            if where is not None and not where(route):
                continue
            senders = route.senders & self.near
            receivers = [m for m in route.delivery if m in self.beyond]
            if not senders or not receivers:
                continue
            if len(senders) > 1:
                raise RouteError(
                    f"{self.name}: {route.message} has several senders here "
                    f"({', '.join(sorted(module_name(m) for m in senders))}); a relay could not name its sender"
                )
            (sender,) = senders
            cls = message_class(route.message)
            if route.kind == route_pb2.COMMAND:
                for receiver in receivers:
                    self._bus.subscribe(receiver, cls, self._forwarder(sender, receiver))
                    made.append((route.message, receiver))
            else:
                self._bus.subscribe(receivers[0], cls, self._forwarder(sender, ANY))
                made.append((route.message, receivers[0]))
        return made

    def forward(self, msg: Message, sender: int, receiver: int = ANY, payload: Any = None) -> None:
        """Send ``msg`` over the link as ``sender`` (to ``receiver``: a command).

        Raises:
            BoundaryViolation: not routed so, or routed to nobody beyond the link.
        """
        name = msg.DESCRIPTOR.full_name
        if sender not in self.near:
            raise BoundaryViolation(sender, name, receiver or None)
        routed = pack(msg, sender, receiver, self._table)
        targets = {receiver} if receiver != ANY else set(self._table.route(name).receivers)
        if not targets & self.beyond:
            raise BoundaryViolation(sender, name, receiver or None)
        if self._send is None:
            raise RuntimeError(f"{self.name}: this link sends nothing out")
        self._send(routed, msg, payload)

    def _forwarder(self, sender: int, receiver: int) -> Callable[[Message, Any], None]:
        def forward(msg: Message, payload: Any = None) -> None:
            self.forward(msg, sender, receiver, payload)

        return forward

    # ------------------------------------------------------------------ in

    def deliver_returned(
        self, error: BaseException, skip: Iterable[type[Message]] = (), stamp: Callable[[Message], None] | None = None
    ) -> list[str]:
        """Deliver the routed events a failed call brought back (:func:`routed_from_rpc`),
        each as :meth:`deliver` does (``stamp`` too); one that is refused or unreadable is
        logged and skipped (the call's own failure still goes on). ``skip``: types the
        caller's relay reports itself for that call (not delivered twice). Returns the
        types delivered."""
        return self.deliver_each(routed_from_rpc(error), skip, stamp)

    def deliver_each(
        self,
        routed_events: Iterable[Routed],
        skip: Iterable[type[Message]] = (),
        stamp: Callable[[Message], None] | None = None,
    ) -> list[str]:
        """Deliver routed events that came back with a reply (e.g. a metric record's
        ``MetricsAck.routed``) as :meth:`deliver_returned` does. Returns the types delivered."""
        skipped = {m.DESCRIPTOR.full_name for m in skip}
        delivered = []
        for routed in routed_events:
            if routed.type in skipped:
                continue
            try:
                self.deliver(routed, stamp=stamp)
            except Exception as e:  # noqa: BLE001 - see above
                _log.error(
                    "returned event not delivered", link=self.name, type=routed.type, error=f"{type(e).__name__}: {e}"
                )
                continue
            delivered.append(routed.type)
        return delivered

    def accept(self, routed: Routed) -> Message:
        """Check an incoming envelope against the link and the table; its message.

        Raises:
            BoundaryViolation: the far process may not speak for the sender, the route does
                not let the sender send it, or names neither ``receiver`` nor any receiver.
                The bus counts and reports it (its ``on_violation`` hook) before it is raised.
            RelayError: unknown type or a body that does not parse.
        """
        name, sender, receiver = routed.type, routed.sender, routed.receiver
        route = self._table.route(name)
        if (
            sender not in self.speaks
            or route is None
            or sender not in route.senders
            or (receiver != ANY and receiver not in route.receivers)
        ):
            self._bus.refuse(sender, name, receiver or None)
        return unpack(routed)

    def deliver(
        self, routed: Routed, payload: Any = None, *, stamp: Callable[[Message], None] | None = None
    ) -> Reply | int:
        """Put an incoming envelope on this process's bus: ``Bus.command`` for a command
        (the reply, which does not go back over the link), ``Bus.publish`` for an event
        (how many receivers got it). ``stamp`` sets the identity the transport knows on the
        message first (the session's worker id, the hello's rank), never its content.

        Raises:
            BoundaryViolation, RelayError: see :meth:`accept`; and whatever the bus raises.
        """
        msg = self.accept(routed)
        if stamp is not None:
            stamp(msg)
        if routed.receiver != ANY:
            return self._bus.command(routed.sender, routed.receiver, msg, payload)
        return self._bus.publish(routed.sender, msg, payload)


class Outbox:
    """Envelopes waiting to go back with a call's end (a ``Link``'s ``send``): the last
    ``limit`` kept (trailing metadata is small: older ones are dropped, counted)."""

    def __init__(self, limit: int = 8):
        self._lock = threading.Lock()
        self._routed: deque[Routed] = deque(maxlen=limit)
        self.dropped = 0

    def put(self, routed: Routed, msg: Message | None = None, payload: Any = None) -> None:
        with self._lock:
            if len(self._routed) == self._routed.maxlen:
                self.dropped += 1
            self._routed.append(routed)

    def drain(self) -> list[Routed]:
        with self._lock:
            out, self._routed = list(self._routed), deque(maxlen=self._routed.maxlen)
        return out


def routed_trailers(routed: Iterable[Routed]) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying ``routed`` back to the caller (see :func:`routed_from_rpc`)."""
    return tuple((ROUTED_METADATA, r.SerializeToString()) for r in routed)


def routed_from_rpc(error: BaseException) -> list[Routed]:
    """The routed events a failed call brought back (none for any other error)."""
    try:
        metadata = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a call's error, or a half-formed one (cancelled)
        return []
    out = []
    for key, value in metadata:
        if key == ROUTED_METADATA:
            routed = Routed()
            try:
                routed.ParseFromString(value)
            except DecodeError:
                continue  # a malformed trailer is dropped; the call's status still says what failed
            out.append(routed)
    return out
