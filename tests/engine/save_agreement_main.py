"""One of two gloo ranks saving through the real checkpoint relay (StoreClient) against the
test's fake store (tests/engine/test_save_agreement.py). Prints one JSON line: what each
save returned, the SnapshotFailed events this rank published, and the communication the
guard (installed as rank.py installs it) saw outside L3-5, with the register entry of each.

    python save_agreement_main.py RANK MASTER_PORT STORE_ADDRESS
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist

from services.common.process_exit import exit_now
from services.contract import Module, comm_guard, store_pb2
from services.contract.acting import run_as
from services.contract.bus import Bus
from services.rank.store_client import StoreClient


def main() -> None:
    warnings.simplefilter("ignore")
    rank, port, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    guard = comm_guard.install(mode="report")  # as rank.py does: the relay's collectives are attributed
    # (the rendezvous stands for L2-2's, as the barrier below for L3-5's all-reduce)
    run_as(
        Module.L2_PARALLEL_STRATEGY,
        dist.init_process_group,
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    bus, failed = Bus(), []
    client = StoreClient(store, bus.emitter(Module.L5_CHECKPOINT_MANAGER))
    for t, h in (
        (store_pb2.SaveCheckpoint, client.save_checkpoint),
        (store_pb2.CommitCheckpoint, client.commit_checkpoint),
        (store_pb2.FlushCheckpoint, client.flush_checkpoint),
    ):
        bus.subscribe(Module.L5_CHECKPOINT_MANAGER, t, h)
    bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SnapshotFailed, lambda m, p=None: failed.append([m.step, m.cause]))
    port_ = bus.port(Module.L2_TRAINING_LOOP, Module.L5_CHECKPOINT_MANAGER)
    staged = {}
    for step in (10, 20, 30, 40):  # the fake store: 10 refused to rank 1; 20's and 30's commits slow (module doc)
        state = {"model": {"w": torch.full((16,), float(step + rank))}}
        reply = port_(store_pb2.SaveCheckpoint(job_id="j", step=step, rank=rank, write_async=True), state).message
        staged[step] = reply.staging_path
        if rank == 0:
            port_(store_pb2.CommitCheckpoint(job_id="j", step=step, world_size=2))
        run_as(Module.L3_GRADIENT_REDUCTION, dist.barrier)  # a training step's all-reduce (L3-5's) stands here
    port_(store_pb2.FlushCheckpoint(job_id="j"))
    crossings = [[Module.Name(c.module) if c.module else "none", c.op, c.site, c.exception] for c in guard.crossings()]
    print(json.dumps({"rank": rank, "staged": staged, "failed": failed, "crossings": crossings}), flush=True)
    client.close(timeout=2)
    dist.destroy_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
