"""Red lines of kind (b): an executor cannot take a decision.

The checkpoint manager cannot trigger its own save or pick a version, the optimizer cannot
skip a step or pick a learning rate, the shuffler cannot pick a seed or change it mid-round,
the batch packer cannot change the batch size, the fault detector cannot command a recovery,
and nobody but the orchestrator can start, pause, resume or stop training. Each is shown on
the real module (or the real composition root's wiring), not on a stand-in.
"""

from __future__ import annotations

import ast
import hashlib
import math
import threading

import numpy as np
import pytest
import torch

from services.contract import Module, control_pb2, data_pb2, engine_pb2, store_pb2
from services.contract.bus import BoundaryViolation, Bus, CommandPort, Emitter, RouteError
from services.contract.frozen import ConfigFrozen
from services.contract.route_table import default_table
from services.control.recovery_controller import RecoveryController
from services.data.shuffler import epoch_order
from tests.data.helpers import catalog, kept_all, packer_on_bus

from .wiring import (
    MODULES,
    build_control,
    build_data,
    build_rank,
    build_store,
    imported_modules,
    optimizer_with_model,
    reachable,
    shuffler_on_bus,
    source_tree,
)

COMMAND, EVENT = 1, 2
CKPT, METRICS = Module.L5_CHECKPOINT_MANAGER, Module.L5_METRICS_LOGGER
TRAINING_CONTROL = (
    engine_pb2.StartTraining,
    engine_pb2.PauseTraining,
    engine_pb2.ResumeTraining,
    engine_pb2.StopTraining,
)


def holds(module_instance) -> dict[str, list[str]]:
    """What a module can act through: its ports' receivers and its emitters' senders."""
    out: dict[str, list[str]] = {"ports": [], "emitters": [], "modules": []}
    for r in reachable(module_instance):
        if isinstance(r.target, CommandPort):
            out["ports"].append(Module.Name(r.target._receiver))
        elif isinstance(r.target, Emitter):
            out["emitters"].append(Module.Name(r.target._sender))
        else:
            out["modules"].append(type(r.target).__name__)
    return out


def sends(module: int, kind: int | None = None) -> set[str]:
    """Short names of the messages ``module`` may send to another seed module (of route
    ``kind`` if given). External endpoints (storage, disk, hardware) are left out: a module
    driving its own device or files is not commanding a module."""
    return {
        r.message.rsplit(".", 1)[-1]
        for r in default_table().routes()
        if module in r.senders and r.receivers & set(MODULES) and (kind is None or r.kind == kind)
    }


def commands_to(sender: int, receiver: int) -> set[str]:
    return {
        r.message.rsplit(".", 1)[-1]
        for r in default_table().routes()
        if sender in r.senders and receiver in r.receivers and r.kind == COMMAND
    }


# ---------------------------------------------------------------------- nobody but L1-1 steers training


def test_only_the_orchestrator_may_start_pause_resume_or_stop_training():
    table = default_table()
    for msg in TRAINING_CONTROL:
        assert table.route(msg).senders == {Module.L1_ORCHESTRATOR}, msg.DESCRIPTOR.name
    for msg in (
        control_pb2.PauseJobRequest,
        control_pb2.ResumeJobRequest,
        control_pb2.StopJobRequest,
        control_pb2.SubmitJobRequest,
    ):
        assert table.route(msg).senders == {Module.EXT_USER} and table.route(msg).receivers == {Module.L1_ORCHESTRATOR}


def test_only_the_orchestrator_may_command_resources_or_a_recovery():
    table = default_table()
    for msg in (control_pb2.AllocateResources, control_pb2.ReleaseResources, control_pb2.StartRecovery):
        assert table.route(msg).senders == {Module.L1_ORCHESTRATOR}, msg.DESCRIPTOR.name


# ---------------------------------------------------------------------- L5-1 checkpoint manager


def _stage(manager, job: str, step: int, data: bytes):
    path = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0)).staging_path
    with open(f"{path}/__0_0.distcp", "wb") as f:
        f.write(data)
    return manager.commit_checkpoint(store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json="{}"))


