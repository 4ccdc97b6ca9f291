"""One rank of the node map test: ``python node_map_rank_main.py RANK PORT OUT NODES TP``.

The rank's real L2-2 (its ports to L3-1 and L3-5 take the plan and do nothing) gets an
assignment as a current L1-2 sends it: its own node (``worker_id``, NODES[RANK] of the
comma-separated NODES) and no list of the world's. It joins the 4-rank gloo group and writes
what it planned on: the node map it learned at the rendezvous and the plan's tp groups.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.process_exit import exit_now
from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.engine.parallel_strategy import ParallelStrategy
from services.jobspec import ModelSpec, ParallelSpec


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    nodes, tp = sys.argv[4].split(","), int(sys.argv[5])
    torch.set_num_threads(1)
    bus = Bus()
    for target in (Module.L3_SHARD_LOADER, Module.L3_GRADIENT_REDUCTION):
        bus.subscribe(target, engine_pb2.ParallelPlan, lambda m, p=None: None)
    strategy = ParallelStrategy(
        bus.emitter(Module.L2_PARALLEL_STRATEGY),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_SHARD_LOADER),
        bus.port(Module.L2_PARALLEL_STRATEGY, Module.L3_GRADIENT_REDUCTION),
        model=ModelSpec(n_layers=1, d_model=16, n_heads=2, vocab_size=32),
        parallel=ParallelSpec(dp=len(nodes) // tp, tp=tp, data_parallel="fsdp2"),
        rendezvous_timeout_s=60,
    )
    strategy.rank_assignment(
        engine_pb2.RankAssignment(
            rank=rank, world_size=len(nodes), master_addr="127.0.0.1", master_port=port, backend="gloo",
            device="cpu", worker_id=nodes[rank],
        )
    )  # fmt: skip
    plan = strategy._plan
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {"nodes": list(getattr(strategy, "_nodes", ())), "tp_groups": [list(g) for g in dict(plan.groups)["tp"]]}
        )
    )
    dist.barrier()  # (no rank leaves the group while another still forms its mesh)
    strategy.shutdown()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
