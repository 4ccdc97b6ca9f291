"""What the rank's phase marker (services/common/phase.py) costs a training step:

    .venv/bin/python bench/phase_overhead.py [--pairs 60] [--steps 30] [--rounds 0]

Paired (the figure to read on a loaded machine): in one process, DDP (gloo, world size 1)
over the demo-size model, forward + backward + the loop's marker stores of one step, with
DDP's built-in all-reduce and no marker vs the marking comm hook and a marker, alternated
step by step; prints the median of the paired differences.

End to end (``--rounds`` > 0; noisy where other work shares the cores): two real rank
processes (the real rank wiring with fake data/store relays, DDP over gloo, dp=2, the
demo-size model) train ``--steps`` steps with the marker (the loop's and L3-5's phase
boundaries, DDP's all-reduce through the marking comm hook) and without it (no
marker, DDP's built-in all-reduce), rounds interleaved so machine load hits both alike.
Prints the median step time over the steps after the first three (warm-up) of each
variant, and the cost of one ``PhaseMarker.enter`` (about 6 per step).
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
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rank(rank: int, port: int, out: Path, steps: int, marked: bool) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "engine")]
    import functools

    import rank_fakes
    import torch

    from services.common.phase import PhaseMarker
    from services.common.process_exit import exit_now
    from services.contract import engine_pb2

    torch.set_num_threads(1)
    import services.rank.__main__ as rank_root

    if marked:  # (LocalRank imports compose from the rank's root at construction)
        rank_root.compose = functools.partial(rank_root.compose, phase=PhaseMarker())
    spec = rank_fakes.tiny_spec(
        steps=steps,
        parallel={"dp": 2},
        model={"n_layers": 4, "d_model": 128, "n_heads": 4},
        data={"seq_len": 256, "micro_batch_size": 8},
        eval={"at_end": False, "every_steps": 0},
        checkpoint={"at_end": False, "every_steps": 0},
    )
    local = rank_fakes.LocalRank(spec, out / "ckpt", rank=rank, world_size=2, port=port)
    local.command(engine_pb2.StartTraining(job_id="job"))
    local.run()
    if local.error is not None:
        raise local.error
    (out / f"rank{rank}.json").write_text(json.dumps([s.step_seconds for s in local.steps()]))
    exit_now(0)


def _paired(pairs: int) -> str:
    import copy
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from services.common import phase as ph
    from services.compute.gradient_reduction import GradientReduction
    from services.compute.model import Transformer
    from services.jobspec import ModelSpec

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    base = Transformer(ModelSpec(n_layers=4, d_model=128, n_heads=4, vocab_size=256))
    plain = DistributedDataParallel(copy.deepcopy(base))
    hooked = DistributedDataParallel(copy.deepcopy(base))
    hooked.register_comm_hook(None, GradientReduction(lambda *a, **k: None, phase=ph.PhaseMarker())._allreduce_marked)
    marker, x = ph.PhaseMarker(), torch.randint(0, 256, (8, 256))

    def step(model, mark) -> float:
        t0 = time.perf_counter()
        mark.enter(ph.DATA_WAIT)
        mark.enter(ph.FORWARD)
        out = model(x)
        mark.enter(ph.BACKWARD)
        out.float().logsumexp(-1).mean().backward()
        for p in (ph.OPTIMIZER, ph.COLLECTIVE, ph.OPTIMIZER):
            mark.enter(p)
        return time.perf_counter() - t0

    for _ in range(3):
        step(plain, ph.NO_PHASE), step(hooked, marker)
    a, b = [], []
    for i in range(pairs):
        order = ((plain, ph.NO_PHASE, a), (hooked, marker, b))
        for model, mark, into in order if i % 2 else order[::-1]:
            into.append(step(model, mark))
    dist.destroy_process_group()
    d = statistics.median(y - x for x, y in zip(a, b))
    return (
        f"paired, in one process (DDP world size 1, demo model 4 x 128, seq 256, 8 rows, {pairs} pairs): "
        f"forward+backward {statistics.median(a) * 1e3:.1f} ms without the marker, {statistics.median(b) * 1e3:.1f} ms "
        f"with it; median paired difference {d * 1e3:+.2f} ms ({d / statistics.median(a) * 100:+.2f} %)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(steps: int, marked: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp), _free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(r), "--port", str(port), "--out", tmp, "--steps", str(steps)]
                + (["--marked"] if marked else []),
                cwd=REPO,
            )
            for r in (0, 1)
        ]
        try:
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"rank exited {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return json.loads((out / "rank0.json").read_text())[3:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--marked", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        return _rank(args.rank, args.port, Path(args.out), args.steps, args.marked)
    sys.path.insert(0, str(REPO))
    from services.common.phase import COLLECTIVE, PhaseMarker

    marker = PhaseMarker()
    enter_us = min(timeit.repeat(lambda: marker.enter(COLLECTIVE), number=100_000, repeat=5)) / 100_000 * 1e6
    print(f"PhaseMarker.enter {enter_us:.2f} us (about 6 per step)")
    if args.pairs:
        print(_paired(args.pairs), flush=True)
    if not args.rounds:
        return
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.rounds):
        row = []
        for marked in (False, True):
            got = _run(args.steps, marked)
            times[marked] += got
            row.append(f"{'with' if marked else 'without'} {statistics.median(got) * 1e3:.1f} ms")
        print(f"round {i + 1}: median step " + ", ".join(row), flush=True)
    base, marked = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"2 ranks (gloo, dp=2, DDP), demo model 4 x 128, seq 256, 8 rows, {args.steps} steps x {args.rounds} rounds, "
        f"cpu count {os.cpu_count()}"
    )
    print(
        f"median step without the phase marker {base * 1e3:.1f} ms, with it {marked * 1e3:.1f} ms "
        f"({(marked / base - 1) * 100:+.1f} %)"
    )


if __name__ == "__main__":
    main()
