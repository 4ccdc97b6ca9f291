"""The node of every rank of a job (``RankAssignment.rank_nodes``, index = rank), carried once
per launch as runs of consecutive ranks on one node (``LaunchRanks.node_runs``).

Why: each rank's assignment carried the whole world's list, and a node agent's launch holds
all its ranks' assignments, so a job's launches were quadratic in its ranks (8,192 ranks on
1,024 nodes: 741 MB; bench/control_start.py, issue 28). Ranks fill nodes in order, so the list
is a few runs (one per node); L1-2 sends them once per launch and the node agent expands them
into each assignment before its rank starts: what the rank receives is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.contract import control_pb2


def node_runs(rank_nodes: Sequence[str]) -> list[control_pb2.NodeRun]:
    """``rank_nodes`` (the node of each rank, index = rank) as runs of consecutive ranks on one node."""
    runs: list[control_pb2.NodeRun] = []
    for node in rank_nodes:
        if runs and runs[-1].worker_id == node:
            runs[-1].ranks += 1
        else:
            runs.append(control_pb2.NodeRun(worker_id=node, ranks=1))
    return runs


def expand(runs: Iterable[control_pb2.NodeRun]) -> list[str]:
    """The node of each rank, index = rank: ``node_runs`` undone."""
    return [run.worker_id for run in runs for _ in range(run.ranks)]
