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
from services.contract.relay import stamp_origin
from services.contract.route_table import default_table

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


def replaced_failure(ev: worker_pb2.RankEvent, worker_id: str) -> Callable[[Any], None] | None:
    """For a routed failure event (its route flagged ``failure``) of a replaced incarnation,
    dropped by ``admit_generation``: the stamp that passes it on marked (``Failure.replaced``,
    its generation), so that the job's record keeps what the old incarnation said (L1-3
    grades it replaced, L1-1 records it stale: no incident). None for any other event (beats,
    steps, a rank's other events stay dropped)."""
    if ev.WhichOneof("event") != "routed":
        return None
    route = default_table().route(ev.routed.type)
    if route is None or not route.failure:
        return None

    def mark(msg: Any) -> None:
        stamp_origin(msg, job_id=ev.job_id, rank=ev.rank, worker_id=worker_id)
        msg.failure.generation, msg.failure.replaced = ev.generation, True

    return mark


def admitted_stamp(ev: worker_pb2.RankEvent, worker_id: str) -> Callable[[Any], None]:
    """The stamp of an admitted rank event's routed message: where it comes from, and on a
    failure event the incarnation that failed (``Failure.generation``, the agent's
    ``RankEvent.generation``; never ``replaced``: the fence admitted it). L1-3 holds a broken
    collective for its attribution window; by the time L1-1 triages it a restart may have
    placed the rank's relaunch, and its generation then says the report is the failed
    generation's (triage ``_replaced``; test_recovery's SIGKILL case: a survivor's comm_error,
    admitted as the relaunch was commanded, was decided as a second fault; order43 found the
    same with the survivor's replaced exit published first). Only a failure part the event
    carries is stamped: none is made where the event has none."""

    def stamp(msg: Any) -> None:
        stamp_origin(msg, job_id=ev.job_id, rank=ev.rank, worker_id=worker_id)
        field = msg.DESCRIPTOR.fields_by_name.get("failure")
        if ev.generation and field is not None and field.message_type is not None and msg.HasField("failure"):
            msg.failure.generation = msg.failure.generation or ev.generation

    return stamp


def replaced(fence: GenerationFence, job_id: str, rank: int, generation: int) -> bool:
    """Whether ``generation`` of (job, rank) is older than the newest control launched (0:
    unknown, never replaced): the fact the relay states on an exit (``RankExited.replaced``),
    never a reason to drop it (L1-3 grades it, L1-1 decides)."""
    return 0 < generation < fence.newest(job_id, rank)


def reattached(fence: GenerationFence, reg: control_pb2.WorkerRegistration) -> dict[tuple[str, int], int]:
    """The generation of each rank ``reg`` re-attaches (after ``without_replaced``), told to the
    fence: after a control restart it knows only launches made since, so a replaced
    incarnation's exit that comes up later is told from the one that runs."""
    generations = {}
    for launch in reg.running:
        for a in launch.ranks:
            fence.tell(launch.job_id, a.rank, a.generation)
            generations[(launch.job_id, a.rank)] = a.generation
    return generations


def lost_exits(
    fence: GenerationFence,
    worker_id: str,
    ranks: list[tuple[str, int]],
    reason: str,
    generations: dict[tuple[str, int], int],
) -> list[control_pb2.RankExited]:
    """The ``worker_lost`` exits of ``ranks``, lost with ``worker_id``'s session: each with the
    launch that ran there (``generations``, the session's; else the newest), read before any is
    reported (the first relaunches the job at once: a newer generation), so a node lost with all
    its ranks of one launch counts once against it (sick_nodes.py), and a rank replaced
    elsewhere before the session ended (its agent frozen, then gone) is stated ``replaced``."""
    launched = [(job_id, rank, generations.get((job_id, rank)) or fence.newest(job_id, rank)) for job_id, rank in ranks]
    return [
        control_pb2.RankExited(
            job_id=job_id,
            rank=rank,
            worker_id=worker_id,
            detail=reason,
            worker_lost=True,
            generation=gen,
            replaced=replaced(fence, job_id, rank, gen),
        )
        for job_id, rank, gen in launched
    ]
