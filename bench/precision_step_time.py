"""Step time of the demo-size model on one rank under fp32, bf16 and fp16 (dynamic loss
scaling), through the real rank wiring (fake data/store relays, no services):

    .venv/bin/python bench/precision_step_time.py [--steps 12] [--rounds 2] [--threads 1]

Prints the median step / forward / backward / optimizer seconds over the steps after the
first two (warm-up), per precision, rounds interleaved so machine load hits all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "engine")]

from rank_fakes import LocalRank, tiny_spec  # noqa: E402

from services.contract import engine_pb2  # noqa: E402


def run(precision: str, steps: int) -> dict[str, float]:
    spec = tiny_spec(
        steps=steps,
        model={"n_layers": 4, "d_model": 128, "n_heads": 4},
        data={"seq_len": 256, "micro_batch_size": 8},
        precision=precision,
    )
    with tempfile.TemporaryDirectory() as tmp:
        local = LocalRank(spec, Path(tmp))
        local.command(engine_pb2.StartTraining(job_id="job"))
        local.run()
    if local.error is not None:
        raise local.error
    timed = local.steps()[2:]
    fields = ("step_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds")
    out = {f: statistics.median(getattr(s, f) for s in timed) for f in fields}
    out["final_loss"] = local.steps()[-1].loss
    out["skipped"] = sum(s.skipped for s in local.steps())
    out["loss_scale"] = local.steps()[-1].loss_scale
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, list[dict[str, float]]] = {p: [] for p in ("fp32", "bf16", "fp16")}
    for _ in range(args.rounds):
        for precision in results:
            results[precision].append(run(precision, args.steps))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), demo model (4 x 128, seq 256, 8 rows), "
        f"{args.steps} steps x {args.rounds} rounds; medians over steps 3..{args.steps}"
    )
    print(
        f"{'precision':>9} {'step s':>8} {'fwd s':>8} {'bwd s':>8} {'opt s':>8} {'loss@end':>9} {'skipped':>7} {'scale':>7}"
    )
    for precision, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"{precision:>9} {med['step_seconds']:8.3f} {med['forward_seconds']:8.3f} {med['backward_seconds']:8.3f} "
            f"{med['optimizer_seconds']:8.4f} {med['final_loss']:9.3f} {int(med['skipped']):7d} {med['loss_scale']:7g}"
        )


if __name__ == "__main__":
    main()
