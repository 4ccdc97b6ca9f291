"""A rank learns which node every rank of its group runs on at the group's rendezvous store
(services/engine/node_map.py): L1-2 no longer sends the world's node list (issue 28, launch35:
O(nodes²) bytes per job; 10,000 one-rank nodes OOM-killed control). What the planner gets is
the partition the list gave: tensor-parallel groups stay inside nodes as before."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from rank_fakes import free_port

from services.common.rank_nodes import expand_groups, node_groups
from services.contract import Module
from services.contract.bus import Bus
from services.engine.parallel_strategy import ParallelStrategy
from services.engine.sharding_plan import Topology, plan
from services.jobspec import ModelSpec, ParallelSpec
from tests.rank_forks import run_ranks_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# (case, rank_nodes, folded groups)
MAPS = [
    ("one node", ["a"] * 4, [(0, 4, 1)]),
    ("filled node by node", ["a", "a", "b", "b", "c", "c"], [(0, 2, 3)]),
    ("one rank per node", [f"n{i}" for i in range(10_000)], [(0, 1, 10_000)]),
    ("a last node smaller", ["a", "a", "b", "b", "c"], [(0, 2, 2), (2, 1, 1)]),
    ("a replacement on a new node", ["a", "a", "b", "x", "b", "c", "c"], [(0, 2, 1), (1, 1, 2), (1, 1, 1), (3, 2, 1)]),
    ("scattered", ["a", "b", "a", "b"], [(0, 1, 2), (0, 1, 2)]),
    ("no node named", [""] * 3, [(0, 3, 1)]),
]


def partition(rank_nodes: list[str]) -> list[list[int]]:
    """Which ranks share a node (what the planner reads), nodes in order of their first rank."""
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        nodes.setdefault(node, []).append(rank)
    return list(nodes.values())


@pytest.mark.parametrize("rank_nodes, groups", [c[1:] for c in MAPS], ids=[c[0] for c in MAPS])
def test_the_folded_map_keeps_which_ranks_share_a_node(rank_nodes, groups):
    assert node_groups(rank_nodes) == groups
    expanded = expand_groups(groups)
    assert partition(expanded) == partition(rank_nodes)
    model, parallel = ModelSpec(n_layers=1, d_model=16, n_heads=2, vocab_size=32), None
    if len(rank_nodes) % 2 == 0 and len(rank_nodes) <= 8:  # (the planner's tp groups are the list's)
        parallel = ParallelSpec(dp=len(rank_nodes) // 2, tp=2, data_parallel="fsdp2")
        got = plan(model, len(rank_nodes), parallel, Topology(tuple(expanded)))
        assert got == plan(model, len(rank_nodes), parallel, Topology(tuple(rank_nodes)))


def strategy() -> ParallelStrategy:
    bus = Bus()
    return ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        rendezvous_timeout_s=60,
    )


def rendezvous(nodes: list[str]) -> list[tuple[str, ...]]:
    """Each rank of ``len(nodes)`` counts itself in at one real rendezvous store (rank 0 hosts
    it), naming its own node only; what each learned."""
    port, ranks = free_port(), [strategy() for _ in nodes]
    learned: list[tuple[str, ...] | BaseException] = [()] * len(nodes)
    stores: list[object] = []  # (rank 0's hosts the store: kept until every rank has read it)

    def arrive(rank: int) -> None:
        try:
            store, learned[rank] = ranks[rank]._arrive("127.0.0.1", port, rank, len(nodes), nodes[rank])
            stores.append(store)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            learned[rank] = e

    threads = [threading.Thread(target=arrive, args=(r,), daemon=True) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank still waits at the rendezvous"
    return learned


@pytest.mark.timeout(180)
def test_every_rank_learns_every_ranks_node_at_the_rendezvous_and_the_new_ones_after_a_node_loss():
    before = ["w0", "w0", "w1", "w1", "w2", "w2"]
    learned = rendezvous(before)
    assert all(isinstance(m, tuple) for m in learned), learned
    assert {m for m in learned} == {tuple(expand_groups(node_groups(before)))}
    assert partition(list(learned[0])) == [[0, 1], [2, 3], [4, 5]]
    # w1 lost: ranks 2 and 3 replaced on w3 and w0 (a node with a free slot) at the rebuild's
    # rendezvous; every rank, survivor or replacement, learns the new map there.
    after = ["w0", "w0", "w3", "w0", "w2", "w2"]
    learned = rendezvous(after)
    assert all(isinstance(m, tuple) for m in learned), learned
    assert all(partition(list(m)) == [[0, 1, 3], [2], [4, 5]] for m in learned), learned


@pytest.mark.timeout(180)
def test_rank_processes_given_only_their_own_node_keep_tensor_parallel_groups_inside_nodes(tmp_path):
    """4 real gloo rank processes on nodes a, b, a, b (ranks placed across nodes), tp=2: each
    learns the map and pairs ranks 0 and 2, 1 and 3 (the old code, given no list: one node,
    pairs 0-1 and 2-3, every tp all-reduce across nodes)."""
    port, nodes = free_port(), "a,b,a,b"
    run_ranks_to_end(
        [[str(HERE / "node_map_rank_main.py"), str(r), str(port), str(tmp_path), nodes, "2"] for r in range(4)],
        timeout=150,
        cwd=REPO,
    )
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(partition(g["nodes"]) == [[0, 2], [1, 3]] for g in got), got
    assert all(g["tp_groups"] == [[0, 2], [1, 3]] for g in got), got
