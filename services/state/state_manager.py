"""The rank-local state manager: the rank side of L5-1 (the seed commentary's state layer).

One owner of a rank's training state at rest. The modules that hold live state register a
slot each (the composition root names them: ``model`` L3-1, ``optim`` L2-3, ``train``
L2-1); they hand out copies only (``ExportState`` -> an immutable
:class:`~services.state.snapshot.Slot`) and take copies only (``RestoreState``). This
manager receives, for the loop's checkpoint commands (it is subscribed as
L5_CHECKPOINT_MANAGER's rank side, in front of the store relay that writes and reads the
bytes):

    SaveCheckpoint (payload: a :class:`Snapshot` of this step) -> checks it (registered
        slots, from their owners, one step and version, any digest it has) -> the store relay
        writes it (``Snapshot.to_write``: the snapshot's own tensors, already a private copy).
    LoadCheckpoint (payload: a template Snapshot: a copy of the current state taken for this
        load, for keys, shapes, placements and the values a checkpoint may lack; handed over:
        its holder does not use it again) -> the store relay reads the version into the
        template's tensors (``Snapshot.blank(reuse=True)``: they are no module's) -> reply
        ``CheckpointLoaded`` with the loaded Snapshot as payload: every slot from the step
        written with it (a checkpoint whose slots were written at different steps is
        refused: InconsistentSnapshot, reported as SnapshotFailed{load, CORRUPT} so the
        orchestrator strikes the version), its digest taken. The loop then hands each owner
        its slot (RestoreState).

    HealState (payload: a template Snapshot, as a load's; every rank of a group rebuilt in
        place, right after ParallelReady: issue 16) -> the ranks all-gather (step, has_state)
        over the new group; the source is the lowest rank at the highest step that holds
        state (a replacement holds none); the source broadcasts its template's tensors (a
        manifest of paths, shapes and dtypes, then one flat buffer per dtype), the others
        receive them into their template's tensors (a path only the source has, such as its
        own rank's RNG streams in the loop's slot, is added; the receiver's own stay) ->
        reply ``StateHealed`` (source rank, step, bytes received, seconds, and the source's
        ``HealState.last_step``: its report of that step, sent with the manifest, so a rank
        one step behind reports the step it takes over) with the healed Snapshot as payload,
        each slot at the source's step. The source's payload is its own
        template: the loop restores nothing there. Communication outside L3-5, registered as
        ``heal-from-peer-broadcast`` (services/contract/exceptions.yaml).

Why the loop, not this manager, sends RestoreState: commands never point up a layer, and
this is L5-1's side of the rank; its reply payload is the copy the loop passes on.

Holds no reference to any module's state: a snapshot passes through it and is gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, Protocol

import structlog
import torch
import torch.distributed as dist

from services.contract import Module, engine_pb2, route_pb2, store_pb2
from services.contract.bus import Emitter, Reply
from services.contract.failures import collective, failure_of
from services.state.snapshot import SLOT_META, InconsistentSnapshot, Snapshot, SnapshotError

log = structlog.get_logger("state_manager")


class CheckpointStorage(Protocol):
    """The store relay's checkpoint side (services/rank/store_client.py): DCP-writes and
    -reads nested dicts of tensors."""

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: dict[str, Any]) -> Any: ...
    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: dict[str, Any]) -> Any: ...


class StateManager:
    """Rank side of L5-1. ``slots``: slot key -> the module that owns it (registered by the
    composition root); ``storage``: the relay that writes and reads checkpoint bytes;
    ``emit``: L5-1's events (SnapshotFailed for a refused snapshot)."""

    def __init__(self, emit: Emitter, storage: CheckpointStorage, slots: Mapping[str, int]):
        self._emit = emit
        self._storage = storage
        self._owners = dict(slots)

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload: Snapshot) -> Any:
        """Hand ``payload`` (this step's snapshot) to the store relay to write.

        Raises:
            InconsistentSnapshot, SlotDigestMismatch: not a snapshot of step ``msg.step`` made
                of registered slots from their owners, or a slot changed after it was taken.
        """
        snapshot = self._checked(payload, "save")
        if snapshot.step != msg.step:
            raise InconsistentSnapshot(f"save of step {msg.step}: the snapshot is of step {snapshot.step}")
        return self._storage.save_checkpoint(msg, snapshot.to_write())

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload: Snapshot) -> Reply:
        """Read version ``msg.version`` into copies shaped like ``payload`` (the template);
        reply CheckpointLoaded with the loaded Snapshot as payload.

        Raises:
            InconsistentSnapshot: the template is not one, or the checkpoint's slots were
                written at different steps (reported first: SnapshotFailed{load, CORRUPT}).
            CheckpointError: the store relay's (refused, unreadable, corrupt).
        """
        template = self._checked(payload, "load")
        into = template.blank(reuse=True)  # the template is the caller's copy for this load: read into
        loaded = self._storage.load_checkpoint(msg, into)
        info = loaded.info
        try:
            snapshot = Snapshot.loaded(into, template, info.version)
        except SnapshotError as e:
            self._refuse(InconsistentSnapshot(f"checkpoint {info.version}: {e}"), info.version)
        if snapshot.step != info.step:
            self._refuse(
                InconsistentSnapshot(
                    f"checkpoint {info.version}: its slots were written at step {snapshot.step}, the catalog says {info.step}"
                ),
                info.version,
            )
        log.info("snapshot_loaded", version=info.version, step=snapshot.step, slots=sorted(snapshot.slots))
        return Reply(loaded, snapshot)

    def heal_state(self, msg: engine_pb2.HealState, payload: Snapshot) -> Reply:
        """Agree on a source among the ranks of the (new) group and take its state
        (module docstring). Collective: every rank of the group calls it, after ParallelReady.

        Raises:
            NoStateToHeal: no rank holds state (every rank is a replacement).
            InconsistentSnapshot: the template is not one, or a tensor the source sent does not
                fit the one this rank holds at its path (raised after every transfer, so the
                ranks stay in step).
            CommunicationFailed: a peer was lost during the transfer (the group is broken again).
        """
        t0 = time.perf_counter()
        template = self._checked(payload, "heal")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = _wire_device()
        offer = torch.tensor([msg.step, int(msg.has_state)], dtype=torch.int64, device=device)
        offers = [torch.empty_like(offer) for _ in range(world)]
        with collective():
            dist.all_gather(offers, offer)
        held = [(int(t[0]), r) for r, t in enumerate(offers) if int(t[1])]
        if not held:
            raise NoStateToHeal(f"heal of job {msg.job_id}: none of the {world} ranks holds state")
        step = max(s for s, _ in held)
        source = min(r for s, r in held if s == step)
        into = template.blank(reuse=True)  # the template is the caller's copy for this heal
        if rank == source:
            for slot in into.values():
                slot[SLOT_META].fill_(step)
        report = msg.last_step.SerializeToString() if rank == source and msg.last_step.step == step else b""
        received, report = _broadcast_tensors(into, source, device, report)
        snapshot = Snapshot.loaded(into, template, f"{msg.job_id}@{step}:healed-from-rank{source}")
        seconds = time.perf_counter() - t0
        log.info("state_healed", step=step, source=source, received_bytes=received, seconds=round(seconds, 4))
        healed = engine_pb2.StateHealed(source_rank=source, step=step, bytes=received, seconds=seconds)
        if report:
            healed.last_step.ParseFromString(report)
        return Reply(healed, snapshot)

    def _checked(self, payload: Any, what: str) -> Snapshot:
        if not isinstance(payload, Snapshot):
            raise InconsistentSnapshot(f"{what}: expected a Snapshot, got {type(payload).__name__}")
        payload.check(self._owners)
        return payload

    def _refuse(self, error: SnapshotError, version: str) -> NoReturn:
        """SnapshotFailed{load, CORRUPT} up to L1 for ``error``, then ``error`` raised (the bus
        does not publish another)."""
        failed = store_pb2.SnapshotFailed(
            job_id=version.rpartition(":")[0],
            version=version,
            operation="load",
            reason=" ".join(str(error).split())[:400],
            cause=store_pb2.CORRUPT,
        )
        failed.failure.CopyFrom(failure_of(error, Module.L5_CHECKPOINT_MANAGER, "surge.v1.LoadCheckpoint"))
        failed.failure.job_id = failed.failure.job_id or failed.job_id
        self._emit(failed)
        error.failure_reported = True
        raise error from None


