"""Run-time attribution of communication: every torch.distributed call is tagged with the
module on whose behalf it runs, and one outside L3-5's job is a boundary violation unless
``services/contract/exceptions.yaml`` registers it (rendered in docs/exceptions.md).

    guard = install(report=violation_reporter)   # once, in each rank process (rank.py main)
    guard.counts()        # {(module, op): calls}: per-step collective counts for benchmarks
    guard.crossings()     # every (module, op, site) outside L3-5's job seen, registered or not

What is wrapped: torch.distributed's collective, point-to-point and group entry points
(:data:`OPS`: ``all_reduce`` ... ``batch_isend_irecv``, ``new_group``), the private
bindings DDP's construction calls (``_broadcast_coalesced``,
``_verify_params_across_processes``) and the functional collectives DTensor uses
(``torch.distributed._functional_collectives``: TP's all-reduces, ``full_tensor()``).
Each function is replaced in its defining module and wherever a loaded module bound it by
name (``from torch.distributed.distributed_c10d import new_group`` in device_mesh.py), so
library code is seen as well as ours. A call made inside another wrapped call (``barrier``
inside ``new_subgroups``, ``gather`` inside ``gather_object``) is counted once, as the outer.

Attribution: the module is :func:`~services.contract.acting.acting_module` (the bus sets
it around every handler). On an autograd engine thread (a CUDA backward runs its hooks
there, and those threads start with no acting module) the call belongs to the backward
pass, which only L3-4 starts. On another thread, a call on a group that a module's handler
created belongs to that module (the store relay's own gloo group, used by DCP's
asynchronous writer thread). Otherwise none (0): the composition root itself. The *site* is
the innermost frame of this repository's code, ``path::qualname``
(``services/engine/grad_norm.py::total_norm``), or ``<library>`` when no frame is ours.

The law checked (seed L3-5 and its red line 4): L3_GRADIENT_REDUCTION runs collectives and
point-to-point transfers, never group creation; L2_PARALLEL_STRATEGY creates and destroys
groups and runs nothing else. Any other (module, op, site) must match a registered
exception of kind ``communication`` (module, one of its operations, one of its ``where``
sites: a path, or ``path::qualname``), else it is a violation.

A violation is counted (``surge_boundary_violations_total{sender, message}`` and the
process's Traffic ledger as a refusal, message ``torch.distributed.<op>``, so ``surgectl
audit`` and the rank's final audit show it) and, the first time per (module, op, site),
reported up as ``BoundaryViolationReported`` through the process's ``report`` hook (the
rank's ViolationReporter: session -> node agent -> control -> L1-3).

Why the call still runs (``mode="report"``, the default) where the bus raises: a message
refused by the bus is one process's act, while a collective is a meeting of every rank of
a group. Raising on a rank whose peers do not raise (a rank-dependent path) leaves them
waiting in the collective until the group times out; raising on all of them turns a
bookkeeping finding into a failed job decided by the rank, not by L1. So the rank reports
and keeps the ranks in step, and L1-3 grades the violation (``boundary_violation``) and
L1-1 decides by the job's fault policy. ``mode="raise"`` (``SURGE_COMM_GUARD=raise``)
raises :class:`CommViolation` before the call instead, for tests and bring-up where
every rank takes the same path; ``SURGE_COMM_GUARD=off`` installs nothing.

What it cannot see: collectives issued from C++ without Python (DDP's reducer when no
Python comm hook is registered: the rank's L3-5 registers one, ``_allreduce_marked``, so
its bucket all-reduces pass through here; NCCL inside a compiled graph). Under
``torch.compile`` tracing the wrapper steps aside (the traced collective runs in the graph).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import yaml
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily

from services.contract import route_pb2
from services.contract.acting import acting_module
from services.contract.bus import (
    BOUNDARY_VIOLATIONS,
    TRAFFIC,
    BoundaryViolation,
    Traffic,
)
from services.contract.failures import communication_failed
from services.contract.route_table import module_name

_log = structlog.get_logger("contract.comm_guard")
Module = route_pb2.Module
REPO = Path(__file__).resolve().parents[2]
REGISTER = Path(__file__).resolve().parent / "exceptions.yaml"
LIBRARY = "<library>"
NONE = "none"  # a register entry's module for calls no module's handler makes

# Group lifecycle: L2-2's (seed L3-5 red line 4: 通信域的创建 / 销毁由并行策略控制器管控).
GROUP_OPS = frozenset(
    {
        "init_process_group",
        "destroy_process_group",
        "new_group",
        "new_subgroups",
        "new_subgroups_by_enumeration",
        "split_group",
        "shrink_group",
    }
)
# Data movement between ranks: L3-5's.
DATA_OPS = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "reduce",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        # private bindings DDP's construction calls (torch/distributed/utils.py)
        "_broadcast_coalesced",
        "_verify_params_across_processes",
    }
)
OPS = GROUP_OPS | DATA_OPS
# torch.distributed._functional_collectives (DTensor, TP): recorded as "funcol.<name>".
FUNCOL_OPS = frozenset(
    {
        "broadcast",
        "all_reduce",
        "all_gather_single",
        "all_gather_single_autograd",
        "reduce_scatter_single",
        "reduce_scatter_single_autograd",
        "all_gather_tensor",
        "all_gather_tensor_autograd",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
        "all_reduce_coalesced",
        "all_gather_single_coalesced",
        "reduce_scatter_single_coalesced",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        "all_to_all_single",
        "all_to_all_single_autograd",
        "permute_tensor",
    }
)
FUNCOL = "funcol."
# The modules that bind collectives by name: imported before the sweep (_wrap_all) so that it
# sees their bindings. A rank's fork server imports them once for every rank it forks
# (services/rank/forkserver.py): torch.distributed.pipelining imports torch._dynamo, ~0.7 CPU-s
# (4.4 s on a loaded host) that every forked rank paid again before its first step.
BINDING_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.nn.parallel",
)


def allowed(module: int, op: str) -> bool:
    """The seed's own law, before any exception: L3-5 moves data, L2-2 manages groups."""
    base = op.removeprefix(FUNCOL)
    if module == Module.L3_GRADIENT_REDUCTION:
        return base not in GROUP_OPS
    if module == Module.L2_PARALLEL_STRATEGY:
        return base in GROUP_OPS
    return False


