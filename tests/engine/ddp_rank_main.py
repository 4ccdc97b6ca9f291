"""One rank of the two-process DDP test: ``python ddp_rank_main.py RANK PORT DIR``.

Runs the real rank wiring (fake relays) under a 2-rank gloo group and saves what the test
compares: final weights, reported losses, the first local batch, and the communication the
guard saw outside L3-5 (installed and wired with a phase marker as rank.py does, so L3-5's
DDP comm hook runs its all-reduces through Python where the guard sees them).
"""

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.contract import comm_guard

guard = comm_guard.install(mode="report")

from rank_fakes import LocalRank, tiny_spec  # noqa: E402

import services.rank.__main__ as rank_module  # noqa: E402
from services.common.phase import PhaseMarker  # noqa: E402
from services.common.process_exit import exit_now  # noqa: E402
from services.contract import engine_pb2  # noqa: E402


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    spec = tiny_spec(
        steps=6,
        parallel={"dp": 2},
        data={"micro_batch_size": 4, "grad_accum": 2},
        eval={"at_end": True, "batches": 2},
        checkpoint={"at_end": True},
    )
    rank_module.compose = functools.partial(rank_module.compose, phase=PhaseMarker())
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
            "crossings": [(c.module, c.op, c.site, c.exception) for c in guard.crossings()],
        },
        out / f"rank{rank}.pt",
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
