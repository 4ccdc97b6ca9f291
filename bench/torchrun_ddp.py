"""The baseline: a plain torchrun + DDP script training Surge's model on Surge's data.

    torchrun --nproc-per-node 2 bench/torchrun_ddp.py --spec bench/jobs/throughput.yaml \
        --data-root .surge/datasets --step-log /tmp/steps.jsonl [--ckpt-dir DIR --ckpt-every N]

What it shares with a Surge job, so that tokens/s compare like for like: the model class
(``services.compute.model.build_model``, same seed), the prepared dataset version's token
file (``train.bin`` + ``train.idx.npy``, memory-mapped, read directly), the micro-batch
(``data.micro_batch_size`` x ``data.seq_len``), grad_accum, AdamW (same groups, betas, eps,
fused), the warm-up + cosine LR, fp32 or bf16 autocast, DDP with default buckets, threads
per rank (``parallel.threads_per_rank``). What it does not share is everything Surge adds:
services, the bus, events, the data service (documents are shuffled per (seed, epoch),
sharded by rank, filtered by ``min_tokens`` and banned bytes, packed with a 0 separator:
the same work, done inline in the rank, the way a nanoGPT-style script does it).

Rank 0 writes one JSON line per step to ``--step-log``: ``{"step", "unix_time", "step_seconds",
"tokens", "loss"}`` (tokens: global, this step), and first a ``{"event": "start"}`` line with
the process start time, so start-up and recovery can be timed from outside.

Fault benchmark support (``--ckpt-dir``): rank 0 saves model + optimizer + step every
``--ckpt-every`` steps (torch.save to a temp file, then rename: atomic); on start every
rank loads the newest and skips the batches already consumed (the data order is a pure
function of (seed, epoch, rank)), so ``torchrun --max-restarts`` resumes where it was.
``--collective-timeout`` bounds how long gloo waits in a collective for a silent peer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

T_PROCESS = time.time()  # before torch's import: start-up includes it, as Surge's does

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn import functional  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.compute.model import build_model  # noqa: E402
from services.jobspec import load_job_spec  # noqa: E402


def batches(root: Path, spec, rank: int, world: int, skip: int = 0):
    """Micro-batches (input_ids int64 [B, T], labels int64 [B, T]) for ``rank``, endless.

    Rows are windows of T + 1 tokens over the rank's packed stream, consecutive rows sharing
    one token (inputs row[:-1], labels row[1:]), like Surge's packer. ``skip``: batches to
    drop first (resume)."""
    d = spec.data
    path = root / d.name / d.version
    tokens = np.memmap(path / "train.bin", dtype=np.uint16, mode="r")
    bounds = np.load(path / "train.idx.npy")
    banned = np.frombuffer(d.filter.banned_bytes.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    B, T = d.micro_batch_size, d.seq_len
    need = B * T + 1
    buf = np.zeros(0, np.int64)
    epoch, n = 0, 0
    while True:
        order = (
            np.random.default_rng((d.shuffle_seed, epoch)).permutation(len(bounds) - 1)
            if d.shuffle
            else np.arange(len(bounds) - 1)
        )
        for doc in order[rank::world]:
            toks = np.asarray(tokens[bounds[doc] : bounds[doc + 1]])
            if len(toks) < d.filter.min_tokens or (d.filter.max_tokens and len(toks) > d.filter.max_tokens):
                continue
            if len(banned) and np.isin(toks, banned).any():
                continue
            buf = np.concatenate([buf, toks.astype(np.int64), [0]])
            while len(buf) >= need:
                rows = np.lib.stride_tricks.sliding_window_view(buf[:need], T + 1)[::T]
                buf = buf[B * T :]
                n += 1
                if n > skip:
                    r = torch.from_numpy(np.ascontiguousarray(rows))
                    yield r[:, :-1], r[:, 1:]
        epoch += 1


def precision(spec) -> str:
    """``"fp32"`` | ``"bf16"`` | ... whether the spec writes ``precision: bf16`` or
    ``precision: {dtype: bf16}``."""
    return str(getattr(spec.precision, "dtype", spec.precision))


def lr_at(spec, step: int) -> float:
    """Linear warm-up then cosine to ``min_lr_ratio`` (services/engine/lr_schedule.py's shape)."""
    o = spec.optimizer
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, spec.steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", type=Path, required=True, help="a Surge job spec (model, data, optimizer, steps)")
    ap.add_argument("--data-root", type=Path, required=True, help="where prepared dataset versions live")
    ap.add_argument("--step-log", type=Path, required=True, help="rank 0's per-step JSON lines")
    ap.add_argument("--steps", type=int, default=0, help="override spec.steps")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (one GPU per rank, NCCL)")
    ap.add_argument("--ckpt-dir", type=Path, default=None)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--collective-timeout", type=float, default=600.0, help="seconds (gloo/NCCL default: 600)")
    args = ap.parse_args(argv)
    spec = load_job_spec(args.spec)
    steps = args.steps or spec.steps
    torch.set_num_threads(spec.parallel.threads_per_rank)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build_model(spec.model, spec.seed, device)
    o = spec.optimizer
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.0,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        fused=True,
    )
    start = 0
    ckpt = args.ckpt_dir / "latest.pt" if args.ckpt_dir else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = int(state["step"])
    ddp = DDP(model) if world > 1 else model
    accum = spec.data.grad_accum
    data = batches(args.data_root, spec, rank, world, skip=start * accum)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision(spec) == "bf16")
    log = open(args.step_log, "a") if rank == 0 else None
    if log:
        log.write(
            json.dumps({"event": "start", "unix_time": T_PROCESS, "start_step": start, "pid": os.getpid()}) + "\n"
        )
        log.flush()
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        mbs = [next(data) for _ in range(accum)]
        ntok = sum(int(y.numel()) for _, y in mbs)
        loss_sum = torch.zeros((), device=device)
        optim.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(mbs):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            ddp.require_backward_grad_sync = i == accum - 1  # what DDP.no_sync() toggles
            with autocast:
                logits = ddp(x)
            loss = functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
            (loss / ntok).backward()
            loss_sum += loss.detach()
        for g in optim.param_groups:
            g["lr"] = lr_at(spec, step)
        optim.step()
        reduced = torch.stack([loss_sum, torch.tensor(float(ntok), device=device)])
        dist.all_reduce(reduced)  # global loss and tokens, as Surge's ReduceGradients does
        step_s = time.perf_counter() - t0
        if log:
            loss_v, tok = reduced.tolist()
            log.write(
                json.dumps(
                    {
                        "step": step,
                        "unix_time": time.time(),
                        "step_seconds": step_s,
                        "tokens": int(tok),
                        "loss": loss_v / tok,
                    }
                )
                + "\n"
            )
            log.flush()
        if ckpt is not None and step % args.ckpt_every == 0 and rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": torch.tensor(step)}, tmp)
            os.replace(tmp, ckpt)
    if log:
        log.close()
    dist.destroy_process_group()
    # End without interpreter finalization: a gloo worker thread dropping the last reference
    # to a finished all-reduce then needs the GIL and aborts the process ("terminate called
    # without an active exception"; pytorch/pytorch#190489). Same as Surge's ranks do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