def test_the_checkpoint_manager_cannot_trigger_its_own_save(tmp_path):
    built = build_store(tmp_path)
    manager, bus = built.modules[CKPT], built.buses[0]
    # Nothing to act with: no port, no thread or timer of its own; its one emitter publishes
    # its own events (CheckpointCorrupt), and every route it sends on is an event or goes to
    # storage, never a command to a module.
    assert holds(manager) == {"ports": [], "emitters": ["L5_CHECKPOINT_MANAGER"], "modules": []}
    assert not any(isinstance(v, threading.Thread) for v in vars(manager).values())
    for route in default_table().routes():
        if CKPT in route.senders and route.kind == COMMAND:
            assert route.receivers <= {Module.EXT_STORAGE}, route.message
    # No module's event reaches it (only its commanders' commands, and storage feedback).
    for route in default_table().routes():
        if CKPT in route.receivers:
            assert route.kind == COMMAND or route.senders <= {Module.EXT_STORAGE}, route.message
    # L1-1's one command to it that is not about versions (a recorded addition, session 33):
    # the job ended, so L5-1 drops its own Prometheus series of that job; it reads, asks or
    # decides nothing for it, and the job's versions stay.
    retire = default_table().route(store_pb2.RetireCheckpointSeries)
    assert (retire.senders, retire.receivers, retire.kind) == ({Module.L1_ORCHESTRATOR}, {CKPT}, COMMAND)
    with pytest.raises(RouteError):
        bus.subscribe(CKPT, engine_pb2.StepCompleted, lambda m, p: None)
    # A step summary on its bus reaches the metrics logger only; nothing is staged or saved.
    assert bus.publish(Module.L2_TRAINING_LOOP, engine_pb2.StepCompleted(job_id="j", step=100, loss=0.5)) == 1
    assert not (tmp_path / "store" / "checkpoints" / "j").exists()
    assert list(manager.checkpoint_query(store_pb2.CheckpointQuery()).checkpoints) == []


def test_the_checkpoint_manager_commands_nobody_so_it_cannot_pause_or_start_training():
    assert sends(CKPT, COMMAND) == set()  # (it commands storage: its own files)
    for msg in TRAINING_CONTROL:
        assert CKPT not in default_table().route(msg).senders


def test_the_checkpoint_manager_loads_exactly_the_version_it_is_told(tmp_path):
    manager = build_store(tmp_path).modules[CKPT]
    first, second = _stage(manager, "j", 1, b"one" * 50), _stage(manager, "j", 2, b"two" * 50)
    assert (first.version, second.version) == ("j:1", "j:2")
    assert manager.load_checkpoint(store_pb2.LoadCheckpoint(version="j:1")).info.version == "j:1"  # not the newest
    assert (
        manager.load_checkpoint(store_pb2.LoadCheckpoint(version="j:latest")).info.version == "j:2"
    )  # the caller's word
    with pytest.raises(ValueError, match="expected"):
        manager.load_checkpoint(store_pb2.LoadCheckpoint(version=""))  # no version named: it picks none


def test_the_checkpoint_manager_never_changes_the_bytes_it_commits(tmp_path):
    manager = build_store(tmp_path).modules[CKPT]
    data = bytes(range(256)) * 64
    done = _stage(manager, "k", 5, data)
    assert (tmp_path / "store" / "checkpoints" / "k" / "1" / "__0_0.distcp").read_bytes() == data
    assert done.bytes == len(data)
    assert (
        hashlib.sha256(data).hexdigest()
        in (tmp_path / "store" / "checkpoints" / "k" / "1" / "manifest.json").read_text()
    )


# ---------------------------------------------------------------------- L2-3 optimizer


def test_the_optimizer_applies_every_commanded_update_even_with_non_finite_gradients():
    # Whether an overflowing step is skipped is the loop's decision (its skip policy), made
    # on the precision manager's report; the optimizer never skips, clips or checks itself.
    model, _, port = optimizer_with_model()
    first = next(model.parameters())
    first.grad[0] = math.inf
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = port(engine_pb2.ApplyUpdate(step=1, learning_rate=0.01)).message
    assert done.step == 1 and done.learning_rate == 0.01
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == [n for n, _ in model.named_parameters()]  # every parameter moved
    assert not torch.isfinite(first).all()  # it did apply the inf gradient: no check of its own


