"""The 20 modules as the real composition roots build them, and a walker over what each holds.

Every red-line test that asks "what can this module reach?" starts here: the modules are
built by ``services.control.__main__.build``, ``services.data.__main__.build_registry`` /
``build_stream``, ``services.store.__main__.wire`` and ``services.rank.__main__.compose``
(the rank's model loaded, so the composition root's handover has run), on a bus that
records every subscription. Nothing is hand-wired here.
"""

from __future__ import annotations

import ast
import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from services.compute.backward_unit import BackwardUnit
from services.compute.forward_unit import ForwardUnit
from services.compute.gradient_reduction import GradientReduction
from services.compute.operator_adapter import OperatorAdapter
from services.compute.shard_loader import ShardLoader
from services.contract import Module, engine_pb2
from services.contract.bus import Bus, CommandPort, Emitter
from services.control.event_applier import InOrder
from services.control.fault_detector import FaultDetector
from services.control.orchestrator import Orchestrator
from services.control.recovery_controller import RecoveryController
from services.control.resource_allocator import ResourceAllocator
from services.data.batch_packer import BatchPacker
from services.data.dataset_versions import DatasetVersions
from services.data.prefetcher import Prefetcher
from services.data.sample_filter import SampleFilter
from services.data.shuffler import Shuffler
from services.engine.mixed_precision import MixedPrecision
from services.engine.optimizer import Optimizer
from services.engine.parallel_strategy import ParallelStrategy
from services.engine.training_loop import TrainingLoop
from services.store.checkpoint_manager import CheckpointManager
from services.store.metrics_logger import MetricsLogger

REPO = Path(__file__).resolve().parents[2]

# Seed module id -> its class and its file (one file per module, named after its role), or its
# package (a directory of that name) once it grew.
MODULES: dict[int, tuple[type, str]] = {
    Module.L1_ORCHESTRATOR: (Orchestrator, "services/control/orchestrator"),  # a package
    Module.L1_RESOURCE_ALLOCATOR: (ResourceAllocator, "services/control/resource_allocator"),  # a package
    Module.L1_FAULT_DETECTOR: (FaultDetector, "services/control/fault_detector"),  # a package
    Module.L1_RECOVERY_CONTROLLER: (RecoveryController, "services/control/recovery_controller.py"),
    Module.L2_TRAINING_LOOP: (TrainingLoop, "services/engine/training_loop"),  # a package
    Module.L2_PARALLEL_STRATEGY: (ParallelStrategy, "services/engine/parallel_strategy.py"),
    Module.L2_OPTIMIZER: (Optimizer, "services/engine/optimizer.py"),
    Module.L2_MIXED_PRECISION: (MixedPrecision, "services/engine/mixed_precision.py"),
    Module.L3_SHARD_LOADER: (ShardLoader, "services/compute/shard_loader.py"),
    Module.L3_OPERATOR_ADAPTER: (OperatorAdapter, "services/compute/operator_adapter.py"),
    Module.L3_FORWARD_UNIT: (ForwardUnit, "services/compute/forward_unit.py"),
    Module.L3_BACKWARD_UNIT: (BackwardUnit, "services/compute/backward_unit.py"),
    Module.L3_GRADIENT_REDUCTION: (GradientReduction, "services/compute/gradient_reduction.py"),
    Module.L4_DATASET_VERSIONS: (DatasetVersions, "services/data/dataset_versions.py"),
    Module.L4_PREFETCHER: (Prefetcher, "services/data/prefetcher.py"),
    Module.L4_SHUFFLER: (Shuffler, "services/data/shuffler.py"),
    Module.L4_FILTER: (SampleFilter, "services/data/sample_filter.py"),
    Module.L4_BATCH_PACKER: (BatchPacker, "services/data/batch_packer.py"),
    Module.L5_CHECKPOINT_MANAGER: (CheckpointManager, "services/store/checkpoint_manager"),  # a package
    Module.L5_METRICS_LOGGER: (MetricsLogger, "services/store/metrics_logger.py"),
}
MODULE_OF_CLASS: dict[type, int] = {cls: module for module, (cls, _) in MODULES.items()}


def layer(module: int) -> int:
    """1..5 for a seed module (``L2_OPTIMIZER`` = 23 -> 2); 9 for an external endpoint."""
    return module // 10


class RecordingBus(Bus):
    """A Bus that remembers every subscription (module, message type, handler)."""

    created: list[RecordingBus] = []

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.subscriptions: list[tuple[int, type[Message], Any]] = []
        RecordingBus.created.append(self)

    def subscribe(self, module: int, message_type: type[Message], handler: Any) -> None:
        super().subscribe(module, message_type, handler)
        self.subscriptions.append((module, message_type, handler))


