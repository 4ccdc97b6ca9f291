"""What the pipeline tests and their rank processes share: the small model, the global
batches (with uneven padding, so normalisation by the global token count matters), the
layer split and the optimizer, and the single-process reference run."""

from __future__ import annotations

import torch
from torch.nn import functional

from services.compute.model import build_model
from services.engine.sharding_plan import plan
from services.jobspec import ModelSpec, ParallelSpec

# 4 layers, d_model 64, seq 32 (the test size). Untied: pp > 1 refuses tied weights.
SPEC = ModelSpec(n_layers=4, d_model=64, n_heads=4, vocab_size=256, tie_embeddings=False, attention="math")
SEQ, ROWS, SEED = 32, 8, 7


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels), int64 [ROWS, SEQ]; row r has its last 3 r labels padded (-100)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    ids_BT = torch.randint(0, SPEC.vocab_size, (ROWS, SEQ + 1), generator=gen)
    labels_BT = ids_BT[:, 1:].clone()
    for r in range(ROWS):
        if r:
            labels_BT[r, SEQ - 3 * r :] = -100
    return ids_BT[:, :-1].contiguous(), labels_BT


def layer_ranges(pp: int, dp: int = 1) -> list[range]:
    """Stage -> block indices, from the L2-2 planner (the split the rank process uses)."""
    sharding = plan(SPEC, pp * dp, ParallelSpec(pp=pp, dp=dp, microbatches=pp))
    return [range(layers[0], layers[-1] + 1) for layers in sharding.stage_layers]


def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: per-parameter updates, identical whatever the set of parameters held.
    return torch.optim.AdamW(module.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


def reference_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model on the whole global batch: mean token loss per step, final weights."""
    torch.set_num_threads(1)
    model = build_model(SPEC, seed=SEED)
    optim = make_optimizer(model)
    losses = []
    for step in range(1, steps + 1):
        ids_BT, labels_BT = global_batch(step)
        logits_BTV = model(ids_BT)
        tokens = int((labels_BT != -100).sum())
        ce_sum = functional.cross_entropy(
            logits_BTV.reshape(-1, SPEC.vocab_size), labels_BT.reshape(-1), ignore_index=-100, reduction="sum"
        )
        optim.zero_grad(set_to_none=True)
        (ce_sum / tokens).backward()
        optim.step()
        losses.append(float(ce_sum.detach()) / tokens)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
