"""L1-4 recovery controller: executes a recovery the orchestrator commanded, nothing more.

Seed 000 L1-4: it never listens for faults, never triggers a recovery, never chooses the
snapshot version; it executes ``StartRecovery`` for the version the orchestrator names
and reports ``RecoveryCompleted`` or ``RecoveryFailed``.

What it executes today: the snapshot step. A named version is verified by the checkpoint
manager (``LoadCheckpoint`` -> ``CheckpointLoaded``, over the store relay); "" means a
fresh start and needs no snapshot. Rebuilding the process group on fresh ports is done by
the orchestrator re-commanding the allocator with ``InitJob.resume_version`` set, because
the route table gives L1-4 no command to L1-2 or to the node agents (a proto change is
proposed in the control report). The orchestrator does not command recoveries yet: on a
severe fault it fails the job.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from services.contract import control_pb2, store_pb2
from services.contract.bus import CommandPort

IDLE, RECOVERING, SUCCEEDED, FAILED = "idle", "recovering", "succeeded", "failed"


class RecoveryController:
    """Executes recoveries one job at a time.

    Args:
        checkpoints: command port to L5-1 (LoadCheckpoint), reached through the store relay.
    """

    def __init__(self, checkpoints: CommandPort):
        self._checkpoints = checkpoints
        self._lock = threading.Lock()
        self._state: dict[str, str] = {}      # job_id -> recovery state enum
        self._version: dict[str, str] = {}    # job_id -> snapshot version used last

    def start_recovery(
        self, msg: control_pb2.StartRecovery, payload: Any = None
    ) -> control_pb2.RecoveryCompleted | control_pb2.RecoveryFailed:
        """启动故障恢复指令 / 指定快照回载恢复指令: verify the named version (if any).

        Returns RecoveryFailed (never raises) when a recovery of the job is already in
        flight, or the version cannot be loaded; the reason names the version and why.
        """
        t0 = time.monotonic()
        with self._lock:
            if self._state.get(msg.job_id) == RECOVERING:
                return control_pb2.RecoveryFailed(job_id=msg.job_id, reason="a recovery is already in progress")
            self._state[msg.job_id] = RECOVERING
        try:
            if msg.checkpoint_version:
                reply = self._checkpoints(store_pb2.LoadCheckpoint(version=msg.checkpoint_version)).message
                if not isinstance(reply, store_pb2.CheckpointLoaded) or reply.info.version != msg.checkpoint_version:
                    raise RuntimeError(f"the checkpoint manager did not confirm {msg.checkpoint_version}")
        except Exception as e:  # any failure of the step is reported, never acted on here
            with self._lock:
                self._state[msg.job_id] = FAILED
            where = f"checkpoint {msg.checkpoint_version}" if msg.checkpoint_version else "fresh start"
            return control_pb2.RecoveryFailed(job_id=msg.job_id, reason=f"{where}: {e}")
        with self._lock:
            self._state[msg.job_id] = SUCCEEDED
            self._version[msg.job_id] = msg.checkpoint_version
        return control_pb2.RecoveryCompleted(
            job_id=msg.job_id, checkpoint_version=msg.checkpoint_version, seconds=time.monotonic() - t0
        )
