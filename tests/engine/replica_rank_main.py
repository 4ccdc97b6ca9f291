"""One rank of the replica-check test: ``python replica_rank_main.py RANK WORLD PORT DIR
STEPS EVERY INJECT_STEP INJECT_RANK`` (INJECT_STEP 0: no injection).

Runs the real rank wiring (fake relays) under a WORLD-rank gloo group at dp = WORLD with the
replica check every EVERY steps, and the test-only ``corrupt_weights`` injection (services/
rank/faults.py) wired as rank.py wires it, through the StepGuard on the optimizer port. Saves
the loop's failure, its completed steps, the time of each replica check (L3-5's
``_check_replicas``, wall clock) and each step's own time.
"""

import functools
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rank_fakes import LocalRank, tiny_spec

import services.rank.__main__ as rank_module
from services.common.process_exit import exit_now
from services.compute.gradient_reduction import GradientReduction
from services.contract import engine_pb2
from services.rank.faults import FaultInjector, Injection, StepGuard

CHECK_SECONDS: list[float] = []
_check = GradientReduction._check_replicas


def _timed_check(self, t0):
    start = time.perf_counter()
    try:
        return _check(self, t0)
    finally:
        CHECK_SECONDS.append(time.perf_counter() - start)


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    steps, every, inject_step, inject_rank = (int(a) for a in sys.argv[5:9])
    torch.set_num_threads(1)
    GradientReduction._check_replicas = _timed_check
    spec = tiny_spec(steps=steps, parallel={"dp": world}, integrity={"replica_check_every_steps": every})
    injections = [Injection("corrupt_weights", inject_step, inject_rank)] if inject_step else []
    injector = FaultInjector(injections, "job", rank, marker_dir=out / "faults") if injections else None
    guard = StepGuard(lambda: 0, injector=injector)
    rank_module.compose = functools.partial(rank_module.compose, guard=guard)
    local = LocalRank(spec, out / "ckpt", rank=rank, world_size=world, port=port)
    local.command(engine_pb2.StartTraining(job_id="job"))

    def stop_after_failure() -> None:
        # L1's decision, as the test's stand-in for it: a rank that found a replica divergence
        # waits in its loop for it (a rollback in place or a stop; issue 29 item 9): stopped.
        local.up.finished.wait()
        if local.up.of(engine_pb2.TrainingLoopFailed):
            local.command(engine_pb2.StopTraining(job_id="job", seq=1, checkpoint=False))

    threading.Thread(target=stop_after_failure, daemon=True).start()
    local.run()
    failed = local.up.of(engine_pb2.TrainingLoopFailed)
    torch.save(
        {
            "failed": [(f.fault_class, f.step, f.detail) for f in failed],
            "steps": [s.step for s in local.steps()],
            "step_seconds": [s.step_seconds for s in local.steps()],
            "check_seconds": CHECK_SECONDS,
        },
        out / f"rank{rank}.pt",
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
