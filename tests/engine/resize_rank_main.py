"""One rank of the resize-in-place tests: ``python resize_rank_main.py SCENARIO ROLE RANK PORT DIR``.

The real rank wiring (``services.rank.__main__.compose``, fake L1/L4/L5 relays: rank_fakes.py,
the train stream dealt from one global row order as the real packer deals it) under a gloo
group, data parallel (DDP). Every layout holds the same 12 rows per optimizer step.

SCENARIO (the launch's layout -> the layout L1-2's rendezvous names, dp x micro_batch_size x
grad_accum):
    shrink  3 x 2 x 2 -> 2 x 2 x 3   rank 2 is lost in a gradient all-reduce (no command)
    up      2 x 2 x 3 -> 3 x 2 x 2   an operator's scale: pause, ResumeTraining(rebuild)
    down    3 x 2 x 2 -> 2 x 3 x 2   the same; the test kills rank 2 while every rank is paused
ROLE:
    plain     train to the end at 3 x 2 x 2 (the uninterrupted run)
    victim    SIGKILL itself in the first gradient all-reduce after step KILL_AFTER
    survivor  (shrink) when the group breaks, take L1-2's rendezvous at the new layout from
              DIR/rendezvous.json once the test writes it; start again once healed
    kept      (up, down) pause after step PAUSE_AT (PauseTraining, no checkpoint), write
              DIR/paused-RANK; on DIR/rendezvous.json: the rendezvous at the new layout and
              ResumeTraining(rebuild=True); start again once healed
    new       (up) rank 2 of the new size: InitJob.heal_from_peer, the spec at the new
              layout, the group named by PORT

Each process writes DIR/ROLE-RANK.pt after every step it completes (a process killed later
leaves what it completed): per step the input rows it trained on (the last attempt: a step
cut short by the fault is replayed), its losses and the loop's events that matter here; at
the end, the final weights, its RNG streams when it paused and when it started again, and
the layout the loop ended at.
"""

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.contract import comm_guard

guard = comm_guard.install(mode="report")

from rank_fakes import GlobalRowData, LocalRank, tiny_spec  # noqa: E402

import services.compute.gradient_reduction as reduction_module  # noqa: E402
import services.rank.__main__ as rank_module  # noqa: E402
from services.common.phase import COLLECTIVE, PhaseMarker  # noqa: E402
from services.common.process_exit import exit_now  # noqa: E402
from services.compute.forward_unit import ForwardUnit  # noqa: E402
from services.contract import engine_pb2  # noqa: E402
from services.contract.failures import set_collective_probe  # noqa: E402
from services.engine import rng_streams  # noqa: E402
from services.engine.training_loop import LoopState  # noqa: E402
from services.jobspec import spec_from_json  # noqa: E402

STEPS, KILL_AFTER, PAUSE_AT = 8, 4, 4
LAYOUTS = {  # scenario: (launch layout, new layout), each (dp, micro_batch_size, grad_accum)
    "shrink": ((3, 2, 2), (2, 2, 3)),
    "up": ((2, 2, 3), (3, 2, 2)),
    "down": ((3, 2, 2), (2, 3, 2)),
}


def spec(dp: int, micro_batch_size: int, grad_accum: int):
    return tiny_spec(
        steps=STEPS, parallel={"dp": dp}, data={"micro_batch_size": micro_batch_size, "grad_accum": grad_accum}
    )


def main() -> None:
    scenario, role, rank, port, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    signal.alarm(240)  # never outlive the test
    torch.set_num_threads(1)
    launch, target = LAYOUTS[scenario]
    layout = (3, 2, 2) if role == "plain" else target if role == "new" else launch
    heals = role == "new"
    phase = PhaseMarker()
    set_collective_probe(lambda: phase.phase == COLLECTIVE)  # as rank.py
    rank_module.compose = functools.partial(rank_module.compose, phase=phase, heals=heals)
    record = Record(out / f"{role}-{rank}.pt")
    record.patch_forward()  # (before the modules are wired: the bus binds their handlers)
    local = LocalRank(spec(*layout), out / "ckpt", rank=rank, world_size=layout[0], port=port, data=GlobalRowData)
    local.init.rebuild_in_place = True
    local.init.heal_from_peer = heals
    record.watch(local)
    if role == "victim":
        die_in_allreduce(local)
    if role == "survivor":
        threading.Thread(target=play_l1, args=(local, out, rank, target, False), daemon=True).start()
    if role == "kept":
        local.command(engine_pb2.PauseTraining(job_id="job", at_step=PAUSE_AT, checkpoint=False, seq=1))
        threading.Thread(target=play_l1, args=(local, out, rank, target, True), daemon=True).start()
    local.command(engine_pb2.StartTraining(job_id="job"))
    local.run()
    if local.error is not None:
        raise local.error
    loop = local.modules.loop
    ended = spec_from_json(loop._spec_json)  # the spec a commit would name now
    record.final(
        state=local.model_state(),
        started=[
            (m.start_step, m.healed, m.healed_from_rank, m.rebuild_generation, m.startup_seconds)
            for m in local.up.of(engine_pb2.TrainingLoopStarted)
        ],  # fmt: skip
        topology_errors=len(local.up.of(engine_pb2.ParallelTopologyError)),
        world_sizes=[s.world_size for s in local.steps()],
        layout=(ended.parallel.dp, ended.data.micro_batch_size, ended.data.grad_accum),
        data_order=LoopState(loop).state_dict()["data_order"].tolist(),
        opened=[
            (o.split, o.start.row, o.packer.rank, o.packer.world_size, o.packer.micro_batch_size)
            for o in local.data.opened
        ],  # fmt: skip
        pid=os.getpid(),
        crossings=[(c.module, c.op, c.site, c.exception) for c in guard.crossings()],
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)


