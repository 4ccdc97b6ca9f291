"""An older L1-2's launch (issue 28, launch35: the current one sends no node list; each rank
learns it at its rendezvous, tests/engine/test_node_map.py): the node agent fills each
assignment's ``rank_nodes`` from its ``node_runs`` (services/common/rank_nodes.py), so that
rank receives the whole list as it expects; a launch that carries it per assignment is taken
as it is."""

from __future__ import annotations

import structlog

from services.common.rank_nodes import node_runs
from services.contract import control_pb2, engine_pb2
from services.worker.node_agent import NodeAgent


def launched_assignments(tmp_path, launch: control_pb2.LaunchRanks) -> list[engine_pb2.RankAssignment]:
    agent = NodeAgent("w1", "127.0.0.1:1", tmp_path, emit=lambda ev: None, log=structlog.get_logger())
    got: list[engine_pb2.RankAssignment] = []
    agent._launch_one = lambda job_id, init, assignment: got.append(assignment)  # (no process: what it would start)
    agent.launch_ranks(launch)
    return got


def test_each_rank_receives_the_worlds_node_list_from_the_launchs_runs(tmp_path):
    world = ["a", "a", "b", "b"]
    launch = control_pb2.LaunchRanks(
        job_id="j",
        init=engine_pb2.InitJob(job_id="j"),
        ranks=[engine_pb2.RankAssignment(rank=r, world_size=4, device="cpu") for r in (2, 3)],
        node_runs=node_runs(world),
    )
    assert [list(a.rank_nodes) for a in launched_assignments(tmp_path, launch)] == [world, world]


def test_an_assignment_with_its_own_node_list_keeps_it(tmp_path):
    own = engine_pb2.RankAssignment(rank=0, world_size=2, device="cpu", rank_nodes=["x", "y"])
    launch = control_pb2.LaunchRanks(job_id="j", init=engine_pb2.InitJob(job_id="j"), ranks=[own])
    assert [list(a.rank_nodes) for a in launched_assignments(tmp_path, launch)] == [["x", "y"]]
