"""Write the golden checkpoint of the current format: ``python -m tests.checkpoint.golden.make_golden``.

A tiny model (the real ``Transformer``: 1 layer, d_model 8, vocab 16) after one AdamW step,
and the training loop's slot as the loop saves it (step, loss scaler, data position and
order, ranks, the rank's RNG state), saved by the ranks' chunk writer and committed by the
real checkpoint manager, the way a rank and the store do. The store's ``checkpoints``
directory is copied to ``format-<N>/`` (N: ``formats.CHECKPOINT_FORMAT``) with
``expected.json``: every saved tensor's SHA-256, which the test compares after loading.

Run it once per format, when a format is added (formats.py); never rewrite an existing
``format-<N>``: it stands for what users of that release have on disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from services.compute.model import build_model
from services.contract import store_pb2
from services.jobspec import ModelSpec
from services.state.chunk_store import ChunkWriter
from services.store.checkpoint_manager import CheckpointManager
from services.store.checkpoint_manager.formats import CHECKPOINT_FORMAT

HERE = Path(__file__).resolve().parent
JOB, STEP = "golden-000000", 7
SPEC = ModelSpec(n_layers=1, d_model=8, n_heads=2, vocab_size=16)


def golden_state() -> dict:
    """The state a rank of a 1-rank job saves (RANK_SLOTS: model, optim, train)."""
    torch.manual_seed(0)
    model = build_model(SPEC, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).view(1, 8)).float().pow(2).mean().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "train": {
            "step": torch.tensor(STEP, dtype=torch.int64),
            "skipped_steps": torch.tensor(0, dtype=torch.int64),
            "consecutive_skips": torch.tensor(0, dtype=torch.int64),
            "loss_scale": torch.tensor(1.0, dtype=torch.float64),
            "loss_scaler": torch.tensor([0, 0, 0], dtype=torch.int64),
            "data_position": torch.tensor([0, 56, *b"v2".ljust(16, b"\0")], dtype=torch.int64),
            "data_order": torch.tensor([1, 2, 3], dtype=torch.int64),
            "ranks": torch.tensor([1], dtype=torch.int64),
            "rank0": {"rng": {"cpu": torch.random.get_rng_state()}},
        },
    }


def tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state by its dotted key."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= tensors(v, key + ".")
        elif isinstance(v, torch.Tensor):
            out[key] = v
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    out = HERE / f"format-{CHECKPOINT_FORMAT}"
    if out.exists():
        sys.exit(f"{out}: exists; a golden checkpoint is never rewritten")
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Path(tmp))
        staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=JOB, step=STEP, rank=0, baseline_every=4))
        state = golden_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=ChunkWriter(staged.staging_path, staged.chunk_path), no_dist=True)
        manager.commit_checkpoint(
            store_pb2.CommitCheckpoint(
                job_id=JOB, step=STEP, world_size=1, spec_json=json.dumps({"model": SPEC.model_dump()})
            )
        )
        shutil.copytree(Path(tmp) / "checkpoints", out / "checkpoints")
    expected = {
        k: {"sha256": digest(t), "dtype": str(t.dtype), "shape": list(t.shape)} for k, t in tensors(state).items()
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
