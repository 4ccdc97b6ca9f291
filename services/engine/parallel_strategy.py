"""L2-2 parallel strategy: turns the rank assignment into a frozen plan and a device mesh.

Receives: ``RankAssignment`` (from L1's resource allocator, through the rank's session
relay), pushed once; ``RebuildParallelGroup`` (below). On the assignment: compute the plan with the pure planner
(:func:`services.engine.sharding_plan.plan`: mesh, coordinates, groups, stages, TP styles),
initialise the torch.distributed default process group (gloo on CPU, nccl on CUDA;
rendezvous at ``tcp://master_addr:master_port``), build the ``("pp", "dp", "tp")``
DeviceMesh the plan names, command ``ParallelPlan`` to the shard loader and the
gradient-reduction unit (the mesh handle travels as the payload) and publish
``ParallelReady`` (this rank's coordinates) to the loop.

The model and parallel sections of the job spec are given at construction (composition
root); an impossible combination (dp * tp * pp != world size, heads not divisible by tp,
...) is refused with the planner's one-line ``ValueError`` before any group is formed.

In-place rebuild (issue 16; seed 重建并行通信域指令): ``RebuildParallelGroup`` comes from two
senders. From L1-2 (on the session's thread) it names the next generation's rendezvous of
the job (a lost rank's replacement joins it with its RankAssignment): it is kept in a
mailbox, newest generation first (one that names the group this rank is in only records
that generation). From the training loop (``master_port`` 0, on the main thread) it says
this rank leaves its group: the group broke under a collective, or the loop was paused for
a resize L1 commanded (``ResumeTraining.rebuild``). A broken group (this process's
communicator recorded broken: services/contract/failures.py) is published as
``ParallelTopologyError`` (comm_error, typed FAILURE_COMMUNICATION; L1-3 and L1-2 hear of
it); a group left for a resize is no fault and is not. Then: have L3-5 and L3-1 drop
everything that holds the old group (the current ``ParallelPlan`` without a mesh: L3-5
lets go of its DDP wrapper, L3-1 hands the model over again so the forward unit lets go of
it too), destroy the group (and collect: a group still referenced keeps its sockets open,
and a peer blocked in it, not next to the lost rank, stays blocked until its timeout --
measured, torch 2.13 gloo), wait up to the group timeout for a rendezvous newer than this
rank's, join it with the same rank, build the mesh, push the plan with the new mesh (L3-5
wraps the model in a new DDP, without DDP's start-up broadcast) and publish
``ParallelReady``. Only plans with tp == pp == 1 and data_parallel ddp or none are rebuilt
(L1 decides a relaunch for the others).

Resize in place (issue 16: ``surgectl scale``, a job shrunk by a fault, growing back): a
rendezvous of L1-2's that names a ``layout`` (``world_size`` = ``layout.dp``) is a group of
another size. The plan is computed again for it (the same model and parallel sections with
``dp`` = ``layout.dp``, by the same planner; it must still be tp == pp == 1 and ddp or none),
this rank joins with its rank id at the new world size (ranks >= the new size were released
by L1; one here is a bug: RuntimeError), and the new plan goes to L3-5 and L3-1 and its
coordinates out in ``ParallelReady``. The world size this rank is in is kept here (the
RankAssignment stays as given: frozen). A rendezvous without a layout must be of the current
size. The reply to the loop's rebuild carries the rendezvous joined as its payload
(generation, and the layout the loop takes: the data side of the same resize).

Where the ranks run (issue 28): the planner's topology (which ranks share a node) is learned
at every rendezvous, not sent: each rank names its node (``RankAssignment.worker_id``) at the
store and the last to arrive publishes the map (services/engine/node_map.py). The assignment's
plan is computed first without it (a bad config is refused before any group) and again on it
after the join; a resize's likewise. An assignment or rendezvous that lists the nodes (an older
L1-2's) is planned on its list.

Communication faults (issue 26): the group's timeout is a collective's, given at
construction (derived from the job's settings by the rank's root:
services/rank/comm_settings.py); the rendezvous keeps its own (:data:`RENDEZVOUS_TIMEOUT_S`).
An NCCL rank's watchdog aborts the communicator on a timeout or an NCCL error and leaves the
process alive (the root's NCCL settings). When L1-2's rendezvous names ``lost_ranks``, the survivor's group
is recorded broken and aborted from the session's thread (:meth:`_abort_group`), so a
collective blocked on the lost peer returns at once; either way the failure reaches the
loop typed as a communication failure and the rebuild above proceeds.

Red lines kept (seed L2-2): the plan is computed by the planner, never adapted here: it is
fixed at initialisation, and a new plan at a new size comes only with L1-2's rendezvous
naming a new layout (L1's command), computed from the same job sections; this module
performs no tensor communication (DDP/FSDP's collectives belong to L3-5, TP's to the
DTensor modules L3-1 lays out) and never touches the step schedule.
"""

