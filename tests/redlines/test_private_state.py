"""Red lines of kind (a): a lower module cannot obtain an upper module's private state.

Three facts make it so, each checked on the modules the real composition roots build:
a module's attributes are all private and its public methods are exactly the commands and
events it may receive (no getter anyone could call); no module holds a reference to another
module (only CommandPorts, each checked by the bus on every send); and no message routed to
a compute or data module carries the training step, learning rate or loss.
"""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest

from services.compute.shard_loader import ShardLoader
from services.contract import Module
from services.contract.bus import CommandPort, Emitter
from services.contract.route_table import default_table

from .wiring import MODULES, REPO, build_all, build_rank, layer, reachable

# Public methods that are not message handlers, each called only by its composition root:
# ``attach`` hands a module the model handles it works on (parallelism applied from outside,
# DESIGN.md); ``close`` / ``shutdown`` release resources at process end; ``run`` is the rank's
# main thread entering the loop and ``fail`` reports what ended it; ``side_group`` is the
# handle the root gives the store relay to the gloo groups L2-2 makes with the world.
LIFECYCLE: dict[str, set[str]] = {
    "TrainingLoop": {"run", "fail"},
    "ParallelStrategy": {"shutdown", "side_group"},
    "Optimizer": {"attach"},
    "MixedPrecision": {"attach"},
    "ForwardUnit": {"attach"},
    "BackwardUnit": {"attach"},
    "GradientReduction": {"attach", "lay_out"},
    "Prefetcher": {"close"},
    "MetricsLogger": {"close"},
    "FaultDetector": {"close"},
    "Orchestrator": {"close"},
}
# The checkpoint data plane: bytes, not messages (services/contract/exceptions.yaml,
# checkpoint-bytes-stream). The store's relay hands each PutCheckpointFiles /
# HeldCheckpointChunks / GetCheckpointFiles stream to L5-1 itself, which checks every name,
# size and digest and decides where the bytes live; no route carries them.
DATA_PLANE: dict[str, set[str]] = {
    "CheckpointManager": {"held_chunks", "receive_files", "send_files"},
}

# The one composition-root callback a module holds that reaches other modules: the shard
# loader's model handover (services/rank/__main__.py::compose), which attaches the model it
# built to the units that run and update it. Write-only: see the test below.
HANDOVER = (
    "ShardLoader._handover",
    {"ForwardUnit", "GradientReduction", "BackwardUnit", "MixedPrecision", "Optimizer"},
)
# And the layout it has applied to the model on the meta device before it materialises the
# weights (L3-5's ``lay_out``: TP, activation checkpointing, FSDP2). Write-only as well.
LAY_OUT = ("ShardLoader._lay_out", {"GradientReduction"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("roots"))


def test_the_composition_roots_build_all_twenty_modules(built):
    found = {m for b in built for m in b.modules}
    assert found == set(MODULES), sorted(Module.Name(m) for m in set(MODULES) - found)


def test_module_instances_keep_every_attribute_private(built):
    public = {
        f"{type(inst).__name__}.{name}"
        for b in built
        for inst in b.modules.values()
        for name in vars(inst)
        if not name.startswith("_")
    }
    assert public == set()


def test_module_classes_expose_no_property_or_public_data(built):
    exposed = []
    for cls, _ in MODULES.values():
        for name, value in inspect.getmembers(cls):
            if name.startswith("_"):
                continue
            if not inspect.isfunction(value):  # a property, class constant or nested type
                exposed.append(f"{cls.__name__}.{name}")
    assert exposed == []


def test_module_public_methods_are_exactly_their_commands_and_event_handlers(built):
    subscribed: dict[str, set[str]] = {}
    for b in built:
        for cls, names in b.handlers().items():
            subscribed.setdefault(cls.__name__, set()).update(names)
    mismatches = {}
    for cls, _ in MODULES.values():
        public = {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
        expected = (
            subscribed.get(cls.__name__, set())
            | LIFECYCLE.get(cls.__name__, set())
            | DATA_PLANE.get(cls.__name__, set())
        )
        if public != expected:
            mismatches[cls.__name__] = {
                "not a handler": sorted(public - expected),
                "missing": sorted(expected - public),
            }
    assert mismatches == {}


def test_no_module_holds_a_reference_to_another_module(built):
    held: dict[str, set[str]] = {}
    lay_out: set[str] = set()
    for b in built:
        for inst in b.modules.values():
            for r in reachable(inst):
                if not isinstance(r.target, (CommandPort, Emitter)):
                    top = r.path.split("<")[0].split("[")[0]
                    held.setdefault(top, set()).add(type(r.target).__name__)
            if isinstance(inst, ShardLoader):  # (walked alone: the handover's closure reached L3-5 first)
                lay_out |= {type(r.target).__name__ for r in reachable(SimpleNamespace(lay_out=inst._lay_out))}
    assert held == {HANDOVER[0]: HANDOVER[1]}
    assert lay_out == LAY_OUT[1]


def test_the_shard_loader_handover_is_write_only():
    # The shard loader only ever calls its handover with the model it built (once per load,
    # and again for a group rebuilt in place), and reads nothing back: no attribute of it is
    # read, its result is not used.
    tree = ast.parse((REPO / MODULES[Module.L3_SHARD_LOADER][1]).read_text())
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "_handover"]
    assigns = [n for n in uses if isinstance(n.ctx, ast.Store)]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "_handover"]
    assert len(assigns) == 1 and len(calls) == 1 and len(uses) == 2
    (call,) = calls
    assert [ast.unparse(a) for a in call.args] == ["model"] and not call.keywords
    stmt_parents = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and n.value is call]
    assert stmt_parents, "the handover's result must not be used"
    # The layout callback likewise: called once, with the model, its result unused.
    lay_outs = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "_lay_out"]
    assert [[ast.unparse(a) for a in c.args] for c in lay_outs] == [["model"]]
    assert any(isinstance(n, ast.Expr) and n.value is lay_outs[0] for n in ast.walk(tree))
    # And the composition root's handover returns nothing.
    rank = ast.parse((REPO / "services/rank/__main__.py").read_text())
    (handover,) = [n for n in ast.walk(rank) if isinstance(n, ast.FunctionDef) and n.name == "handover"]
    assert all(r.value is None for r in ast.walk(handover) if isinstance(r, ast.Return))


