"""L1-4 recovery controller: executes a recovery the orchestrator commanded, nothing more.

Seed 000 L1-4: it never listens for faults, never triggers a recovery, never chooses the
snapshot version; it executes ``StartRecovery`` for the version the orchestrator names
and reports ``RecoveryCompleted`` or ``RecoveryFailed`` with a typed cause.

A recovery is a sequence of steps, each a command and the event that answers it; nothing
in it blocks (no RPC, no disk): the orchestrator drives the sequence from the answers.

1. verification (the orchestrator's, before it names a version): ``VerifyCheckpoints`` to
   the checkpoint manager, answered asynchronously by ``CheckpointVerification`` or a typed
   ``SnapshotFailed`` (store unreachable, timeout). The store answers from the verdicts it
   recorded at commit (and by its scrub); nothing is re-hashed on this path, so the time
   from fault to first new step does not grow with the number of versions kept.
2. communicator (重建通信域指令, here): ``RebuildCommunicator`` to the resource allocator,
   which kills the job's ranks through their node agents (a rank stuck in a collective is
   killed, not waited on), takes a fresh rendezvous port and relaunches every rank with
   the version to load first (重置模块状态: each module starts from its initial state and
   restores from the snapshot). The allocator only queues commands to the node agents, so
   this step answers at once: ``ResourcesReady`` or ``ResourcesInsufficient``, the latter
   reported as ``RecoveryFailed`` with cause ``RECOVERY_NO_PLACEMENT`` (the orchestrator
   waits for capacity and commands the step again).
   With ``in_place`` (the policy's ``rebuild``, issue 16) the allocator kills only the lost
   ranks, launches their replacements (which heal from a live peer) and sends the survivors
   the fresh rendezvous (重建通信域 in place: their processes stay). A replacement that does
   not fit is reported as ``RECOVERY_NO_PLACEMENT``, and the orchestrator falls back to
   relaunching every rank (or, for ``shrink``, commands it again at a smaller ``layout``).
   With a ``layout`` (a resize: a shrink, `surgectl scale`, growing back) the group is
   rebuilt in place at that data-parallel size.
3. restore: each relaunched rank loads the version, checking every shard's digest as it
   reads it (a mismatch is the rank's typed ``checkpoint_integrity`` failure), and reports
   ready; the orchestrator sees that and keeps the step's deadline.

The step log (台账) of each job's last recovery is kept here for the operator's events.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from services.contract import control_pb2
from services.contract.bus import CommandPort

IDLE, RECOVERING, SUCCEEDED, FAILED = "idle", "recovering", "succeeded", "failed"
RecoveryFailureCause = control_pb2.RecoveryFailureCause


class RecoveryController:
    """Executes recoveries, one at a time per job.

    Args:
        resources: command port to L1-2 (RebuildCommunicator).
    """

    def __init__(self, resources: CommandPort):
        self._resources = resources
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}  # job_id -> recovery state enum
        self._version: dict[str, str] = {}  # job_id -> snapshot version used last
        self._steps: dict[str, list[str]] = {}  # job_id -> steps done in the last recovery (台账)

    def start_recovery(
        self, msg: control_pb2.StartRecovery, payload: Any = None
    ) -> control_pb2.RecoveryCompleted | control_pb2.RecoveryFailed:
        """启动故障恢复指令 / 指定快照回载恢复指令: rebuild the job's process group with its
        ranks relaunched to load ``checkpoint_version`` ("" = from scratch).

        Returns RecoveryFailed (never raises) with a typed cause: ``RECOVERY_IN_PROGRESS``
        (one of the job is being executed right now), ``RECOVERY_NO_PLACEMENT`` (the ranks
        do not fit: requested and available ranks say by how much)."""
        t0 = time.monotonic()
        with self._lock:
            if self._state.get(msg.job_id) == RECOVERING:
                return control_pb2.RecoveryFailed(
                    job_id=msg.job_id,
                    reason="a recovery is already in progress",
                    checkpoint_version=msg.checkpoint_version,
                    cause=RecoveryFailureCause.RECOVERY_IN_PROGRESS,
                    step="placement",
                )
            self._state[msg.job_id] = RECOVERING
            self._steps[msg.job_id] = []
        where = f"checkpoint {msg.checkpoint_version}" if msg.checkpoint_version else "fresh start"
        if msg.in_place:
            where = f"replacing rank(s) {', '.join(map(str, msg.lost_ranks))} in place" if msg.lost_ranks else ""
            if msg.HasField("layout"):
                where = (where + " " if where else "") + f"resizing in place to dp {msg.layout.dp}"
        rebuilt = self._resources(
            control_pb2.RebuildCommunicator(
                job_id=msg.job_id,
                reason=msg.reason,
                resume_version=msg.checkpoint_version,
                exclude_worker_ids=msg.exclude_worker_ids,
                in_place=msg.in_place,
                lost_ranks=msg.lost_ranks,
                layout=msg.layout if msg.HasField("layout") else None,
                withdrawn_orders=msg.withdrawn_orders,
            )
        ).message
        if not isinstance(rebuilt, control_pb2.ResourcesReady):
            short = rebuilt if isinstance(rebuilt, control_pb2.ResourcesInsufficient) else None
            with self._lock:
                self._state[msg.job_id] = FAILED
            return control_pb2.RecoveryFailed(
                job_id=msg.job_id,
                checkpoint_version=msg.checkpoint_version,
                step="placement",
                reason=f"placing the ranks ({where}): {short.reason if short else 'no reply'}",
                cause=RecoveryFailureCause.RECOVERY_NO_PLACEMENT,
                requested_ranks=short.requested_ranks if short else 0,
                available_ranks=short.available_ranks if short else 0,
            )
        with self._lock:
            self._steps[msg.job_id].append(
                f"group rebuilt in place on port {rebuilt.master_port}"
                if msg.in_place
                else f"ranks relaunched on port {rebuilt.master_port}"
            )
            self._state[msg.job_id] = SUCCEEDED
            self._version[msg.job_id] = msg.checkpoint_version
        return control_pb2.RecoveryCompleted(
            job_id=msg.job_id,
            checkpoint_version=msg.checkpoint_version,
            seconds=time.monotonic() - t0,
            master_addr=rebuilt.master_addr,
            master_port=rebuilt.master_port,
            worker_ids=rebuilt.worker_ids,
            in_place=msg.in_place,
            replaced_ranks=rebuilt.replaced_ranks,
            generation=rebuilt.generation,
            world_size=rebuilt.world_size,
            placed=rebuilt.placed if rebuilt.HasField("placed") else None,
            rank_worker_ids=rebuilt.rank_worker_ids,
            rank_generation=rebuilt.rank_generation,
        )
