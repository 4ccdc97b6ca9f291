"""Red lines of kind (d), a module cannot send across layers, and the "one module, one kind
of work" red lines that a module's own source shows.

Run time: a module's emitter and ports speak only as that module, and the bus refuses a
send the route table does not name (the forward unit cannot reach the orchestrator, the
shuffler cannot reach the optimizer). Source: what each module file imports and calls.
The import-linter contracts in pyproject.toml (``make lint``) check the package layering;
these scans are per seed module and per red line.
"""

from __future__ import annotations

import ast

import pytest
import torch

from services.contract import Module, data_pb2, engine_pb2
from services.contract.bus import BoundaryViolation, CommandPort, Emitter, RouteError
from services.contract.route_table import default_table

from .wiring import (
    MODULES,
    attribute_names,
    build_all,
    build_data,
    build_rank,
    called_names,
    imported_modules,
    layer,
    reachable,
    source_tree,
)


def _by_layer(*layers: int) -> list[int]:
    return [m for m in MODULES if layer(m) in layers]


# ---------------------------------------------------------------------- run time: no skipping


def test_the_forward_unit_cannot_send_to_the_orchestrator(tmp_path):
    built = build_rank(tmp_path, load_model=False)
    bus, forward = built.buses[0], built.modules[Module.L3_FORWARD_UNIT]
    with pytest.raises(RouteError, match="L3_FORWARD_UNIT may not command L1_ORCHESTRATOR"):
        bus.port(Module.L3_FORWARD_UNIT, Module.L1_ORCHESTRATOR)
    with pytest.raises(BoundaryViolation, match="L3_FORWARD_UNIT may not send surge.v1.StepCompleted"):
        forward._emit(engine_pb2.StepCompleted(job_id="j", step=1, loss=0.1))
    with pytest.raises(BoundaryViolation, match="L3_FORWARD_UNIT may not send surge.v1.TrainingLoopFailed"):
        bus.command(Module.L3_FORWARD_UNIT, Module.L1_ORCHESTRATOR, engine_pb2.TrainingLoopFailed(job_id="j"))


def test_the_shuffler_cannot_send_to_the_optimizer(tmp_path):
    built = build_data(tmp_path)
    bus, shuffler = built.buses[-1], built.modules[Module.L4_SHUFFLER]
    with pytest.raises(RouteError, match="L4_SHUFFLER may not command L2_OPTIMIZER"):
        bus.port(Module.L4_SHUFFLER, Module.L2_OPTIMIZER)
    with pytest.raises(BoundaryViolation, match="L4_SHUFFLER may not send surge.v1.ApplyUpdate"):
        shuffler._emit(engine_pb2.ApplyUpdate(step=1, learning_rate=1.0))
    with pytest.raises(BoundaryViolation):  # nor skip its own stage: the packer is two down
        shuffler._emit(data_pb2.SamplesFiltered(count=1))


def test_every_port_and_emitter_a_module_holds_speaks_as_that_module(tmp_path):
    wrong = []
    for b in build_all(tmp_path):
        for module, inst in b.modules.items():
            for r in reachable(inst):
                if isinstance(r.target, (CommandPort, Emitter)) and r.target._sender != module:
                    wrong.append(f"{r.path} speaks as {Module.Name(r.target._sender)}")
    assert wrong == []


def test_no_compute_or_data_module_may_send_anything_to_the_orchestrator():
    # The decider hears L3 and L4 only through the loop's reports and the detector's grades.
    direct = [
        f"{r.message} from {Module.Name(s)}"
        for r in default_table().routes()
        if Module.L1_ORCHESTRATOR in r.receivers
        for s in r.senders
        if s in MODULES and layer(s) in (3, 4)
    ]
    assert direct == []


# ---------------------------------------------------------------------- source: imports


@pytest.mark.parametrize("module", _by_layer(1), ids=Module.Name)
def test_control_modules_import_no_tensor_library_and_no_lower_layer_code(module):
    roots = {i.split(".")[0] for i in imported_modules(source_tree(module))}
    assert not roots & {"torch", "numpy", "safetensors"}
    assert not [
        i
        for i in imported_modules(source_tree(module))
        if i.startswith(("services.engine", "services.compute", "services.data", "services.store"))
    ]


