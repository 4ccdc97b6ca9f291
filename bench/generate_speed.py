"""`surgectl generate`'s decoding speed with the KV cache and without it (issue 31 item 5:
"generation tokens/s before and after").

    .venv/bin/python bench/generate_speed.py [--tokens 200] [--reps 5] [--batch 4] [--out FILE]

The demo model (examples/jobs/demo.yaml: 4 layers, d_model 128, seq_len 256, random weights
from its seed: speed does not depend on the weights' values) decodes ``--tokens`` greedy tokens
from a one-token prompt, on one intra-op thread as `surgectl generate` runs a model of this
size (services/compute/inference.py ``ONE_THREAD_MAX_D_MODEL``):

* ``kv_cache``: services/compute/decode.py ``generate`` (the prompt once, then one token at a
  time against the cache; past seq_len the window recomputed);
* ``recompute``: what decoding did before the cache, for every token: the whole window again
  (``model(idx[:, -seq_len:])[:, -1]``);
* ``batch``: ``--batch`` prompts of one length decoded together with the cache (what several
  ``--prompt`` of one length do), tokens/s counting every row.

The two single-prompt ways run interleaved, ``--reps`` times each, and must give the same
tokens (checked). Reported: best and median seconds and tokens/s, and the load average (a
shared 2-core host's figures are upper bounds). Not the process's start, imports or the
checkpoint's load (1.9-3.3 s and 0.7 s on the README's model, docs/LOG.md session 31).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402

SPEC = c.REPO / "examples" / "jobs" / "demo.yaml"


def _recompute(model, prompt_BT, n: int, context_len: int):
    """Decoding before the KV cache: every new token re-runs the whole (cropped) window."""
    import torch

    idx = prompt_BT
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -context_len:])[:, -1, :].float()
            idx = torch.cat((idx, logits.argmax(dim=-1, keepdim=True)), dim=1)
    return idx


def measure(tokens: int, reps: int, batch: int) -> dict:
    import torch

    from services.compute.decode import generate
    from services.compute.model import build_model
    from services.jobspec import parse_job_spec

    spec = parse_job_spec(SPEC.read_text(), str(SPEC))
    model = build_model(spec.model, spec.seed).eval()
    ctx = spec.data.seq_len
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = torch.tensor([[ord("d")]], dtype=torch.int64)
        times: dict[str, list[float]] = {"kv_cache": [], "recompute": [], "batch": []}
        outs = {}
        for _ in range(reps):
            t0 = time.perf_counter()
            outs["kv_cache"] = generate(model, prompt, tokens, temperature=0.0, context_len=ctx)
            times["kv_cache"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs["recompute"] = _recompute(model, prompt, tokens, ctx)
            times["recompute"].append(time.perf_counter() - t0)
            rows = torch.tensor([[ord("a") + i % 26] for i in range(batch)], dtype=torch.int64)
            t0 = time.perf_counter()
            generate(model, rows, tokens, temperature=0.0, context_len=ctx)
            times["batch"].append(time.perf_counter() - t0)
        if not torch.equal(outs["kv_cache"], outs["recompute"]):
            raise RuntimeError("the KV cache's greedy tokens differ from the recomputed ones")
    finally:
        torch.set_num_threads(threads)
    out: dict = {"model": f"{SPEC.name}: {sum(p.numel() for p in model.parameters()):,} parameters, seq_len {ctx}"}
    out["tokens"], out["reps"], out["batch_rows"] = tokens, reps, batch
    for way, ts in times.items():
        n = tokens * (batch if way == "batch" else 1)
        out[way] = {
            "seconds_best": round(min(ts), 3),
            "seconds_median": round(statistics.median(ts), 3),
            "tokens_per_second_best": round(n / min(ts), 1),
            "tokens_per_second_median": round(n / statistics.median(ts), 1),
        }
    out["speedup_median"] = round(statistics.median(times["recompute"]) / statistics.median(times["kv_cache"]), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = ap.parse_args()
    result = {"machine": c.machine(), **measure(args.tokens, args.reps, args.batch)}
    result["loadavg_at_end"] = round(os.getloadavg()[0], 2)
    c.report("generate_speed", result, args.out)


if __name__ == "__main__":
    main()
