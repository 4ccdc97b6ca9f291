"""A job's launches carry the world's node list once per node agent, as runs, not in every
rank's assignment (issue 28): 8,192 ranks on 1,024 nodes were 741 MB of LaunchRanks, quadratic
in the ranks (bench/control_start.py). What each rank receives is unchanged: its node agent
fills the assignment's ``rank_nodes`` from the launch's ``node_runs`` (tests/worker/test_rank_nodes.py)."""

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
    for i in range(world // per_node):
        allocator.on_worker_registration(registration(f"node-{i:04d}", per_node))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(parse_job_spec(spec_yaml(dp=world))))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    return sent


def test_a_launch_carries_the_worlds_nodes_once_not_in_every_assignment():
    sent = launches(world=64, per_node=8)
    world = [f"node-{r // 8:04d}" for r in range(64)]
    assert len(sent) == 8
    for launch in sent:
        assert [a.rank_nodes for a in launch.ranks] == [[]] * 8  # (each was the 64-entry list)
        assert expand(launch.node_runs) == world and len(launch.node_runs) == 8


def test_a_jobs_launches_are_not_quadratic_in_its_ranks():
    """512 ranks on 64 nodes: each launch carries 64 runs, not 8 assignments x 512 names; the
    job's launches were 3,076,579 bytes (the old code), 253,923 now (bench/control_start.py)."""
    sent = launches(world=512, per_node=8)
    assert {len(launch.node_runs) for launch in sent} == {64}
    assert sum(m.ByteSize() for m in sent) < 400_000


def rebuild_in_place(world: int, per_node: int) -> engine_pb2.RebuildParallelGroup:
    """One rebuild in place of rank 1 of a job over world/per_node nodes (its replacement on
    its own node): the rendezvous L1-2 sends L2-2 of every rank."""
    rebuilds: list[engine_pb2.RebuildParallelGroup] = []
    allocator = ResourceAllocator(
        hardware=lambda msg, payload=None: None,
        emit=lambda msg, payload=None: None,
        parallel=lambda msg, payload=None: rebuilds.append(msg),
    )
    for i in range(world // per_node):
        allocator.on_worker_registration(registration(f"node-{i:04d}", per_node))
    init = engine_pb2.InitJob(job_id="j", spec_json=spec_to_json(parse_job_spec(spec_yaml(dp=world))))
    allocator.allocate_resources(control_pb2.AllocateResources(job_id="j", world_size=world, init=init))
    ready = allocator.rebuild_communicator(
        control_pb2.RebuildCommunicator(job_id="j", reason="test", in_place=True, lost_ranks=[1])
    )
    assert isinstance(ready, control_pb2.ResourcesReady), ready
    (rebuild,) = rebuilds
    return rebuild


def test_a_rebuilds_rendezvous_carries_the_worlds_nodes_as_runs():
    """The rendezvous of a rebuild in place names every rank's node as runs, not as the
    world's list: the same command goes to every node agent of the job (the old code: 64
    names, the runs empty)."""
    rebuild = rebuild_in_place(world=64, per_node=8)
    nodes = [f"node-{r // 8:04d}" for r in range(64)]
    assert list(rebuild.rank_nodes) == []
    assert expand(rebuild.node_runs) == nodes and nodes_of(rebuild) == nodes
    assert len(rebuild.node_runs) == 8


def test_a_rebuilds_rendezvous_is_not_the_size_of_the_world():
    """8 ranks per node: one rendezvous is O(nodes), not O(ranks): 512 ranks' was ~5.7 KB
    (the world's list), now under 1.5 KB; it goes to each of the job's 64 node agents
    (bench/control_start.py ``--rebuild-sizes``)."""
    rebuild = rebuild_in_place(world=512, per_node=8)
    assert len(rebuild.node_runs) == 64
    assert rebuild.ByteSize() < 1_500


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