def test_no_lower_module_holds_a_port_to_an_upper_one(built):
    upward = []
    for b in built:
        for inst in b.modules.values():
            for r in reachable(inst):
                if isinstance(r.target, CommandPort):
                    sender, receiver = r.target._sender, r.target._receiver
                    if layer(receiver) < layer(sender):
                        upward.append(r.path)
    assert upward == []


def test_no_command_route_points_up_a_layer():
    table = default_table()
    upward = [
        f"{r.message}: {Module.Name(s)} -> {Module.Name(t)}"
        for r in table.routes()
        if r.kind == 1  # COMMAND
        for s in r.senders
        for t in r.receivers
        if s in MODULES and t in MODULES and layer(t) < layer(s)
    ]
    assert upward == []


# Upper-layer private state the seed names in the compute and data modules' red lines
# (L3-x / L4-x red line 1). Compute units may be told a step in a command (e.g. a label on
# a gradient read); the data path never: nothing it does depends on the training step.
UPPER_TRAINING_STATE = {"learning_rate", "lr", "loss", "train_loss", "eval_loss", "grad_norm"}
UPPER_STATE_FOR_DATA = UPPER_TRAINING_STATE | {"step", "global_step"}


def _field_names(descriptor, seen=None) -> set[str]:
    seen = seen if seen is not None else set()
    if descriptor.full_name in seen:
        return set()
    seen.add(descriptor.full_name)
    names = set()
    for f in descriptor.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= _field_names(f.message_type, seen)
    return names


def test_no_message_routed_to_a_compute_or_data_module_carries_step_learning_rate_or_loss():
    from services.contract.route_table import PROTO_FILES

    by_name = {d.full_name: d for fd in PROTO_FILES for d in fd.message_types_by_name.values()}
    leaks = {}
    for route in default_table().routes():
        layers = {layer(r) for r in route.receivers if r in MODULES}
        if not layers & {3, 4} or route.message not in by_name:
            continue
        carried = _field_names(by_name[route.message]) & (UPPER_STATE_FOR_DATA if 4 in layers else UPPER_TRAINING_STATE)
        if carried:
            leaks[route.message] = sorted(carried)
    assert leaks == {}


def test_a_compute_unit_attached_to_the_model_holds_no_upper_module(tmp_path):
    # After LoadModel the units hold the model (their work), never the loop, the optimizer
    # or the precision manager that work above them.
    built = build_rank(tmp_path)
    for module, inst in built.modules.items():
        if layer(module) != 3 or module == Module.L3_SHARD_LOADER:
            continue
        others = [r.path for r in reachable(inst) if not isinstance(r.target, (CommandPort, Emitter))]
        assert others == [], Module.Name(module)