def test_the_optimizer_never_writes_a_gradient():
    model, _, port = optimizer_with_model()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for step in (1, 2, 3):
        port(engine_pb2.ApplyUpdate(step=step, learning_rate=0.01 * step))
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    tree = source_tree(Module.L2_OPTIMIZER)
    writes = [
        ast.unparse(t)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if "grad" in ast.unparse(t)
    ]
    assert writes == []
    assert not {"clip_grad_norm_", "clip_grad_value_", "backward", "zero_grad"} & {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def test_the_optimizer_learning_rate_is_only_ever_the_commanded_one():
    model, optimizer, port = optimizer_with_model()
    assert {g["lr"] for g in optimizer._optim.param_groups} == {0.0}  # nothing until commanded
    port(engine_pb2.ApplyUpdate(step=1, learning_rate=0.003))
    assert {g["lr"] for g in optimizer._optim.param_groups} == {0.003}
    # No schedule of its own: the learning-rate schedule lives with the loop (lr_schedule.py).
    assert not any(
        m.startswith("services.engine.lr_schedule") for m in imported_modules(source_tree(Module.L2_OPTIMIZER))
    )


# ---------------------------------------------------------------------- L2-4 mixed precision


def test_the_precision_manager_reports_overflow_but_never_skips_or_edits_gradients(tmp_path):
    built = build_rank(tmp_path)
    bus, precision = built.buses[0], built.modules[Module.L2_MIXED_PRECISION]
    loop = bus.port(Module.L2_TRAINING_LOOP, Module.L2_MIXED_PRECISION)
    loop(engine_pb2.InitPrecision(precision="fp32"))
    params = precision._params
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    params[0].grad[0] = math.inf
    grads = [p.grad.clone() for p in params]
    checked = loop(engine_pb2.UnscaleAndCheck(step=1)).message
    assert checked.found_inf and checked.loss_scale == 1.0
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # reported, not zeroed or clipped
    # It can command only the operator adapter: no update, evaluation or save of its own.
    assert holds(precision)["ports"] == ["L3_OPERATOR_ADAPTER"]
    for receiver in (
        Module.L2_OPTIMIZER,
        Module.L2_TRAINING_LOOP,
        Module.L3_FORWARD_UNIT,
        Module.L5_CHECKPOINT_MANAGER,
        Module.L2_PARALLEL_STRATEGY,
        Module.L3_GRADIENT_REDUCTION,
    ):
        assert commands_to(Module.L2_MIXED_PRECISION, receiver) == set(), Module.Name(receiver)


# ---------------------------------------------------------------------- L4-3 shuffler


def _order(out) -> list[int]:
    """The documents' first tokens (document i is made of i) in the orders handed on, read
    through the catalog's read handle."""
    return [
        int(o.catalog.reader.read(int(o.catalog.store.bounds_n1[i]), 1)[0]) for o in out for i in o.order().tolist()
    ]


def test_the_shuffler_emits_nothing_until_a_plan_comes_from_above():
    bus, out = shuffler_on_bus()
    assert out == []  # the whole split is buffered; no order is picked without a plan


def test_the_shuffle_order_is_a_pure_function_of_the_plan_it_is_given():
    orders = []
    for seed in (5, 5, 6):
        bus, out = shuffler_on_bus()
        bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER)(data_pb2.ShufflePlan(seed=seed, epoch=3, enabled=True))
        orders.append(_order(out))
    assert orders[0] == orders[1] == epoch_order(5, 3, 12).tolist()
    assert orders[2] == epoch_order(6, 3, 12).tolist() != orders[0]


def test_a_rounds_seed_cannot_change_mid_epoch():
    refused: list[BaseException] = []

    def change_seed_mid_round(out):
        if len(out) == 1:  # the first chunk of the round is out; the round is in progress
            try:
                port(data_pb2.ShufflePlan(seed=8, epoch=0, enabled=True))
            except ConfigFrozen as e:
                refused.append(e)

    bus, out = shuffler_on_bus(chunk=2, on_chunk=change_seed_mid_round)
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER)
    port(data_pb2.ShufflePlan(seed=7, epoch=0, enabled=True))
    assert len(refused) == 1 and "being emitted" in str(refused[0])
    assert _order(out) == epoch_order(7, 0, 12).tolist()  # the round finished with its own seed
    with pytest.raises(ConfigFrozen, match="epoch 0 was planned with seed 7"):
        port(data_pb2.ShufflePlan(seed=8, epoch=0, enabled=True))