class Record:
    """What this rank did, saved to ``path`` after every completed step and at the end."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict = {"rows": {}, "steps": [], "losses": [], "rng_paused": None, "rng_restarted": None}
        self._pending: list[torch.Tensor] = []  # the input rows of the step in flight

    def patch_forward(self) -> None:
        """Record the input rows of every training forward (on the loop's thread)."""
        original = ForwardUnit.run_forward

        def run_forward(unit, msg, payload):
            if msg.training:
                self._pending.append(payload.clone())
            return original(unit, msg, payload)

        ForwardUnit.run_forward = run_forward

    def watch(self, local: LocalRank) -> None:
        """Record each step's rows once it completed (its event goes up on the loop's thread),
        and the RNG streams when the rank paused and when it started again."""
        on_event = local.up.on_event

        def seen(msg, payload=None):
            on_event(msg, payload)
            if isinstance(msg, engine_pb2.StepCompleted):
                self.data["rows"][msg.step] = torch.cat(self._pending)
                self.data["steps"].append(msg.step)
                self.data["losses"].append(msg.loss)
                self._pending = []
                self.save()
            elif isinstance(msg, engine_pb2.TrainingLoopPaused):
                self.data["rng_paused"] = rng_streams.capture()
            elif isinstance(msg, engine_pb2.TrainingLoopStarted):
                self._pending = []  # (a step cut short is replayed: its first attempt is not counted)
                self.data["rng_restarted"] = rng_streams.capture()  # (the last start's)

        local.up.on_event = seen

    def final(self, **values) -> None:
        self.data.update(values, done=True)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save(self.data, tmp)
        tmp.replace(self.path)  # (whole or absent, whenever the process is killed)


def die_in_allreduce(local: LocalRank) -> None:
    """SIGKILL this process inside the first bucket all-reduce of step KILL_AFTER + 1."""
    original = reduction_module.default_hooks.allreduce_hook

    def hook(group, bucket):
        if len(local.steps()) == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(group, bucket)

    reduction_module.default_hooks.allreduce_hook = hook


def play_l1(local: LocalRank, out: Path, rank: int, target: tuple[int, int, int], paused: bool) -> None:
    """What L1 does for a rank that stays: (``paused``: once it paused, say so, and after L1-2's
    rendezvous leave the pause into the rebuild: ResumeTraining.rebuild) L1-2's rendezvous at
    the new layout, then StartTraining once the rank reported started again."""
    if paused:
        while not local.up.of(engine_pb2.TrainingLoopPaused):
            time.sleep(0.02)
        (out / f"paused-{rank}").touch()
    rendezvous = out / "rendezvous.json"
    while not rendezvous.exists():
        time.sleep(0.02)
    r = json.loads(rendezvous.read_text())
    dp, micro_batch_size, grad_accum = target
    local.modules.allocator(engine_pb2.RebuildParallelGroup(
        job_id="job", master_addr="127.0.0.1", master_port=r["port"], world_size=dp, generation=1,
        reason=r["reason"], layout=engine_pb2.DataParallelLayout(
            dp=dp, micro_batch_size=micro_batch_size, grad_accum=grad_accum),
    ))  # fmt: skip
    if paused:
        local.command(engine_pb2.ResumeTraining(job_id="job", rebuild=True))
    while len(local.up.of(engine_pb2.TrainingLoopStarted)) < 2:
        time.sleep(0.02)
    local.command(engine_pb2.StartTraining(job_id="job"))


if __name__ == "__main__":
    main()