@dataclass
class Built:
    """One composition root's result: its buses and the seed modules found on them."""

    root: str
    buses: list[RecordingBus]
    modules: dict[int, Any] = field(default_factory=dict)  # module id -> instance

    def __post_init__(self) -> None:
        for bus in self.buses:
            for module, _, handler in bus.subscriptions:
                owner = getattr(handler, "__self__", None)
                if type(owner) in MODULE_OF_CLASS:
                    assert MODULE_OF_CLASS[type(owner)] == module, (
                        f"{self.root}: {type(owner).__name__} subscribed as {Module.Name(module)}"
                    )
                    self.modules.setdefault(module, owner)

    def handlers(self) -> dict[type, set[str]]:
        """Module class -> names of its methods the root subscribed on a bus."""
        out: dict[type, set[str]] = {}
        for bus in self.buses:
            for _, _, handler in bus.subscriptions:
                owner = getattr(handler, "__self__", None)
                if type(owner) in MODULE_OF_CLASS:
                    out.setdefault(type(owner), set()).add(handler.__name__)
        return out


@contextmanager
def _recording(module: types.ModuleType) -> Iterator[list[RecordingBus]]:
    RecordingBus.created = []
    with mock.patch.object(module, "Bus", RecordingBus):
        yield RecordingBus.created


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def build_control(tmp: Path) -> Built:
    import services.control.__main__ as root
    from services.control.job_store import JobStore

    with _recording(root) as buses:
        root.build(JobStore(tmp / "control.db"), data_address="127.0.0.1:1", store_address="127.0.0.1:2")
    return Built("services.control.__main__.build", list(buses))


def build_data(tmp: Path) -> Built:
    """The registry bus (L4-1 for the operator) and one stream's pipeline bus."""
    import services.data.__main__ as root

    (tmp / "datasets").mkdir(exist_ok=True)
    with _recording(root) as buses:
        root.build_registry(tmp / "datasets")
        root.build_stream(tmp / "datasets")
    return Built("services.data.__main__.build_registry/build_stream", list(buses))


def build_store(tmp: Path) -> Built:
    import services.store.__main__ as root

    with _recording(root) as buses:
        root.wire(tmp / "store", _Log(), registry=CollectorRegistry())
    return Built("services.store.__main__.wire", list(buses))


class _Relay:
    """Stands in for the L1 session, L4 data and L5 store relays of a rank (never called)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def rank_spec():
    from services.jobspec import JobSpec

    return JobSpec.model_validate(
        {
            "name": "redlines",
            "steps": 2,
            "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": 32},
            "data": {"dataset": "tiny@v1", "seq_len": 8, "micro_batch_size": 2},
            "optimizer": {"warmup_steps": 0},  # (warmup must be shorter than the run)
        }
    )


def build_rank(tmp: Path, *, load_model: bool = True) -> Built:
    """The rank's L2/L3 modules as ``compose`` wires them; with ``load_model`` the plan is
    pushed and the model loaded, so the handover has attached it to the units."""
    from services.rank.__main__ import compose

    bus = RecordingBus()
    relay = _Relay()
    compose(bus, rank_spec(), "cpu", data=relay, store=relay, metrics=relay, up=relay)
    built = Built("services.rank.__main__.compose", [bus])
    if load_model:
        plan = engine_pb2.ParallelPlan(rank=0, world_size=1, dp=1, data_parallel="none", device="cpu")
        bus.command(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER, plan)
        bus.command(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION, plan)
        spec = rank_spec()
        bus.command(
            Module.L2_TRAINING_LOOP,
            Module.L3_SHARD_LOADER,
            engine_pb2.LoadModel(model_json=spec.model.model_dump_json(), seed=0),
        )
    return built


def build_all(tmp: Path) -> list[Built]:
    return [build_control(tmp), build_data(tmp), build_store(tmp), build_rank(tmp)]


# ---------------------------------------------------------------------- the walker


@dataclass(frozen=True)
class Reach:
    """Something a module holds: a path from the module to it, and what it is."""

    path: str
    target: Any


_LEAVES = (str, bytes, int, float, complex, bool, type(None), Message, Path, type)


def _is_ours(obj: Any) -> bool:
    return type(obj).__module__.startswith(("services.", "tests."))


def reachable(owner: Any) -> Iterator[Reach]:
    """Every CommandPort, Emitter and seed-module instance reachable from ``owner``'s
    attributes, through containers, dataclasses, our own objects, functions' closures and
    defaults, bound methods and partials. Library objects (tensors, models, locks, files,
    sockets, thread pools) are not entered: they hold nothing a composition root gave.
    A port or emitter is reported and not entered (its bus reaches everything by design:
    the bus checks every send); another module is reported and not entered.
    """
    seen: set[int] = {id(owner)}

    def visit(obj: Any, path: str) -> Iterator[Reach]:
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            return
        if isinstance(obj, InOrder):
            # Not entered, as a port is not: it runs only the callable its holder gives it, on
            # control's ordered queues (L1-3's fired deadlines), and offers nothing else.
            return
        seen.add(id(obj))
        if isinstance(obj, (CommandPort, Emitter)) or type(obj) in MODULE_OF_CLASS:
            yield Reach(path, obj)
            return
        if isinstance(obj, dict) or type(obj).__name__ == "mappingproxy":
            for k, v in obj.items():
                yield from visit(k, f"{path}[key]")
                yield from visit(v, f"{path}[{k!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            for i, v in enumerate(obj):
                yield from visit(v, f"{path}[{i}]")
        elif isinstance(obj, types.MethodType):
            yield from visit(obj.__self__, f"{path}.__self__")
            yield from visit(obj.__func__, path)
        elif isinstance(obj, types.FunctionType):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    yield from visit(cell.cell_contents, f"{path}<closure {name}>")
                except ValueError:  # an empty cell
                    pass
            for i, v in enumerate(obj.__defaults__ or ()):
                yield from visit(v, f"{path}<default {i}>")
        elif isinstance(obj, functools.partial):
            yield from visit(obj.func, f"{path}.func")
            yield from visit(obj.args, f"{path}.args")
            yield from visit(obj.keywords, f"{path}.keywords")
        elif is_dataclass(obj) and not isinstance(obj, type):
            for f in fields(obj):
                yield from visit(getattr(obj, f.name), f"{path}.{f.name}")
        elif _is_ours(obj):
            for name in getattr(obj, "__slots__", ()):
                if hasattr(obj, name):
                    yield from visit(getattr(obj, name), f"{path}.{name}")
            for name, v in getattr(obj, "__dict__", {}).items():
                yield from visit(v, f"{path}.{name}")

    for name, value in vars(owner).items():
        yield from visit(value, f"{type(owner).__name__}.{name}")


def port_ends(port: CommandPort) -> tuple[int, int]:
    return port._sender, port._receiver


def emitter_sender(emitter: Emitter) -> int:
    return emitter._sender


# ---------------------------------------------------------------------- source scans


def module_files(path: str) -> list[str]:
    """A module's file, or every file of a module grown into a package (a directory)."""
    if (REPO / path).is_dir():
        return sorted(str(f.relative_to(REPO)) for f in (REPO / path).glob("*.py"))
    return [path]


