"""Which node each rank of a group runs on, learned at the group's rendezvous store (L2-2's),
not sent by L1-2 (issue 28, launch35).

Why: the planner keeps tensor-parallel groups inside a node (services/engine/sharding_plan.py
``Topology``), so every rank needs the whole group's map, O(world) per rank. L1-2 sent it in
every node agent's launch (and in every rebuild's rendezvous, queued on each agent of the job):
O(nodes) per launch, O(nodes²) per job, 10^8 entries and an OOM-killed control for 10,000 one-rank
nodes. As torchrun learns co-location at its rendezvous, each rank now names its own node
(``RankAssignment.worker_id``) at the store while it counts itself in; the last to arrive reads
them all (one ``multi_get``) and publishes the map once, in the folded form of
services/common/rank_nodes.py ``node_groups`` (a job filled node by node is a few bytes whatever
its size); every rank reads that one key after the go. So a launch is O(its own ranks), and the
store serves O(world) reads of a small key, not O(world²) of the world's list.

Only the rendezvous store is used (group lifecycle, L2-2's): no collective, so no tensor
communication outside L3-5 (the red line services/contract/comm_guard.py checks).
"""

from __future__ import annotations

import json

import torch.distributed as dist

from services.common.rank_nodes import expand_groups, node_groups

# Keys of the rendezvous store, beside the group's own (under its prefix "group").
_NODE = "surge/node/"  # + rank: that rank's node
_MAP = "surge/nodes"  # the map, folded (node_groups), set by the last rank to arrive


def publish(store: dist.Store, rank: int, node: str) -> None:
    """This rank's node, before it counts itself in (the last to arrive finds every rank's)."""
    store.set(f"{_NODE}{rank}", node)


def assemble(store: dist.Store, world_size: int) -> None:
    """The last rank to arrive: every rank's node, read at once and published as the map."""
    nodes = [v.decode() for v in store.multi_get([f"{_NODE}{r}" for r in range(world_size)])]
    store.set(_MAP, json.dumps(node_groups(nodes), separators=(",", ":")))


def read(store: dist.Store) -> tuple[str, ...]:
    """The map (index = rank; nodes named ``node<i>`` by their first rank), once the go is given."""
    return tuple(expand_groups(json.loads(store.get(_MAP))))
