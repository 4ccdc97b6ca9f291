"""Communication escapes L3-5 only through a registered exception (issue 13, parts 5 and 6).

Run time: every torch.distributed call is tagged with the module whose handler the bus runs
(services/contract/comm_guard.py); a call outside L3-5's job (and L2-2's group lifecycle)
that services/contract/exceptions.yaml does not register is a boundary violation: counted,
and reported up as ``BoundaryViolationReported``. Source: a torch.distributed call reachable
from a module's file through imports and calls (tests/redlines/reach.py) must be its own
job or registered. The register: complete, each entry pinned by a test that exists, and
docs/exceptions.md rendered from it.

In-process tests use a one-rank gloo group (a collective on one rank returns at once); the
real-training test runs two gloo rank processes.
"""

from __future__ import annotations

import ast
import json
import os
import threading
from pathlib import Path

import pytest
import structlog
import torch
import torch.distributed as dist
from prometheus_client import REGISTRY

from services.contract import Module, comm_guard, engine_pb2, store_pb2
from services.contract.acting import run_as
from services.contract.audit import ViolationReporter
from services.contract.bus import Bus, Traffic
from services.contract.comm_guard import (
    CommViolation,
    allowed,
    exemptions,
    load_register,
)
from services.engine.mixed_precision import MixedPrecision
from services.rank.store_client import StoreClient
from tests.conftest import free_ports
from tests.rank_forks import run_ranks_to_end

from .reach import defines, reachable_communication
from .wiring import MODULES, build_rank, module_files

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KINDS = {"communication", "reference", "io", "authority", "seed"}
FIELDS = ("id", "kind", "module", "operations", "where", "boundary", "why", "impact", "rollback", "test")
# The relays that speak for a module of another process inside a rank (their class).
RELAYS = {
    ("services/rank/store_client.py", "StoreClient"): Module.L5_CHECKPOINT_MANAGER,
    # (StoreClient's parts, one concern a file: services/rank/store_client.py docstring)
    ("services/rank/save_agreement.py", "SaveAgreement"): Module.L5_CHECKPOINT_MANAGER,
    ("services/rank/checkpoint_commit.py", "BackgroundCommit"): Module.L5_CHECKPOINT_MANAGER,
    ("services/rank/checkpoint_io.py", "ChunkIO"): Module.L5_CHECKPOINT_MANAGER,
    ("services/rank/data_client.py", "DataClient"): Module.L4_DATASET_VERSIONS,
}


# ---------------------------------------------------------------------- the register


def test_every_register_entry_says_why_impact_rollback_and_names_a_test_that_exists():
    entries = load_register()
    assert len({e["id"] for e in entries}) == len(entries)
    for e in entries:
        assert set(FIELDS) <= set(e) and e["kind"] in KINDS, e["id"]
        assert all(isinstance(e[f], str) and len(e[f]) > 10 for f in ("boundary", "why", "impact", "rollback")), e["id"]
        assert e["module"] == comm_guard.NONE or Module.Value(e["module"]), e["id"]
        path, _, function = e["test"].partition("::")
        tree = ast.parse((REPO / path).read_text())
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{e['id']}: {e['test']}"
        if e["kind"] == "communication":
            ops = comm_guard.OPS | {comm_guard.FUNCOL + op for op in comm_guard.FUNCOL_OPS}
            assert set(e["operations"]) <= ops, e["id"]
            gone = [w for w in e["where"] if w != comm_guard.LIBRARY and not defines(w)]
            assert gone == [], f"{e['id']}: no such code any more; drop the entry if its crossing went with it"


def test_docs_exceptions_md_is_rendered_from_the_register():
    from services.contract.exceptions_doc import DOC, render

    assert DOC.read_text() == render(), "docs/exceptions.md is stale: run `make contracts`"
    for e in load_register():
        assert f"### {e['id']}" in render()


# ---------------------------------------------------------------------- source: reachable calls


def _roots() -> list[tuple[str, str | None, int]]:
    return [(f, None, module) for module, (_, path) in MODULES.items() for f in module_files(path)] + [
        (path, cls, module) for (path, cls), module in RELAYS.items()
    ]


@pytest.mark.parametrize("path, cls, module", _roots(), ids=lambda v: Module.Name(v) if isinstance(v, int) else None)
def test_communication_reachable_from_a_module_is_its_job_or_registered(path, cls, module):
    register = exemptions()
    unregistered = [
        f"{f} runs {sorted(f.ops)}"
        for f in reachable_communication(path, only_class=cls)
        if not all(allowed(module, op) or any(e.covers(module, op, f.site) for e in register) for op in f.ops)
    ]
    assert unregistered == []


