"""Activation checkpointing per block (the plan's flag, set by the shard loader)."""

from __future__ import annotations

import torch

from services.compute.model import build_model
from services.jobspec import ModelSpec

SPEC = ModelSpec(n_layers=2, d_model=64, n_heads=4)


def _attention_calls(checkpointed: bool) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(SPEC, seed=1, activation_checkpointing=checkpointed)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(idx).float().logsumexp(-1).mean()
    loss.backward()
    return len(calls), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_checkpointed_block_recomputes_its_forward_in_backward_with_identical_gradients():
    plain_calls, plain_loss, plain_grads = _attention_calls(False)
    ckpt_calls, ckpt_loss, ckpt_grads = _attention_calls(True)
    assert (plain_calls, ckpt_calls) == (1, 2)  # once in forward, once more in backward
    assert torch.equal(plain_loss, ckpt_loss)
    assert all(torch.equal(plain_grads[n], ckpt_grads[n]) for n in plain_grads)


def test_evaluation_does_not_recompute():
    model = build_model(SPEC, seed=1, activation_checkpointing=True)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.int64))
    assert calls == [1]