def test_the_shuffler_has_no_entropy_source_of_its_own():
    tree = source_tree(Module.L4_SHUFFLER)
    imports = imported_modules(tree)
    assert not {"random", "secrets", "os", "time", "uuid", "torch"} & {i.split(".")[0] for i in imports}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).startswith(("np.random", "numpy.random")):
            assert node.args, f"{ast.unparse(node)}: an unseeded generator"
            assert "default_rng" not in ast.unparse(node.func)
    # The seed it uses is the plan's: epoch_order(msg.seed, msg.epoch, ...).
    calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "epoch_order"]
    assert calls and all(c.startswith("epoch_order(msg.seed, msg.epoch") for c in calls)


# ---------------------------------------------------------------------- L4-5 batch packer


def test_the_batch_packer_cannot_change_the_batch_size_or_sequence_length(tmp_path):
    feed, assemble, batches, _, port = packer_on_bus(
        data_pb2.PackerConfig(seq_len=8, micro_batch_size=2, mode=data_pb2.PAD)
    )
    with pytest.raises(ConfigFrozen, match="L4_BATCH_PACKER: batching rules"):
        port(data_pb2.PackerConfig(seq_len=32, micro_batch_size=16, mode=data_pb2.PAD))
    parts = [np.arange(1, n + 1, dtype=np.uint16) for n in (3, 20, 9, 2, 40, 5)]
    feed(kept_all(catalog(tmp_path, *parts)))
    assemble()
    assert batches and {(b.batch_size, b.seq_len, len(b.input_ids) // 4) for b in batches} == {(2, 8, 16)}


# ---------------------------------------------------------------------- L1-3 fault detector


def test_the_fault_detector_cannot_command_a_recovery(tmp_path):
    built = build_control(tmp_path)
    bus, detector = built.buses[0], built.modules[Module.L1_FAULT_DETECTOR]
    with pytest.raises(RouteError, match="L1_FAULT_DETECTOR may not command L1_RECOVERY_CONTROLLER"):
        bus.port(Module.L1_FAULT_DETECTOR, Module.L1_RECOVERY_CONTROLLER)
    for receiver in (Module.L1_RESOURCE_ALLOCATOR, Module.L2_TRAINING_LOOP, Module.EXT_HARDWARE):
        with pytest.raises(RouteError):
            bus.port(Module.L1_FAULT_DETECTOR, receiver)
    # It holds one thing: its emitter, and the only message that may carry is its report.
    assert holds(detector) == {"ports": [], "emitters": ["L1_FAULT_DETECTOR"], "modules": []}
    # Its reports go to the orchestrator. Its own failure event (issue 13: a handler's exception
    # is its module's failure event) comes back to it alone, graded by its own table like any
    # module's, and that report reaches L1-1: no route from it names another module.
    sent = [r for r in default_table().routes() if Module.L1_FAULT_DETECTOR in r.senders]
    assert sent and all(r.kind == EVENT for r in sent)
    assert {r.message: r.receivers for r in sent if r.failure} == {
        "surge.v1.FaultDetectorFailed": {Module.L1_FAULT_DETECTOR}
    }
    assert all(r.receivers == {Module.L1_ORCHESTRATOR} for r in sent if not r.failure)
    emit = detector._emit
    for forged in (
        control_pb2.StartRecovery(job_id="j"),
        engine_pb2.StopTraining(job_id="j"),
        control_pb2.ReleaseResources(job_id="j", kill=True),
    ):
        with pytest.raises(BoundaryViolation):
            emit(forged)
    # A fatal fault is reported and nothing else happens: the recovery controller saw nothing.
    bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j"))
    bus.publish(Module.EXT_HARDWARE, control_pb2.RankExited(job_id="j", rank=0, exit_code=-9))
    assert built.modules[Module.L1_RECOVERY_CONTROLLER]._state == {}


# ---------------------------------------------------------------------- L1-4 recovery controller


def test_the_recovery_controller_cannot_listen_for_faults(tmp_path):
    built = build_control(tmp_path)
    bus = built.buses[0]
    for event in (control_pb2.FaultReport, control_pb2.RankExited, engine_pb2.TrainingLoopFailed):
        with pytest.raises(RouteError):
            bus.subscribe(Module.L1_RECOVERY_CONTROLLER, event, lambda m, p: None)
    # It reaches the allocator (the rebuild), no one else: the snapshot's digests are checked
    # by the ranks as they load it, the versions' verdicts asked by the orchestrator.
    assert holds(built.modules[Module.L1_RECOVERY_CONTROLLER]) == {
        "ports": ["L1_RESOURCE_ALLOCATOR"],
        "emitters": [],
        "modules": [],
    }


def test_the_recovery_controller_relaunches_exactly_the_version_it_is_told():
    bus = Bus()
    relaunched = []

    def rebuild(msg, payload):
        relaunched.append(msg.resume_version)
        return control_pb2.ResourcesReady(job_id=msg.job_id)

    bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, control_pb2.RebuildCommunicator, rebuild)
    recovery = RecoveryController(bus.port(Module.L1_RECOVERY_CONTROLLER, Module.L1_RESOURCE_ALLOCATOR))
    done = recovery.start_recovery(control_pb2.StartRecovery(job_id="j", checkpoint_version="j:2"))
    assert isinstance(done, control_pb2.RecoveryCompleted) and done.checkpoint_version == "j:2"
    fresh = recovery.start_recovery(control_pb2.StartRecovery(job_id="k", checkpoint_version=""))
    assert isinstance(fresh, control_pb2.RecoveryCompleted) and fresh.checkpoint_version == ""
    assert relaunched == ["j:2", ""]  # the ranks load the version it was told, or none


def test_the_recovery_controller_cannot_change_the_job_or_its_parallel_rules():
    # It may ask L5-1 for the named snapshot and L2-2 to rebuild the group on the same plan
    # (seed L1-4 s5), or L1-2 to rebuild it by relaunching the ranks with the job config L1-1
    # pushed (RebuildCommunicator carries a version and exclusions, never a config); it can
    # send nothing that carries a configuration, a plan or a spec.
    assert sends(Module.L1_RECOVERY_CONTROLLER, COMMAND) <= {
        "LoadCheckpoint",
        "VerifyCheckpoints",
        "RebuildParallelGroup",
        "RebuildCommunicator",
    }
    assert not _fields("surge.v1.RebuildCommunicator") & {"init", "spec_json", "spec_yaml", "world_size", "backend"}
    for msg in (engine_pb2.InitJob, engine_pb2.RankAssignment, engine_pb2.ParallelPlan, control_pb2.AllocateResources):
        assert Module.L1_RECOVERY_CONTROLLER not in default_table().route(msg).senders


# ---------------------------------------------------------------------- L1-2 resource allocator


def test_the_resource_allocator_cannot_steer_training_or_read_its_metrics(tmp_path):
    built = build_control(tmp_path)
    bus, allocator = built.buses[0], built.modules[Module.L1_RESOURCE_ALLOCATOR]
    # L2_PARALLEL_STRATEGY: the fresh rendezvous of a group rebuilt in place (RebuildParallelGroup:
    # an address, a generation, where each rank runs; no configuration, nothing of the training).
    assert holds(allocator) == {
        "ports": ["EXT_HARDWARE", "L2_PARALLEL_STRATEGY"],
        "emitters": ["L1_RESOURCE_ALLOCATOR"],
        "modules": [],
    }
    assert not _fields("surge.v1.RebuildParallelGroup") & (TRAINING_PARAMETERS | {"spec_json", "spec_yaml", "init"})
    for msg in TRAINING_CONTROL + (engine_pb2.ParallelPlan, engine_pb2.ApplyUpdate, engine_pb2.InitJob):
        assert Module.L1_RESOURCE_ALLOCATOR not in default_table().route(msg).senders, msg.DESCRIPTOR.name
    for metric in (
        engine_pb2.StepCompleted,
        engine_pb2.EvalCompleted,
        engine_pb2.OverflowChecked,
        engine_pb2.PrecisionReady,
        engine_pb2.BackwardDone,
    ):
        with pytest.raises(RouteError):
            bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, metric, lambda m, p: None)