def source_tree(module: int) -> ast.Module:
    """The module's source as one tree (a package's files together: the checks read the
    whole place)."""
    trees = [ast.parse((REPO / f).read_text()) for f in module_files(MODULES[module][1])]
    return ast.Module(body=[node for tree in trees for node in tree.body], type_ignores=[])


def dotted(node: ast.AST) -> str:
    """``torch.distributed.all_reduce`` for an Attribute/Name chain ("" otherwise)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module a file imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def called_names(tree: ast.AST) -> set[str]:
    """Dotted names of every call (``dist.all_reduce``, ``p.grad.mul_`` -> ``p.grad.mul_``)
    plus the bare attribute name of each (``all_reduce``, ``mul_``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name:
                out.add(name)
            if isinstance(node.func, ast.Attribute):
                out.add(node.func.attr)
            elif isinstance(node.func, ast.Name):
                out.add(node.func.id)
    return out


def attribute_names(tree: ast.AST) -> set[str]:
    """Every attribute name read or written anywhere in the file (``x.grad`` -> ``grad``)."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


# ---------------------------------------------------------------------- single modules on a bus


def optimizer_with_model(grad: float = 0.5):
    """L2-3 on a bus with a tiny model attached and every gradient set to ``grad``;
    returns (model, optimizer, the loop's port to it)."""
    import torch

    from services.compute.model import build_model
    from services.jobspec import ModelSpec, OptimizerSpec

    bus = Bus()
    optimizer = Optimizer(OptimizerSpec(weight_decay=0.1), bus.emitter(Module.L2_OPTIMIZER))
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, optimizer.apply_update)
    model = build_model(ModelSpec(n_layers=1, d_model=16, n_heads=2, vocab_size=32), 0)
    optimizer.attach(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    return model, optimizer, bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)


def shuffler_on_bus(chunk: int = 4, n: int = 12, on_chunk=None):
    """L4-3 given the catalog of ``n`` documents (document i is made of the token i), with the
    filter's inbox recording the epoch orders it hands on (and calling ``on_chunk(orders so
    far)`` after each). (``chunk``: kept for the callers; an order is handed on whole.)"""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import numpy as np

    from services.contract import data_pb2
    from services.data.documents import Catalog, EpochOrder, TokenStore
    from services.data.prefetcher import TokenReader

    bus = Bus()
    shuffler = Shuffler(bus.emitter(Module.L4_SHUFFLER))
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.SamplesRead, shuffler.on_samples_read)
    bus.subscribe(Module.L4_SHUFFLER, data_pb2.ShufflePlan, shuffler.shuffle_plan)
    out: list[EpochOrder] = []

    def filter_inbox(msg, order):
        out.append(order)
        if on_chunk is not None:
            on_chunk(out)

    bus.subscribe(Module.L4_FILTER, data_pb2.SamplesShuffled, filter_inbox)
    parts = [np.full(i % 3 + 1, i, np.uint16) for i in range(n)]
    path = Path(tempfile.mkdtemp()) / "train.bin"
    np.concatenate(parts).astype("<u2").tofile(path)
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    store = TokenStore("t@v1", "train", path, np.dtype("<u2"), bounds, "bytes")
    catalog = Catalog(store, TokenReader(store, ThreadPoolExecutor(1), 1, 8))
    bus.publish(Module.L4_PREFETCHER, data_pb2.SamplesRead(count=n), catalog)
    return bus, out
