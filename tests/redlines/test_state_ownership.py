"""Red line of the state layer (issue 14): no module can obtain a writable reference to
another module's state, and a restore takes only a consistent snapshot.

The rank is built by the real composition root (``services.rank.__main__.compose``) with its
real store relay (``StoreClient``) talking to a real store service (in this process, on
loopback); the model is loaded, the optimizer's moments exist, and a checkpoint has been
saved and loaded back through the rank's state manager and restored into the owners. Then
every object reachable from each module and relay is walked, and the storage of every
tensor found is compared with the owners' state:

* L3-1's weights (and buffers): held only by L3-1 and the declared compute group, the
  units that run, differentiate, reduce, scale or update those very parameters (L3-3,
  L3-4, L3-5, L2-4, L2-3; services/contract/red_lines.yaml, the state layer's entry);
* L2-3's moments: held only by L2-3;
* L2-1's state (its progress objects): held only by L2-1.

Another seed module met on the way is not entered (holding one is refused by
test_private_state.py, the write-only model handover being its one exception), nor is a
port or an emitter (every send through one is route-checked).
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.contract import Module, engine_pb2, store_pb2
from services.contract.bus import CommandPort, Emitter
from services.jobspec import spec_to_json
from services.state.snapshot import InconsistentSnapshot, SlotDigestMismatch, Snapshot
from services.state.state_manager import StateManager

from .wiring import MODULE_OF_CLASS, Built, RecordingBus, rank_spec

pytestmark = pytest.mark.timeout(120)
L = Module.L2_TRAINING_LOOP
# Modules that work on L3-1's parameters themselves, by design (DESIGN.md: parallelism and
# the update are applied to the one set of parameter tensors; no copies on the hot path).
COMPUTE_GROUP = {
    Module.L3_SHARD_LOADER,
    Module.L3_FORWARD_UNIT,
    Module.L3_BACKWARD_UNIT,
    Module.L3_GRADIENT_REDUCTION,
    Module.L2_MIXED_PRECISION,
    Module.L2_OPTIMIZER,
}


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class _Relay:
    """Stands in for the L4 data relay (never called here) and the L1 session: what goes up
    is kept in ``up``."""

    def __init__(self) -> None:
        self.up: list[Any] = []

    def send_up(self, routed: Any, msg: Any, payload: Any = None) -> None:
        self.up.append(msg)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@contextmanager
def store_service(root: Path) -> Iterator[str]:
    """The real store (L5-1, L5-2 and their gRPC relay, as services/store/__main__.py wires
    them) serving on a loopback port in this process; yields its address."""
    from services.common.grpc_server import AioServiceServer
    from services.contract import store_pb2_grpc
    from services.store.__main__ import wire

    relay, metrics, _ = wire(root, _Log(), registry=CollectorRegistry())
    server = AioServiceServer("store", "127.0.0.1", 0)
    store_pb2_grpc.add_StoreServiceServicer_to_server(relay, server.server)
    server.start(["surge.v1.StoreService"])
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(grace=0.5)
        metrics.close()


class RankWithStore:
    """The rank as compose builds it, with a real StoreClient, the model loaded."""

    def __init__(self, address: str):
        from services.rank.__main__ import compose
        from services.rank.store_client import StoreClient

        self.bus = RecordingBus()
        self.store = StoreClient(address, self.bus.emitter(Module.L5_CHECKPOINT_MANAGER))
        self.relay = relay = _Relay()
        self.rank = compose(self.bus, rank_spec(), "cpu", data=relay, store=self.store, metrics=relay, up=relay)
        self.built = Built("services.rank.__main__.compose", [self.bus])
        self.manager = next(
            h.__self__ for _, _, h in self.bus.subscriptions if isinstance(getattr(h, "__self__", None), StateManager)
        )
        plan = engine_pb2.ParallelPlan(rank=0, world_size=1, dp=1, data_parallel="none", device="cpu")
        self.bus.command(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER, plan)
        self.bus.command(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION, plan)
        spec = rank_spec()
        self.send(Module.L3_SHARD_LOADER, engine_pb2.LoadModel(model_json=spec.model.model_dump_json(), seed=0))
        # The loop's set-up as its run() does it: the job from L1-1, the group from L2-2.
        self.rank.orchestrator(engine_pb2.InitJob(job_id="own", spec_json=spec_to_json(spec)))
        self.bus.publish(Module.L2_PARALLEL_STRATEGY, engine_pb2.ParallelReady(rank=0, world_size=1, dp_size=1))
        self.module(L)._await_setup()
        model = self.module(Module.L3_SHARD_LOADER)._model
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        self.send(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate(step=1, learning_rate=0.1))  # moments exist

    def module(self, module: int) -> Any:
        return self.built.modules[module]

    def send(self, receiver: int, msg: Any, payload: Any = None) -> Any:
        return self.bus.command(L, receiver, msg, payload)

    def save(self, step: int) -> store_pb2.SaveCompleted:
        """The loop's save: its snapshot to L5-1, the commit, the flush (as _save / _finish)."""
        loop = self.module(L)
        self.send(Module.L5_CHECKPOINT_MANAGER, store_pb2.SaveCheckpoint(job_id="own", step=step, write_async=True),
                  loop._snapshot(step))  # fmt: skip
        self.send(Module.L5_CHECKPOINT_MANAGER, store_pb2.CommitCheckpoint(job_id="own", step=step, world_size=1))
        self.send(Module.L5_CHECKPOINT_MANAGER, store_pb2.FlushCheckpoint(job_id="own"))
        (done,) = [e for e in self.relay.up if isinstance(e, store_pb2.SaveCompleted) and e.step == step]
        return done

    def load(self, version: str) -> Snapshot:
        loop = self.module(L)
        return self.send(
            Module.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint(version=version), loop._snapshot(0)
        ).payload

    def close(self) -> None:
        self.store.close(timeout=0.5)


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    with store_service(tmp_path_factory.mktemp("store")) as address:
        r = RankWithStore(address)
        try:
            r.save(1)
            r.module(L)._restore(r.load("own:latest"))
            yield r
        finally:
            r.close()


