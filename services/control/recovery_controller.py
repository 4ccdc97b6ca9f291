"""L1-4 recovery controller: executes a recovery the orchestrator commanded, nothing more.

Seed 000 L1-4: it never listens for faults, never triggers a recovery, never chooses the
snapshot version; it executes ``StartRecovery`` for the version the orchestrator names
and reports ``RecoveryCompleted`` or ``RecoveryFailed``.

A recovery, in order:

1. snapshot (加载指定快照指令): the named version is verified by the checkpoint manager
   (``LoadCheckpoint`` -> ``CheckpointLoaded``, over the store relay); "" is a fresh start
   and needs none. A version that does not verify is never loaded: RecoveryFailed with
   ``snapshot_unusable``, and the orchestrator may name an older one.
2. communicator (重建通信域指令): ``RebuildCommunicator`` to the resource allocator, which
   kills the job's ranks through their node agents (a rank stuck in a collective is
   killed, not waited on), takes a fresh rendezvous port and relaunches every rank with
   the version to load first (重置模块状态: each module starts from its initial state and
   restores from the snapshot). Each node agent starts a rank only once the killed process
   of that rank has been reaped.
3. RecoveryCompleted, with how long the two steps took; the job resumes when every
   relaunched rank has restored and reported ready (the orchestrator sees that).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from services.contract import control_pb2, store_pb2
from services.contract.bus import CommandPort

IDLE, RECOVERING, SUCCEEDED, FAILED = "idle", "recovering", "succeeded", "failed"


class RecoveryController:
    """Executes recoveries, one at a time per job.

    Args:
        checkpoints: command port to L5-1 (LoadCheckpoint), reached through the store relay.
        resources: command port to L1-2 (RebuildCommunicator).
    """

    def __init__(self, checkpoints: CommandPort, resources: CommandPort):
        self._checkpoints = checkpoints
        self._resources = resources
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}      # job_id -> recovery state enum
        self._version: dict[str, str] = {}    # job_id -> snapshot version used last
        self._steps: dict[str, list[str]] = {}  # job_id -> steps done in the last recovery (台账)

    def start_recovery(
        self, msg: control_pb2.StartRecovery, payload: Any = None
    ) -> control_pb2.RecoveryCompleted | control_pb2.RecoveryFailed:
        """启动故障恢复指令 / 指定快照回载恢复指令: verify the named version (if any), then
        rebuild the job's process group with its ranks relaunched to load it.

        Returns RecoveryFailed (never raises) when a recovery of the job is already in
        flight, the version cannot be verified (``snapshot_unusable``), or the ranks
        cannot be placed again; the reason names the version and why.
        """
        t0 = time.monotonic()
        with self._lock:
            if self._state.get(msg.job_id) == RECOVERING:
                return control_pb2.RecoveryFailed(job_id=msg.job_id, reason="a recovery is already in progress")
            self._state[msg.job_id] = RECOVERING
            self._steps[msg.job_id] = []
        where = f"checkpoint {msg.checkpoint_version}" if msg.checkpoint_version else "fresh start"
        try:
            if msg.checkpoint_version:
                reply = self._checkpoints(store_pb2.LoadCheckpoint(version=msg.checkpoint_version)).message
                if not isinstance(reply, store_pb2.CheckpointLoaded) or reply.info.version != msg.checkpoint_version:
                    raise RuntimeError(f"the checkpoint manager did not confirm {msg.checkpoint_version}")
                self._done(msg.job_id, "snapshot verified")
        except Exception as e:  # any failure of the step is reported, never acted on here
            return self._failed(msg, f"{where}: {e}", snapshot_unusable=True)
        try:
            rebuilt = self._resources(
                control_pb2.RebuildCommunicator(
                    job_id=msg.job_id,
                    reason=msg.reason,
                    resume_version=msg.checkpoint_version,
                    exclude_worker_ids=msg.exclude_worker_ids,
                )
            ).message
        except Exception as e:
            return self._failed(msg, f"relaunching the ranks ({where}): {e}", snapshot_unusable=False)
        if not isinstance(rebuilt, control_pb2.ResourcesReady):
            reason = rebuilt.reason if isinstance(rebuilt, control_pb2.ResourcesInsufficient) else "no reply"
            return self._failed(msg, f"relaunching the ranks ({where}): {reason}", snapshot_unusable=False)
        self._done(msg.job_id, f"ranks relaunched on port {rebuilt.master_port}")
        with self._lock:
            self._state[msg.job_id] = SUCCEEDED
            self._version[msg.job_id] = msg.checkpoint_version
        return control_pb2.RecoveryCompleted(
            job_id=msg.job_id,
            checkpoint_version=msg.checkpoint_version,
            seconds=time.monotonic() - t0,
            master_addr=rebuilt.master_addr,
            master_port=rebuilt.master_port,
            worker_ids=rebuilt.worker_ids,
        )

    # ------------------------------------------------------------ private

    def _done(self, job_id: str, step: str) -> None:
        with self._lock:
            self._steps[job_id].append(step)

    def _failed(self, msg: control_pb2.StartRecovery, reason: str, *, snapshot_unusable: bool) -> control_pb2.RecoveryFailed:
        with self._lock:
            self._state[msg.job_id] = FAILED
        return control_pb2.RecoveryFailed(
            job_id=msg.job_id, reason=reason, checkpoint_version=msg.checkpoint_version,
            snapshot_unusable=snapshot_unusable,
        )
