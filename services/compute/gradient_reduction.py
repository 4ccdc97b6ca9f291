"""L3-5 gradient reduction: cross-rank sync of gradients and of the step's token and loss sums.

Receives: ``ParallelPlan`` from L2-2 (payload: the ``("pp", "dp", "tp")`` DeviceMesh),
``ArmReduction`` and ``ReduceGradients`` from the training loop. Replies
``GradientsReduced`` with the global loss sum and token count.

The plan is pushed once; an in-place rebuild of the group (issue 16, L2-2's
RebuildParallelGroup, only for tp == pp == 1 and data_parallel ddp or none) pushes the
plan twice more: first without a mesh (the group is withdrawn: this unit drops its DDP
wrapper, its group and its mesh, so nothing holds the broken group when L2-2 destroys it:
a live reference keeps its sockets open and a peer blocked in it stays blocked), then with
the new group's mesh; the composition root then attaches the model again and only the DDP
wrapper is made anew, on the new group. That second plan is the same, or, for a resize in
place (L1's command, through L2-2), the same at another dp size, accepted only after the
withdrawal (:func:`services.compute.parallelize.data_parallel_resize`: world size, dp, dp
coordinate, mesh; ddp at dp > 1, none at 1); the wrapper and the step's statistics
reduction follow it. Any other plan is refused (ConfigFrozen).

The model's communication is laid out here, together with activation checkpointing, in the
order services/compute/parallelize.py fixes (torchtitan's: TP, activation checkpointing, then
FSDP2 or DDP): TP, activation checkpointing and FSDP2 when L3-1 has them applied to the
model on the meta device (``lay_out``, through the composition root, before it materialises
this rank's shards), DDP and the hooks on the real parameters when the composition root
attaches the materialised model (``attach``):

Tensor parallelism (tp > 1) over the mesh's tp axis: ``parallelize_module`` with the plan's
Megatron styles (Shoeybi et al. 2019): ``ColwiseParallel`` for q/k/v and the MLP gate/up,
``RowwiseParallel`` for the attention and MLP output projections (one all-reduce of the
partial sums per sub-block in forward, and of the input gradient in backward). Those
weights become DTensor shards; every other weight (embedding, norms, LM head) a replicated
DTensor (``distribute_module``, the model's input and output converted at its boundary),
so the optimizer and the gradient norm never see plain tensors and DTensors mixed.

Gradient sync over the mesh's dp axis, per ``plan.data_parallel``:
    * ``ddp``: ``DistributedDataParallel`` on the dp group. Its autograd hooks start
      bucketed all-reduces while backward is still running (Li et al. 2020, "PyTorch
      Distributed") -- the DESIGN.md exception, stated here where it lives. Only with
      tp == 1 (the planner refuses DDP over DTensor shards, as torchtitan does: DDP would
      checkpoint each shard as if it were the whole tensor).
    * ``fsdp2``: ``fully_shard`` on every block, then the root (torchtitan's layout):
      parameters, gradients and optimizer state sharded over dp, all-gathered per block
      in forward and backward, gradients reduce-scattered in backward.
Both average gradients over the dp ranks. ``ArmReduction(sync)`` comes before each
micro-step's forward: ``sync=False`` for the accumulation micro-steps (DDP: what
``no_sync()`` sets; FSDP2: ``set_requires_gradient_sync(False)``, gradients accumulate
unsharded locally), ``sync=True`` for the last one.

``ReduceGradients`` (after backward) is the step's one small collective: one float64
all-reduce (SUM) over the whole world of ``[loss_sum, tokens, replicated_squares,
sharded_squares, found_inf, held boundary commands' slots x 4]`` (the last: the ranks'
agreement on the step boundary of a pause, stop or revoke, services/common/boundary_commands.py;
over the whole world, so tp and pp peers agree too), each rank's share weighted so that each quantity is counted
once: tokens on the ranks at tp = pp = 0 (tp and pp peers read the same data), the loss on
tp = 0 (only the last pipeline stage has one; the others send 0), the squares of plain
(whole, replicated) gradients on dp = tp = 0, DTensor shards' squares as L2-4 counted them
(services/engine/grad_norm.py), the overflow flags summed (> 0: some rank overflowed). So
the token count, the loss statistics, the overflow verdict and the gradient norm's pieces
meet once per step instead of in three to five collectives on three groups, and the loop
learns the token count after backward (it back-propagates with a known normaliser and has
L2-4 correct the gradients: training_loop/__init__.py, "Loss normalisation"). Sums of integers and
of 0/1 flags are exact in float64 below 2**53. ``seconds`` is that collective's time,
including waiting for the slowest rank. The gradient reduction itself is overlapped with,
and counted in, the backward time.

Under tensor parallelism (without FSDP2) some gradients come out of backward Partial (each
tp rank holds a summand): the replicated weights' and the row-parallel ones'. They are
settled here, once the last micro-step's backward has accumulated every gradient (post-
accumulate-grad hooks, active when ``ArmReduction(sync=True)``): all of them in one flat
all-reduce over the tp group, then laid out as their parameter (Replicate, or this rank's
Shard slice, a local view). That is the gradient reduction of those weights, so neither
the norm (L2-4) nor the update (L2-3) meets the other ranks for them (before: one
all-reduce or reduce-scatter per such tensor, in both).

With ``data_parallel="none"`` (dp == 1) nothing is wrapped and nothing is communicated here.

Replica check (issue 29 item 3; ``ReduceGradients.check_replicas``, sent by the loop after the
update at its check steps only): this rank's parameters are digested (one float64 sum per
tensor, services/compute/replica_digest.py), the digests all-gathered over the dp group (a
vector of one float64 per tensor per replica) and compared, the odd replica found by majority.
Every rank of the group compares the same gathered matrix, so all find the same answer. Not
folded into the step's SUM all-reduce: a sum says that the replicas differ, not which one
does. Only where dp replicas of a parameter exist: ddp (tp and pp peers compare their own
shards within their dp group); under FSDP2 each dp rank holds different shards (nothing to
compare: ``replicas_checked`` false).

Red lines kept (seed L3-5): produces no gradients and changes none beyond DDP/FSDP's
averaging (the reduction itself), no weight update, never creates or rebuilds a process
group (the mesh's groups are L2-2's).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from services.common import boundary_commands
from services.common import phase as ph
from services.compute import replica_digest
from services.compute.parallelize import (
    ACTIVATION_CHECKPOINTING,
    DDP,
    FULLY_SHARD,
    ON_META,
    TENSOR_PARALLEL,
    checkpoint_activations,
    data_parallel_resize,
    layout_steps,
    rebuildable,
)
from services.contract import Module, engine_pb2
from services.contract.acting import acting
from services.contract.bus import Emitter
from services.contract.failures import CommunicationFailed, communicator_broken, communicator_failed
from services.contract.frozen import FrozenConfig


class GradientReduction:
    """L3-5."""

    def __init__(self, emit: Emitter, *, phase: ph.PhaseMarker | ph.NoPhase = ph.NO_PHASE, sync_at_wrap: bool = True):
        """``phase``: the rank's phase marker: set to "collective" while this unit waits in a
        collective (services/common/phase.py). ``sync_at_wrap``: DDP's construction checks
        the parameters' shapes across the ranks and broadcasts rank 0's values (two
        collectives). False for a rank that replaces a lost one (InitJob.heal_from_peer): it
        takes its state from a peer after the group is formed, and its peers, re-wrapping
        for the rebuilt group, construct theirs without those collectives too (a broadcast
        of rank 0's weights then would overwrite the state being healed)."""
        self._emit = emit
        self._mark = phase
        self._sync_at_wrap = sync_at_wrap
        self._laid_out = False  # the parameter layout (lay_out) was applied, once
        self._attached = False  # the model was attached once (a re-attach only wraps it again)
        # Seed L3-5: group config is pushed once at init (red line 1); never rebuilt here (4).
        self._frozen = FrozenConfig[engine_pb2.ParallelPlan]("L3_GRADIENT_REDUCTION", "parallel plan")
        self._plan: engine_pb2.ParallelPlan | None = None  # the plan in force (the first, or a resize's)
        self._withdrawn = False  # the plan was pushed again without a mesh: a rebuild is under way
        self._group: dist.ProcessGroup | None = None  # the dp axis
        self._mesh: DeviceMesh | None = None
        self._ddp: DistributedDataParallel | None = None
        self._fsdp: FSDPModule | None = None
        self._stats_device = torch.device("cpu")
        self._state = "idle"  # idle | reducing | done | comm_failed
        self._sync = True  # this micro-step's backward is the step's last (ArmReduction.sync)
        self._replicated: list[nn.Parameter] = []  # tp > 1 (no FSDP2): parameters whose grads may come out Partial
        self._pending: set[int] = set()  # ids of those whose grad the last backward has accumulated
        self._model: nn.Module | None = None  # the attached model (unwrapped): the replica check's parameters

    def parallel_plan(self, msg: engine_pb2.ParallelPlan, payload: Any = None) -> None:
        """通信域同步策略指令 (payload: the DeviceMesh). Once, then only the same plan again
        for an in-place rebuild (module docstring): without a mesh, the group is withdrawn;
        with one, it is the rebuilt group's. Once withdrawn, the same plan at another dp size
        may come with the new group's mesh (a resize in place).

        Raises:
            ConfigFrozen: another plan, or a plan this unit cannot rebuild in place (tp or
                pp > 1, FSDP2).
        """
        if self._frozen.is_set:
            self._rebuilt(msg, payload)
            return
        self._plan, self._mesh = self._frozen.set(msg), payload
        self._group = payload["dp"].get_group() if payload is not None and msg.dp > 1 else None
        if msg.device.startswith("cuda"):
            self._stats_device = torch.device(msg.device)

    def _rebuilt(self, msg: engine_pb2.ParallelPlan, mesh: DeviceMesh | None) -> None:
        # The same plan (withdrawn, or with the rebuilt group's mesh), or, once withdrawn, the
        # same at another dp size with the new group's mesh (a resize).
        same = msg == self._plan and rebuildable(msg)
        resized = self._withdrawn and mesh is not None and data_parallel_resize(self._plan, msg)
        if not (same or resized):
            self._frozen.require_unset()  # raises ConfigFrozen
        self._plan, self._withdrawn = msg, mesh is None  # (the first plan stays the frozen one)
        # Every reference to the old group goes: the wrapper (its reducer holds the group and
        # the failed bucket's work) and the mesh. The forward unit's reference to the wrapper
        # goes when the model is attached again (the composition root, from L3-1).
        self._ddp = None
        self._mesh = mesh
        self._group = mesh["dp"].get_group() if mesh is not None and msg.dp > 1 else None
        self._state = "idle"

    def lay_out(self, model: nn.Module) -> None:
        """Composition root (for L3-1, before the weights exist): the layout steps that only
        re-lay ``model``'s parameters out (TP, activation checkpointing, FSDP2:
        :data:`~services.compute.parallelize.ON_META`), in place, in the order
        services/compute/parallelize.py fixes. They apply to a model on the meta device,
        without communication; L3-1 then materialises this rank's shards. Once: later
        calls leave the model as it is."""
        if self._plan is None:
            raise RuntimeError("gradient reduction: a model was laid out before the parallel plan")
        if self._laid_out:
            return
        self._laid_out = True
        for step in (step for step in layout_steps(self._plan) if step in ON_META):
            if step == TENSOR_PARALLEL:
                _tensor_parallel(model, self._plan, self._mesh["tp"])
            elif step == ACTIVATION_CHECKPOINTING:
                checkpoint_activations(model)
            elif step == FULLY_SHARD:
                dp_mesh = self._mesh["dp"]
                for block in model.blocks:
                    fully_shard(block, mesh=dp_mesh)
                fully_shard(model, mesh=dp_mesh)
                self._fsdp = model

    def attach(self, model: nn.Module) -> nn.Module:
        """Composition root: lay ``model`` out per the plan, one step after the other in the
        order services/compute/parallelize.py fixes (TP, activation checkpointing, FSDP2 or
        DDP; those of :meth:`lay_out` unless L3-1 had them applied before it materialised the
        weights), and arm the hooks on its (now real) parameters; returns the module to run
        forward (the model, or its DDP wrapper)."""
        if self._plan is None:
            raise RuntimeError("gradient reduction: a model was attached before the parallel plan")
        steps = layout_steps(self._plan)
        self._model = model
        if self._attached:  # a rebuilt group (ddp or none only): the layout stays, the wrapper is new
            return self._wrap_ddp(model, sync=False) if DDP in steps and self._group is not None else model
        self._attached = True
        self.lay_out(model)
        if TENSOR_PARALLEL in steps and self._plan.data_parallel != "fsdp2":
            self._arm_partial_settle(model)
        # DDP last (parallelize.py): its wrap checks and broadcasts the weights themselves.
        return self._wrap_ddp(model, sync=self._sync_at_wrap) if DDP in steps else model

    def _wrap_ddp(self, model: nn.Module, *, sync: bool) -> DistributedDataParallel:
        """``sync``: DDP's construction-time shape check and broadcast of rank 0's weights
        (``sync_at_wrap``); never on a re-wrap for a rebuilt group, whose weights are healed
        after it."""
        device = torch.device(self._plan.device)
        # Defaults otherwise (25 MiB buckets, grads not bucket views), as a plain
        # torchrun + DDP script has them. The model registers no buffers (RoPE tables are
        # a cache), so DDP has nothing to broadcast per forward.
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[device.index or 0] if device.type == "cuda" else None,
            process_group=self._group,
            init_sync=sync,
        )
        if self._mark is not ph.NO_PHASE:
            # The default all-reduce, marking the rank "in a collective" once the last
            # bucket is handed over: backward's compute is done and what is left of it is
            # DDP's wait for the all-reduces (where a rank blocks when a peer hangs).
            self._ddp.register_comm_hook(self._group, self._allreduce_marked)
        return self._ddp

    def _allreduce_marked(self, group, bucket):  # (no annotations: DDP compares them as types)
        if bucket.is_last():
            self._mark.enter(ph.COLLECTIVE)
        return broken_on_failure(default_hooks.allreduce_hook(group, bucket))

    def arm_reduction(self, msg: engine_pb2.ArmReduction, payload: Any = None) -> None:
        """Before a micro-step's forward: whether its backward all-reduces gradients."""
        self._sync = msg.sync
        if self._ddp is not None:
            # What DDP.no_sync() sets; read by DDP's forward to prepare the reducer.
            self._ddp.require_backward_grad_sync = msg.sync
        elif self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(msg.sync)

    def reduce_gradients(self, msg: engine_pb2.ReduceGradients, payload: Any = None) -> engine_pb2.GradientsReduced:
        """执行梯度归约指令: DDP/FSDP2 reduced the gradients during backward (and the Partial
        ones were settled at its end); finish with the step's one small all-reduce over the
        world (module docstring). Communication errors propagate (the plan is not rebuilt)."""
        t0 = time.perf_counter()
        self._mark.enter(ph.COLLECTIVE)
        if msg.check_replicas:
            return self._check_replicas(t0)
        plan = self._plan
        held = list(msg.held_commands)
        local = [msg.local_loss_sum, float(msg.local_tokens), msg.replicated_squares, msg.sharded_squares,
                 float(msg.local_found_inf), *boundary_commands.slots(held)]  # fmt: skip
        world = 1
        if plan is not None and plan.world_size > 1:
            world = plan.world_size
            # Each quantity counted once over the world (module docstring): zero the shares
            # this rank's replicas also send; every rank's held boundary commands count.
            tp0, pp0 = plan.tp_rank == 0, plan.pp_rank == 0
            weights = [float(tp0), float(tp0 and pp0), float(tp0 and plan.dp_rank == 0), 1.0, 1.0]
            weights += [1.0] * boundary_commands.WINDOW
            stats = torch.tensor(
                [v * w for v, w in zip(local, weights)], dtype=torch.float64, device=self._stats_device
            )
            self._state = "reducing"
            try:
                dist.all_reduce(stats)  # the default (world) group: L2-2's, never one made here
            except Exception:
                self._state = "comm_failed"
                raise
            local = stats.tolist()
            if communicator_broken():
                # Aborted under this step (L2-2, on L1-2's word that a peer was lost): an NCCL
                # collective cut short returns what its buffers held, so the step's numbers
                # are not the group's. Typed by the record, never by what NCCL said.
                self._state = "comm_failed"
                raise CommunicationFailed("the process group was aborted during the step's reduction")
            self._state = "done"
        loss_sum, tokens, replicated, sharded, overflowed, *held_counts = local
        return engine_pb2.GradientsReduced(
            global_loss_sum=loss_sum, global_tokens=round(tokens), seconds=time.perf_counter() - t0,
            found_inf=overflowed > 0 or not math.isfinite(overflowed), grad_squares=replicated + sharded,
            commands_agreed=boundary_commands.agreed(held, held_counts, world),
        )  # fmt: skip

    def _check_replicas(self, t0: float) -> engine_pb2.GradientsReduced:
        """The replica check (module docstring): digest, all-gather over the dp group, vote.
        Communication errors propagate, as the step's reduction's do."""
        if self._group is None or self._fsdp is not None or self._model is None:
            return engine_pb2.GradientsReduced(seconds=time.perf_counter() - t0)  # no dp replicas to compare
        named = replica_digest.local_tensors(self._model)
        mine = replica_digest.digest(t for _, t in named).to(self._stats_device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        self._state = "reducing"
        try:
            dist.all_gather(gathered, mine, group=self._group)
        except Exception:
            self._state = "comm_failed"
            raise
        if communicator_broken():  # (as in reduce_gradients: a cut-short NCCL gather is no answer)
            self._state = "comm_failed"
            raise CommunicationFailed("the process group was aborted during the replica check")
        self._state = "done"
        found = replica_digest.odd_replicas(torch.stack(gathered).cpu(), [n for n, _ in named])
        reply = engine_pb2.GradientsReduced(seconds=time.perf_counter() - t0, replicas_checked=True)
        if found is not None:
            reply.diverged_tensor, reply.diverged_tensors = found.tensor, found.num_tensors
            reply.odd_dp_ranks.extend(found.odd_ranks)
        return reply

    def _arm_partial_settle(self, model: nn.Module) -> None:
        """tp > 1 without FSDP2 (which reduces its gradients itself): a hook on every
        parameter notes that the backward accumulated its grad; the last one noted, on the
        step's last micro-step, settles the Partial ones (module docstring)."""
        self._replicated = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        for p in self._replicated:
            p.register_post_accumulate_grad_hook(self._noted)

    def _noted(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        self._pending.add(id(param))
        if len(self._pending) == len(self._replicated):
            self._pending.clear()
            with acting(Module.L3_GRADIENT_REDUCTION):  # inside L3-4's backward, on L3-5's behalf
                self._settle_partial()

    def _settle_partial(self) -> None:
        """Every Partial(sum) grad summed over its mesh (one flat all-reduce per mesh, dtype
        and placements) and laid out as its parameter is: Replicate, or this rank's slice of
        a Shard (a local view, no more communication)."""
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in self._replicated:
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                groups.setdefault((id(g.device_mesh), g.to_local().dtype, tuple(g.placements)), []).append(p)
        for params in groups.values():
            grads = [p.grad for p in params]
            mesh = grads[0].device_mesh
            flat = torch.cat([g.to_local().reshape(-1) for g in grads])
            try:
                for d, pl in enumerate(grads[0].placements):
                    if isinstance(pl, Partial):
                        assert pl.reduce_op == "sum", f"a Partial({pl.reduce_op}) gradient"
                        dist.all_reduce(flat, group=mesh.get_group(d))
            except Exception:
                self._state = "comm_failed"
                raise
            offset = 0
            for p, g in zip(params, grads):
                n = g.to_local().numel()
                local = flat[offset : offset + n].view_as(g.to_local())
                offset += n
                summed = DTensor.from_local(local, mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements],
                                            run_check=False, shape=g.shape, stride=g.stride())  # fmt: skip
                # Replicate -> the parameter's Shard is a local slice (no collective).
                p.grad = summed if tuple(summed.placements) == tuple(p.placements) else summed.redistribute(
                    p.device_mesh, p.placements)  # fmt: skip


def _tensor_parallel(model: nn.Module, plan: engine_pb2.ParallelPlan, tp_mesh: DeviceMesh) -> None:
    """The module docstring's TP layout, in place. On the meta device (L3-1's load) there
    are no values yet (and nothing is sent): L3-1 then fills each rank's slice of the tensor
    a single process would have; on a built model every rank holds bit-identical full
    weights (seeded), so each keeps its slice.
    Between the column- and row-parallel linears the attention and MLP work on plain local
    tensors (n_heads / tp heads, F / tp hidden units); the residual stream is a replicated
    DTensor, made a plain tensor again at the model's output (the logits)."""
    styles = {
        s.module: ColwiseParallel() if s.style == "colwise" else RowwiseParallel(use_local_output=False)
        for s in plan.tp_styles
    }
    parallelize_module(model, tp_mesh, styles)
    tied = model.lm_head.weight is model.tok_emb.weight
    distribute_module(
        model, tp_mesh,
        input_fn=lambda _m, inputs, mesh: (DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False), *inputs[1:]),
        output_fn=lambda _m, out, _mesh: out.to_local(),
    )  # fmt: skip
    if tied:  # replicating each module's parameters separately untied them
        model.lm_head.weight = model.tok_emb.weight


def broken_on_failure(fut):
    """``fut`` (a bucket's gradient all-reduce) chained so that its failure records this
    process's communicator broken before DDP sees it: gloo raises a plain RuntimeError when a
    peer died, and an early bucket's fails during the backward, before the rank's phase says it
    waits in a collective, so the step's error was typed internal_error and the survivor of a
    killed peer was stopped instead of rebuilt (CI, test_rebuild_in_place)."""

    def settled(done):
        try:
            return done.value()
        except Exception:
            communicator_failed()
            raise

    return fut.then(settled)