def test_the_static_check_follows_imports_and_calls_into_helpers(tmp_path):
    pkg = tmp_path / "services" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "planted_helper.py").write_text(
        "import torch.distributed as dist\n\n"
        "def agree(t):\n    dist.barrier()\n    return _norm(t)\n\n"
        "def _norm(t):\n    return t.full_tensor()\n\n"
        "def unused():\n    dist.broadcast(None, 0)\n"
    )
    (pkg / "planted_module.py").write_text(
        "from services.engine.planted_helper import agree\n\n"
        "class Planted:\n    def check(self, t):\n        return self._inner(t)\n\n"
        "    def _inner(self, t):\n        return agree(t)\n"
    )
    found = {(f.site, f.call) for f in reachable_communication("services/engine/planted_module.py", root=tmp_path)}
    assert found == {
        ("services/engine/planted_helper.py::agree", "dist.barrier"),
        ("services/engine/planted_helper.py::_norm", "t.full_tensor"),
    }  # not the unused broadcast


# ---------------------------------------------------------------------- run time, one rank


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    (port,) = free_ports(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def guarded(one_rank_group):
    """The guard installed with a rank's ViolationReporter whose reports land in a list."""
    reports: list = []
    reporter = ViolationReporter(
        "rank 0 of job j", structlog.get_logger(), deliver=reports.append, job_id="j", inline=True
    )
    traffic = Traffic()
    guard = comm_guard.install(report=reporter, mode="report", traffic=traffic)
    guard.reports, guard.reporter, guard.traffic = reports, reporter, traffic
    yield guard
    comm_guard.uninstall()


def test_a_collective_planted_in_the_precision_manager_is_caught_at_run_time(guarded, monkeypatch, tmp_path):
    original = MixedPrecision.unscale_and_check

    def planted_unscale_and_check(self, msg, payload=None):
        flag = torch.ones(1)
        dist.all_reduce(flag)  # L2-4 may not communicate (seed L2-4 red line 4)
        return original(self, msg, payload)

    monkeypatch.setattr(MixedPrecision, "unscale_and_check", planted_unscale_and_check)
    bus = build_rank(tmp_path).buses[0]
    reply = bus.command(Module.L2_TRAINING_LOOP, Module.L2_MIXED_PRECISION, engine_pb2.UnscaleAndCheck())
    # The call still ran (report mode): the ranks stay in step and L1 decides.
    assert isinstance(reply.message, engine_pb2.OverflowChecked) and not reply.message.found_inf

    site = (
        "tests/redlines/test_communication.py::test_a_collective_planted_in_the_precision_manager_is_caught_at_"
        "run_time.<locals>.planted_unscale_and_check"
    )
    [event] = guarded.reports
    assert (event.sender, event.message, event.job_id, event.process) == (
        Module.L2_MIXED_PRECISION,
        "torch.distributed.all_reduce",
        "j",
        "rank 0 of job j",
    )
    assert site in event.detail
    [crossing] = guarded.unregistered()
    assert (crossing.module, crossing.op, crossing.site, crossing.count) == (
        Module.L2_MIXED_PRECISION,
        "all_reduce",
        site,
        1,
    )
    assert guarded.traffic.snapshot().refused == {(Module.L2_MIXED_PRECISION, "torch.distributed.all_reduce", 0): 1}
    assert (
        REGISTRY.get_sample_value(
            "surge_boundary_violations_total",
            {"sender": "L2_MIXED_PRECISION", "message": "torch.distributed.all_reduce"},
        )
        >= 1
    )
    bus.command(Module.L2_TRAINING_LOOP, Module.L2_MIXED_PRECISION, engine_pb2.UnscaleAndCheck())
    assert len(guarded.reports) == 1 and guarded.unregistered()[0].count == 2  # reported once, counted always


def test_a_barrier_planted_in_the_store_relay_is_caught_and_its_registered_agreement_is_not(guarded, monkeypatch):
    original = StoreClient.flush_checkpoint

    def planted_flush(self, msg, payload=None):
        dist.barrier()  # the relay waits for every rank on the training world: not registered
        return original(self, msg, payload)

    monkeypatch.setattr(StoreClient, "flush_checkpoint", planted_flush)
    bus = Bus(on_violation=guarded.reporter)
    client = StoreClient("127.0.0.1:1", bus.emitter(Module.L5_CHECKPOINT_MANAGER))
    try:
        bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.FlushCheckpoint, client.flush_checkpoint)
        bus.port(Module.L2_TRAINING_LOOP, Module.L5_CHECKPOINT_MANAGER)(store_pb2.FlushCheckpoint(job_id="j"))
        # The relay's own save agreement (its gloo group and all-reduce) is registered.
        assert run_as(Module.L5_CHECKPOINT_MANAGER, client._agree, 0) == 0
    finally:
        client.close(timeout=0.1)
    assert [(e.sender, e.message) for e in guarded.reports] == [
        (Module.L5_CHECKPOINT_MANAGER, "torch.distributed.barrier")
    ]
    by_op = {c.op: c for c in guarded.crossings()}
    assert by_op["barrier"].exception == "" and by_op["barrier"].site.endswith("planted_flush")
    assert by_op["new_group"].exception == by_op["all_reduce"].exception == "store-relay-save-agreement"
    assert by_op["all_reduce"].site == "services/rank/save_agreement.py::SaveAgreement._agree"