# ---------------------------------------------------------------------- L2-1 training loop


def test_the_training_loop_cannot_request_resources_or_change_the_job(tmp_path):
    loop = build_rank(tmp_path, load_model=False).modules[Module.L2_TRAINING_LOOP]
    ports = holds(loop)["ports"]
    assert not [p for p in ports if p.startswith("L1_") or p.startswith("EXT_")]
    for msg in (
        control_pb2.AllocateResources,
        control_pb2.ReleaseResources,
        control_pb2.LaunchRanks,
        control_pb2.ReleaseRanks,
        control_pb2.SubmitJobRequest,
        control_pb2.StopJobRequest,
        engine_pb2.InitJob,
        engine_pb2.RankAssignment,
    ):
        assert Module.L2_TRAINING_LOOP not in default_table().route(msg).senders, msg.DESCRIPTOR.name
    # Its fault is a report to L1 (the detector grades it, the orchestrator decides).
    assert default_table().route(engine_pb2.TrainingLoopFailed).receivers == {
        Module.L1_ORCHESTRATOR,
        Module.L1_FAULT_DETECTOR,
    }


# ---------------------------------------------------------------------- L1-1 orchestrator


def test_the_orchestrator_only_commands_below_and_never_queries(tmp_path):
    orchestrator = build_control(tmp_path).modules[Module.L1_ORCHESTRATOR]
    # L5_CHECKPOINT_MANAGER: VerifyCheckpoints before naming a version to load (a recorded
    # addition in seed_routes.yaml); the store reports verdicts, the orchestrator chooses.
    # L5_METRICS_LOGGER: RetireMetricSeries at a job's end or relaunch (an addition too): a
    # command, answered by nothing the orchestrator reads; so is L5-1's RetireCheckpointSeries
    # at a job's end (session 33), on the L5_CHECKPOINT_MANAGER port.
    assert sorted(holds(orchestrator)["ports"]) == [
        "L1_FAULT_DETECTOR",
        "L1_RECOVERY_CONTROLLER",
        "L1_RESOURCE_ALLOCATOR",
        "L2_TRAINING_LOOP",
        "L5_CHECKPOINT_MANAGER",
        "L5_METRICS_LOGGER",
    ]
    sent = [r for r in default_table().routes() if Module.L1_ORCHESTRATOR in r.senders and r.receivers & set(MODULES)]
    below = [r for r in sent if not r.failure]
    assert below and all(r.kind == COMMAND for r in below)
    # Its one event to a module is its own failure event (issue 13), to the detector that grades it.
    assert {r.message: r.receivers for r in sent if r.failure} == {
        "surge.v1.OrchestratorFailed": {Module.L1_FAULT_DETECTOR}
    }
    assert not [r.message for r in below if "Query" in r.message or "Get" in r.message]


