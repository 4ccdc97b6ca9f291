"""What communication a module's code can reach: its file, and every function of ours it
calls, through imports, transitively (helpers such as ``services/engine/grad_norm.py`` and
the relays count as the module that calls them).

A static over-approximation by names, no types: a call resolves when its callee is a name
the file imports from one of our files (``from services.engine.grad_norm import
total_norm``; ``import services.x as x; x.f()``), a function or class of the same file, or
``self.method()`` inside a class. A call through an object handed in at run time (a port, a
model, a callback) does not resolve here: the run-time guard (services/contract/comm_guard.py)
sees those.

A *communication call* is a torch.distributed collective, point-to-point or group call
(``dist.all_reduce``, ``torch.distributed.new_group``), a functional collective, a DTensor
method that reduces or gathers (``full_tensor``, ``redistribute``), a distributed checkpoint
save or load, or a call that lays a model out over ranks (DDP, FSDP2, TP): each maps to the
torch.distributed operations it runs (:data:`FAMILIES`), the names the register uses.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.contract.comm_guard import FUNCOL, FUNCOL_OPS, OPS

REPO = Path(__file__).resolve().parents[2]
_C10D = ("torch.distributed.", "torch.distributed.distributed_c10d.")
_FUNCOL = "torch.distributed._functional_collectives."
_DCP_OPS = frozenset(
    {
        "gather_object",
        "scatter_object_list",
        "all_gather_object",
        "broadcast_object_list",
        "barrier",
        "all_reduce",
        "reduce_scatter",
        "all_gather",
    }
)
# Calls that run collectives inside torch: what they run (for the register's names).
FAMILIES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.save": _DCP_OPS,
    "torch.distributed.checkpoint.load": _DCP_OPS,
    "torch.distributed.checkpoint.async_save": _DCP_OPS,
    "torch.distributed.device_mesh.init_device_mesh": frozenset({"new_group"}),
    "torch.distributed.device_mesh.DeviceMesh": frozenset({"new_group"}),
    "torch.nn.parallel.DistributedDataParallel": frozenset({"_broadcast_coalesced", "_verify_params_across_processes"}),
    "torch.distributed.tensor.distribute_tensor": frozenset({"broadcast", "scatter"}),
    "torch.distributed.tensor.distribute_module": frozenset({"broadcast", "scatter"}),
    "torch.distributed.tensor.parallel.parallelize_module": frozenset({"broadcast", "scatter"}),
    "torch.distributed.fsdp.fully_shard": frozenset({"all_gather_single", "reduce_scatter_single"}),
}
# DTensor methods that communicate when the placements differ (a Partial or Shard made whole).
DTENSOR_METHODS = {
    "full_tensor": frozenset({FUNCOL + "all_reduce", FUNCOL + "all_gather_single"}),
    "redistribute": frozenset({FUNCOL + op for op in FUNCOL_OPS}),
}


@dataclass(frozen=True)
class Finding:
    """A communication call reachable from a module: the operations it may run and where."""

    ops: frozenset[str]
    site: str  # "path::qualname"
    call: str  # the call as written

    def __str__(self) -> str:
        return f"{self.call} at {self.site}"


@dataclass
class _Function:
    path: str
    qualname: str
    node: ast.AST
    cls: str | None


class _File:
    """One parsed file of ours: its import aliases, functions and classes."""

    def __init__(self, path: str, root: Path):
        self.path, self.root = path, root
        self.tree = ast.parse((root / path).read_text())
        self.aliases: dict[str, str] = {}  # local name -> dotted target
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        self.aliases.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.functions: dict[str, _Function] = {}
        self.classes: set[str] = set()
        self._collect(self.tree, "", None)

    def _collect(self, node: ast.AST, prefix: str, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                self.functions[qual] = _Function(self.path, qual, child, cls)
                self._collect(child, f"{qual}.<locals>.", cls)
            elif isinstance(child, ast.ClassDef):
                qual = f"{prefix}{child.name}"
                self.classes.add(qual)
                self._collect(child, f"{qual}.", qual)

    def resolve(self, node: ast.AST) -> str:
        """The dotted name a call's callee stands for (imports resolved), or ""."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return ""
        head = self.aliases.get(node.id, node.id)
        return ".".join([head, *reversed(parts)])


