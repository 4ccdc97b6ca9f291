"""The node of every rank of a job (``RankAssignment.rank_nodes``, index = rank): how it was
carried, and the form in which ranks now learn it at their rendezvous (the end of this file).

Legacy (launch35): an older L1-2 sends it once per launch as runs of consecutive ranks on one
node (``LaunchRanks.node_runs``), and in a rebuild's rendezvous the same way
(``RebuildParallelGroup.node_runs``); the node agent and the rank still read those. The
current L1-2 sends neither (the history below, then the section at the end).

Why: each rank's assignment carried the whole world's list, and a node agent's launch holds
all its ranks' assignments, so a job's launches were quadratic in its ranks (8,192 ranks on
1,024 nodes: 741 MB; bench/control_start.py, issue 28). Ranks fill nodes in order, so the list
is a few runs (one per node); L1-2 sends them once per launch and the node agent expands them
into each assignment before its rank starts: what the rank receives is unchanged.

A rebuild in place sent ``RebuildParallelGroup`` with the world's list to L2-2 of every rank,
one copy per node agent that runs the job (the session hub queues the same command on each):
O(ranks x nodes) bytes per rebuild, ~84 MB at 8,192 ranks on 1,024 nodes. L1-2 sends runs there
too and the rank expands them (``nodes_of``): the node agent relays routed commands as they
came (it checks their route, it does not parse them), so the rank, which parses it, expands.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from services.contract import engine_pb2


def node_runs(rank_nodes: Sequence[str]) -> list[engine_pb2.NodeRun]:
    """``rank_nodes`` (the node of each rank, index = rank) as runs of consecutive ranks on one node."""
    runs: list[engine_pb2.NodeRun] = []
    for node in rank_nodes:
        if runs and runs[-1].worker_id == node:
            runs[-1].ranks += 1
        else:
            runs.append(engine_pb2.NodeRun(worker_id=node, ranks=1))
    return runs


def expand(runs: Iterable[engine_pb2.NodeRun]) -> list[str]:
    """The node of each rank, index = rank: ``node_runs`` undone."""
    return [run.worker_id for run in runs for _ in range(run.ranks)]


def nodes_of(msg: Any) -> list[str]:
    """The node of each rank a message names (a ``RebuildParallelGroup``): its own
    ``rank_nodes`` where it carries them, else its ``node_runs`` expanded (empty: neither)."""
    return list(msg.rank_nodes) or expand(msg.node_runs)


# ---------------------------------------------------------------- the map a rank learns at its rendezvous
#
# Why (issue 28, launch35): the runs above made each launch O(nodes), still O(nodes²) for a job
# of one-rank nodes (10,000 nodes: 10^8 runs built by L1-2, 13.2 GB of control's memory, then
# the OOM killer). L1-2 now sends neither: each rank names its own node at its rendezvous store
# and the last to arrive publishes the map once, in the form below, which the planner needs
# (services/engine/node_map.py). The planner reads only which ranks share a node, not the
# nodes' names, so the map names nodes by their order of first appearance and folds runs of
# equal size on successive new nodes into one group: a job filled node by node is one group
# whatever its size; each irregularity (a replacement on another node, mixed node sizes) adds one.


def node_groups(rank_nodes: Sequence[str]) -> list[tuple[int, int, int]]:
    """``rank_nodes`` (index = rank) as groups ``(first node, ranks per node, nodes)``: ``nodes``
    runs of ``ranks per node`` consecutive ranks on the nodes ``first node``, ``first node + 1``,
    ... (nodes numbered 0, 1, ... in the order of their first rank)."""
    number: dict[str, int] = {}
    groups: list[tuple[int, int, int]] = []
    for run in node_runs(rank_nodes):
        node = number.setdefault(run.worker_id, len(number))
        if groups and groups[-1][1] == run.ranks and groups[-1][0] + groups[-1][2] == node:
            first, size, nodes = groups[-1]
            groups[-1] = (first, size, nodes + 1)
        else:
            groups.append((node, run.ranks, 1))
    return groups


def expand_groups(groups: Iterable[Sequence[int]]) -> list[str]:
    """The node of each rank, index = rank, from :func:`node_groups` (nodes named ``node<i>``):
    the same partition of the ranks into nodes as the list it was made from."""
    return [f"node{first + k}" for first, size, nodes in groups for k in range(nodes) for _ in range(size)]
