"""A job's launches carry no list of the world's nodes (issue 28): in every rank's assignment
8,192 ranks on 1,024 nodes were 741 MB of LaunchRanks; once per launch as runs, still O(nodes²)
per job (10,000 one-rank nodes: 10^8 runs, control OOM-killed; bench/control_start.py). Each
rank learns the nodes at its rendezvous (services/engine/node_map.py); an older L1-2's runs
are still expanded by the node agent (tests/worker/test_rank_nodes.py)."""

from __future__ import annotations

import pytest

from services.common.rank_nodes import expand, node_runs, nodes_of
from services.contract import control_pb2, engine_pb2
from services.control.resource_allocator import ResourceAllocator
from services.jobspec import parse_job_spec, spec_to_json

from .conftest import registration, spec_yaml

# (case, rank_nodes) -> runs as (worker id, ranks)
RUNS = [
    ("no ranks", [], []),
    ("one node", ["a"] * 4, [("a", 4)]),
    ("filled in order", ["a", "a", "b", "b", "c"], [("a", 2), ("b", 2), ("c", 1)]),
    ("scattered by a rebuild", ["a", "b", "a", "a"], [("a", 1), ("b", 1), ("a", 2)]),
]


@pytest.mark.parametrize("rank_nodes, runs", [c[1:] for c in RUNS], ids=[c[0] for c in RUNS])
def test_the_node_list_as_runs_expands_to_the_same_list(rank_nodes, runs):
    encoded = node_runs(rank_nodes)
    assert [(r.worker_id, r.ranks) for r in encoded] == runs
    assert expand(encoded) == rank_nodes


