"""The rank's L5 checkpoint relay (``store_client.py``): the ranks' agreement on a save
(SaveAgreement, a part of StoreClient).

Every rank saves at the same step and agrees, on a gloo group of the relay's own, that every
previous save settled and that every rank got its staging directory (``_agree``), and on
this launch's generation of ranks (``_generation``: ``SaveCheckpoint.attempt``). The groups
are L2-2's side groups of the current world, or made at the first save; after the world was
rebuilt in place, the old world's save is dropped and the groups and generation made anew
(``_leave_old_world``).
"""

from __future__ import annotations

import concurrent.futures
import secrets
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from services.contract.failures import (
    cause_of,
    collective,
)
from services.rank.checkpoint_errors import (
    STORE_RPC_TIMEOUT_S,
    CheckpointError,
    _dropped,
    _one_line,
    _write_failed,
)

log = structlog.get_logger()

# The relay's own gloo groups: "agree" (the ranks' agreement on a save, main thread) and
# "write" (an asynchronous save's DCP collectives, on the writer thread).
RELAY_GROUPS = ("agree", "write")


class SaveAgreement:
    """StoreClient's part that makes the ranks agree on a save, on the relay's own groups
    (its state: StoreClient.__init__)."""

    def _agree(self, cause: int) -> int:
        """The largest failure cause over every rank (0: every rank is fine). Collective on
        the relay's own gloo group, from the main thread only."""
        if not dist.is_initialized():
            return cause
        group = self._relay_group("agree")  # collective the first time: the first save, every rank
        t = torch.tensor([int(cause)], dtype=torch.int64)
        with collective():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def _generation(self) -> str:
        """This launch's ``SaveCheckpoint.attempt``: two random 63-bit numbers every rank
        agrees on (the maximum of each rank's draws), drawn at the first save. Collective then (every rank
        saves at the same step), on the relay's own gloo group, from the main thread only.
        A relaunched rank is a new process: a new draw, so a new generation never shares a
        staging directory with an old one (a rendezvous port may be reused; this is not)."""
        if not self._attempt:
            draw = torch.tensor([secrets.randbits(63), secrets.randbits(63)], dtype=torch.int64)
            if dist.is_initialized():
                group = self._relay_group("agree")  # collective the first time, as in _agree
                with collective():
                    dist.all_reduce(draw, op=dist.ReduceOp.MAX, group=group)
            self._attempt = "".join(f"{int(v):016x}" for v in draw.tolist())
        return self._attempt

    def use_side_groups(self, side_group: Callable[[str], Any]) -> None:
        """Composition root: take the relay's groups ("agree", "write") from ``side_group``
        (L2-2's, made at every formation of the world) instead of making them at the first save."""
        self._side_group = side_group

    def _relay_group(self, use: str) -> Any:
        """The relay's own gloo group for ``use`` ("agree", "write"): L2-2's side group of the
        current world, else made on first use (``new_group`` is collective, so every rank asks
        at the same point, its first save)."""
        group = self._groups[use]() if use in self._groups else None
        if group is None:
            group = self._side_group(use) if self._side_group is not None else None
            if group is None:
                group = dist.new_group(backend="gloo")
            self._groups[use] = weakref.ref(group)
            self._world = weakref.ref(dist.group.WORLD)  # (the world they belong to: _leave_old_world)
        return group

    def _leave_old_world(self, job_id: str, rank: int | None) -> None:
        """After the default group was rebuilt in place (issue 16), before anything of a save:
        the old world's groups are gone and its generation of ranks with them. The write in
        flight (its collectives ran on the broken group) and rank 0's commit chained on it are
        waited for and dropped, never committed; the groups are made anew and the attempt
        drawn anew at the next save, by every rank of the new group at the same point (a
        replacement rank starts with neither). A save that failed or was abandoned so is
        reported once, by rank 0 (``rank``; None: not known here, as in a flush, whose
        caller ends the rank), typed by its own error where that says more than
        "communication": L1 records it as the consequence of the fault that broke the group."""
        if self._world is None or (dist.is_initialized() and self._world() is dist.group.WORLD):
            return
        self._world, self._groups, self._attempt = None, {}, ""
        self._chain = None
        dropped: CheckpointError | None = None
        for what, pending in (("write", self._write), ("commit", self._commit)):
            if pending is None:
                continue
            try:
                pending.result(timeout=STORE_RPC_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                # Still blocked in the old group: left to itself on a thread of its own; the
                # next save's write gets a new one (a single worker would queue it behind).
                log.warning("checkpoint_abandoned_with_old_group", what=what, step=self._write_step)
                self._writer.shutdown(wait=False)
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
                dropped = dropped or _dropped(CheckpointError(f"checkpoint {what} abandoned, blocked in the old group"))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - the old world's save: dropped
                log.warning("checkpoint_dropped_with_old_group", what=what, step=self._write_step, error=_one_line(e))
                dropped = dropped or _dropped(_write_failed(e, self._write_step), cause_of(e))
        self._write = self._commit = None
        self._skipped_step, self._failed_commit = None, None
        if dropped is not None and rank == 0:
            reason = f"the save of step {self._write_step} was dropped with the replaced group: {dropped}"
            self._report("save", 0, reason, step=self._write_step, job_id=job_id, rank=rank, error=dropped)