def test_every_policy_lookup_of_the_orchestrator_goes_through_fault_decision():
    # Issue 28 item 1: the job's fault policy is read in one place (services/control/
    # fault_decision.py); L1-1's package and the monitoring command it builds hand the policy
    # to it and read none of its fields (the launch's fields were read in three copies).
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "services" / "control"
    read = []
    for path in [*sorted((root / "orchestrator").glob("*.py")), root / "monitoring.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            field = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            if field and node.value.attr == "fault_policy":  # (spec.fault_policy.<field>)
                read.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            named = isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
            if named and node.value.attr == "fault_policy":  # (read later through a name)
                read.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert read == []


# ---------------------------------------------------------------------- L5-2 metrics logger


def test_the_metrics_logger_commands_nobody_and_cannot_trigger_a_save(tmp_path):
    built = build_store(tmp_path)
    # Its own emitter only: for its failure event (LogWriteFailed, a sink that failed to write).
    assert holds(built.modules[METRICS]) == {"ports": [], "emitters": ["L5_METRICS_LOGGER"], "modules": []}
    assert sends(METRICS, COMMAND) == set()  # (it commands storage: its own log files)
    with pytest.raises(RouteError, match="L5_METRICS_LOGGER may not command L5_CHECKPOINT_MANAGER"):
        built.buses[0].port(METRICS, CKPT)
    with pytest.raises(BoundaryViolation):
        built.buses[0].command(METRICS, CKPT, store_pb2.SaveCheckpoint(job_id="j", step=1))
    for decision in TRAINING_CONTROL + (engine_pb2.ApplyUpdate, store_pb2.SaveCheckpoint):
        assert METRICS not in default_table().route(decision).senders


# ---------------------------------------------------------------------- L4 data modules


def test_no_data_module_can_command_another_stage_or_the_reads(tmp_path):
    built = build_data(tmp_path)
    got = {Module.Name(m): holds(inst)["ports"] for m, inst in built.modules.items()}
    assert got == {
        "L4_DATASET_VERSIONS": ["L4_PREFETCHER"],
        "L4_PREFETCHER": [],
        "L4_SHUFFLER": [],
        "L4_FILTER": [],
        "L4_BATCH_PACKER": [],
    }
    for stage in (Module.L4_SHUFFLER, Module.L4_FILTER, Module.L4_BATCH_PACKER, Module.L4_DATASET_VERSIONS):
        assert data_pb2.SetPrefetch.DESCRIPTOR.full_name not in {
            r.message for r in default_table().routes() if stage in r.senders
        }


def test_the_dataset_manager_activates_only_the_version_it_is_told(tmp_path):
    from services.data.prepare import prepare_dataset

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_bytes(b"x = 1\n" * 20)
    (src / "b.py").write_bytes(b"y = 2\n" * 30)
    root = tmp_path / "datasets"
    prepare_dataset(src, "tiny", "v1", root, val_fraction=0.0)
    (src / "c.py").write_bytes(b"z = 3\n" * 40)
    prepare_dataset(src, "tiny", "v2", root, val_fraction=0.0)
    bus = Bus()
    from services.data.dataset_versions import DatasetVersions

    activated = []
    versions = DatasetVersions(
        root, bus.emitter(Module.L4_DATASET_VERSIONS), bus.port(Module.L4_DATASET_VERSIONS, Module.L4_PREFETCHER)
    )
    bus.subscribe(Module.L4_DATASET_VERSIONS, data_pb2.OpenStream, versions.open_stream)
    bus.subscribe(Module.L4_PREFETCHER, data_pb2.ActivateSource, lambda m, store: activated.append(m.version))
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L4_DATASET_VERSIONS)
    ready = port(data_pb2.OpenStream(mount=data_pb2.MountDataset(name="tiny", version="v1"), split="train")).message
    assert ready.version == "v1" and activated == ["v1"]  # the newer v2 is never switched to on its own