def launches(world: int, per_node: int) -> list[control_pb2.LaunchRanks]:
    sent: list[control_pb2.LaunchRanks] = []

    def hardware(msg, payload=None):
        if isinstance(msg, control_pb2.LaunchRanks):
            sent.append(msg)

    allocator = ResourceAllocator(hardware=hardware, emit=lambda msg, payload=None: None)
    for i in range(-(-world // per_node)):  # (the last node partly used where per_node does not divide world)
        allocator.on_worker_registration(registration(f"node-{i:05d}", per_node))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(parse_job_spec(spec_yaml(dp=world))))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    return sent


def others(sent: list[control_pb2.LaunchRanks]) -> list[control_pb2.LaunchRanks]:
    """The launches of every node but rank 0's (whose link probe names every node of the job:
    one launch O(nodes), the job's O(nodes))."""
    return [launch for launch in sent if all(a.rank != 0 for a in launch.ranks)]


def test_a_nodes_launch_is_the_same_size_whatever_the_jobs_node_count():
    """One-rank nodes: a launch names its own rank, not the world's nodes (the old code: 100
    nodes' launches ~2.1 KB each, 1,000 nodes' ~17.6 KB, quadratic in all; 10,000 OOM-killed
    control, issue 28). Each rank learns the world's nodes at its rendezvous
    (services/engine/node_map.py, tests/engine/test_node_map.py)."""
    small, large = launches(world=100, per_node=1), launches(world=1_000, per_node=1)
    assert (len(small), len(large)) == (100, 1_000)
    per_node = {n: max(m.ByteSize() for m in others(sent)) for n, sent in ((100, small), (1_000, large))}
    assert per_node[1_000] <= per_node[100] + 4, per_node  # (+4: a larger rank's varint)
    for launch in small + large:
        assert not launch.node_runs and all(not a.rank_nodes for a in launch.ranks)
    assert sum(m.ByteSize() for m in large) < 12 * sum(m.ByteSize() for m in small)


def test_each_rank_is_told_its_place_among_its_nodes_ranks():
    """What a node agent read the world's list for (LOCAL_RANK, LOCAL_WORLD_SIZE: its
    binding) comes in each assignment."""
    sent = launches(world=20, per_node=8)  # (8, 8, 4)
    got = sorted((a.rank, a.worker_id, a.local_rank, a.local_world_size) for m in sent for a in m.ranks)
    assert got == [(r, f"node-{r // 8:05d}", r % 8, 8 if r < 16 else 4) for r in range(20)]


def rebuild_in_place(world: int, per_node: int, lost: list[int], exclude: list[str] = ()):
    """One rebuild in place of the ``lost`` ranks of a job over world/per_node nodes
    (``exclude``: nodes lost, their ranks placed elsewhere): the rendezvous L1-2 sends L2-2 of
    every rank, the launches it sends, and where the ranks are."""
    rebuilds: list[engine_pb2.RebuildParallelGroup] = []
    sent: list[tuple[control_pb2.LaunchRanks, str]] = []
    allocator = ResourceAllocator(
        hardware=lambda msg, payload=None: (
            sent.append((msg, payload)) if isinstance(msg, control_pb2.LaunchRanks) else None
        ),
        emit=lambda msg, payload=None: None,
        parallel=lambda msg, payload=None: rebuilds.append(msg),
    )
    for i in range(world // per_node + 1):  # (one node more, free: a lost node's ranks go there)
        allocator.on_worker_registration(registration(f"node-{i:05d}", per_node))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(parse_job_spec(spec_yaml(dp=world))))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    sent.clear()
    ready = allocator.rebuild_communicator(
        control_pb2.RebuildCommunicator(
            job_id="j", reason="test", in_place=True, lost_ranks=lost, exclude_worker_ids=list(exclude)
        )
    )
    assert isinstance(ready, control_pb2.ResourcesReady), ready
    (rebuild,) = rebuilds
    return rebuild, [(launch, worker) for launch, worker in sent if launch.ranks], ready


def test_a_rebuilds_rendezvous_is_the_same_size_whatever_the_jobs_node_count():
    """The rendezvous goes to every node agent of the job: it names no nodes now (the old
    code: runs of the world's nodes, 15 KB per agent at 1,000 one-rank nodes, 135 MB per
    rebuild at 3,000: bench/control_start.py ``--rebuild-sizes``)."""
    small, _, _ = rebuild_in_place(world=64, per_node=1, lost=[1])
    large, _, _ = rebuild_in_place(world=1_000, per_node=1, lost=[1])
    for rebuild in (small, large):
        assert not rebuild.node_runs and not rebuild.rank_nodes
    assert large.ByteSize() <= small.ByteSize() + 4, (small.ByteSize(), large.ByteSize())


def test_a_rebuild_after_a_node_loss_launches_its_ranks_on_the_new_node_with_their_place_there():
    """Node 1 (ranks 8-15) lost: its ranks go to the free node 3; the replacements' launch
    names that node and each rank's place among its 8 (the survivors' nodes get no launch)."""
    rebuild, sent, ready = rebuild_in_place(world=24, per_node=8, lost=list(range(8, 16)), exclude=["node-00001"])
    assert [worker for _, worker in sent] == ["node-00003"] and list(ready.replaced_ranks) == list(range(8, 16))
    ((launch, _),) = sent
    got = [(a.rank, a.worker_id, a.local_rank, a.local_world_size) for a in launch.ranks]
    assert got == [(r, "node-00003", r - 8, 8) for r in range(8, 16)]
    assert (rebuild.world_size, list(rebuild.lost_ranks)) == (24, list(range(8, 16)))


def test_a_rank_reads_the_nodes_of_either_form():
    """``nodes_of``: the list where a message carries it (a rendezvous of an older sender, or a
    test's), else its runs expanded."""
    listed = engine_pb2.RebuildParallelGroup(rank_nodes=["a", "b"], node_runs=node_runs(["x", "x"]))
    assert nodes_of(listed) == ["a", "b"]
    assert nodes_of(engine_pb2.RebuildParallelGroup(node_runs=node_runs(["a", "a", "b"]))) == ["a", "a", "b"]
    assert nodes_of(engine_pb2.RebuildParallelGroup()) == []


def test_a_jobs_launch_costs_calls_linear_in_its_nodes():
    """Each node's memory peer and link probe are looked up in rings built once per launch:
    the old code scanned the node list per launched node, O(nodes²) (most of a 4,000-node
    launch in py-spy, session 34). Counted in calls (the same on a loaded machine): 10x the
    nodes costs about 10x, not 100x."""
    from .test_offer_capacity import profiled_calls

    def cost(nodes: int) -> int:
        allocator = ResourceAllocator(hardware=lambda msg, payload=None: None, emit=lambda msg, payload=None: None)
        for i in range(nodes):
            allocator.on_worker_registration(registration(f"node-{i:05d}", 1))
        init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(parse_job_spec(spec_yaml(dp=nodes))))
        msg = control_pb2.AllocateResources(job_id="j", world_size=nodes, init=init)
        return profiled_calls(lambda: allocator.allocate_resources(msg))

    small, large = cost(200), cost(2000)
    assert large < 20 * small, (small, large)
