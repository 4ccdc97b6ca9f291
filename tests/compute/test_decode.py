"""Decoding with a KV cache (services/compute/decode.py): the cached logits are the full
forward's at every position, greedy output is the uncached decoding's, and past the trained
context the cropped window takes over."""

from __future__ import annotations

import pytest
import torch

from services.compute.decode import KVCache, forward_cached, generate
from services.compute.model import build_model
from services.jobspec import ModelSpec

SHAPES = {
    "mha_swiglu": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64},
    "gqa_gelu_bias": {"n_layers": 2, "d_model": 48, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 64,
                      "mlp": "gelu", "qkv_bias": True},
}  # fmt: skip


def uncached_greedy(m, prompt: torch.Tensor, n: int, context_len: int) -> torch.Tensor:
    """What decoding did before the cache: the whole (cropped) context again per token."""
    idx = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            window = idx[:, -context_len:] if context_len else idx
            idx = torch.cat((idx, m(window)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx[0]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cached_logits_are_the_full_forward_s_at_every_position(shape):
    m = build_model(ModelSpec(**SHAPES[shape]), seed=3).eval()
    x = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(x)
    cache = KVCache(len(m.blocks))
    got = [forward_cached(m, x[:, :8], cache)]  # a prefill of 8, then one token at a time
    got += [forward_cached(m, x[:, t : t + 1], cache) for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20 and cache.k[0].shape[2] == 20


@pytest.mark.parametrize("context_len", [0, 12])
def test_greedy_output_is_the_uncached_decoding_s_within_and_past_the_trained_context(context_len):
    m = build_model(ModelSpec(**SHAPES["gqa_gelu_bias"]), seed=5)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    got = generate(m, prompt, 20, temperature=0.0, context_len=context_len)  # (past 12 at context 12)
    assert torch.equal(got, uncached_greedy(m, prompt, 20, context_len))


def test_after_the_prefill_only_one_token_at_a_time():
    m = build_model(ModelSpec(**SHAPES["mha_swiglu"]), seed=0)
    cache = KVCache(len(m.blocks))
    forward_cached(m, torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="one token at a time"):
        forward_cached(m, torch.tensor([[4, 5]]), cache)


@pytest.mark.parametrize("context_len", [0, 12])
def test_a_batch_of_prompts_decodes_each_row_as_it_would_alone(context_len):
    """Batch generation (issue 31 item 5): prompts of one length decoded together, [B, T] in,
    [B, T + n] out, each row the greedy output of that prompt decoded alone, with the cache
    and past the trained context."""
    m = build_model(ModelSpec(**SHAPES["mha_swiglu"]), seed=7)
    prompts = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2], [6, 6, 6, 0, 1]])
    got = generate(m, prompts, 16, temperature=0.0, context_len=context_len)
    assert got.shape == (3, 5 + 16)
    for row, prompt in zip(got, prompts, strict=True):
        assert torch.equal(row, generate(m, prompt, 16, temperature=0.0, context_len=context_len))
        assert torch.equal(row, uncached_greedy(m, prompt, 16, context_len))
