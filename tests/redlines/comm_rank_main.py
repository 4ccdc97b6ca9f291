"""One rank of short two-rank jobs with the communication guard installed, as rank.py
installs it: ``python comm_rank_main.py RANK RUNS_JSON`` where RUNS_JSON is
``[[master_port, parallel], ...]``, run one after the other in this process (one process
start for all of them). Prints one JSON line per run: every crossing the guard saw in it
(module, op, site, count, register entry or "").

The rank is wired by the real composition root (fake relays, no checkpoint: the fake
store's collectives are not the real relay's) with a phase marker, so L3-5 registers its
DDP comm hook as a real rank does.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
from rank_fakes import LocalRank, tiny_spec

import services.rank.__main__ as rank_module
from services.common.phase import PhaseMarker
from services.common.process_exit import exit_now
from services.contract import comm_guard, engine_pb2


def main() -> None:
    rank, runs = int(sys.argv[1]), json.loads(sys.argv[2])
    guard = comm_guard.install(mode="report")  # as rank.py main does, after the imports
    torch.set_num_threads(1)
    compose = rank_module.compose
    for port, parallel in runs:
        guard.reset()
        model = {"tie_embeddings": False} if parallel.get("pp", 1) > 1 else {}
        spec = tiny_spec(
            steps=2,
            parallel=parallel,
            model=model,
            data={"micro_batch_size": 4, "grad_accum": 2},
            eval={"at_end": True, "batches": 1},
        )
        rank_module.compose = functools.partial(compose, phase=PhaseMarker())
        local = LocalRank(spec, None, rank=rank, world_size=2, port=port)
        local.command(engine_pb2.StartTraining(job_id="job"))
        local.run()  # (ends with L2-2's shutdown: the process group is destroyed)
        if local.error is not None:
            raise local.error
        name = comm_guard._name
        print(json.dumps([[name(c.module), c.op, c.site, c.count, c.exception] for c in guard.crossings()]), flush=True)
    exit_now(0)


if __name__ == "__main__":
    main()
