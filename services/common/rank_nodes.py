"""The node of every rank of a job (``RankAssignment.rank_nodes``, index = rank), carried once
per launch as runs of consecutive ranks on one node (``LaunchRanks.node_runs``), and in a
rebuild's rendezvous the same way (``RebuildParallelGroup.node_runs``).

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