# ---------------------------------------------------------------------- more single red lines

TRAINING_PARAMETERS = {"learning_rate", "lr", "loss", "grad_norm", "loss_scale", "weight_decay"}


def _fields(msg_full_name: str) -> set[str]:
    from services.contract.route_table import PROTO_FILES

    for fd in PROTO_FILES:
        for d in fd.message_types_by_name.values():
            if d.full_name == msg_full_name:
                return {f.name for f in d.fields}
    return set()


def test_the_orchestrator_sends_no_training_parameter_down():
    # The job's configuration goes down once, frozen, in InitJob (全局初始化指令); after that
    # every command it sends says when (a step boundary), never what a parameter becomes.
    for route in default_table().routes():
        if (
            Module.L1_ORCHESTRATOR in route.senders
            and route.receivers & set(MODULES)
            and route.message != "surge.v1.InitJob"
        ):
            assert not _fields(route.message) & (TRAINING_PARAMETERS | {"spec_json", "spec_yaml"}), route.message


def test_the_resource_allocator_cannot_change_the_parallel_plan():
    table = default_table()
    for name in ("ParallelPlan", "ReloadShards"):  # the plan, and a re-shard by it
        route = table.route(f"surge.v1.{name}")
        assert route is None or Module.L1_RESOURCE_ALLOCATOR not in route.senders, name
    # Its RankAssignment is the launch-time topology, sent once per rank with LaunchRanks (a
    # replacement rank of a rebuild in place is launched with one too, the same rank and world).
    tree = source_tree(Module.L1_RESOURCE_ALLOCATOR)
    where = [
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith("RankAssignment")
    ]
    assert sorted(where) == ["_rebuild_in_place", "allocate_resources"]


