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

Why the loop, not this manager, sends RestoreState: commands never point up a layer, and
this is L5-1's side of the rank; its reply payload is the copy the loop passes on.

Holds no reference to any module's state: a snapshot passes through it and is gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, Protocol

import structlog

from services.contract import Module, store_pb2
from services.contract.bus import Emitter, Reply
from services.contract.failures import failure_of
from services.state.snapshot import InconsistentSnapshot, Snapshot, SnapshotError

log = structlog.get_logger("state_manager")


class CheckpointStorage(Protocol):
    """The store relay's checkpoint side (services/worker/store_client.py): DCP-writes and
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
