"""L2-2's planner: a pure function from (model, world, parallel config, topology) to a plan.

:func:`plan` decides everything about how a job's ranks split the model and the batch,
before any process group exists, so it is unit-tested without processes and the same
inputs always give the same plan. :class:`~services.engine.parallel_strategy.ParallelStrategy`
builds the process groups it names and pushes it down once; nothing changes it later.

The mesh is 3-D, axes ``("pp", "dp", "tp")``, tp innermost: a tp group is ``tp``
consecutive entries of the mesh, and the mesh lists ranks node by node, so a tp group sits
inside one node whenever a node holds a multiple of ``tp`` ranks (Megatron-LM's placement,
Narayanan et al. 2021, sec. 3.3: TP's per-layer all-reduces need the intra-node links).

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019): the q, k, v and MLP gate/up
projections are column-parallel (each rank computes n_heads / tp query heads, F / tp hidden
units), the attention output and MLP down projections row-parallel (partial sums, one
all-reduce per sub-block). Embedding, norms and the LM head stay replicated. Under
grouped-query attention the k and v columns are n_kv_heads heads, so a rank holds
n_kv_heads / tp of them: exactly those its query heads read (the heads are grouped
consecutively), so tp must divide n_kv_heads too (refused at parse otherwise). The q/k/v
biases (qkv_bias) split with their columns.

Pipeline stages get an even split of the blocks, the first ``n_layers % pp`` stages one
more; the embedding belongs to stage 0, the final norm and LM head to the last stage.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

from services.jobspec import ModelSpec, ParallelSpec, check_parallel

AXES = ("pp", "dp", "tp")
DataParallelKind = Literal["none", "ddp", "fsdp2"]
TPStyle = Literal["colwise", "rowwise"]


class TopologyWarning(UserWarning):
    """A plan that works but communicates across nodes where it should not."""


@dataclass(frozen=True)
class Topology:
    """Where the ranks live: ``rank_nodes[r]`` names rank r's node (any string)."""

    rank_nodes: tuple[str, ...]

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> Topology:
        """Ranks filled node by node, ``ranks_per_node`` on each (the last may hold fewer)."""
        if ranks_per_node < 1:
            raise ValueError(f"topology: ranks_per_node must be >= 1, got {ranks_per_node}")
        return cls(tuple(f"node{r // ranks_per_node}" for r in range(world_size)))

    @classmethod
    def single_node(cls, world_size: int) -> Topology:
        return cls(("node0",) * world_size)


@dataclass(frozen=True)
class ShardingPlan:
    """What every rank does. Immutable; built only by :func:`plan`.

    mesh:             the rank at each mesh coordinate, nested [pp][dp][tp].
    coords:           rank -> (pp, dp, tp) coordinates.
    groups:           axis name -> the rank lists of that axis's process groups (every
                      group of the axis; a rank belongs to exactly one of them).
    stage_layers:     pipeline stage -> the block indices it holds.
    tp_styles:        (linear module FQN, "colwise" | "rowwise"); empty when tp == 1.
    data_parallel:    how the dp axis syncs gradients ("none" when dp == 1).
    microbatches:     pipeline micro-batches per micro-step (pp when the config said 0).
    warnings:         placement concessions (e.g. a tp group spanning nodes).
    """

    dp: int
    tp: int
    pp: int
    mesh: tuple[tuple[tuple[int, ...], ...], ...]
    coords: tuple[tuple[int, int, int], ...]
    groups: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    stage_layers: tuple[tuple[int, ...], ...]
    tp_styles: tuple[tuple[str, TPStyle], ...]
    data_parallel: DataParallelKind
    activation_checkpointing: bool
    pipeline_schedule: str
    microbatches: int
    warnings: tuple[str, ...] = ()

    axis_names: tuple[str, ...] = AXES

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coord(self, rank: int) -> dict[str, int]:
        """{"pp": stage, "dp": replica, "tp": shard} of ``rank``."""
        return dict(zip(AXES, self.coords[rank]))

    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s process group along ``axis`` (ordered by coordinate)."""
        for name, groups in self.groups:
            if name == axis:
                return next(g for g in groups if rank in g)
        raise KeyError(f"no axis {axis!r}; axes are {AXES}")

    def flat_mesh(self) -> list[int]:
        """The mesh's ranks in row-major (pp, dp, tp) order."""
        return [r for plane in self.mesh for row in plane for r in row]