def test_the_resource_allocator_launches_and_releases_ranks_only_when_commanded():
    tree = source_tree(Module.L1_RESOURCE_ALLOCATOR)
    callers = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self._hardware"
    }
    # L1-1's two commands and L1-4's rebuild in place, nothing else.
    assert callers == {"allocate_resources", "release_resources", "_rebuild_in_place"}
    entries = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self._rebuild_in_place"
    }
    assert entries == {"rebuild_communicator"}  # (RebuildCommunicator.in_place, from L1-4)


def test_the_fault_detector_hears_only_public_error_events_and_its_commands():
    for route in default_table().routes():
        if Module.L1_FAULT_DETECTOR not in route.receivers:
            continue
        if route.kind == COMMAND:
            assert route.senders == {Module.L1_ORCHESTRATOR}, route.message
        else:
            assert not _fields(route.message) & TRAINING_PARAMETERS, route.message


def test_the_training_loop_reports_a_fault_and_leaves_the_verdict_to_l1(tmp_path):
    built = build_rank(tmp_path, load_model=False)
    loop = built.modules[Module.L2_TRAINING_LOOP]
    for verdict in (
        control_pb2.FaultReport(job_id="j", grade=control_pb2.FATAL),
        control_pb2.StopJobRequest(job_id="j"),
        control_pb2.ReleaseResources(job_id="j"),
    ):
        with pytest.raises(BoundaryViolation):
            loop._emit(verdict)
    for above in (
        Module.L1_ORCHESTRATOR,
        Module.L1_RESOURCE_ALLOCATOR,
        Module.L1_FAULT_DETECTOR,
        Module.L1_RECOVERY_CONTROLLER,
    ):
        assert commands_to(Module.L2_TRAINING_LOOP, above) == set()  # it reports up; it commands nothing above
    tree = source_tree(Module.L2_TRAINING_LOOP)
    graded = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & {
        "FaultGrade",
        "SEVERE",
        "FATAL",
        "grade",
    }
    assert graded == set()  # it classifies what happened; the detector grades, the orchestrator decides


def test_the_parallel_strategy_sends_the_loop_only_events():
    assert commands_to(Module.L2_PARALLEL_STRATEGY, Module.L2_TRAINING_LOOP) == set()
    assert commands_to(Module.L2_PARALLEL_STRATEGY, Module.L2_OPTIMIZER) == set()
    tree = source_tree(Module.L2_PARALLEL_STRATEGY)
    assert not {"step", "at_step", "StopTraining", "PauseTraining"} & {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def test_the_precision_manager_cannot_touch_the_learning_rate_or_the_step():
    for route in default_table().routes():
        if Module.L2_MIXED_PRECISION in route.senders:
            assert not _fields(route.message) & {"learning_rate", "lr"}, route.message
    tree = source_tree(Module.L2_MIXED_PRECISION)
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
    }
    assert not names & {"learning_rate", "lr", "param_groups", "_step", "global_step"}


def test_the_operator_adapter_only_responds_to_calls(tmp_path):
    adapter = build_rank(tmp_path, load_model=False).modules[Module.L3_OPERATOR_ADAPTER]
    assert holds(adapter) == {"ports": [], "emitters": ["L3_OPERATOR_ADAPTER"], "modules": []}
    for route in default_table().routes():
        if Module.L3_OPERATOR_ADAPTER in route.receivers:
            assert route.kind == COMMAND or route.senders <= {Module.EXT_HARDWARE}, route.message


def test_the_metrics_logger_only_waits_for_reported_events(tmp_path):
    metrics = build_store(tmp_path).modules[METRICS]
    assert holds(metrics) == {"ports": [], "emitters": ["L5_METRICS_LOGGER"], "modules": []}
    assert not any(isinstance(v, threading.Thread) for v in vars(metrics).values())
    for route in default_table().routes():
        if METRICS in route.receivers and route.kind == COMMAND:
            if route.message == "surge.v1.RetireMetricSeries":
                # The one command from above (a recorded addition, issue 31 item 6): L1-1 decided
                # the job ended or its ranks were relaunched; L5-2 drops series it already holds
                # and reads, asks or collects nothing for it. Commands flow down: L1-1 only.
                assert route.senders == {Module.L1_ORCHESTRATOR}, route.senders
                continue
            assert route.senders <= {Module.L2_TRAINING_LOOP}, route.message  # 日志采集指令 from L2-1 only
