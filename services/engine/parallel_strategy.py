"""L2-2 parallel strategy: turns the rank assignment into a frozen plan and a device mesh.

Receives: ``RankAssignment`` (from L1's resource allocator, through the rank's session
relay), pushed once. On it: compute the plan with the pure planner
(:func:`services.engine.sharding_plan.plan`: mesh, coordinates, groups, stages, TP styles),
initialise the torch.distributed default process group (gloo on CPU, nccl on CUDA;
rendezvous at ``tcp://master_addr:master_port``), build the ``("pp", "dp", "tp")``
DeviceMesh the plan names, command ``ParallelPlan`` to the shard loader and the
gradient-reduction unit (the mesh handle travels as the payload) and publish
``ParallelReady`` (this rank's coordinates) to the loop.

The model and parallel sections of the job spec are given at construction (composition
root); an impossible combination (dp * tp * pp != world size, heads not divisible by tp,
...) is refused with the planner's one-line ``ValueError`` before any group is formed.

Red lines kept (seed L2-2): the plan is fixed at initialisation and never adapted; this
module performs no tensor communication (DDP/FSDP's collectives belong to L3-5, TP's to
the DTensor modules L3-1 lays out) and never touches the step schedule.
"""

from __future__ import annotations

import errno
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from services.contract import engine_pb2
from services.contract.bus import CommandPort, Emitter
from services.contract.failures import RendezvousFailed
from services.contract.frozen import FrozenConfig
from services.engine.schedule_check import check_pipeline
from services.engine.sharding_plan import ShardingPlan, Topology, plan
from services.jobspec import ModelSpec, ParallelSpec

DEFAULT_TIMEOUT_S = 300.0