def plan(model: ModelSpec, world_size: int, parallel: ParallelSpec, topology: Topology | None = None) -> ShardingPlan:
    """The sharding plan of a job.

    Args:
        model: the job's model section (sizes are checked against the tp and pp degrees).
        world_size: the ranks the job was given.
        parallel: the job's ``parallel`` section (dp, tp, pp, data_parallel,
            activation_checkpointing, pipeline_schedule, microbatches).
        topology: which node each rank lives on (default: all on one node).

    Raises:
        ValueError: an impossible configuration, one line naming the field (the rules are
            :func:`services.jobspec.check_parallel`, so a job spec is refused when parsed:
            dp * tp * pp differs from the world size; n_heads, n_kv_heads, d_model or the
            MLP hidden width not divisible by tp; ddp with tp > 1; fewer layers than
            stages; tied embeddings with pp > 1; fewer micro-batches than stages under
            1f1b); a topology that does not list every rank.

    Warns:
        TopologyWarning: a tp group had to span nodes (tp larger than the ranks of a node,
            or node sizes that tp does not divide). The plan is still returned.
    """
    check_parallel(model, world_size, parallel)  # ValueError naming the field
    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    topology = topology or Topology.single_node(world_size)
    if len(topology.rank_nodes) != world_size:
        raise ValueError(f"topology: lists {len(topology.rank_nodes)} ranks, the world has {world_size}")

    order, notes = _node_major_order(topology, tp)
    for note in notes:
        warnings.warn(note, TopologyWarning, stacklevel=2)
    mesh = tuple(tuple(tuple(order[(s * dp + d) * tp : (s * dp + d + 1) * tp]) for d in range(dp)) for s in range(pp))
    coords: list[tuple[int, int, int]] = [(0, 0, 0)] * world_size
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                coords[mesh[s][d][t]] = (s, d, t)
    groups = (
        ("pp", tuple(tuple(mesh[s][d][t] for s in range(pp)) for d in range(dp) for t in range(tp))),
        ("dp", tuple(tuple(mesh[s][d][t] for d in range(dp)) for s in range(pp) for t in range(tp))),
        ("tp", tuple(mesh[s][d] for s in range(pp) for d in range(dp))),
    )
    return ShardingPlan(
        dp=dp, tp=tp, pp=pp, mesh=mesh, coords=tuple(coords), groups=groups,
        stage_layers=stage_layers(model.n_layers, pp),
        tp_styles=tp_styles(model) if tp > 1 else (),
        data_parallel="none" if dp == 1 else parallel.data_parallel,
        activation_checkpointing=parallel.activation_checkpointing,
        pipeline_schedule=parallel.pipeline_schedule,
        microbatches=parallel.microbatches or pp,
        warnings=tuple(notes),
    )  # fmt: skip


def stage_layer_counts(n_layers: int, pp: int) -> tuple[int, ...]:
    """Pipeline stage -> how many blocks it holds: ``n_layers`` split into ``pp`` runs, the
    first ``n_layers % pp`` stages one longer (what :func:`stage_layers` lists, in O(pp))."""
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def stage_of_layer(n_layers: int, pp: int, layer: int) -> int:
    """The pipeline stage that holds block ``layer`` (:func:`stage_layers`' split, in O(1))."""
    base, extra = divmod(n_layers, pp)
    long_runs = extra * (base + 1)  # the first ``extra`` stages hold base + 1 blocks each
    return layer // (base + 1) if layer < long_runs else extra + (layer - long_runs) // base


def stage_layers(n_layers: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Pipeline stage -> the block indices it holds (:func:`stage_layer_counts`' runs, in
    order). Depends on no rank (the plan's mesh does)."""
    stages, first = [], 0
    for n in stage_layer_counts(n_layers, pp):
        stages.append(tuple(range(first, first + n)))
        first += n
    return tuple(stages)


def block_tp_styles(model: ModelSpec) -> tuple[tuple[str, TPStyle], ...]:
    """Megatron's split of one block's linears, by FQN within the block (``attn.q``, ...)."""
    out: list[tuple[str, TPStyle]] = [("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"),
                                      ("attn.proj", "rowwise")]  # fmt: skip
    if model.mlp == "swiglu":
        out.append(("mlp.gate", "colwise"))
    out += [("mlp.up", "colwise"), ("mlp.down", "rowwise")]
    return tuple(out)


def tp_styles(model: ModelSpec) -> tuple[tuple[str, TPStyle], ...]:
    """Megatron's split of each block's linears, by module FQN (see the module docstring)."""
    block = block_tp_styles(model)
    return tuple((f"blocks.{i}.{fqn}", style) for i in range(model.n_layers) for fqn, style in block)


def _node_major_order(topology: Topology, tp: int) -> tuple[list[int], list[str]]:
    """Ranks listed node by node (nodes in order of their first rank), and the notes on tp
    groups that could not stay inside one node."""
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(topology.rank_nodes):
        nodes.setdefault(node, []).append(rank)
    order = [r for ranks in nodes.values() for r in ranks]
    notes = []
    if tp > 1:
        node_of = topology.rank_nodes
        spanning = [
            order[i : i + tp] for i in range(0, len(order), tp) if len({node_of[r] for r in order[i : i + tp]}) > 1
        ]
        if spanning:
            sizes = sorted({len(v) for v in nodes.values()})
            notes.append(
                f"parallel.tp: {len(spanning)} tp group(s) span nodes (first: ranks {spanning[0]}); nodes hold "
                f"{'/'.join(map(str, sizes))} ranks and tp is {tp}: tensor-parallel all-reduces will cross nodes"
            )
    return order, notes
