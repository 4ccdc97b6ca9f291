"""Autoregressive decoding with Surge's model (services/compute/model.py): a KV cache, and
:func:`generate` (``surgectl generate``, sample generation).

Without a cache every new token re-ran the whole context: T forward passes of up to T tokens
for T new tokens. With it the prompt runs once (prefill) and each new token runs alone,
reading the keys and values of the tokens before it from the cache; the layers' weights are
the model's own, called as its blocks call them, so the logits are the full forward's (to
float rounding: the same sums in another order).

The cache holds the positions the model was trained on (``context_len``, the job's
``seq_len``). Past that the context is cropped to its last ``context_len`` tokens and, as
RoPE positions then restart at 0, recomputed for each further token (what decoding did
before the cache, for every token).
"""

from __future__ import annotations

import torch
from torch.nn import functional

from services.compute.model import Attention, Transformer


class KVCache:
    """Per layer, the keys and values (after RoPE) of the positions decoded so far."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0  # positions held

    def append(self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this layer's new positions; returns its keys and values so far."""
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k_BGTK if old_k is None else torch.cat((old_k, k_BGTK), dim=2)
        self.v[layer] = v_BGTK if old_v is None else torch.cat((old_v, v_BGTK), dim=2)
        return self.k[layer], self.v[layer]  # type: ignore[return-value]


@torch.no_grad()
def forward_cached(model: Transformer, idx_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, T, V] of the tokens ``idx_BT`` that follow the ``cache.length`` positions
    held in ``cache`` (0: a prefill), which gains them. T > 1 only for a prefill."""
    start, T = cache.length, idx_BT.shape[1]
    if start and T != 1:
        raise ValueError("forward_cached: after the prefill, one token at a time")
    x_BTD = model.tok_emb(idx_BT)
    cos, sin = model.rope(start + T, x_BTD.device)
    rope = (cos[start:], sin[start:])
    for layer, block in enumerate(model.blocks):
        x_BTD = x_BTD + _attend(block.attn, block.attn_norm(x_BTD), rope, cache, layer, causal=start == 0)
        x_BTD = x_BTD + block.mlp(block.mlp_norm(x_BTD))
    cache.length = start + T
    return model.lm_head(model.norm(x_BTD))


def _attend(attn: Attention, x_BTD: torch.Tensor, rope, cache: KVCache, layer: int, causal: bool) -> torch.Tensor:
    """:meth:`Attention.forward` for new positions, their keys and values appended to the
    cache; a single new token attends to every position before it (no mask needed)."""
    q_BHTK, k_BGTK, v_BGTK = attn.heads(x_BTD, rope)
    k_BGSK, v_BGSK = cache.append(layer, k_BGTK, v_BGTK)
    gqa = q_BHTK.shape[1] != k_BGSK.shape[1]
    return attn.merge(functional.scaled_dot_product_attention(q_BHTK, k_BGSK, v_BGSK, is_causal=causal, enable_gqa=gqa))


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    context_len: int = 0,
) -> torch.Tensor:
    """Continue ``prompt_ids`` (int64 [T] or [B, T]) by ``max_new_tokens`` tokens.

    ``temperature == 0`` or ``top_k == 1`` is greedy decoding; otherwise tokens are drawn
    from softmax(logits / temperature) restricted to the ``top_k`` most likely (0: all).
    ``context_len``: the positions the model was trained on (pass the job's seq_len; 0: no
    limit): the context is cropped to its last ``context_len`` tokens (module docstring).

    Returns the prompt plus the new tokens, same rank as ``prompt_ids``.
    Raises ValueError for an empty prompt or negative arguments.
    """
    if prompt_ids.numel() == 0:
        raise ValueError("generate: the prompt must hold at least one token")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("generate: max_new_tokens, temperature and top_k must be >= 0")
    squeeze = prompt_ids.ndim == 1
    idx_BT = prompt_ids.unsqueeze(0) if squeeze else prompt_ids
    was_training = model.training
    model.eval()
    try:
        cache: KVCache | None = None
        for _ in range(max_new_tokens):
            if context_len > 0 and idx_BT.shape[1] > context_len:
                cache = None  # past the trained positions: the cropped window, recomputed
                logits_BV = model(idx_BT[:, -context_len:])[:, -1, :].float()
            elif cache is None:
                cache = KVCache(len(model.blocks))
                logits_BV = forward_cached(model, idx_BT, cache)[:, -1, :].float()
            else:
                logits_BV = forward_cached(model, idx_BT[:, -1:], cache)[:, -1, :].float()
            idx_BT = torch.cat((idx_BT, _next_token(logits_BV, temperature, top_k, generator)), dim=1)
    finally:
        model.train(was_training)
    return idx_BT[0] if squeeze else idx_BT


def _next_token(logits_BV: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    if temperature == 0 or top_k == 1:
        return logits_BV.argmax(dim=-1, keepdim=True)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    return torch.multinomial(torch.softmax(logits_BV, dim=-1), 1, generator=generator)


def text_codec(tokenizer: str, vocab_size: int):
    """(encode, decode) of text for a model of ``vocab_size`` tokens: ``tokenizer`` "bytes"
    (token = UTF-8 byte) or the path of the HF ``tokenizers`` JSON the dataset was prepared
    with. Raises ValueError: a byte-level tokenizer for a vocabulary that is not 256."""
    if tokenizer == "bytes":
        if vocab_size != 256:
            raise ValueError(f"generate: tokenizer 'bytes' needs model.vocab_size 256, got {vocab_size}")
        return (lambda text: list(text.encode("utf-8"))), (lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    return (lambda text: tok.encode(text).ids), (lambda ids: tok.decode(ids))
