"""Who is calling: the sending module travels with every call and each server checks it.

A Surge client names the module its process speaks for in the gRPC metadata key
``x-surge-module`` (``channel(address, module=...)`` sets it on every call, e.g.
``L2_TRAINING_LOOP`` for a rank, ``EXT_HARDWARE`` for a node agent, ``EXT_USER`` for the
CLI). Every Surge server checks it before the handler runs (``services/common/grpc_guards.py``):

* the claim names a module, and the route table lets that module send the RPC's request
  message (for the plumbing streams, whose request is an envelope, :data:`PLUMBING_CALLERS`
  says who may open them);
* under mutual TLS, the client certificate's identity (its common name or a DNS
  subject-alternative name) is a role of :data:`ROLE_MODULES` that may claim that module:
  a certificate made for a worker cannot speak as the orchestrator.

A call that fails either check is refused with PERMISSION_DENIED and counted and returned
as a boundary violation (the report rides in the trailing metadata, as the bus's refusals
do: :func:`services.contract.audit.abort_with_violation`). Health checks and reflection name
no module: they carry no routed message.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.contract import Module
from services.contract.relay import L1, L4, L5, RANK
from services.contract.route_table import PROTO_FILES, RouteTable, default_table

MODULE_METADATA = "x-surge-module"

M = Module
# Certificate identity (CN or DNS SAN) -> the modules its holder may claim. A process
# certificate names the service it runs; the operator's names the user.
ROLE_MODULES: dict[str, frozenset[int]] = {
    "surge-control": L1,
    "surge-worker": RANK | {M.EXT_HARDWARE},  # node agents and their rank processes
    "surge-data": L4,
    "surge-store": L5,
    "surge-user": frozenset({M.EXT_USER}),
}

# RPCs whose request is plumbing (a stream envelope, a log or audit query): who may open them.
PLUMBING_CALLERS: dict[str, frozenset[int]] = {
    "/surge.v1.ControlService/WorkerSession": frozenset({M.EXT_HARDWARE}),  # a node agent
    "/surge.v1.ControlService/StreamLogs": frozenset({M.EXT_USER}),
    "/surge.v1.WorkerService/RankSession": frozenset({M.L2_TRAINING_LOOP}),  # a rank, for its modules
    # StepCompleted / EvalCompleted to L5-2: a node agent, for its ranks' loops (worker/metric_stream.py)
    "/surge.v1.StoreService/Record": frozenset({M.L2_TRAINING_LOOP}),
    "/surge.v1.AuditService/Audit": frozenset({M.EXT_USER}),
    # In-memory checkpoint copies (worker.proto MemoryCopyService; the data plane, exception
    # memory-copies-data-plane): a rank's L5 relay with its own agent, an agent with its peer.
    "/surge.v1.MemoryCopyService/PutChunks": frozenset({M.L5_CHECKPOINT_MANAGER, M.EXT_HARDWARE}),
    "/surge.v1.MemoryCopyService/HeldChunks": frozenset({M.L5_CHECKPOINT_MANAGER, M.EXT_HARDWARE}),
    "/surge.v1.MemoryCopyService/GetChunk": frozenset({M.L5_CHECKPOINT_MANAGER, M.EXT_HARDWARE}),
    "/surge.v1.MemoryCopyService/GetChunks": frozenset({M.L5_CHECKPOINT_MANAGER, M.EXT_HARDWARE}),
    # A heal's bulk lane (services/worker/bulk_lane.py): one agent asks its peer, never a rank.
    "/surge.v1.MemoryCopyService/OpenBulkRead": frozenset({M.EXT_HARDWARE}),
    # Checkpoint bytes without a shared filesystem (store.proto, exception checkpoint-bytes-stream):
    # a rank's L5 relay streams its save's files to the store and reads a version's back.
    "/surge.v1.StoreService/PutCheckpointFiles": frozenset({M.L5_CHECKPOINT_MANAGER}),
    "/surge.v1.StoreService/HeldCheckpointChunks": frozenset({M.L5_CHECKPOINT_MANAGER}),
    "/surge.v1.StoreService/GetCheckpointFiles": frozenset({M.L5_CHECKPOINT_MANAGER}),
    # A rank's profile files (surgectl profile): its loop's StoreProfile heads the stream.
    "/surge.v1.StoreService/PutProfile": frozenset({M.L2_TRAINING_LOOP}),
    # A job's metric records for the operator (surgectl plot, samples): the relay reads L5-2's files.
    "/surge.v1.StoreService/ReadMetrics": frozenset({M.EXT_USER}),
}


class Refused(Exception):
    """A call whose identity does not hold: ``sender`` (0: none claimed) may not send
    ``message`` (the RPC's request type) here; ``why`` is the one line the caller gets."""

    def __init__(self, sender: int, message: str, why: str):
        super().__init__(why)
        self.sender, self.message = sender, message


class CallerPolicy:
    """Per RPC, the modules that may call it, read from the route table (routed requests)
    and :data:`PLUMBING_CALLERS`."""

    def __init__(self, table: RouteTable | None = None, files=PROTO_FILES):
        table = table or default_table()
        self._callers: dict[str, tuple[str, frozenset[int]]] = {}
        for fd in files:
            for service in fd.services_by_name.values():
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    request = method.input_type.full_name
                    route = table.route(request)
                    callers = route.senders if route is not None else PLUMBING_CALLERS.get(path)
                    if callers is None:
                        raise ValueError(
                            f"{path}: its request {request} is plumbing and PLUMBING_CALLERS names no caller"
                        )
                    self._callers[path] = (request, frozenset(callers))

    def callers(self, method: str) -> frozenset[int]:
        """The modules that may call ``method`` (KeyError: not a Surge RPC)."""
        return self._callers[method][1]

    def governs(self, method: str) -> bool:
        """Whether ``method`` is a Surge RPC (health and reflection are not)."""
        return method in self._callers

    def check(self, method: str, claim: str | None, certificate_names: Iterable[str] | None) -> int:
        """The module the caller speaks as, once its claim holds.

        Args:
            method: the RPC path, e.g. ``/surge.v1.DataService/Stream``.
            claim: the ``x-surge-module`` value (None: absent).
            certificate_names: the client certificate's CN and DNS SANs; None when the call
                came without one (plaintext, or TLS without client certificates).

        Raises:
            Refused: no claim, an unknown module, a module the route table does not let
                call this RPC, or a certificate whose role may not claim it.
        """
        request, callers = self._callers[method]
        if not claim:
            raise Refused(0, request, f"{method}: no calling module: Surge clients name theirs in '{MODULE_METADATA}'")
        try:
            sender = Module.Value(claim)
        except ValueError:
            raise Refused(0, request, f"{method}: {MODULE_METADATA}: unknown module {claim!r}") from None
        if sender not in callers:
            raise Refused(sender, request, f"boundary violation: {claim} may not send {request} ({method})")
        if certificate_names is not None:
            names = set(certificate_names)
            roles = sorted(r for r in ROLE_MODULES if r in names)
            if not any(sender in ROLE_MODULES[r] for r in roles):
                held = (
                    ", ".join(roles)
                    or "no Surge role (surge-control, surge-worker, surge-data, surge-store, surge-user)"
                )
                raise Refused(sender, request, f"{method}: the client certificate ({held}) may not speak as {claim}")
        return sender