@functools.cache
def _file(path: str, root: Path = REPO) -> _File:
    return _File(path, root)


def _path_of(module: str, root: Path) -> str | None:
    """``services.engine.grad_norm`` -> ``services/engine/grad_norm.py`` when it is ours."""
    if not module.startswith("services."):
        return None
    base = root / Path(*module.split("."))
    if base.with_suffix(".py").is_file():
        return str(base.with_suffix(".py").relative_to(root))
    if (base / "__init__.py").is_file():
        return str((base / "__init__.py").relative_to(root))
    return None


def _callee(file: _File, fn: _Function, call: ast.Call) -> _Function | None:
    """The function of ours ``call`` reaches (a class: its ``__init__``), if it resolves."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and fn.cls:
        return file.functions.get(f"{fn.cls}.{func.attr}")
    if isinstance(func, ast.Name) and func.id not in file.aliases:
        local = file.functions.get(func.id) or (
            file.functions.get(f"{func.id}.__init__") if func.id in file.classes else None
        )
        return local
    dotted = file.resolve(func)
    if not dotted.startswith("services."):
        return None
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a file of ours
        path = _path_of(".".join(parts[:cut]), file.root)
        if path is None:
            continue
        other = _file(path, file.root)
        name = ".".join(parts[cut:])
        return other.functions.get(name) or (other.functions.get(f"{name}.__init__") if name in other.classes else None)
    return None


def _communication(file: _File, call: ast.Call) -> frozenset[str]:
    dotted = file.resolve(call.func)
    for prefix in _C10D:
        if dotted.startswith(prefix) and dotted[len(prefix) :] in OPS:
            return frozenset({dotted[len(prefix) :]})
    if dotted.startswith(_FUNCOL) and dotted[len(_FUNCOL) :] in FUNCOL_OPS:
        return frozenset({FUNCOL + dotted[len(_FUNCOL) :]})
    if dotted in FAMILIES:
        return FAMILIES[dotted]
    if isinstance(call.func, ast.Attribute) and call.func.attr in DTENSOR_METHODS:
        return DTENSOR_METHODS[call.func.attr]
    return frozenset()


def _calls(fn: _Function) -> Iterator[ast.Call]:
    """The calls in ``fn``'s own body (nested functions are functions of their own)."""
    todo = list(ast.iter_child_nodes(fn.node))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) and node is not fn.node:
            if isinstance(node, ast.Lambda):
                todo.extend(ast.iter_child_nodes(node))
            continue
        if isinstance(node, ast.Call):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def reachable_communication(path: str, *, only_class: str | None = None, root: Path = REPO) -> list[Finding]:
    """Every communication call reachable from the functions of ``path`` (those of class
    ``only_class`` when given: a relay's class in a file holding more), following calls
    into our other files transitively. ``root``: the tree the paths are relative to."""
    start = _file(path, root)
    todo = deque(f for f in start.functions.values() if only_class is None or f.cls == only_class)
    seen = {(f.path, f.qualname) for f in todo}
    out: list[Finding] = []
    while todo:
        fn = todo.popleft()
        file = _file(fn.path, root)
        for call in _calls(fn):
            ops = _communication(file, call)
            if ops:
                out.append(Finding(ops, f"{fn.path}::{fn.qualname}", ast.unparse(call.func)))
                continue
            callee = _callee(file, fn, call)
            if callee is not None and (callee.path, callee.qualname) not in seen:
                seen.add((callee.path, callee.qualname))
                todo.append(callee)
        # a nested function runs when its parent hands it on (a thread target, a hook)
        for qual, inner in file.functions.items():
            if qual.startswith(f"{fn.qualname}.<locals>.") and (inner.path, qual) not in seen:
                seen.add((inner.path, qual))
                todo.append(inner)
    return sorted(set(out), key=str)


def defines(site: str) -> bool:
    """Whether a register's ``where`` names code that exists: a file, or ``file::qualname``
    (a function or class of that file)."""
    path, _, name = site.partition("::")
    if not (REPO / path).is_file():
        return False
    if not name:
        return True
    file = _file(path)
    return name in file.functions or name in file.classes