# ---------------------------------------------------------------------- the walker


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


def held(root: Any) -> tuple[set[int], set[int]]:
    """(tensor storages, object ids) reachable from ``root``'s attributes: through
    containers, any object's ``__dict__`` / slots (library objects too: modules, optimizers,
    futures, threads), closures, bound methods; not into ports, emitters or other seed
    modules, nor into python modules, classes or a function's globals."""
    storages: set[int] = set()
    ids: set[int] = set()
    seen: set[int] = {id(root)}
    stack = list(vars(root).values())
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type, types.ModuleType)):
            continue
        seen.add(id(obj))
        ids.add(id(obj))
        if isinstance(obj, (CommandPort, Emitter)) or type(obj) in MODULE_OF_CLASS:
            continue
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storages.add(_storage(obj))
            continue
        if isinstance(obj, Mapping) or type(obj).__name__ == "mappingproxy":
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.extend((obj.__self__, obj.__func__))
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            stack.extend(obj.__defaults__ or ())
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if isinstance(name, str) and hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return storages, ids


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def owned(r: RankWithStore) -> dict[str, tuple[int, set[int], set[int]]]:
    """What each owner holds: name -> (owner, storages, object ids), and who else may hold it."""
    model = r.module(Module.L3_SHARD_LOADER)._model
    weights = {_storage(t) for t in [*model.parameters(), *model.buffers()]}
    optim = r.module(Module.L2_OPTIMIZER)._optim
    moments = {_storage(v) for per in optim.state.values() for v in per.values() if isinstance(v, torch.Tensor)}
    loop = r.module(L)
    progress = {id(loop._position), id(loop._scaler_state)}
    return {
        "L3-1 weights": (Module.L3_SHARD_LOADER, weights, set()),
        "L2-3 moments": (Module.L2_OPTIMIZER, moments, set()),
        "L2-1 state": (L, set(), progress),
    }


def test_no_module_or_relay_can_reach_another_modules_state(rank):
    state = owned(rank)
    assert all(storages or ids for _, storages, ids in state.values())
    holders: dict[str, Any] = {Module.Name(m): inst for m, inst in rank.built.modules.items()}
    holders |= {
        "state manager (L5-1 rank side)": rank.manager,
        "store relay (StoreClient)": rank.store,
        "session link (compose's L1 stand-in)": rank.rank.link,
    }
    allowed = {
        "L3-1 weights": {Module.Name(m) for m in COMPUTE_GROUP},
        "L2-3 moments": {Module.Name(Module.L2_OPTIMIZER)},
        "L2-1 state": {Module.Name(L)},
    }
    found = {}
    for who, obj in holders.items():
        storages, ids = held(obj)
        for name, (_, mine_s, mine_i) in state.items():
            if (storages & mine_s or ids & mine_i) and who not in allowed[name]:
                found.setdefault(name, []).append(who)
    assert found == {}
    # The walker sees them where they are (so the check above can fail).
    assert state["L3-1 weights"][1] <= held(rank.module(Module.L3_FORWARD_UNIT))[0]
    assert state["L2-3 moments"][1] <= held(rank.module(Module.L2_OPTIMIZER))[0]
    assert state["L2-1 state"][2] <= held(rank.module(L))[1]


def test_the_walker_finds_a_live_handle_the_old_way_of_exporting_state(rank):
    # What ExportState used to hand out (a Stateful view: get_model_state_dict of the live
    # model), held by a relay, is found.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    class Relay:
        def __init__(self, handle):
            self._payload = {"model": handle}

    weights = owned(rank)["L3-1 weights"][1]
    assert held(Relay(get_model_state_dict(rank.module(Module.L3_SHARD_LOADER)._model)))[0] & weights
    exported = rank.send(Module.L3_SHARD_LOADER, engine_pb2.ExportState(step=1, version="v")).payload
    assert not held(Relay(exported))[0] & weights