@pytest.mark.parametrize("module", _by_layer(4, 5), ids=Module.Name)
def test_data_and_store_modules_import_no_torch_and_no_training_code(module):
    imports = imported_modules(source_tree(module))
    assert not [i for i in imports if i.split(".")[0] == "torch"]
    assert not [i for i in imports if i.startswith(("services.engine", "services.compute", "services.control"))]


# ---------------------------------------------------------------------- source: who communicates

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "fully_shard",
}
GROUP_LIFECYCLE = {"init_process_group", "new_group", "destroy_process_group"}
ALLOWED_COMMUNICATION = {
    # gradient aggregation is its job (DDP or FSDP2 over the dp axis; TP's layout too, issue 6)
    # (all_gather: the replica check's digests over the dp group, issue 29 item 3)
    Module.L3_GRADIENT_REDUCTION: {"all_reduce", "all_gather", "DistributedDataParallel", "fully_shard"},
    Module.L2_PARALLEL_STRATEGY: {
        "init_process_group",
        "new_group",  # the relays' side groups, made with the world
        "destroy_process_group",
    },  # communicator lifecycle (seed L3-5 red line 4)
}


@pytest.mark.parametrize("module", list(MODULES), ids=Module.Name)
def test_only_the_reduction_unit_communicates_and_only_the_parallel_strategy_builds_groups(module):
    tree = source_tree(module)
    used = called_names(tree) | attribute_names(tree) | {i.rsplit(".", 1)[-1] for i in imported_modules(tree)}
    assert used & (COLLECTIVES | GROUP_LIFECYCLE) == ALLOWED_COMMUNICATION.get(module, set())
    # torch.distributed beyond the local state-dict helpers only where communication is the job.
    dist = {
        i
        for i in imported_modules(tree)
        if i.startswith("torch.distributed") and not i.startswith("torch.distributed.checkpoint.state_dict")
    }
    if module not in ALLOWED_COMMUNICATION:
        assert dist == set(), dist


# ---------------------------------------------------------------------- source: disk

DISK = {
    "open",
    "pread",
    "pwrite",
    "read_bytes",
    "read_text",
    "write_bytes",
    "write_text",
    "mkdir",
    "rmtree",
    "unlink",
    "rename",
    "replace",
    "fsync",
    "iterdir",
    "glob",
    "rglob",
    "walk",
    "load",
    "save",
    "memmap",
    "fromfile",
    "tofile",
    "remove",
    "makedirs",
}
FILES_ARE_THE_JOB = {
    Module.L4_DATASET_VERSIONS,
    Module.L4_PREFETCHER,
    Module.L5_CHECKPOINT_MANAGER,
    Module.L5_METRICS_LOGGER,
}


