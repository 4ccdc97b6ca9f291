"""L2-2 parallel strategy: turns the rank assignment into a frozen plan and a process group.

Receives: ``RankAssignment`` (from L1's resource allocator, through the rank's session
relay), pushed once. On it: initialise the torch.distributed default process group
(gloo on CPU, nccl on CUDA; rendezvous at ``tcp://master_addr:master_port``), freeze the
plan, command ``ParallelPlan`` to the shard loader and the gradient-reduction unit (the
process-group handle travels as the payload) and publish ``ParallelReady`` to the loop.

For now the plan is data-parallel only: every rank holds the whole model, the batch is
split across ranks, gradients are all-reduced by DDP (``data_parallel="ddp"``; ``"none"``
for a single rank, where DDP would only add a copy).

Red lines kept (seed L2-2): the plan is fixed at initialisation and never adapted; this
module performs no tensor communication (DDP's all-reduce belongs to L3-5) and never
touches the step schedule.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.contract import engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.contract.frozen import FrozenConfig

DEFAULT_TIMEOUT_S = 300.0


class ParallelStrategy:
    """L2-2. ``shard_loader`` and ``reduction`` are its ports to L3-1 and L3-5."""

    def __init__(
        self,
        emit: Emitter,
        shard_loader: CommandPort,
        reduction: CommandPort,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if timeout_s <= 0:
            raise ValueError(f"parallel strategy: timeout_s must be > 0, got {timeout_s}")
        self._emit = emit
        self._shard_loader = shard_loader
        self._reduction = reduction
        self._timeout = timedelta(seconds=timeout_s)
        # Seed L2-2: the plan is fixed at initialisation (red line 1). The seed's 重建并行通信域
        # 指令 (RebuildParallelGroup) rebuilds the group on the same plan; nothing changes it.
        self._assignment = FrozenConfig[engine_pb2.RankAssignment]("L2_PARALLEL_STRATEGY", "rank assignment")
        self._plan: engine_pb2.ParallelPlan | None = None
        self._owns_group = False
        self._state = "uninitialised"  # uninitialised | ready | comm_error

    def assign(self, msg: engine_pb2.RankAssignment, payload: Any = None) -> None:
        """分配 rank 拓扑与通信权限指令: build the group (blocks until every rank joined or
        the timeout passes), push the plan down, report ready.

        Raises:
            ValueError: an assignment that cannot work (rank >= world size, nccl without
                CUDA, unknown backend); the message names the field.
            ConfigFrozen: a second assignment (the plan is frozen).
            RuntimeError: the rendezvous failed.
        """
        self._assignment.require_unset()
        _validate(msg)
        self._assignment.set(msg)
        t0 = time.perf_counter()
        if msg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(msg.device))
        if not dist.is_initialized():
            try:
                dist.init_process_group(
                    backend=msg.backend,
                    init_method=f"tcp://{msg.master_addr}:{msg.master_port}",
                    rank=msg.rank,
                    world_size=msg.world_size,
                    timeout=self._timeout,
                )
            except Exception:
                self._state = "comm_error"
                raise
            self._owns_group = True
        group = dist.group.WORLD
        self._plan = engine_pb2.ParallelPlan(
            rank=msg.rank,
            world_size=msg.world_size,
            dp=msg.world_size,
            data_parallel="ddp" if msg.world_size > 1 else "none",
            device=msg.device,
        )
        self._shard_loader(self._plan, group)
        self._reduction(self._plan, group)
        self._state = "ready"
        self._emit(
            engine_pb2.ParallelReady(
                rank=msg.rank,
                world_size=msg.world_size,
                dp_rank=msg.rank,
                dp_size=msg.world_size,
                init_seconds=time.perf_counter() - t0,
            )
        )

    def shutdown(self) -> None:
        """Composition root, at process end: destroy the group this module created."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _validate(msg: engine_pb2.RankAssignment) -> None:
    if msg.world_size < 1 or msg.rank >= msg.world_size:
        raise ValueError(f"rank assignment: rank {msg.rank} is not in world_size {msg.world_size}")
    if msg.backend not in ("gloo", "nccl"):
        raise ValueError(f"rank assignment: backend must be 'gloo' or 'nccl', got {msg.backend!r}")
    if msg.backend == "nccl" and not msg.device.startswith("cuda"):
        raise ValueError(f"rank assignment: backend nccl needs a CUDA device, got device {msg.device!r}")
    if msg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"rank assignment: device {msg.device!r} but CUDA is not available in this process")
    if not msg.master_addr or not msg.master_port:
        raise ValueError("rank assignment: master_addr and master_port are required")
