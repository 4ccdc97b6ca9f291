"""One rank of the in-place rebuild test: ``python rebuild_rank_main.py ROLE RANK PORT DIR [WORLD]``.

The real rank wiring (``services.rank.__main__.compose``, fake L4/L5/L1 relays: rank_fakes.py)
under a gloo group of WORLD ranks (default 3), data parallel (DDP). ROLE:

    plain        train to the end (the uninterrupted run)
    victim       SIGKILL itself in the first gradient all-reduce after step KILL_AFTER
                 (DDP's comm hook: its peers are inside the same all-reduce)
    stopped      SIGSTOP itself there instead (alive, silent: its peers stay blocked in
                 the all-reduce until it is killed or the group times out)
    survivor     train; when the group breaks, L2-2 waits for a rendezvous, which this
                 script delivers as L1-2 would (RebuildParallelGroup, read from
                 DIR/rendezvous.json once the test writes it); start again once healed
    replacement  InitJob.heal_from_peer: join the group named by PORT, heal, train
    laggard      a survivor whose step KILL_AFTER + 1 fails after its all-reduces (a typed
                 communication failure from L2-4's ScaleLoss): its peers complete that step,
                 it rolls back to KILL_AFTER and breaks the group; every rank rebuilds

Every role but the victim saves under DIR/ROLE-RANK.pt: final weights, the loop's events
that matter here, and whether the launch's process group object is gone (nothing holds it).
"""

import functools
import json
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from services.contract import comm_guard

guard = comm_guard.install(mode="report")

from rank_fakes import LocalRank, tiny_spec  # noqa: E402

import services.compute.gradient_reduction as reduction_module  # noqa: E402
import services.rank.__main__ as rank_module  # noqa: E402
from services.common.phase import COLLECTIVE, PhaseMarker  # noqa: E402
from services.common.process_exit import exit_now  # noqa: E402
from services.contract import engine_pb2  # noqa: E402
from services.contract.failures import CommunicationFailed, set_collective_probe  # noqa: E402
from services.engine.mixed_precision import MixedPrecision  # noqa: E402

STEPS, KILL_AFTER = 8, 4
WORLD = int(sys.argv[5]) if len(sys.argv) > 5 else 3


def spec():
    # REBUILD_BOUNDARY=1: an evaluation every 2 steps and a checkpoint every 4 (a val stream
    # per evaluation, saves on the rebuilt group).
    boundary = (
        {"eval": {"every_steps": 2, "batches": 2}, "checkpoint": {"every_steps": 4, "at_end": True}}
        if os.environ.get("REBUILD_BOUNDARY")
        else {}
    )
    return tiny_spec(steps=STEPS, parallel={"dp": WORLD}, data={"micro_batch_size": 4, "grad_accum": 2}, **boundary)


def main() -> None:
    role, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    signal.alarm(240)  # never outlive the test
    torch.set_num_threads(1)
    heals = role == "replacement"
    phase = PhaseMarker()
    # As rank.py: an untyped error while the rank waits in a collective is a communication
    # failure (gloo's error inside DDP's reducer is a plain RuntimeError).
    set_collective_probe(lambda: phase.phase == COLLECTIVE)
    rank_module.compose = functools.partial(rank_module.compose, phase=phase, heals=heals)
    if role == "laggard":
        fail_after_allreduce()  # (before the rank is composed: its bus holds the bound handler)
    local = LocalRank(spec(), out / "ckpt", rank=rank, world_size=WORLD, port=port)
    local.init.rebuild_in_place = True
    local.init.heal_from_peer = heals
    if role in ("victim", "stopped"):
        die_in_allreduce(local, signal.SIGKILL if role == "victim" else signal.SIGSTOP)
    first_world: list[weakref.ref] = []
    if role in ("survivor", "laggard"):
        threading.Thread(target=play_l1, args=(local, out, first_world), daemon=True).start()
    local.command(engine_pb2.StartTraining(job_id="job"))
    local.run()
    if local.error is not None:
        raise local.error
    started = local.up.of(engine_pb2.TrainingLoopStarted)
    torch.save(
        {
            "state": local.model_state(),
            "steps": [s.step for s in local.steps()],
            "losses": [s.loss for s in local.steps()],
            "started": [
                (m.start_step, m.healed, m.healed_from_rank, m.rebuild_generation, m.startup_seconds) for m in started
            ],  # fmt: skip
            "topology_errors": len(local.up.of(engine_pb2.ParallelTopologyError)),
            "evals": [(e.step, e.loss) for e in local.up.of(engine_pb2.EvalCompleted)],
            "saved": [c.step for c in local.store.committed],
            "first_world_freed": bool(first_world) and first_world[0]() is None,
            "pid": os.getpid(),
            "crossings": [(c.module, c.op, c.site, c.exception) for c in guard.crossings()],
        },
        out / f"{role}-{rank}.pt",
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)


def die_in_allreduce(local: LocalRank, sig: int = signal.SIGKILL) -> None:
    """Send this process ``sig`` inside the first bucket all-reduce of step KILL_AFTER + 1."""
    original = reduction_module.default_hooks.allreduce_hook

    def hook(group, bucket):
        if len(local.steps()) == KILL_AFTER:
            os.kill(os.getpid(), sig)
        return original(group, bucket)

    reduction_module.default_hooks.allreduce_hook = hook


def fail_after_allreduce() -> None:
    """Raise a communication failure from ScaleLoss of step KILL_AFTER + 1 (once): every
    collective of that step has returned on every rank, and this rank applies no update."""
    original = MixedPrecision.scale_loss

    def scale_loss(self, msg, payload=None):
        if msg.step == KILL_AFTER + 1 and not getattr(fail_after_allreduce, "done", False):
            fail_after_allreduce.done = True
            raise CommunicationFailed(f"laggard: step {msg.step} cut short after its all-reduces")
        return original(self, msg, payload)

    MixedPrecision.scale_loss = scale_loss


def play_l1(local: LocalRank, out: Path, first_world: list) -> None:
    """What L1 does for a survivor: RebuildParallelGroup with the next rendezvous (L1-2),
    and StartTraining once the rank reported started again (L1-1)."""
    while not local.steps():
        time.sleep(0.01)
    first_world.append(weakref.ref(dist.group.WORLD))  # the launch's group: must be freed by the rebuild
    rendezvous = out / "rendezvous.json"
    while not rendezvous.exists():
        time.sleep(0.05)
    r = json.loads(rendezvous.read_text())
    local.modules.allocator(engine_pb2.RebuildParallelGroup(
        job_id="job", master_addr="127.0.0.1", master_port=r["port"], world_size=WORLD, generation=1,
        reason=f"rank {r['lost']} lost", lost_ranks=[r["lost"]] if r["lost"] >= 0 else [],
    ))  # fmt: skip
    while len(local.up.of(engine_pb2.TrainingLoopStarted)) < 2:
        time.sleep(0.05)
    local.command(engine_pb2.StartTraining(job_id="job"))


if __name__ == "__main__":
    main()