class NoStateToHeal(RuntimeError):
    """A heal found no rank holding state (every rank of the group is a replacement)."""

    failure_cause = route_pb2.FAILURE_UNAVAILABLE


def _wire_device() -> torch.device:
    """Where the heal's tensors travel: host memory under gloo, the current CUDA device
    under NCCL (which moves device memory only)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensors(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every tensor in a nested state dict, in sorted key order."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key in sorted(tree, key=str):
            yield from _tensors(tree[key], (*path, key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, (*path, i))


def _place(tree: dict[str, Any], path: tuple, tensor: torch.Tensor) -> None:
    """Put ``tensor`` at ``path`` (a path the receiver lacks; its parents are mappings)."""
    node: Any = tree
    for key in path[:-1]:
        if not isinstance(node, dict):
            raise InconsistentSnapshot(f"heal: cannot add {'.'.join(map(str, path))} (not a mapping on the way)")
        node = node.setdefault(key, {})
    node[path[-1]] = tensor


def _broadcast_tensors(into: dict[str, Any], source: int, device: torch.device, report: bytes) -> tuple[int, bytes]:
    """Every tensor of the source's ``into`` into the others' (module docstring): the
    source's manifest (with ``report``, its serialized step report, in the same message),
    then one flat buffer per dtype. Returns the bytes this rank received (0 on the source)
    and the source's report. Every rank runs the same collectives, whatever it finds."""
    mine = dict(_tensors(into))
    is_source = dist.get_rank() == source
    manifest = [([(p, tuple(t.shape), t.dtype) for p, t in mine.items()], report) if is_source else None]
    with collective():
        dist.broadcast_object_list(manifest, src=source)
    entries_sent, report = manifest[0]
    by_dtype: dict[torch.dtype, list[tuple[tuple, tuple]]] = {}
    for path, shape, dtype in entries_sent:
        by_dtype.setdefault(dtype, []).append((path, shape))
    received, misfits = 0, []
    for dtype, entries in by_dtype.items():
        wire = torch.uint8 if dtype == torch.bool else dtype  # (gloo has no bool reduction type)
        if is_source:
            flat = torch.cat([mine[p].detach().reshape(-1).to(wire) for p, _ in entries]).to(device)
        else:
            flat = torch.empty(sum(_numel(s) for _, s in entries), dtype=wire, device=device)
        with collective():
            dist.broadcast(flat, src=source)
        if is_source:
            continue
        received += flat.numel() * flat.element_size()
        flat, offset = flat.cpu(), 0
        for path, shape in entries:
            n = _numel(shape)
            value = flat[offset : offset + n].view(shape).to(dtype)
            offset += n
            held = mine.get(path)
            if held is None:
                _place(into, path, value.clone())
            elif held.shape != value.shape or held.dtype != dtype:
                misfits.append(
                    f"{'.'.join(map(str, path))}: {tuple(held.shape)} {held.dtype} here, {shape} {dtype} sent"
                )
            else:
                held.copy_(value)
    if misfits:
        raise InconsistentSnapshot(
            f"heal from rank {source}: {len(misfits)} tensors do not fit: {'; '.join(misfits[:3])}"
        )
    return received, report


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
