"""One rank of the two-process DDP test: ``python ddp_rank_main.py RANK PORT DIR``.

Runs the real rank wiring (fake relays) under a 2-rank gloo group and saves what the test
compares: final weights, reported losses, the first local batch.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_fakes import LocalRank, tiny_spec

from services.common.process_exit import exit_now
from services.contract import engine_pb2


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    spec = tiny_spec(steps=6, parallel={"dp": 2}, data={"micro_batch_size": 4, "grad_accum": 2},
                     eval={"at_end": True, "batches": 2}, checkpoint={"at_end": True})
    local = LocalRank(spec, out / "ckpt", rank=rank, world_size=2, port=port)
    local.command(engine_pb2.StartTraining(job_id="job"))
    local.run()
    if local.error is not None:
        raise local.error
    torch.save(
        {
            "state": local.model_state(),
            "losses": [s.loss for s in local.steps()],
            "tokens": [s.tokens for s in local.steps()],
            "eval": [e.loss for e in local.up.of(engine_pb2.EvalCompleted)],
            "first_batch": local.data.first_train_batch,
            "committed": len(local.store.committed),
        },
        out / f"rank{rank}.pt",
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
