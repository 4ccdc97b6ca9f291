"""One rank of the boundary agreement test: ``python boundary_rank_main.py RANK PORT DIR``.

Two gloo ranks wired by the real rank composition root (fake relays: rank_fakes.py), data
parallel (DDP). A stand-in for L1-1 on each rank sends the boundary commands in order, each
once this rank's loop has shown the previous one took effect (what control waits for too),
through the test-only delivery delay of the real rank's session (services/rank/command_delay.py,
``SURGE_COMMAND_DELAY`` set by the test: rank 1 gets every boundary command seconds late, in
line, as a backlog would hold it):

    1 RevokeStandingOrder(order 7)                then 2 steps
    2 PauseTraining(checkpoint)                   paused: ResumeTraining, then 2 steps
    3 PauseTraining(no checkpoint: a scale's)     paused: ResumeTraining, then 2 steps
    4 StopTraining(checkpoint)                    finished

Writes DIR/rank-RANK.json: every StepCompleted's (step, commands_agreed), the paused steps,
the finished step, the revoked orders and, per command, the step this rank had completed
when the command was handed to its loop.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rank_fakes import LocalRank, tiny_spec

from services.common.process_exit import exit_now
from services.contract import engine_pb2
from services.rank.command_delay import CommandDelay

ORDER = 7


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    spec = tiny_spec(steps=100000, parallel={"dp": 2}, data={"micro_batch_size": 2}, model={"n_layers": 1})
    local = LocalRank(spec, out / "ckpt", rank=rank, world_size=2, port=port)
    local.init.standing_orders.add(id=ORDER, kind=engine_pb2.STEP_FAULT_NON_FINITE_LOSS, action=engine_pb2.STEP_SKIP)
    local.command(engine_pb2.StartTraining(job_id="job"))
    delay = CommandDelay.from_env(rank)
    handed: dict[int, int] = {}

    def steps() -> list:
        return local.steps()

    def wait(condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if local.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: waited for {what}: {local.error!r}")
            time.sleep(0.01)

    def deliver(msg) -> None:
        delay.hold(msg.DESCRIPTOR.full_name)  # the session reader's hook, in line
        handed[msg.seq] = len(steps())
        local.command(msg)

    def paused() -> int:
        return len(local.up.of(engine_pb2.TrainingLoopPaused))

    def control() -> None:
        wait(lambda: len(steps()) >= 3, "step 3")
        deliver(engine_pb2.RevokeStandingOrder(job_id="job", order=ORDER, seq=1))
        wait(lambda: steps()[-1].commands_agreed >= 1, "the revoke agreed")
        done = len(steps())
        wait(lambda: len(steps()) >= done + 2, "2 more steps")
        for seq, checkpoint in ((2, True), (3, False)):
            deliver(engine_pb2.PauseTraining(job_id="job", seq=seq, checkpoint=checkpoint))
            wait(lambda n=seq - 1: paused() >= n, f"pause {seq}")
            done = len(steps())
            local.command(engine_pb2.ResumeTraining(job_id="job"))
            wait(lambda n=done: len(steps()) >= n + 2, "2 steps after the resume")
        deliver(engine_pb2.StopTraining(job_id="job", seq=4, checkpoint=True))

    driver = threading.Thread(target=control, daemon=True)
    driver.start()
    local.run()
    if local.error is not None:
        raise local.error
    driver.join(5)
    (finished,) = local.up.of(engine_pb2.TrainingLoopFinished)
    result = {
        "steps": [(s.step, s.commands_agreed) for s in steps()],
        "paused": [p.step for p in local.up.of(engine_pb2.TrainingLoopPaused)],
        "finished": [finished.step, finished.stopped],
        "revoked": {str(k): v for k, v in local.modules.loop._revoked.items()},
        "handed": handed,
        "committed": [c.step for c in local.store.committed],
        "delay_env": os.environ.get("SURGE_COMMAND_DELAY", ""),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