@pytest.mark.parametrize("module", [m for m in MODULES if m not in FILES_ARE_THE_JOB], ids=Module.Name)
def test_modules_whose_job_is_not_files_touch_no_disk(module):
    tree = source_tree(module)
    calls = {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    assert calls & DISK == set()
    assert not {i.split(".")[0] for i in imported_modules(tree)} & {"os", "shutil", "pathlib", "sqlite3", "io"}


# ---------------------------------------------------------------------- source: one kind of tensor work

# What each rank module must never call or touch (by attribute name), from its red lines.
FORBIDDEN = {
    # (the loop's ports are named after the units it commands: ``self._p.backward(...)`` is a
    # command, so its tensor use is checked by name below instead.)
    Module.L2_TRAINING_LOOP: {"cross_entropy", "zero_grad", "grad", "parameters", "no_grad", "_foreach_mul_"},
    Module.L2_PARALLEL_STRATEGY: {"backward", "cross_entropy", "step", "grad", "parameters"},
    Module.L2_OPTIMIZER: {
        "backward",
        "cross_entropy",
        "clip_grad_norm_",
        "clip_grad_value_",
        "zero_grad",
        "forward",
        "autocast",
        "GradScaler",
    },
    Module.L2_MIXED_PRECISION: {
        "backward",
        "cross_entropy",
        "step",
        "zero_grad",
        "clip_grad_norm_",
        "clip_grad_value_",
        "memory_allocated",
        "memory_reserved",
        "mem_get_info",
        "memory_stats",
        "max_memory_allocated",
    },
    Module.L3_SHARD_LOADER: {
        "backward",
        "cross_entropy",
        "step",
        "zero_grad",
        "grad",
        "forward",
        "load",
        "save",
        "clip_grad_norm_",
    },
    Module.L3_OPERATOR_ADAPTER: {"backward", "cross_entropy", "step", "grad", "parameters", "loss"},
    Module.L3_FORWARD_UNIT: {
        "backward",
        "cross_entropy",
        "nll_loss",
        "log_softmax",
        "step",
        "zero_grad",
        "grad",
        "copy_",
        "no_sync",
        "data",
    },
    Module.L3_BACKWARD_UNIT: {
        "step",
        "zero_grad",
        "clip_grad_norm_",
        "clip_grad_value_",
        "_foreach_mul_",
        "mul_",
        "add_",
        "isfinite",
        "isinf",
        "isnan",
        "GradScaler",
    },
    Module.L3_GRADIENT_REDUCTION: {"backward", "cross_entropy", "step", "zero_grad", "clip_grad_norm_", "forward"},
}


@pytest.mark.parametrize("module", list(FORBIDDEN), ids=Module.Name)
def test_each_rank_module_does_only_its_own_kind_of_tensor_work(module):
    tree = source_tree(module)
    touched = called_names(tree) | attribute_names(tree)
    assert touched & FORBIDDEN[module] == set()


def _grad_writes(tree) -> list[str]:
    out = []
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "grad":
                value = node.value if isinstance(node, ast.Assign) else None
                if not (isinstance(value, ast.Constant) and value.value is None):
                    out.append(ast.unparse(node))
    return out


@pytest.mark.parametrize("module", [m for m in _by_layer(2, 3) if m != Module.L3_GRADIENT_REDUCTION], ids=Module.Name)
def test_no_rank_module_assigns_a_gradient(module):
    # The backward unit may start a window from zero (``p.grad = None``); nobody writes values.
    assert _grad_writes(source_tree(module)) == []


def test_only_the_reduction_writes_the_reduced_gradient():
    # L3-5's duty is the aggregated gradient (seed L3-5 s3 1175: 梯度归约完成, carrying the
    # aggregated global gradient): under TP it sums the partial gradients and puts the sum in
    # place, and that is the only gradient it writes.
    assert _grad_writes(source_tree(Module.L3_GRADIENT_REDUCTION)) == [
        "p.grad = summed if tuple(summed.placements) == tuple(p.placements) else summed.redistribute(p.device_mesh, p.placements)"
    ]


def test_the_training_loop_touches_tensors_only_to_carry_and_checkpoint_them():
    tree = source_tree(Module.L2_TRAINING_LOOP)
    used = {
        dotted.split(".", 1)[1]
        for dotted in (ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute))
        if dotted.startswith("torch.")
    }
    assert {u.split(".")[0] for u in used} <= {
        "Tensor",
        "tensor",
        "int64",
        "float64",
        "get_rng_state",
        "set_rng_state",
        "OutOfMemoryError",
        "distributed",
    }


def test_the_forward_unit_reads_weights_and_never_writes_them(tmp_path):
    built = build_rank(tmp_path)
    bus = built.buses[0]
    loop = lambda receiver, msg, payload=None: bus.command(Module.L2_TRAINING_LOOP, receiver, msg, payload)  # noqa: E731
    loop(Module.L2_MIXED_PRECISION, engine_pb2.InitPrecision(precision="fp32"))
    loop(Module.L3_FORWARD_UNIT, engine_pb2.ConfigureForward(attention="math"))
    state = loop(Module.L3_SHARD_LOADER, engine_pb2.ExportState()).payload.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    logits = loop(
        Module.L3_FORWARD_UNIT, engine_pb2.RunForward(training=True), torch.randint(0, 32, (2, 8), dtype=torch.int64)
    ).payload
    assert logits.shape == (2, 8, 32)
    after = loop(Module.L3_SHARD_LOADER, engine_pb2.ExportState()).payload.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.grad is None for p in built.modules[Module.L2_OPTIMIZER]._model.parameters())  # no backward either