class ParallelStrategy:
    """L2-2. ``shard_loader`` and ``reduction`` are its ports to L3-1 and L3-5."""

    def __init__(
        self,
        emit: Emitter,
        shard_loader: CommandPort,
        reduction: CommandPort,
        *,
        model: ModelSpec | None = None,
        parallel: ParallelSpec | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        """``model`` and ``parallel``: the job spec's sections the plan is computed from
        (default: a data-parallel-only plan over whatever world the assignment names)."""
        if timeout_s <= 0:
            raise ValueError(f"parallel strategy: timeout_s must be > 0, got {timeout_s}")
        self._emit = emit
        self._shard_loader = shard_loader
        self._reduction = reduction
        self._timeout = timedelta(seconds=timeout_s)
        self._model_spec = model
        self._parallel_spec = parallel
        self._mesh: DeviceMesh | None = None
        # Seed L2-2: the plan is fixed at initialisation (red line 1). The seed's 重建并行通信域
        # 指令 (RebuildParallelGroup) rebuilds the group on the same plan; nothing changes it.
        self._assignment = FrozenConfig[engine_pb2.RankAssignment]("L2_PARALLEL_STRATEGY", "rank assignment")
        self._plan: ShardingPlan | None = None
        self._owns_group = False
        self._state = "uninitialised"  # uninitialised | ready | comm_error

    def rank_assignment(self, msg: engine_pb2.RankAssignment, payload: Any = None) -> None:
        """分配 rank 拓扑与通信权限指令: build the group (blocks until every rank joined or
        the timeout passes), push the plan down, report ready.

        Raises:
            ValueError: an assignment that cannot work (rank >= world size, nccl without
                CUDA, unknown backend) or a parallel config the planner refuses (dp * tp *
                pp != world size, heads not divisible by tp, ...); the message names the field.
            ConfigFrozen: a second assignment (the plan is frozen).
            RendezvousFailed: the rendezvous failed (``port_in_use``: rank 0 found its port
                taken by another socket).
        """
        self._assignment.require_unset()
        _validate(msg)
        parallel = self._parallel_spec or ParallelSpec(dp=msg.world_size)
        topology = Topology(tuple(msg.rank_nodes)) if msg.rank_nodes else None
        sharding = plan(self._model_spec or ModelSpec(), msg.world_size, parallel, topology)  # ValueError: bad config
        if sharding.pp > 1:  # seed commentary 2.4: the schedule's static deadlock check, before any group exists
            check_pipeline(sharding.pipeline_schedule, sharding.pp, sharding.microbatches)  # ScheduleError
        self._assignment.set(msg)
        t0 = time.perf_counter()
        if msg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(msg.device))
        if not dist.is_initialized():
            # Rank 0 hosts the rendezvous store on master_port: whether another socket holds
            # it is asked of the OS first (a bind probe's errno), never read from torch's message.
            if msg.rank == 0 and _port_taken(msg.master_port):
                self._state = "comm_error"
                raise RendezvousFailed(f"rendezvous port {msg.master_port} is in use", port_in_use=True)
            try:
                dist.init_process_group(
                    backend=msg.backend,
                    init_method=f"tcp://{msg.master_addr}:{msg.master_port}",
                    rank=msg.rank,
                    world_size=msg.world_size,
                    timeout=self._timeout,
                )
            except (ValueError, TypeError, RendezvousFailed):  # a wrong call (a bug); the guard's own type
                self._state = "comm_error"
                raise
            except Exception as e:  # its store, a peer that never came: the group was not formed
                self._state = "comm_error"
                where = f"{msg.master_addr}:{msg.master_port}"
                raise RendezvousFailed(f"rendezvous at {where} failed: {type(e).__name__}") from e
            self._owns_group = True
        # Every rank builds the same mesh from the same plan (new_group is collective).
        device_type = "cuda" if msg.device.startswith("cuda") else "cpu"
        ranks, names = _mesh_layout(sharding)
        self._mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        self._plan = sharding
        plan_msg = plan_message(sharding, msg.rank, msg.device)
        self._shard_loader(plan_msg, self._mesh)
        self._reduction(plan_msg, self._mesh)
        self._state = "ready"
        self._emit(
            engine_pb2.ParallelReady(
                rank=msg.rank,
                world_size=msg.world_size,
                dp_rank=plan_msg.dp_rank,
                dp_size=sharding.dp,
                tp_rank=plan_msg.tp_rank,
                tp_size=sharding.tp,
                pp_rank=plan_msg.pp_rank,
                pp_size=sharding.pp,
                init_seconds=time.perf_counter() - t0,
            )
        )

    def shutdown(self) -> None:
        """Composition root, at process end: destroy the group this module created."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _mesh_layout(sharding: ShardingPlan) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The DeviceMesh's rank tensor and dim names: the plan's (pp, dp, tp) mesh without its
    size-1 axes other than ``dp`` (so ``mesh["dp"]`` always exists; ``mesh["pp"]`` and
    ``mesh["tp"]`` exist when that degree is > 1, the only case they are asked for).

    Why: DeviceMesh builds one process group per dim, and an idle gloo group keeps a TCP
    loop thread that wakes about 100 times a second (measured, torch 2.13). Two size-1
    groups cost a DP=2 rank 200 extra context switches/s on its cores for nothing; a mesh
    of the world's ranks alone reuses the default group."""
    keep = [
        i for i, (name, size) in enumerate(zip(sharding.axis_names, sharding.mesh_shape)) if size > 1 or name == "dp"
    ]
    shape = tuple(sharding.mesh_shape[i] for i in keep)
    return torch.tensor(sharding.flat_mesh()).view(shape), tuple(sharding.axis_names[i] for i in keep)


def plan_message(sharding: ShardingPlan, rank: int, device: str) -> engine_pb2.ParallelPlan:
    """The plan as the ``ParallelPlan`` command L3-1 and L3-5 receive, for ``rank``."""
    pp_rank, dp_rank, tp_rank = sharding.coords[rank]
    return engine_pb2.ParallelPlan(
        rank=rank, world_size=sharding.world_size, dp=sharding.dp, tp=sharding.tp, pp=sharding.pp,
        data_parallel=sharding.data_parallel, device=device,
        axis_names=list(sharding.axis_names), mesh=sharding.flat_mesh(),
        pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
        tp_styles=[engine_pb2.ParallelPlan.TPStyle(module=m, style=st) for m, st in sharding.tp_styles],
        stages=[engine_pb2.ParallelPlan.Stage(layers=list(layers)) for layers in sharding.stage_layers],
        activation_checkpointing=sharding.activation_checkpointing,
        pipeline_schedule=sharding.pipeline_schedule, microbatches=sharding.microbatches,
    )  # fmt: skip


def _port_taken(port: int) -> bool:
    """Whether another socket holds ``port`` (on any address, as the rendezvous store
    binds): a bind probe's ``EADDRINUSE``. (One taken between this probe and the store's
    bind is a plain rendezvous failure.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's: TIME_WAIT is not "taken"
        try:
            probe.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


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