from __future__ import annotations

import errno
import gc
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from services.common.rank_nodes import nodes_of
from services.contract import Module, engine_pb2
from services.contract.bus import CommandPort, Emitter, Reply
from services.contract.failures import (
    CommunicationFailed,
    Refusal,
    RendezvousFailed,
    communicator_broken,
    communicator_failed,
    communicator_reset,
    failure_of,
)
from services.contract.frozen import FrozenConfig
from services.engine import node_map
from services.engine.memory_quota import apply_memory_quota
from services.engine.schedule_check import check_pipeline
from services.engine.sharding_plan import ShardingPlan, Topology, plan
from services.jobspec import ModelSpec, ParallelSpec

# A collective's timeout without a job spec (seconds): torchft's default (60 s); a rank's is
# derived from its job's settings (services/rank/comm_settings.py).
DEFAULT_TIMEOUT_S = 60.0
# How long a rendezvous may take (every rank counted in, a replacement started, L1-2's next
# rendezvous heard): torchtitan's ``comm.init_timeout_seconds`` (300 s).
RENDEZVOUS_TIMEOUT_S = 300.0
_log = structlog.get_logger("parallel_strategy")


def abort_communicators(backend: str) -> bool:
    """Abort this process's process groups so that a collective blocked in them returns
    (the caller recorded the communicator broken first). Returns whether anything could be
    aborted.

    ``nccl``: ``ncclCommAbort`` of every group (torch's ``_abort_process_group``, as torchft
    aborts a timed-out group); the blocked collective's kernels return and its next use
    raises; the world is gone (``dist.is_initialized()`` is False) and the rebuild forms a
    new one. ``gloo``: nothing can be: torch 2.13's ProcessGroupGloo does not implement
    ``abort`` (``Backend::abort`` is a no-op; measured: a collective blocked on a SIGSTOPped
    peer stays blocked after ``abort()``, ``shutdown()`` and ``_abort_process_group()``). A
    gloo survivor is released when the lost peer's process ends (L1 kills it: its sockets
    close) or at the collective timeout."""
    if backend != "nccl" or not dist.is_initialized():
        return False
    dist.distributed_c10d._abort_process_group()
    return True


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
        side_groups: tuple[str, ...] = (),
        side_timeout_s: float | None = None,
        rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S,
        abort: Callable[[str], bool] = abort_communicators,
        visible_devices: str | None = None,
    ):
        """``model`` and ``parallel``: the job spec's sections the plan is computed from
        (default: a data-parallel-only plan over whatever world the assignment names).
        ``timeout_s``: a collective's timeout, the process group's (the rank's root derives it
        from the job's settings: services/rank/comm_settings.py). ``side_groups``: names of the gloo groups over the
        whole world that other parts of the rank run on (the store relay's "agree" and
        "write"), made at every formation of the group (:meth:`side_group`), with
        ``side_timeout_s`` (default ``timeout_s``). ``rendezvous_timeout_s``: how long a
        rendezvous may take (the store, every rank's arrival, L1-2's next rendezvous).
        ``abort``: aborts the process groups of a backend (:func:`abort_communicators`; the
        NCCL boundary, which tests on CPU stand in for). ``visible_devices``: the process's
        ``CUDA_VISIBLE_DEVICES`` (None: unset), named when a device it cannot see is refused."""
        for name, value in (("timeout_s", timeout_s), ("rendezvous_timeout_s", rendezvous_timeout_s)):
            if value <= 0:
                raise ValueError(f"parallel strategy: {name} must be > 0, got {value}")
        self._emit = emit
        self._shard_loader = shard_loader
        self._reduction = reduction
        self._timeout = timedelta(seconds=rendezvous_timeout_s)  # (the rendezvous's waits)
        self._collective_timeout = timedelta(seconds=timeout_s)
        self._side_timeout = timedelta(seconds=side_timeout_s or timeout_s)
        self._abort = abort
        self._visible_devices = visible_devices
        self._aborted_generation = 0  # the newest rendezvous whose lost ranks made this rank abort
        self._model_spec = model
        self._parallel_spec = parallel
        self._mesh: DeviceMesh | None = None
        # Seed L2-2: the plan is fixed at initialisation (red line 1). The seed's 重建并行通信域
        # 指令 (RebuildParallelGroup) rebuilds the group on the same plan; only L1-2's rendezvous
        # naming a new layout (a resize, L1's command) brings a plan computed at the new size.
        self._assignment = FrozenConfig[engine_pb2.RankAssignment]("L2_PARALLEL_STRATEGY", "rank assignment")
        self._plan: ShardingPlan | None = None
        self._world_size = 0  # the group's size now (the assignment's, until a resize)
        self._owns_group = False
        self._state = "uninitialised"  # uninitialised | ready | comm_error | rebuilding
        # In-place rebuilds: the generation of the group this rank is in (0: its launch's),
        # the rendezvous it joined last, and L1-2's newest rendezvous not joined yet.
        self._generation = 0
        self._joined: tuple[str, int] = ("", 0)
        self._rendezvous: engine_pb2.RebuildParallelGroup | None = None
        self._mailbox = threading.Condition()
        self._joining: tuple[str, int] | None = None  # a rebuild's rendezvous being waited at
        # The node of each rank of the group joined last, learned at its rendezvous store
        # (services/engine/node_map.py: L1-2 no longer sends the world's list).
        self._nodes: tuple[str, ...] = ()
        self._side_names = side_groups
        self._side: dict[str, Any] = {}  # the current world's side groups, by name

    def rank_assignment(self, msg: engine_pb2.RankAssignment, payload: Any = None) -> None:
        """分配 rank 拓扑与通信权限指令: build the group (blocks until every rank joined or
        the timeout passes), push the plan down, report ready.

        Raises:
            ValueError: an assignment that cannot work (rank >= world size, nccl without
                CUDA, unknown backend) or a parallel config the planner refuses (dp * tp *
                pp != world size, heads not divisible by tp, ...); the message names the field.
            DeviceNotVisible: a device this process cannot see (a typed refusal, config_error).
            ConfigFrozen: a second assignment (the plan is frozen).
            RendezvousFailed: the rendezvous failed (``port_in_use``: rank 0 found its port
                taken by another socket).
        """
        self._assignment.require_unset()
        _validate(msg, self._visible_devices)
        parallel = self._parallel_spec or ParallelSpec(dp=msg.world_size)
        # The nodes: an older launcher's list in the assignment, else learned at the rendezvous
        # (node_map.py) and planned on again then; this plan refuses a bad config before any group.
        listed = tuple(msg.rank_nodes)
        sharding = plan(self._model_spec or ModelSpec(), msg.world_size, parallel, Topology(listed) if listed else None)
        if sharding.pp > 1:  # seed commentary 2.4: the schedule's static deadlock check, before any group exists
            check_pipeline(sharding.pipeline_schedule, sharding.pp, sharding.microbatches)  # ScheduleError
        self._assignment.set(msg)
        t0 = time.perf_counter()
        if msg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(msg.device))
            apply_memory_quota(msg.memory_quota_bytes, torch.cuda.current_device())  # L1-2's quota, enforced
        if not dist.is_initialized():
            # (Counted in at the store like a rebuild's ranks: a replacement may be joining
            # survivors that wait for it there.)
            try:
                self._join(msg.master_addr, msg.master_port, msg.rank, msg.world_size, msg.backend, node=msg.worker_id)
            except _Superseded as e:
                self._state = "comm_error"
                raise RendezvousFailed(f"rendezvous at {msg.master_addr}:{msg.master_port} failed: {e}") from None
            if not listed:  # (the same plan but where tp groups must stay inside nodes)
                sharding = plan(self._model_spec or ModelSpec(), msg.world_size, parallel, Topology(self._nodes))
        self._plan, self._world_size = sharding, msg.world_size
        self._ready(t0, (self._shard_loader, self._reduction))

    def rebuild_parallel_group(self, msg: engine_pb2.RebuildParallelGroup, payload: Any = None) -> Reply | None:
        """重建并行通信域指令 (module docstring, "In-place rebuild", "Resize in place"). From
        L1-2: kept for the loop's rebuild (reply None). From the loop (``master_port`` 0):
        rebuild now; reply payload: the RebuildParallelGroup (L1-2's rendezvous) joined.

        Raises:
            RuntimeError: a rebuild before the group was formed, or of a plan that cannot be
                rebuilt in place (tp or pp > 1, FSDP2); a rendezvous of another size without a
                layout, or with a layout this rank is not in or that is not its world size.
            ValueError: the planner refuses the plan at the new layout (one line, the field).
            RendezvousFailed: no newer rendezvous came within the group timeout, or joining it failed.
        """
        if msg.master_port:
            self._post(msg)
            return None
        if self._plan is None:
            raise RuntimeError("parallel strategy: RebuildParallelGroup before the group was formed")
        assignment = self._assignment.get()
        plan_msg = plan_message(self._plan, assignment.rank, assignment.device)
        if not (self._plan.tp == 1 and self._plan.pp == 1 and self._plan.data_parallel in ("ddp", "none")):
            raise RuntimeError(
                f"parallel strategy: a plan with tp={self._plan.tp} pp={self._plan.pp} "
                f"data_parallel={self._plan.data_parallel} is not rebuilt in place"
            )
        t0 = time.perf_counter()
        self._state = "rebuilding"
        if communicator_broken():  # (else the loop leaves a whole group for a resize: no fault)
            broken = CommunicationFailed(msg.reason or "the process group broke")
            self._emit(engine_pb2.ParallelTopologyError(
                rank=assignment.rank, fault_class="comm_error", detail=str(broken),
                failure=failure_of(broken, Module.L2_PARALLEL_STRATEGY, msg.DESCRIPTOR.full_name),
            ))  # fmt: skip
        if self._mesh is not None:  # (None: a rebuild that failed to join is being retried)
            # L3-5 first: L3-1's handover then finds it without a group, and the forward
            # unit gets the bare model in place of the old wrapper.
            self._reduction(plan_msg, None)
            self._shard_loader(plan_msg, None)
            self._mesh = None
        self._side = {}  # (destroyed with the world below; no reference may keep their sockets open)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 - a broken group may fail to say goodbye; it is gone either way
                _log.warning("destroy_of_broken_group_failed", error=f"{type(e).__name__}: {e}")
        gc.collect()  # what referenced the group's work (the wrapper's reducer) frees its sockets now
        destroyed = time.perf_counter()
        while True:
            rendezvous = self._wait_rendezvous()
            sharding = self._plan_for(rendezvous, assignment.rank)  # (the same plan, or one at the new layout)
            self._generation = rendezvous.generation
            try:
                self._join(rendezvous.master_addr, rendezvous.master_port, assignment.rank, rendezvous.world_size,
                           assignment.backend, node=assignment.worker_id)  # fmt: skip
                break
            except _Superseded as why:  # a rank of this generation was lost before all arrived
                _log.warning("rendezvous_superseded", generation=rendezvous.generation, reason=str(why))
        if rendezvous.layout.dp:  # a resize: planned again on the nodes learned at the rendezvous
            sharding = self._plan_for(rendezvous, assignment.rank, self._nodes)
        communicator_reset()  # the new group is whole
        resized = sharding.world_size != self._world_size
        self._plan, self._world_size = sharding, rendezvous.world_size
        _log.info(
            "group_rebuilt",
            generation=self._generation,
            world_size=rendezvous.world_size,
            resized=resized,
            teardown_s=round(destroyed - t0, 4),
            waited_and_joined_s=round(time.perf_counter() - destroyed, 4),
        )
        # L3-5 first: L3-1 hands the model over again and L3-5 wraps it on the new group.
        self._ready(t0, (self._reduction, self._shard_loader))
        return Reply(None, rendezvous)

    def _plan_for(
        self, rendezvous: engine_pb2.RebuildParallelGroup, rank: int, learned: tuple[str, ...] = ()
    ) -> ShardingPlan:
        """The plan of the group ``rendezvous`` names: this rank's plan when it names no layout,
        else the plan computed again at ``layout.dp`` (module docstring, "Resize in place"), on
        the nodes the rendezvous lists (an older L1-2's) or else ``learned`` (the node of each
        rank, learned at its store: node_map.py; before the join: none, one node).

        Raises:
            RuntimeError: another size without a layout; a layout that is not the world size,
                that this rank is not in, or whose plan cannot be rebuilt in place (a bug: L1
                decides these before it commands a resize).
            ValueError: the planner refuses it (one line naming the field).
        """
        layout, generation = rendezvous.layout, rendezvous.generation
        if not layout.dp:
            if rendezvous.world_size != self._world_size:
                raise RuntimeError(
                    f"parallel strategy: generation {generation} has {rendezvous.world_size} ranks and names no "
                    f"layout; the group has {self._world_size}"
                )
            return self._plan
        if rendezvous.world_size != layout.dp or rank >= layout.dp:
            raise RuntimeError(
                f"parallel strategy: generation {generation} has {rendezvous.world_size} ranks at layout dp "
                f"{layout.dp}; rank {rank} cannot join it (world size must be dp, ranks above it are released)"
            )
        base = self._parallel_spec or ParallelSpec(dp=self._world_size)
        parallel = ParallelSpec.model_validate({**base.model_dump(), "dp": layout.dp})
        nodes = nodes_of(rendezvous) or learned  # (an older L1-2 sent the list: services/common/rank_nodes.py)
        topology = Topology(tuple(nodes)) if nodes else None
        sharding = plan(self._model_spec or ModelSpec(), layout.dp, parallel, topology)  # ValueError: bad config
        if not (sharding.tp == 1 and sharding.pp == 1 and sharding.data_parallel in ("ddp", "none")):
            raise RuntimeError(
                f"parallel strategy: the plan at dp {layout.dp} has data_parallel={sharding.data_parallel}: "
                "it is not rebuilt in place"
            )
        return sharding

    def _post(self, msg: engine_pb2.RebuildParallelGroup) -> None:
        """L1-2's rendezvous: kept when newer than this rank's group and than what is kept
        (one naming the group this rank joined or is joining records its generation only). A rank waiting
        at an older rendezvous for peers that will never come (one was lost before it
        arrived) is released from it: the newer one supersedes it."""
        with self._mailbox:
            if (msg.master_addr, msg.master_port) in (self._joined, self._joining):
                # The group this rank is in, or joining (a replacement launched to it): only
                # its generation is news.
                self._generation = max(self._generation, msg.generation)
                return
            kept = self._rendezvous.generation if self._rendezvous is not None else 0
            if msg.generation > max(self._generation, kept):
                self._rendezvous = msg
                self._mailbox.notify_all()
            joining = self._joining if msg.generation > self._generation else None
            # Ranks of the group this rank is in were lost: its communicator is broken (once
            # per rendezvous; not while no group is formed, nor while it is left already).
            abort = (
                bool(msg.lost_ranks)
                and self._state == "ready"
                and msg.generation > max(self._generation, self._aborted_generation)
            )
            if abort:
                self._aborted_generation = msg.generation
        if abort:
            self._abort_group(msg)
        if joining is not None:
            _supersede(*joining, self._timeout)

    def _abort_group(self, msg: engine_pb2.RebuildParallelGroup) -> None:
        """L1-2 says ranks of this rank's group were lost (``msg.lost_ranks``): the group's
        communicator is recorded broken (so what its use raises now is a communication
        failure by type, services/contract/failures.py, never by its text) and aborted, on
        this, the session's thread: a collective the main thread is blocked in on a lost
        peer returns at once instead of at the group timeout (NCCL; gloo cannot be aborted:
        :func:`abort_communicators`), and the loop's rebuild proceeds."""
        backend = self._assignment.get().backend
        communicator_failed()
        t0 = time.perf_counter()
        try:
            aborted = self._abort(backend)
        except Exception as e:  # noqa: BLE001 - a failed abort leaves the timeout as the backstop
            _log.warning("abort_failed", backend=backend, error=f"{type(e).__name__}: {e}")
            return
        _log.info(
            "communicator_aborted" if aborted else "communicator_not_abortable",
            backend=backend,
            lost_ranks=list(msg.lost_ranks),
            generation=msg.generation,
            abort_s=round(time.perf_counter() - t0, 4),
        )

    def _wait_rendezvous(self) -> engine_pb2.RebuildParallelGroup:
        """L1-2's newest rendezvous past this rank's generation (taken out of the mailbox),
        waiting up to the group timeout.

        Raises:
            RendezvousFailed: none came in time.
        """

        def newer() -> bool:
            return self._rendezvous is not None and self._rendezvous.generation > self._generation

        with self._mailbox:
            if not self._mailbox.wait_for(newer, timeout=self._timeout.total_seconds()):
                raise RendezvousFailed(
                    f"no rendezvous for generation {self._generation + 1} within {self._timeout.total_seconds():g} s"
                )
            rendezvous, self._rendezvous = self._rendezvous, None
        return rendezvous

    def _join(self, addr: str, port: int, rank: int, world_size: int, backend: str, *, node: str = "") -> None:
        """Initialise the default process group on the rendezvous store at ``addr:port``; learn
        there which node each rank runs on (``self._nodes``; this rank's is ``node``: node_map.py).

        Every rank first counts itself in at the store and waits for the last to arrive, or
        for a newer rendezvous from L1-2 (``_post`` marks this one superseded): a peer lost
        before it joined never comes, and the ranks waiting for it move on to the group that
        replaces it instead of waiting out the group timeout. An unreachable store (its
        host, rank 0, was lost) is the same.

        Raises:
            _Superseded: the rendezvous was given up for a newer one.
            RendezvousFailed: ``port_in_use`` (rank 0 found its port taken by another socket),
                or the group was not formed (its store, a peer that never came).
            ValueError, TypeError: a wrong call (a bug).
        """
        # Rank 0 hosts the rendezvous store on the port: whether another socket holds it is
        # asked of the OS first (a bind probe's errno), never read from torch's message.
        if rank == 0 and _port_taken(port):
            self._state = "comm_error"
            raise RendezvousFailed(f"rendezvous port {port} is in use", port_in_use=True)
        store, nodes = self._arrive(addr, port, rank, world_size, node)
        try:
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore("group", store),
                rank=rank,
                world_size=world_size,
                timeout=self._collective_timeout,
            )
        except (ValueError, TypeError, RendezvousFailed):  # a wrong call (a bug); the guard's own type
            self._state = "comm_error"
            raise
        except Exception as e:  # its store, a peer that never came: the group was not formed
            self._state = "comm_error"
            raise RendezvousFailed(f"rendezvous at {addr}:{port} failed: {type(e).__name__}") from e
        self._owns_group = True
        # The side groups, made here while every rank is at the rendezvous: new_group is
        # collective and waits at the store for every peer, so one made later (the relay's
        # first save) waited for a peer lost just then in a store wait that its loss never
        # ends, and the survivor never reached L1's rebuild (CI: a node agent lost at step 10).
        try:
            self._side = {name: dist.new_group(backend="gloo", timeout=self._side_timeout) for name in self._side_names}
        except Exception as e:  # a peer lost during the formation: the group was not formed
            self._state = "comm_error"
            raise RendezvousFailed(f"rendezvous at {addr}:{port} failed: {type(e).__name__}") from e
        with self._mailbox:
            self._joined, self._nodes = (addr, port), nodes

    def side_group(self, name: str) -> Any:
        """The side group ``name`` of the current world (None before the group is formed, or
        when something else formed it). Destroyed with the world: a rebuild makes new ones."""
        return self._side.get(name) if dist.is_initialized() else None

    def _arrive(
        self, addr: str, port: int, rank: int, world_size: int, node: str = ""
    ) -> tuple[dist.TCPStore, tuple[str, ...]]:
        """Count this rank in at the rendezvous store (rank 0 hosts it) and wait until all
        ``world_size`` arrived; returns the store to form the group on and the node of each
        rank (each names its own, ``node``, as it arrives; the last publishes the map: node_map.py).

        Raises:
            _Superseded: a newer rendezvous came first, or the store was unreachable.
        """
        with self._mailbox:
            self._joining = (addr, port)
            kept = self._rendezvous
            if kept is not None and (kept.master_addr, kept.master_port) == (addr, port):
                # L1-2's notice of this very group, heard before this rank began to join it (a
                # replacement still starting up): only its generation is news, as in _post. (The
                # trial: taken for a newer group, it superseded the replacement's own join.)
                self._generation, self._rendezvous = max(self._generation, kept.generation), None
            newer = self._rendezvous is not None and self._rendezvous.generation > self._generation
        try:
            if newer:
                raise _Superseded("a newer rendezvous came before this one was joined")
            try:
                store = self._connect(addr, port, rank, world_size)
                node_map.publish(store, rank, node)
                if store.add(_ARRIVED, 1) == world_size:
                    node_map.assemble(store, world_size)  # (every rank's node is there: each set it first)
                    store.compare_set(_GO, "", _ALL)  # (unless superseded first)
                store.wait([_GO])  # set by the last rank to arrive, or by _post (superseded)
                go = store.get(_GO)
                nodes = node_map.read(store) if go == _ALL else ()
            except Exception as e:  # noqa: BLE001 - its host went away, or it timed out: not this group
                raise _Superseded(f"rendezvous store {addr}:{port}: {type(e).__name__}") from None
            if go != _ALL:
                raise _Superseded("a newer rendezvous came while waiting for the others")
            return store, nodes
        finally:
            with self._mailbox:
                self._joining = None

    def _connect(self, addr: str, port: int, rank: int, world_size: int) -> dist.TCPStore:
        """The rendezvous store: rank 0 hosts it; the others connect, in attempts of a few
        seconds between which a newer rendezvous is looked for (a host that was lost never
        answers), up to the group timeout.

        Raises:
            _Superseded: a newer rendezvous came. RuntimeError: the timeout passed."""
        if rank == 0:
            return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False, timeout=self._timeout)
        give_up_at = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=_CONNECT)
                store.set_timeout(self._timeout)  # (the short one was for connecting only)
                return store
            except Exception:  # noqa: BLE001 - not up yet, or gone
                with self._mailbox:
                    if self._rendezvous is not None and self._rendezvous.generation > self._generation:
                        raise _Superseded("a newer rendezvous came while connecting") from None
                if time.monotonic() > give_up_at:
                    raise

    def _ready(self, t0: float, ports: tuple[CommandPort, ...]) -> None:
        """Build the mesh of the plan on the group (every rank the same: new_group is
        collective), push the plan to ``ports`` in that order, publish ParallelReady."""
        assignment, sharding = self._assignment.get(), self._plan
        device_type = "cuda" if assignment.device.startswith("cuda") else "cpu"
        ranks, names = _mesh_layout(sharding)
        self._mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        plan_msg = plan_message(sharding, assignment.rank, assignment.device)
        for port in ports:
            port(plan_msg, self._mesh)
        self._state = "ready"
        self._emit(
            engine_pb2.ParallelReady(
                rank=assignment.rank,
                world_size=self._world_size,
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
        self._side = {}
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


# Keys of a rebuild's rendezvous store, next to the group's own (under its prefix "group").
_ARRIVED, _GO, _ALL, _SUPERSEDED = "surge/arrived", "surge/go", b"all", b"superseded"
_CONNECT = timedelta(seconds=3)  # one attempt to reach a rebuild's rendezvous store


class _Superseded(Exception):
    """A rebuild's rendezvous given up for a newer one (a peer was lost before it arrived)."""


def _supersede(addr: str, port: int, timeout: timedelta) -> None:
    """Mark the rendezvous at ``addr:port`` superseded, releasing every rank waiting there.
    (A store that cannot be reached has released them already: their wait fails.)"""
    try:
        client = dist.TCPStore(addr, port, is_master=False, timeout=min(timeout, _CONNECT))
        client.compare_set(_GO, "", _SUPERSEDED)  # (a group already complete stays complete)
    except Exception as e:  # noqa: BLE001 - see above
        _log.info("rendezvous_supersede_unreachable", store=f"{addr}:{port}", error=type(e).__name__)


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


def _validate(msg: engine_pb2.RankAssignment, visible_devices: str | None) -> None:
    if msg.world_size < 1 or msg.rank >= msg.world_size:
        raise ValueError(f"rank assignment: rank {msg.rank} is not in world_size {msg.world_size}")
    if msg.backend not in ("gloo", "nccl"):
        raise ValueError(f"rank assignment: backend must be 'gloo' or 'nccl', got {msg.backend!r}")
    if msg.backend == "nccl" and not msg.device.startswith("cuda"):
        raise ValueError(f"rank assignment: backend nccl needs a CUDA device, got device {msg.device!r}")
    if not msg.master_addr or not msg.master_port:
        raise ValueError("rank assignment: master_addr and master_port are required")
    if msg.device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        why = device_not_visible(msg.device, count, visible_devices)
        if why is not None:
            raise DeviceNotVisible(why)


class DeviceNotVisible(ValueError, Refusal):
    """The rank was told a device this process cannot see (its node agent's binding and
    the process disagree, or the node has no such GPU): a configuration error, graded fatal
    (``config_error``), reported in one line."""

    fault_class = "config_error"


def device_not_visible(device: str, visible_count: int, cuda_visible_devices: str | None) -> str | None:
    """Why ``device`` ("cuda", "cuda:N") cannot be used by a process that sees
    ``visible_count`` CUDA devices under ``CUDA_VISIBLE_DEVICES`` = ``cuda_visible_devices``
    (None: unset); None when it can. The node agent masks each rank to its one GPU, which
    it then sees as ``cuda:0`` (services/worker/device_binding.py)."""
    mask = "unset" if cuda_visible_devices is None else repr(cuda_visible_devices)
    if visible_count == 0:
        return f"rank assignment: device {device!r} but this process sees no CUDA device (CUDA_VISIBLE_DEVICES {mask})"
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= visible_count):
        return (
            f"rank assignment: device {device!r} but this process sees {visible_count} CUDA "
            f"device{'' if visible_count == 1 else 's'} (cuda:0..cuda:{visible_count - 1}; CUDA_VISIBLE_DEVICES {mask})"
        )
    return None
