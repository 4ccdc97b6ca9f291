"""Incremental checkpoints: what a save writes and how long it takes, a full version every
time against a baseline then deltas, for dense training and for fine-tunes with 90 % and
97 % of the parameters frozen; the demo model and a ~100 M-parameter one.

    .venv/bin/python bench/incremental_save.py [--models demo 100m] [--saves 6] [--json]

One process: the real `store` service (a subprocess), the rank's real checkpoint relay
(``StoreClient``: BeginSave, a synchronous DCP save through the chunk writer, CommitSave)
and the model with torch's AdamW (the optimizer L2-3 builds: frozen parameters get no
state). Between two saves, one training step (a 1 x 64-token batch: the trained
parameters and their moments change, the frozen ones do not). Each (model, frozen share)
saves ``saves`` times as two jobs: ``baseline_every 1`` (every version a full baseline)
and ``baseline_every 10`` (a baseline, then deltas). Reported per save after the first:
bytes written (SaveCompleted.written_bytes: the chunks this save put on disk), their ratio
to a full version's, and the save's wall time (save + commit, both synchronous, so the
whole write is timed; an asynchronous save blocks the loop only for its staging copy).

Frozen shares are reached by freezing whole parameters, largest first, each one that still
fits under the share (``model.freeze`` with their exact names); the share reached is
reported. Arithmetic for AdamW: a delta writes the trained
weights and their two moments, 3 t, against a baseline's P + 2 t (t = trained, P = all):
90 % frozen: 0.3 / 1.2 = 1/4; 97 %: 0.09 / 1.06 = 1/12.
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
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"demo": {}, "100m": {"n_layers": 14, "d_model": 768, "n_heads": 12}}
SHARES = {"dense": 0.0, "90% frozen": 0.90, "97% frozen": 0.97}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_spec(name: str):
    from services.jobspec import load_job_spec

    spec = load_job_spec(REPO / "examples/jobs/demo.yaml")
    return spec.model.model_copy(update=MODELS[name])


def freeze_names(model: torch.nn.Module, share: float) -> list[str]:
    """Parameter names to freeze, largest first: each one that still fits under ``share`` of
    all parameters (so the frozen share comes as close to it as whole parameters allow,
    never above)."""
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    names, frozen = [], 0
    for name, p in sorted(params, key=lambda np: -np[1].numel()):
        if frozen + p.numel() <= share * total:
            names.append(name)
            frozen += p.numel()
    return names


def run_case(store: str, model_name: str, share: float, saves: int, tag: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from services.compute.model import build_model, count_parameters
    from services.contract import store_pb2
    from services.rank.store_client import StoreClient

    spec = model_spec(model_name)
    model = build_model(spec, 0)
    names = freeze_names(model, share)
    spec = spec.model_copy(update={"freeze": names})  # what the shard loader applies, by name
    frozen_set = set(names)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen_set)
    total = count_parameters(model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, spec.vocab_size, (1, 64))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    client = StoreClient(store, lambda *a, **k: 1)
    out: dict = {"params": total, "trained_params": trained, "frozen_share": 1 - trained / total}
    for mode, every in (("full", 1), ("incremental", 10)):
        job = f"{tag}-{mode}"
        rows = []
        for n in range(1, saves + 1):
            step()
            state = {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt),
                "train": {"step": n},
            }
            t0 = time.perf_counter()
            client.save_checkpoint(
                store_pb2.SaveCheckpoint(job_id=job, step=n, rank=0, write_async=False, baseline_every=every), state
            )
            done = client.commit_checkpoint(
                store_pb2.CommitCheckpoint(job_id=job, step=n, world_size=1, spec_json="{}", keep_last=2)
            )
            rows.append(
                {
                    "seconds": time.perf_counter() - t0,
                    "written_bytes": done.written_bytes,
                    "bytes": done.bytes,
                    "baseline": done.baseline,
                }
            )
        out[mode] = rows
    client.close(timeout=2)
    full_bytes = statistics.median(r["written_bytes"] for r in out["full"])
    deltas = [r for r in out["incremental"] if not r["baseline"]]
    out["summary"] = {
        "full_version_bytes": full_bytes,
        "delta_written_bytes_median": statistics.median(r["written_bytes"] for r in deltas),
        "delta_over_full": statistics.median(r["written_bytes"] for r in deltas) / full_bytes,
        "full_save_s_median": statistics.median(r["seconds"] for r in out["full"][1:]),
        "baseline_save_s": out["incremental"][0]["seconds"],
        "delta_save_s_median": statistics.median(r["seconds"] for r in deltas),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "100m"])
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    torch.manual_seed(0)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        port, metrics = free_port(), free_port()
        argv = ["-m", "services.store", "--port", str(port), "--metrics-port", str(metrics), "--root", f"{tmp}/store"]
        store = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            time.sleep(2.0)
            for model_name in args.models:
                saves = args.saves if model_name == "demo" else max(3, args.saves // 2)
                for label, share in SHARES.items():
                    tag = f"{model_name}-{label.split('%')[0].split()[0]}"
                    case = run_case(f"127.0.0.1:{port}", model_name, share, saves, tag)
                    results.setdefault(model_name, {})[label] = case
                    s = case["summary"]
                    print(
                        f"{model_name:5} {label:11} ({case['params'] / 1e6:5.1f} M params, "
                        f"{100 * case['frozen_share']:4.1f} % frozen): full version {s['full_version_bytes'] / 1e6:7.1f} MB "
                        f"in {s['full_save_s_median']:.2f} s; delta writes {s['delta_written_bytes_median'] / 1e6:7.2f} MB "
                        f"({s['delta_over_full']:.3f} of full, 1/{1 / max(s['delta_over_full'], 1e-9):.1f}) "
                        f"in {s['delta_save_s_median']:.2f} s",
                        flush=True,
                    )
        finally:
            store.terminate()
            store.wait()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