# ---------------------------------------------------------------------- the register


@dataclass(frozen=True)
class Exemption:
    """One ``communication`` entry of the register, as the guard reads it."""

    id: str
    module: int  # 0 for ``none``
    operations: frozenset[str]
    where: tuple[str, ...]  # "path" or "path::qualname"

    def covers(self, module: int, op: str, site: str) -> bool:
        return module == self.module and op in self.operations and any(site_matches(site, w) for w in self.where)


def site_matches(site: str, where: str) -> bool:
    """``services/x.py::f`` matches where ``services/x.py`` or ``services/x.py::f`` (and
    ``services/x.py::C.f`` matches ``services/x.py::C``: a class covers its methods)."""
    path, _, name = site.partition("::")
    w_path, _, w_name = where.partition("::")
    return path == w_path and (not w_name or name == w_name or name.startswith(w_name + "."))


def module_of(name: str) -> int:
    """A register's module name (``L2_MIXED_PRECISION`` or ``none``) -> its enum value."""
    return 0 if name == NONE else Module.Value(name)


def load_register(path: Path = REGISTER) -> list[dict[str, Any]]:
    """The register's entries, as written (``exceptions:`` list of mappings)."""
    return yaml.safe_load(path.read_text())["exceptions"]


def exemptions(entries: Iterable[dict[str, Any]] | None = None) -> list[Exemption]:
    """The ``communication`` entries the guard and the static check read."""
    out = []
    for e in entries if entries is not None else load_register():
        if e.get("kind") != "communication":
            continue
        out.append(Exemption(e["id"], module_of(e["module"]), frozenset(e["operations"]), tuple(e["where"])))
    return out


# ---------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class Crossing:
    """A call outside L3-5's job (and outside L2-2's group lifecycle): who, what, where,
    how often, and the register entry that covers it ("" for none: a violation)."""

    module: int
    op: str
    site: str
    count: int
    exception: str

    def __str__(self) -> str:
        return f"{_name(self.module)} {self.op} at {self.site} x{self.count} ({self.exception or 'UNREGISTERED'})"


class CommViolation(BoundaryViolation):
    """A communication call no law and no registered exception allows."""

    def __init__(self, module: int, op: str, site: str):
        RuntimeError.__init__(
            self,
            f"boundary violation: {_name(module)} may not run torch.distributed {op} (at {site}); only "
            "L3_GRADIENT_REDUCTION communicates, unless services/contract/exceptions.yaml registers it",
        )
        self.sender, self.message, self.receiver = module, f"torch.distributed.{op}", None
        self.op, self.site = op, site


