"""Test clients that name a calling module (services/common/identity.py), for tests that call
one service as several of its callers through one stub (a store test commits as the training
loop, then verifies as the operator)."""

from __future__ import annotations

import grpc

from services.common.grpc_server import _CallDetails, _Channel, _Headers, channel
from services.common.identity import MODULE_METADATA, CallerPolicy
from services.contract import Module

# Preferred when an RPC has several callers: the one a test most often stands for.
_PREFERENCE = (Module.EXT_USER, Module.L2_TRAINING_LOOP, Module.L1_ORCHESTRATOR, Module.EXT_HARDWARE)


_POLICY = CallerPolicy()


def usual_caller(method: str) -> int:
    """A module the route table lets call ``method`` (``/surge.v1.StoreService/Verify``)."""
    callers = _POLICY.callers(method)
    return next((m for m in _PREFERENCE if m in callers), min(callers))


class _PerMethod(_Headers):
    def __init__(self) -> None:
        super().__init__([])

    def _details(self, details):
        if not _POLICY.governs(details.method):  # health, reflection: no module
            return details
        metadata = [*(details.metadata or ()), (MODULE_METADATA, Module.Name(usual_caller(details.method)))]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )


def any_caller_channel(address: str) -> grpc.Channel:
    """A channel whose every call names a module allowed to make it (see ``usual_caller``)."""
    raw = channel(address)
    return _Channel(raw, grpc.intercept_channel(raw, _PerMethod()))


def metadata(module: int) -> tuple[tuple[str, str], ...]:
    """Per-call metadata naming ``module`` (for grpc.aio calls and one-off claims)."""
    return ((MODULE_METADATA, Module.Name(module)),)