def test_an_exported_state_is_a_read_only_copy_whose_changes_reach_no_owner(rank):
    model = rank.module(Module.L3_SHARD_LOADER)._model
    optim = rank.module(Module.L2_OPTIMIZER)._optim
    before_w = {k: v.clone() for k, v in model.state_dict().items()}
    before_m = [v.clone() for per in optim.state.values() for v in per.values()]
    for receiver in (Module.L3_SHARD_LOADER, Module.L2_OPTIMIZER):
        reply = rank.send(receiver, engine_pb2.ExportState(step=1, version="v", digest=True))
        slot = reply.payload
        assert (reply.message.digest, reply.message.step, reply.message.version) == (slot.digest, 1, "v")
        with pytest.raises(TypeError):
            slot.state["extra"] = 1  # read-only mapping
        tensors = _tensors(slot.state)
        assert tensors
        for t in tensors:
            t.add_(1) if t.is_floating_point() else t.fill_(7)  # the copy's tensors are the copy's
        with pytest.raises(SlotDigestMismatch):
            slot.verify()
    assert all(torch.equal(v, before_w[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip([v for per in optim.state.values() for v in per.values()], before_m))


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, Mapping):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def test_a_restore_refuses_a_changed_slot_and_a_slot_of_another_step_and_changes_nothing(rank):
    port = rank.bus.port(L, Module.L3_SHARD_LOADER)
    model = rank.module(Module.L3_SHARD_LOADER)._model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    undigested = port(engine_pb2.ExportState(step=3, version="own@3")).payload  # a save's: nothing to check it by
    with pytest.raises(SlotDigestMismatch, match="has no digest to check"):
        port(engine_pb2.RestoreState(step=3, version="own@3"), undigested)
    slot = port(engine_pb2.ExportState(step=3, version="own@3", digest=True)).payload
    with pytest.raises(InconsistentSnapshot, match=r"^restore of 'model': the command names step 4"):
        port(engine_pb2.RestoreState(step=4, version="own@3", digest=slot.digest), slot)
    next(iter(_tensors(slot.state))).add_(1)
    with pytest.raises(SlotDigestMismatch, match="does not match its digest"):
        port(engine_pb2.RestoreState(step=3, version="own@3", digest=slot.digest), slot)
    optim_slot = rank.send(Module.L2_OPTIMIZER, engine_pb2.ExportState(step=3, version="own@3", digest=True)).payload
    with pytest.raises(InconsistentSnapshot, match="got another module's slot"):
        port(engine_pb2.RestoreState(step=3, version="own@3", digest=optim_slot.digest), optim_slot)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_snapshot_of_slots_from_different_steps_or_versions_is_refused(rank):
    loop = rank.module(L)
    a, b = loop._snapshot(5), loop._snapshot(6)
    with pytest.raises(InconsistentSnapshot) as e:
        Snapshot.of([a.slots["model"], b.slots["optim"], a.slots["train"]])
    assert "\n" not in str(e.value) and "'optim' step 6" in str(e.value)
    same_step = loop._snapshot(5)  # another version of step 5
    with pytest.raises(InconsistentSnapshot, match="different steps or versions"):
        Snapshot.of([a.slots["model"], same_step.slots["optim"], a.slots["train"]])
    mixed = Snapshot(5, a.version, types.MappingProxyType({"model": a.slots["model"], "optim": b.slots["optim"]}))
    with pytest.raises(InconsistentSnapshot):
        loop._restore(mixed)  # refused before anything is restored


def test_a_checkpoint_whose_slots_were_written_at_different_steps_is_refused_and_reported(rank):
    from services.contract.failures import FailureCause, cause_of

    loop = rank.module(L)
    a, b = loop._snapshot(7), loop._snapshot(8)
    # A writer that mixed two instants (built without Snapshot.of's check, as a broken one would).
    mixed = Snapshot(7, a.version, types.MappingProxyType({**a.slots, "optim": b.slots["optim"]}))
    rank.store.save_checkpoint(store_pb2.SaveCheckpoint(job_id="mix", step=7), mixed.to_write())
    rank.store.commit_checkpoint(store_pb2.CommitCheckpoint(job_id="mix", step=7, world_size=1))
    with pytest.raises(InconsistentSnapshot, match=r"^checkpoint mix:1: snapshot: slots from different steps") as e:
        rank.load("mix:latest")
    assert "\n" not in str(e.value) and cause_of(e.value) == FailureCause.FAILURE_DATA_CORRUPT
    (failed,) = [f for f in rank.relay.up if isinstance(f, store_pb2.SnapshotFailed) and f.version.startswith("mix:")]
    assert (failed.operation, failed.cause, failed.failure.cause) == (
        "load",
        store_pb2.CORRUPT,
        FailureCause.FAILURE_DATA_CORRUPT,
    )