def test_raise_mode_refuses_the_call_before_it_runs(one_rank_group):
    guard = comm_guard.install(mode="raise", traffic=Traffic())
    try:
        with pytest.raises(
            CommViolation,
            match=r"^boundary violation: L2_OPTIMIZER may not run torch.distributed "
            r"broadcast \(at tests/redlines/test_communication.py::",
        ):
            run_as(Module.L2_OPTIMIZER, dist.broadcast, torch.zeros(1), 0)
        assert guard.counts() == {(Module.L2_OPTIMIZER, "broadcast"): 1}
    finally:
        comm_guard.uninstall()


def test_calls_are_counted_per_module_and_op_and_attributed_to_the_module_that_created_the_group(guarded):
    for _ in range(3):
        run_as(Module.L3_GRADIENT_REDUCTION, dist.all_reduce, torch.ones(1))  # its job: counted, not a crossing
    run_as(Module.L2_PARALLEL_STRATEGY, dist.new_group, backend="gloo")  # its job too
    group = run_as(Module.L5_CHECKPOINT_MANAGER, dist.new_group, backend="gloo")  # the relay's own group
    worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(1),), kwargs={"group": group})
    worker.start()  # a library thread (DCP's writer) using the relay's group, no module acting
    worker.join()
    counts = guarded.counts()
    assert counts[(Module.L3_GRADIENT_REDUCTION, "all_reduce")] == 3
    assert counts[(Module.L2_PARALLEL_STRATEGY, "new_group")] == 1
    assert counts[(Module.L5_CHECKPOINT_MANAGER, "all_reduce")] == 1  # attributed by its group
    assert {(c.module, c.op) for c in guarded.crossings()} == {
        (Module.L5_CHECKPOINT_MANAGER, "new_group"),
        (Module.L5_CHECKPOINT_MANAGER, "all_reduce"),
    }
    assert (
        REGISTRY.get_sample_value("surge_collectives_total", {"module": "L3_GRADIENT_REDUCTION", "op": "all_reduce"})
        == 3
    )


def test_the_law_before_exceptions():
    assert allowed(Module.L3_GRADIENT_REDUCTION, "all_reduce") and allowed(
        Module.L3_GRADIENT_REDUCTION, "funcol.all_reduce"
    )
    assert not allowed(Module.L3_GRADIENT_REDUCTION, "new_group")  # seed L3-5 red line 4
    assert allowed(Module.L2_PARALLEL_STRATEGY, "init_process_group") and not allowed(
        Module.L2_PARALLEL_STRATEGY, "barrier"
    )
    assert not any(allowed(m, "all_reduce") for m in MODULES if m != Module.L3_GRADIENT_REDUCTION)


# ---------------------------------------------------------------------- run time, real training

# Each configuration and register entries its run must use (the crossings it pins).
REAL_RUNS = {
    "fsdp2": (
        {"dp": 2, "data_parallel": "fsdp2"},
        {"fsdp2-gathers-in-forward", "fsdp2-and-tp-collectives-in-backward", "composition-root-teardown"},
    ),
    # (TP is laid out on the meta device: its load scatters and broadcasts nothing.)
    "tp2": ({"tp": 2, "data_parallel": "fsdp2"}, {"tp-reductions-in-forward"}),
    "pp2": ({"pp": 2}, {"pipeline-p2p-in-backward"}),
}


@pytest.mark.timeout(180)
def test_real_training_crosses_only_registered_boundaries():
    ports = free_ports(len(REAL_RUNS))
    runs = json.dumps([[port, parallel] for port, (parallel, _) in zip(ports, REAL_RUNS.values())])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "engine")])}
    outs = run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
        [[str(HERE / "comm_rank_main.py"), str(r), runs] for r in (0, 1)],
        timeout=150,
        cwd=REPO / "tests" / "engine",
        env=env,
    )
    for out in outs:
        lines = [json.loads(line) for line in out.strip().splitlines() if line.startswith("[")]
        assert len(lines) == len(REAL_RUNS), out[-2000:]
        for (name, (_, expected)), crossings in zip(REAL_RUNS.items(), lines):
            assert [c for c in crossings if not c[4]] == [], name
            assert expected <= {c[4] for c in crossings}, (name, crossings)
            if name != "pp2":  # FSDP2 and TP lay out the meta model: no collective while loading it
                assert "shard-loader-handover-communication" not in {c[4] for c in crossings}, (name, crossings)
