"""Test-only: the real data service, with one unauthorized send planted at start.

    python -m tests.integration.planted_violation <the data service's own arguments>

Runs ``services.data.__main__.main`` unchanged, except that right after the composition
root builds its bus, code speaking as the shuffler (L4-3) sends ``FilterRules`` to the
filter (L4-4): a command only the training loop (L2-1) may give. The bus must refuse it,
count it in ``surge_boundary_violations_total`` and in the audit; the service then serves
as usual, so a test can scrape its ``/metrics`` and call its ``AuditService``.
"""

from __future__ import annotations

import sys

import services.data.__main__ as data_main
from services.contract import Module, data_pb2
from services.contract.bus import BoundaryViolation

_build_registry = data_main.build_registry


def _planted(root, on_violation=None, remote=None):
    bus, versions = _build_registry(root, on_violation, remote)
    try:
        bus.command(Module.L4_SHUFFLER, Module.L4_FILTER, data_pb2.FilterRules(min_tokens=1))
    except BoundaryViolation as e:
        print(f"planted send refused: {e}", flush=True)
    else:
        print("planted send was NOT refused", flush=True)
    return bus, versions


if __name__ == "__main__":
    data_main.build_registry = _planted
    sys.exit(data_main.main(sys.argv[1:]))
