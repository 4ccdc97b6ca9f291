"""Snapshots: immutable copies of a rank's training state, one slot per owner.

The state layer's unit of exchange (DESIGN.md "State"). An owner (L3-1 the model, L2-3 the
optimizer, L2-1 the loop's own progress) never hands out its live tensors: ``ExportState``
replies with a :class:`Slot`, a copy taken at that instant (every tensor copied to host
memory, a DTensor as a DTensor with its placements over a host copy of its shard, in
buffers reused from the slot's previous save once nothing refers to them any more:
services/state/staging.py; containers read-only: ``MappingProxyType`` and tuples),
stamped with the owner, the training step and the snapshot's version, and carrying
the SHA-256 digest of its content. A :class:`Snapshot` is the slots of one instant: every
slot from the same step and the same version, else it is refused (:class:`InconsistentSnapshot`).
Restoring is a command carrying a slot (``RestoreState``); the owner checks it (its key, its
owner, the step, version and digest the command names) and copies it into its own internals,
keeping nothing of the slot.

Nothing here is shared with an owner after the copy: what a reader does to a slot's tensors
cannot change the owner's state, and :meth:`Slot.verify` (run by every restore) finds a slot
whose content changed after it was taken.

Checkpoint layout: a snapshot is written as ``{slot key: {slot state..., "_slot": int64
[step]}}`` (:meth:`Snapshot.to_write`), so each slot's step travels with its tensors and a
load finds a checkpoint whose slots come from different steps (:meth:`Snapshot.loaded`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from services.contract import Module
from services.contract.failures import FailureCause, Refusal
from services.state.staging import staging_for

SLOT_META = "_slot"  # per slot in a written snapshot: int64 [step] (no state key starts with "_")
# A rank's slots and the module owning each (the loop snapshots them; the composition root
# registers them with the rank's state manager).
RANK_SLOTS: Mapping[str, int] = MappingProxyType(
    {"model": Module.L3_SHARD_LOADER, "optim": Module.L2_OPTIMIZER, "train": Module.L2_TRAINING_LOOP}
)


class SnapshotError(RuntimeError, Refusal):
    """A snapshot that cannot be restored as it is: refused (the module that refuses it did
    not fail; the bus hands the refusal to the commander as raised). The version it came
    from is unusable: graded like a corrupt checkpoint (the orchestrator picks an older one)."""

    fault_class = "checkpoint_integrity"
    failure_cause = FailureCause.FAILURE_DATA_CORRUPT


class InconsistentSnapshot(SnapshotError):
    """Slots from different steps or versions, a slot twice, a slot from the wrong owner,
    or a restore command that names another step, version or digest than its slot."""


class SlotDigestMismatch(SnapshotError):
    """A slot's content no longer matches the digest taken with it."""


class _FrozenList(tuple):
    """A list, frozen (thawed back into a list; a tuple stays a tuple)."""

    __slots__ = ()


def freeze(value: Any, *, clone: bool = True, slot: str | None = None) -> Any:
    """A read-only copy of a state dict: mappings as MappingProxyType, lists as tuples,
    tensors copied (``clone=False``: kept, for tensors that are already a private copy).
    Every copied tensor is in host memory (services/state/staging.py): a snapshot never
    doubles the device's memory (a restore copies it back); a DTensor stays a DTensor (same
    mesh and placements) over a host copy of its local shard. ``slot``: the slot the copy is
    for; its tensors are staged in buffers this process reuses from one save of that slot to
    the next (never one still referred to), else in fresh memory."""
    if not clone:
        return _frozen(value, lambda path, t: t.detach(), "")
    staging = staging_for(slot)
    frozen = _frozen(value, lambda path, t: staging.stage(slot or "", path, t), "")
    staging.wait()  # device -> host copies are asynchronous into pinned memory
    return frozen


