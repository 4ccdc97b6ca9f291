"""A rank wired by the real composition root (fake relays) with the rank's fault hooks, for
the precision and skip tests; also runnable as one rank of a gloo job:

    python precision_harness.py RANK WORLD PORT OUT_DIR CKPT_DIR SPEC_JSON [RESUME_VERSION]

Injections come from ``SURGE_FAULT_INJECT`` (job name = the spec's name), as in a real
rank. Saves ``OUT_DIR/rank<R>.pt``: every StepCompleted (as dicts), the loop's final
checkpoint state (``train.*`` scalars), the final weights and the all-rank overflow verdict
L3-5 gives when only rank 0 reports one.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
from rank_fakes import LocalRank

from services.common.process_exit import exit_now
from services.contract import Module, engine_pb2
from services.engine.training_loop import LoopState
from services.jobspec import JobSpec
from services.rank.faults import FaultInjector, Injection, StepGuard

STEP_FIELDS = ("step", "loss", "loss_scale", "skipped", "skip_reason", "grad_norm")


def guarded_rank(
    spec: JobSpec, ckpt: Path, *, injections: list[Injection] | None = None, marker_dir: Path | None = None, **kw: Any
) -> LocalRank:
    """LocalRank with a StepGuard on the backward port (injections from the list, else
    from SURGE_FAULT_INJECT)."""
    import services.rank.__main__ as rank_module

    rank, job_id = kw.get("rank", 0), kw.get("job_id", "job")
    if injections is not None:
        injector = FaultInjector(injections, job_id, rank, marker_dir=marker_dir)
    else:
        injector = FaultInjector.from_env(spec.name, job_id, rank)
    holder: dict[str, LocalRank] = {}

    def current_step() -> int:
        up = holder["rank"].up
        done = up.of(engine_pb2.StepCompleted)
        started = up.of(engine_pb2.TrainingLoopStarted)
        return (done[-1].step if done else started[-1].start_step if started else 0) + 1

    original = rank_module.compose
    rank_module.compose = functools.partial(original, guard=StepGuard(current_step, injector=injector))
    try:
        local = LocalRank(spec, ckpt, **kw)
    finally:
        rank_module.compose = original
    holder["rank"] = local
    return local


def step_dicts(local: LocalRank) -> list[dict[str, Any]]:
    return [{f: getattr(s, f) for f in STEP_FIELDS} for s in local.steps()]


def loop_state(local: LocalRank) -> dict[str, Any]:
    """The scalars the loop checkpoints (what a save after the last step would hold)."""
    state = LoopState(local.modules.loop).state_dict()
    return {k: v.tolist() for k, v in state.items() if isinstance(v, torch.Tensor)}


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, ckpt, spec_json = Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6]
    resume = sys.argv[7] if len(sys.argv) > 7 else ""
    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    local = guarded_rank(spec, ckpt, rank=rank, world_size=world, port=port, resume_version=resume)
    local.command(engine_pb2.StartTraining(job_id="job"))
    verdict = None
    try:
        local.bring_up()
        local.modules.loop.run()
        # L3-5's all-rank verdict when only rank 0 saw an overflow (one more collective,
        # both ranks reach it after the same number of steps).
        reduce = local.bus.port(Module.L2_TRAINING_LOOP, Module.L3_GRADIENT_REDUCTION)
        verdict = reduce(
            engine_pb2.ReduceGradients(local_loss_sum=1.0, local_tokens=1, local_found_inf=rank == 0)
        ).message.found_inf
    except BaseException as e:  # noqa: BLE001 - reported like rank.py does, then saved
        local.error = e
        local.modules.loop.fail(e)
    finally:
        local.modules.parallel.shutdown()
    failed = local.up.of(engine_pb2.TrainingLoopFailed)
    torch.save(
        {
            "steps": step_dicts(local),
            "metrics": [m.skip_reason for m in local.store.metrics if isinstance(m, engine_pb2.StepCompleted)],
            "state": loop_state(local),
            "weights": local.model_state(),
            "verdict": verdict,
            "failed": [(f.fault_class, f.detail) for f in failed],
        },
        out / f"rank{rank}.pt",
    )
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