class CommGuard:
    """The ledger and the check of one process (thread-safe). Built by :func:`install`."""

    def __init__(
        self,
        register: Iterable[Exemption],
        *,
        report: Callable[[BoundaryViolation], Any] | None = None,
        mode: str = "report",
        traffic: Traffic = TRAFFIC,
    ):
        if mode not in ("report", "raise"):
            raise ValueError(f"SURGE_COMM_GUARD: expected report, raise or off, got {mode!r}")
        self._register = list(register)
        self._report, self._mode, self._traffic = report, mode, traffic
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str], int] = defaultdict(int)
        self._crossings: dict[tuple[int, str, str], list] = {}  # -> [count, exception id]
        self._local = threading.local()
        # id(group) -> (a weak reference to the group, the module that created it). Weak: a
        # group referenced anywhere after its destruction keeps its sockets open, and a peer
        # blocked in it stays blocked (a group rebuilt in place, issue 16).
        self._owners: dict[int, tuple[weakref.ref, int]] = {}

    def counts(self) -> dict[tuple[int, str], int]:
        """Calls per (module, op) since install, every module (L3-5's included)."""
        with self._lock:
            return dict(self._counts)

    def crossings(self) -> list[Crossing]:
        """Every (module, op, site) outside the law seen since install, sorted."""
        with self._lock:
            return [Crossing(m, op, site, n, ex) for (m, op, site), (n, ex) in sorted(self._crossings.items())]

    def unregistered(self) -> list[Crossing]:
        return [c for c in self.crossings() if not c.exception]

    def reset(self) -> None:
        """Forget the counts and crossings (a benchmark's warm-up, a test's start)."""
        with self._lock:
            self._counts.clear()
            self._crossings.clear()

    # ------------------------------------------------------------------ the wrapped call

    def _call(self, op: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        local = self._local
        if getattr(local, "depth", 0):  # inside another wrapped call: counted as that one
            return fn(*args, **kwargs)
        local.depth = 1
        try:
            module = self._attribute(args, kwargs)
            self._check(module, op, sys._getframe(2))
            try:
                result = fn(*args, **kwargs)
            except (ValueError, TypeError):  # the call was wrong (a bug), not the link
                raise
            except Exception as e:  # a collective or p2p call that raised failed to communicate
                failed = communication_failed(op, e)
                if failed is e:
                    raise
                raise failed from e
            if op in GROUP_OPS and module not in (0, Module.L2_PARALLEL_STRATEGY):
                self._own(result, module)
            return result
        finally:
            local.depth = 0

    def _attribute(self, args: tuple, kwargs: dict) -> int:
        """The acting module; on an autograd engine thread, the backward pass (L3-4's);
        else the module whose handler created the group the call runs on (a relay's own
        group, used by a library thread such as DCP's asynchronous writer); else 0."""
        module = acting_module()
        if module:
            return module
        if _in_backward():
            return Module.L3_BACKWARD_UNIT
        if self._owners:
            for value in (*args, *kwargs.values()):
                owned = self._owners.get(id(value))
                if owned is not None and owned[0]() is value:
                    return owned[1]
        return 0

    def _own(self, group: Any, module: int) -> None:
        import torch.distributed as dist

        if isinstance(group, dist.ProcessGroup):
            with self._lock:  # (an id reused by a later object is told apart by the reference)
                self._owners[id(group)] = (weakref.ref(group), module)

    def _check(self, module: int, op: str, frame: types.FrameType | None) -> None:
        if allowed(module, op):
            with self._lock:
                self._counts[(module, op)] += 1
            return
        site = _site(frame)
        key = (module, op, site)
        with self._lock:
            self._counts[(module, op)] += 1
            seen = self._crossings.get(key)
            if seen is None:
                ex = next((e.id for e in self._register if e.covers(module, op, site)), "")
                seen = self._crossings[key] = [0, ex]
            seen[0] += 1
            first = seen[0] == 1
        if seen[1]:
            return
        error = CommViolation(module, op, site)
        BOUNDARY_VIOLATIONS.labels(_name(module), error.message).inc()
        self._traffic.refused(module, error.message, 0)
        if first and self._report is not None:
            try:
                self._report(error)
            except Exception:  # noqa: BLE001 - the hook must not hide the violation (as the bus's)
                _log.exception("boundary violation hook failed", error=str(error))
        if self._mode == "raise":
            raise error


def _name(module: int) -> str:
    return module_name(module) if module else NONE


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


_ROOT = str(REPO) + os.sep
_VENV = str(REPO / ".venv") + os.sep
# The contract's plumbing is never the site: the bus and run_as only carry the call.
_PLUMBING = frozenset({__file__, str(REPO / "services/contract/bus.py"), str(REPO / "services/contract/acting.py")})


def _site(frame: types.FrameType | None) -> str:
    """The innermost frame of this repository's code: ``path::qualname``."""
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(_ROOT) and not file.startswith(_VENV) and file not in _PLUMBING:
            return f"{file[len(_ROOT) :]}::{frame.f_code.co_qualname}"
        frame = frame.f_back
    return LIBRARY


# ---------------------------------------------------------------------- install


_GUARD: CommGuard | None = None
_PATCHED: list[tuple[Any, str, Any]] = []  # (module, attribute, original) to restore
_INSTALL_LOCK = threading.Lock()


def install(
    *,
    report: Callable[[BoundaryViolation], Any] | None = None,
    mode: str | None = None,
    register: Iterable[Exemption] | None = None,
    traffic: Traffic = TRAFFIC,
) -> CommGuard | None:
    """Wrap torch.distributed's entry points in this process (idempotent: a second call
    returns the installed guard). ``mode``: ``report`` (default), ``raise`` or ``off``
    (nothing installed, None returned); default from ``SURGE_COMM_GUARD``. ``report``: the
    process's violation hook (a ViolationReporter). ``register``: the exemptions (default:
    exceptions.yaml's communication entries).

    Raises:
        ValueError: an unknown mode; KeyError/ValueError: a malformed register entry.
    """
    global _GUARD
    mode = mode or os.environ.get("SURGE_COMM_GUARD") or "report"
    if mode == "off":
        return None
    with _INSTALL_LOCK:
        if _GUARD is not None:
            return _GUARD
        guard = CommGuard(exemptions() if register is None else register, report=report, mode=mode, traffic=traffic)
        _wrap_all()
        _GUARD = guard
        return guard


def installed() -> CommGuard | None:
    return _GUARD


def uninstall() -> None:
    """Restore every wrapped entry point (tests)."""
    global _GUARD
    with _INSTALL_LOCK:
        for owner, name, original in reversed(_PATCHED):
            setattr(owner, name, original)
        _PATCHED.clear()
        _GUARD = None


def _wrap_all() -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    # The modules that bind collectives by name are imported first, so the sweep sees them.
    for name in BINDING_MODULES:
        __import__(name)
    wrappers: dict[int, Any] = {}
    for op in sorted(OPS):
        original = getattr(c10d, op, None) or getattr(dist, op, None)
        if original is not None:
            wrappers[id(original)] = _wrapper(op, original)
    for op in sorted(FUNCOL_OPS):
        original = getattr(funcol, op, None)
        if original is not None:
            wrappers[id(original)] = _wrapper(FUNCOL + op, original)
    for mod in list(sys.modules.values()):
        if not isinstance(mod, types.ModuleType):
            continue
        name = getattr(mod, "__name__", "") or ""
        if not (name.startswith(("torch", "services.", "tests.", "bench.")) or name == "__main__"):
            continue
        for attr, value in list(vars(mod).items()):
            wrapper = wrappers.get(id(value))
            if wrapper is not None and callable(value):
                _PATCHED.append((mod, attr, value))
                setattr(mod, attr, wrapper)


def _wrapper(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def communicate(*args: Any, **kwargs: Any) -> Any:
        guard = _GUARD  # (a module that bound the wrapper by name keeps it after uninstall)
        if guard is None or is_compiling():  # traced into a graph: the graph runs it, not this frame
            return original(*args, **kwargs)
        return guard._call(op, original, args, kwargs)

    communicate.__surge_comm_op__ = op  # type: ignore[attr-defined]
    return communicate


# ---------------------------------------------------------------------- Prometheus


class _CountsCollector:
    """``surge_collectives_total{module, op}`` from the installed guard (none: no rows)."""

    def describe(self):
        return [self._family()]

    def collect(self):
        family = self._family()
        if _GUARD is not None:
            for (module, op), n in sorted(_GUARD.counts().items()):
                family.add_metric([_name(module), op], n)
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "surge_collectives",
            "torch.distributed calls of this process, by the module they ran for and op.",
            labels=["module", "op"],
        )


REGISTRY.register(_CountsCollector())