def _frozen(value: Any, copy: Callable[[str, torch.Tensor], torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        return copy(path, value)
    if isinstance(value, Mapping):
        return MappingProxyType({k: _frozen(v, copy, f"{path}.{k}") for k, v in value.items()})
    if isinstance(value, list):
        return _FrozenList(_frozen(v, copy, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, tuple):
        return tuple(_frozen(v, copy, f"{path}[{i}]") for i, v in enumerate(value))
    return value  # plain data: int, float, str, bool, None


def thaw(value: Any, *, clone: bool = True) -> Any:
    """A mutable copy of what :func:`freeze` made (plain dicts and lists; tensors cloned
    unless ``clone=False``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if clone else value
    if isinstance(value, Mapping):
        return {k: thaw(v, clone=clone) for k, v in value.items()}
    if isinstance(value, _FrozenList):
        return [thaw(v, clone=clone) for v in value]
    if isinstance(value, tuple):
        return tuple(thaw(v, clone=clone) for v in value)
    return value


def digest_of(state: Any) -> str:
    """SHA-256 over a state dict, in sorted key order: one line per value, a tensor's (this
    rank's local shard of a DTensor) path, dtype, shape and the SHA-256 of its bytes, any
    other value's path and repr. The tensors' own digests are taken on a few threads
    (hashlib releases the GIL), so a large state hashes at the speed of the cores, not one."""
    lines: list[Any] = []
    _lines(lines, "", state)
    tensors = [i for i, line in enumerate(lines) if isinstance(line, tuple)]
    workers = min(_DIGEST_THREADS, len(tensors))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="digest") as pool:
            hashed = list(pool.map(lambda i: _tensor_line(*lines[i]), tensors))
    else:
        hashed = [_tensor_line(*lines[i]) for i in tensors]
    for i, line in zip(tensors, hashed):
        lines[i] = line
    return hashlib.sha256("".join(lines).encode()).hexdigest()


_DIGEST_THREADS = max(1, min(8, os.cpu_count() or 1))


def _lines(out: list[Any], path: str, value: Any) -> None:
    """Each value's line (a tensor's: a (path, tensor) pair, hashed later), in key order."""
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            _lines(out, f"{path}.{k}", value[k])
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _lines(out, f"{path}[{i}]", v)
    else:
        out.append(f"{path}={value!r}\n")


def _tensor_line(path: str, value: torch.Tensor) -> str:
    local = (value.to_local() if hasattr(value, "to_local") else value).detach()
    h = hashlib.sha256()
    if local.numel():
        h.update(local.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())  # (no copy on the CPU)
    return f"{path}:{local.dtype}:{tuple(local.shape)}:{h.hexdigest()}\n"


@dataclass(frozen=True, eq=False)
class Slot:
    """One owner's state at one step: a private, read-only copy (see the module doc)."""

    key: str  # "model" | "optim" | "train"
    owner: int  # the module whose state it is (route_pb2.Module)
    step: int
    version: str  # the snapshot it belongs to (a save's "<job>@<step>#<n>", a loaded version's name)
    state: Mapping[str, Any]  # read-only; tensors are this slot's own
    digest: str  # digest_of(state) when the copy was taken; "" when none was asked for

    @classmethod
    def copy_of(
        cls, key: str, owner: int, step: int, version: str, state: Mapping[str, Any], *, digest: bool = True
    ) -> Slot:
        """A slot holding a copy of ``state`` (the owner's live state dict, read once), with
        its digest taken now unless ``digest`` is False (a snapshot only written: its writer
        hashes what it writes; such a slot cannot be restored)."""
        frozen = freeze(state, slot=key)
        return cls(key, owner, step, version, frozen, digest_of(frozen) if digest else "")

    @classmethod
    def exported(cls, key: str, owner: int, msg: Any, state: Mapping[str, Any]) -> Slot:
        """An owner's reply to ``msg`` (an ExportState): a copy of ``state`` stamped with the
        step and version the message names, digested if it asks."""
        return cls.copy_of(key, owner, msg.step, msg.version, state, digest=msg.digest)

    def stamped(self, message: Any) -> Any:
        """``message`` (StateExported, StateRestored) with this slot's step, version and,
        where it has the field, digest; returned."""
        message.step, message.version = self.step, self.version
        if "digest" in message.DESCRIPTOR.fields_by_name:
            message.digest = self.digest
        return message

    def state_dict(self) -> dict[str, Any]:
        """A mutable copy of the state (tensors cloned): what a restore copies in."""
        return thaw(self.state)

    def verify(self) -> None:
        """Raises SlotDigestMismatch if the content is no longer what was copied (or no
        digest was taken: then nothing says what it was)."""
        if not self.digest:
            raise SlotDigestMismatch(
                f"snapshot {self.version}: slot {self.key!r} ({Module.Name(self.owner)}) has no digest to check"
            )
        if digest_of(self.state) != self.digest:
            raise SlotDigestMismatch(
                f"snapshot {self.version}: slot {self.key!r} ({Module.Name(self.owner)}, step {self.step}) "
                f"does not match its digest {self.digest[:12]}"
            )

    def check_restore(self, key: str, owner: int, step: int, version: str, digest: str) -> None:
        """What an owner checks before it copies a slot in (``RestoreState``'s fields; see
        :func:`restorable`).

        Raises:
            InconsistentSnapshot: another key or owner, or not the step, version or digest named.
            SlotDigestMismatch: the content does not match its digest.
        """
        if (self.key, self.owner) != (key, owner):
            raise InconsistentSnapshot(f"restore of {key!r} ({Module.Name(owner)}): got another module's slot")
        if (self.step, self.version) != (step, version) or (digest and digest != self.digest):
            raise InconsistentSnapshot(
                f"restore of {key!r}: the command names step {step} version {version!r}, the slot is "
                f"step {self.step} version {self.version!r}"
                + (f" with digest {self.digest[:12]} (named {digest[:12]})" if digest and digest != self.digest else "")
            )
        self.verify()


def restorable(payload: Any, key: str, owner: int, msg: Any) -> Slot:
    """``payload`` as the slot ``key`` of ``owner`` that ``msg`` (a RestoreState) names,
    checked (:meth:`Slot.check_restore`). Raises InconsistentSnapshot (not a slot, not this
    owner's, not the one named) or SlotDigestMismatch."""
    if not isinstance(payload, Slot):
        raise InconsistentSnapshot(
            f"restore of {key!r} ({Module.Name(owner)}): got {type(payload).__name__}, not a slot"
        )
    payload.check_restore(key, owner, msg.step, msg.version, msg.digest)
    return payload


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The slots of one instant (same step, same version), keyed by slot key."""

    step: int
    version: str
    slots: Mapping[str, Slot]

    @classmethod
    def of(cls, slots: Iterable[Slot]) -> Snapshot:
        """Raises InconsistentSnapshot: no slot, a key twice, or slots from different
        steps or versions (one line naming them)."""
        slots = list(slots)
        if not slots:
            raise InconsistentSnapshot("snapshot: no slot")
        strays = sorted({type(s).__name__ for s in slots if not isinstance(s, Slot)})
        if strays:
            raise InconsistentSnapshot(f"snapshot: not a slot: {', '.join(strays)}")
        keys = [s.key for s in slots]
        if len(set(keys)) != len(keys):
            raise InconsistentSnapshot(f"snapshot: a slot twice: {sorted(keys)}")
        first = slots[0]
        odd = [s for s in slots if (s.step, s.version) != (first.step, first.version)]
        if odd:
            parts = ", ".join(f"{s.key!r} step {s.step} version {s.version!r}" for s in slots)
            raise InconsistentSnapshot(f"snapshot: slots from different steps or versions: {parts}")
        return cls(first.step, first.version, MappingProxyType({s.key: s for s in slots}))

    def check(self, owners: Mapping[str, int] | None = None, *, verify: bool = True) -> None:
        """Every slot consistent with the snapshot, from its registered owner (``owners``:
        key -> module; a snapshot may hold a subset), and (``verify``) matching its digest
        where it has one (a pass over the state: a restore leaves that to each owner).

        Raises InconsistentSnapshot or SlotDigestMismatch."""
        for key, slot in self.slots.items():
            if (slot.key, slot.step, slot.version) != (key, self.step, self.version):
                raise InconsistentSnapshot(
                    f"snapshot {self.version} (step {self.step}): slot {key!r} is {slot.key!r} from step "
                    f"{slot.step} version {slot.version!r}"
                )
            if owners is not None and owners.get(key) != slot.owner:
                raise InconsistentSnapshot(
                    f"snapshot {self.version}: slot {key!r} is {Module.Name(slot.owner)}'s, not a registered slot"
                )
            if verify and slot.digest:
                slot.verify()

    def to_write(self) -> dict[str, Any]:
        """The nested dict a checkpoint writer saves: the slots' own tensors (not copied:
        they are private to this snapshot and the writer only reads them), each slot with
        its step under ``_slot``."""
        return {
            key: {**thaw(slot.state, clone=False), SLOT_META: torch.tensor([slot.step], dtype=torch.int64)}
            for key, slot in self.slots.items()
        }

    def blank(self, *, reuse: bool = False) -> dict[str, Any]:
        """A mutable dict to load a checkpoint into (same keys, shapes, dtypes and
        placements; a value the checkpoint holds is overwritten, one it lacks stays). Its
        tensors are copies, or with ``reuse`` this snapshot's own: for a template taken for
        this load alone, which its holder hands over and never uses again (one copy fewer)."""
        return {
            key: {**thaw(slot.state, clone=not reuse), SLOT_META: torch.tensor([-1], dtype=torch.int64)}
            for key, slot in self.slots.items()
        }

    @classmethod
    def loaded(cls, state: Mapping[str, Any], template: Snapshot, version: str) -> Snapshot:
        """The snapshot a checkpoint load filled in (``state``: :meth:`blank`'s dict, private
        to the caller: kept, not copied), its slots named ``version``, each at the step
        written with it.

        Raises InconsistentSnapshot: the checkpoint's slots were written at different steps."""
        slots = []
        for key, like in template.slots.items():
            part = dict(state[key])
            step = int(part.pop(SLOT_META).reshape(-1)[0])
            frozen = freeze(part, clone=False)
            slots.append(Slot(key, like.owner, step, version, frozen, digest_of(frozen)))
        return cls.of(slots)
