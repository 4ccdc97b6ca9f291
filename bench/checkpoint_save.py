"""How long a checkpoint save blocks the training loop, synchronous against asynchronous,
and how long a resume takes to load: the demo model (examples/jobs/demo.yaml), two gloo
ranks, the real `store` service and the ranks' real checkpoint relay.

    .venv/bin/python bench/checkpoint_save.py [--rounds 5] [--steps-between 3] [--model demo|100m]
        [--staging reused|both] [--json]

``--model 100m``: the demo spec with 14 layers, d_model 768, 12 heads (99 M parameters,
12 x 14 x 768^2 in the blocks), trained on 1 x 64-token micro-batches so one step stays
near a second on one CPU thread per rank; what is timed is the save, not the step.
``--json``: also print the medians as one JSON line (bench/run.py reads it).

Each rank holds the demo model and its AdamW state (after one update) and the loop's own
state, and saves it ``rounds`` times per mode the way the loop does: a snapshot (each
owner's ExportState copy, services/state/snapshot.py) handed to
``StoreClient.save_checkpoint`` and, on rank 0, ``commit_checkpoint`` (what the loop blocks
on, the snapshot's copy included; the asynchronous write then runs from the relay's thread,
with no staging copy), then both run k = ``steps-between`` training steps (micro-batch
8 x 256, like the demo); "save + k steps" against "no_save: k steps" shows what the save
costs in all, the background write's competition for the cores included. Modes are
interleaved round by round. Then every rank loads the last version into the state
manager's copies, as a resume does (store verification + DCP read + the loaded snapshot's
digests). Medians over rounds, in milliseconds.

Host staging (services/state/staging.py): each snapshot's tensors are copied into host
buffers the rank's pool reuses from the previous save once nothing refers to them (modes
"sync" and "async"). ``--staging both`` adds "sync fresh" and "async fresh": the same saves
with a pool that allocates fresh memory every save (the behaviour before the pool), so the
first-touch page faults of a fresh copy show. "of which snapshot copy" is the part of the
stall spent copying the state; each mode's first save is listed apart ("first save") since
a reusing pool allocates then too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODELS = {"demo": {}, "100m": {"n_layers": 14, "d_model": 768, "n_heads": 12}}
BATCH = {"demo": None, "100m": (1, 64)}


def demo_spec(model: str):
    from services.jobspec import load_job_spec

    spec = load_job_spec(REPO / "examples/jobs/demo.yaml")
    return spec.model_copy(update={"model": spec.model.model_copy(update=MODELS[model])})


def rank_main(
    rank: int,
    world: int,
    port: int,
    store: str,
    rounds: int,
    steps_between: int,
    out: str,
    model_name: str = "demo",
    staging_modes: tuple[str, ...] = ("reused",),
) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from dataclasses import fields

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from services.common.process_exit import exit_now
    from services.compute.model import build_model
    from services.contract import Module, data_pb2, engine_pb2, store_pb2
    from services.engine.optimizer import Optimizer
    from services.engine.training_loop import LoopPorts, LoopState, TrainingLoop
    from services.rank.store_client import StoreClient
    from services.state import staging
    from services.state.snapshot import Slot, Snapshot

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = demo_spec(model_name)
    model = build_model(spec.model, spec.seed)
    opt = Optimizer(spec.optimizer, lambda *a, **k: 1)
    opt.attach(model)
    b, t = BATCH[model_name] or (spec.data.micro_batch_size, spec.data.seq_len)
    x = torch.randint(0, 256, (b, t))

    def train_step() -> float:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # stands in for DDP's reduction (same bytes on the wire)
        opt._optim.step()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    train_step()
    # A real loop (never run) so that LoopState sees every field it saves; only what a
    # started loop would have learnt from its job is set here.
    loop = TrainingLoop(lambda *a, **k: 1, LoopPorts(*[None] * len(fields(LoopPorts))))
    loop._rank, loop._world, loop._spec, loop._dp_size = rank, world, spec, world
    loop._position = data_pb2.DataPosition()

    def snapshot(step: int) -> Snapshot:
        """What the loop's _snapshot builds: L3-1's and L2-3's ExportState copies and its own."""
        v = f"bench@{step}"
        slots = [
            Slot.copy_of("model", Module.L3_SHARD_LOADER, step, v, get_model_state_dict(model), digest=False),
            opt.export_state(engine_pb2.ExportState(step=step, version=v)).payload,
            Slot.copy_of("train", Module.L2_TRAINING_LOOP, step, v, LoopState(loop).state_dict(), digest=False),
        ]
        return Snapshot.of(slots)

    client = StoreClient(store, lambda *a, **k: 1)
    pools = {"reused": staging.HostStaging(), "fresh": staging.HostStaging(reuse=False)}
    modes = [
        (f"{mode}{'' if kind == 'reused' else ' fresh'}", mode == "async", pools[kind])
        for kind in staging_modes
        for mode in ("sync", "async")
    ]
    results: dict[str, list[float]] = {}
    for _ in range(3):
        train_step()  # warm-up
    step = 0
    for _ in range(rounds):  # modes interleaved, so drift in the machine's load hits both alike
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps_between):
            train_step()
        results.setdefault("no_save: k steps", []).append(time.perf_counter() - t0)
        for mode, write_async, pool in modes:
            staging.use_pool(pool)
            dist.barrier()
            step += 1
            loop._step = step
            t0 = time.perf_counter()
            taken = snapshot(step)
            copied = time.perf_counter() - t0
            client.save_checkpoint(
                store_pb2.SaveCheckpoint(job_id="bench", step=step, rank=rank, write_async=write_async),
                taken.to_write(),
            )
            del taken  # the loop keeps nothing of a save: only the writer holds the copy now
            if rank == 0:  # the loop's rank 0 also waits for a synchronous commit
                client.commit_checkpoint(
                    store_pb2.CommitCheckpoint(job_id="bench", step=step, world_size=world, spec_json="{}", keep_last=2)
                )
            blocked = time.perf_counter() - t0
            for _ in range(steps_between):
                train_step()
            first = f"{mode}: first save blocked" not in results
            results.setdefault(f"{mode}: {'first save blocked' if first else 'blocked'}", []).append(blocked)
            results.setdefault(f"{mode}: of which snapshot copy", []).append(copied)
            results.setdefault(f"{mode}: save + k steps", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.flush_checkpoint(store_pb2.FlushCheckpoint(job_id="bench"))
            results.setdefault(f"{mode}: flush wait after", []).append(time.perf_counter() - t0)
    staging.use_pool(pools["reused"])
    results["staging bytes (allocated, reused, held)"] = [float(v) for v in pools["reused"].stats().values()]
    for _ in range(rounds):
        template = snapshot(0)  # (taken before a resume's load too: not timed here)
        dist.barrier()
        t0 = time.perf_counter()
        into = template.blank(reuse=True)
        loaded = client.load_checkpoint(store_pb2.LoadCheckpoint(version="bench:latest"), into)
        read = time.perf_counter()
        Snapshot.loaded(into, template, loaded.info.version)  # restorable: every slot digested
        results.setdefault("load", []).append(time.perf_counter() - t0)
        results.setdefault("load: of which digests", []).append(time.perf_counter() - read)
    client.close(timeout=2)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-between", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument(
        "--staging", choices=("reused", "both"), default="reused", help="both: also saves into fresh memory each time"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port, metrics = free_port(), free_port()
        store = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.store",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics),
                "--root",
                f"{tmp}/store",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(2.0)
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            mp.spawn(
                rank_main,
                args=(
                    2,
                    free_port(),
                    f"127.0.0.1:{port}",
                    args.rounds,
                    args.steps_between,
                    tmp,
                    args.model,
                    ("reused", "fresh") if args.staging == "both" else ("reused",),
                ),
                nprocs=2,
                join=True,
            )
            results = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
            size = sum(f.stat().st_size for f in Path(tmp, "store", "checkpoints", "bench").rglob("*") if f.is_file())
        finally:
            store.terminate()
            store.wait()
    from services.compute.model import build_model, count_parameters

    params = count_parameters(build_model(demo_spec(args.model).model, 0))
    print(
        f"{args.model} model ({params / 1e6:.1f} M parameters), 2 gloo ranks, {args.rounds} rounds, "
        f"checkpoint dirs on disk {size / 1e6:.1f} MB (2 versions)"
    )
    pool_bytes = [r.pop("staging bytes (allocated, reused, held)") for r in results]
    print(f"{'what (median ms)':32} {'rank 0':>8} {'rank 1':>8}")
    order = [m.split(":")[0] for m in results[0]]  # each mode's rows together, in the order they ran
    for key in sorted(results[0], key=lambda k: order.index(k.split(":")[0])):
        row = [1e3 * statistics.median(r[key]) for r in results]
        print(
            f"{key:32} {row[0]:8.1f} {row[1]:8.1f}   rank 0 each: {' '.join(f'{1e3 * v:.0f}' for v in results[0][key])}"
        )
    allocated, reused, held = (v / 1e6 for v in pool_bytes[0])
    print(f"host staging pool, rank 0: MB allocated {allocated:.0f}, reused {reused:.0f}, kept {held:.0f}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "params": params,
                    "rounds": args.rounds,
                    "size_mb_2_versions": size / 1e6,
                    "median_ms_rank0": {k: 1e3 * statistics.median(v) for k, v in results[0].items()},
                    "median_ms_rank1": {k: 1e3 * statistics.median(v) for k, v in results[1].items()},
                    "raw_s_rank0": results[0],
                    "staging_pool_bytes_rank0": dict(zip(("allocated", "reused", "held"), pool_bytes[0])),
                }
            )
        )


if __name__ == "__main__":
    main()
