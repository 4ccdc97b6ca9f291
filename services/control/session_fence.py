"""Fencing at the node agent sessions (issue 29 item 4, services/common/fencing.py): what
the ``SessionHub`` does with a rank incarnation control has replaced.

Kept apart from the hub (its sessions, acks and relays) as one concern: which of a node's
ranks and events belong to the newest incarnation control launched, and the ReleaseRanks
that end the others. The hub owns the ``GenerationFence`` (it learns each rank's newest
generation from the LaunchRanks it queues) and its session lock; these functions take them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from services.common.fencing import FENCED_CALLS, GenerationFence, StaleGeneration
from services.contract import control_pb2, worker_pb2

_log = structlog.get_logger("control.server")


def without_replaced(fence: GenerationFence, reg: control_pb2.WorkerRegistration) -> list[control_pb2.ReleaseRanks]:
    """Take out of ``reg.running`` the ranks an agent still runs that were replaced while
    its session was away (a partition, a frozen agent whose stream broke): they are not
    re-attached, and the returned ReleaseRanks (kill, ``below_generation``) end them."""
    releases = []
    for launch in reg.running:
        keep = []
        for a in launch.ranks:
            newest = fence.newest(launch.job_id, a.rank)
            if a.generation and a.generation < newest:
                FENCED_CALLS.labels("control").inc()
                _log.warning("replaced rank not re-attached", worker_id=reg.worker_id, job_id=launch.job_id,
                             rank=a.rank, generation=a.generation, newest=newest)  # fmt: skip
                releases.append(control_pb2.ReleaseRanks(
                    job_id=launch.job_id, kill=True, ranks=[a.rank], below_generation=newest))  # fmt: skip
            else:
                keep.append(a)
        del launch.ranks[:]
        launch.ranks.extend(keep)
    live = [launch for launch in reg.running if launch.ranks]
    del reg.running[:]
    reg.running.extend(live)
    return releases


def admit_generation(
    fence: GenerationFence,
    session: Any,
    ev: worker_pb2.RankEvent,
    lock: threading.Lock,
    release: Callable[[control_pb2.ReleaseRanks, str], None],
) -> bool:
    """Whether a rank's event comes from the newest incarnation of its (job, rank) that
    control launched (``RankEvent.generation``, stamped by the agent). An older one's is
    dropped (its beats would keep the replacement's deadline alive, its failures open an
    incident of a rank already replaced) and its agent is told to end that process, once
    per (job, rank, generation) and session (``session.fenced``, under ``lock``):
    ``release`` of a ``ReleaseRanks`` with ``below_generation`` to the session's worker."""
    try:
        fence.admit(ev.job_id, ev.rank, ev.generation)
        return True
    except StaleGeneration as stale:
        FENCED_CALLS.labels("control").inc()
        key = (ev.job_id, ev.rank, ev.generation)
        with lock:
            first = key not in session.fenced
            session.fenced.add(key)
        if first:
            _log.warning("stale rank event dropped", worker_id=session.worker_id, error=str(stale))
            release(
                control_pb2.ReleaseRanks(job_id=ev.job_id, kill=True, ranks=[ev.rank], below_generation=stale.newest),
                session.worker_id,
            )
        return False
