"""Decoder-only transformer (pre-norm, RoPE, SwiGLU or GELU MLP), kept thin on purpose.

Parallelism, precision and checkpointing are applied to this module from outside (by the
gradient-reduction unit, the operator adapter and the checkpoint writer); nothing here
knows about ranks or devices beyond the tensors it is given.

Shape legend (suffixes on tensor names, torchtitan style):
    B  batch rows                     T  time (sequence positions)
    D  model width (d_model)          H  attention heads
    K  head width (D / H)             F  MLP hidden width
    V  vocabulary size                G  k/v heads (n_kv_heads; H / G query heads share one)

Architecture sources:
    * pre-norm residual blocks: GPT-2 (Radford et al. 2019), RMSNorm (Zhang & Sennrich 2019)
      as in LLaMA (Touvron et al. 2023);
    * rotary position embedding, "rotate-half" layout: RoFormer (Su et al. 2021) as in
      GPT-NeoX / LLaMA; Llama 3.1's frequency rewrite (``rope_scaling``), as transformers'
      ``_compute_llama3_parameters``;
    * grouped-query attention (Ainslie et al. 2023): G k/v heads, each read by H / G
      consecutive query heads (Llama 3, Qwen2, Mistral); optional q/k/v biases (Qwen2);
    * SwiGLU MLP (Shazeer 2020) with hidden width 2/3 * mlp_ratio * D (LLaMA), rounded to
      a multiple of 8 so both MLP choices cost about the same FLOPs, or ``ffn_hidden``;
    * initialisation N(0, init_std), biases 0, residual output projections scaled by
      1/sqrt(2 * n_layers) (GPT-2).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from services.jobspec import ModelSpec, RopeScaling, mlp_hidden_width  # noqa: F401 (re-exported: F of a spec)

ATTENTION_BACKENDS = ("sdpa", "math")


# ------------------------------------------------------------------ attention kernels


def sdpa_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor) -> torch.Tensor:
    """Causal attention through ``F.scaled_dot_product_attention`` (fused kernels); with
    fewer k/v heads than query heads (G < H) its ``enable_gqa`` (torch >= 2.5) reads each
    k/v head for its H / G query heads without a repeated copy (the flash and math kernels
    take it; a kernel that does not is refused by SDPA, never silently replaced)."""
    gqa = k_BGTK.shape[1] != q_BHTK.shape[1]
    return functional.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True, enable_gqa=gqa)


def math_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor) -> torch.Tensor:
    """Causal attention written out: softmax(Q K^T / sqrt(K) + causal mask) V (Vaswani et al. 2017);
    k/v heads repeated for their H / G query heads (HF's ``repeat_kv``)."""
    T, K = q_BHTK.shape[-2], q_BHTK.shape[-1]
    group = q_BHTK.shape[1] // k_BGTK.shape[1]
    k_BHTK, v_BHTK = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k_BGTK, v_BGTK))
    scores_BHTT = (q_BHTK @ k_BHTK.transpose(-2, -1)) * (1.0 / math.sqrt(K))
    future_TT = torch.ones(T, T, dtype=torch.bool, device=q_BHTK.device).triu(1)
    scores_BHTT = scores_BHTT.masked_fill(future_TT, float("-inf"))
    return torch.softmax(scores_BHTT.float(), dim=-1).to(v_BHTK.dtype) @ v_BHTK


_KERNELS = {"sdpa": sdpa_attention, "math": math_attention}


# ------------------------------------------------------------------ rotary embedding


class Rotary:
    """cos/sin tables of RoPE, cached per (T, device, dtype). Not a buffer: nothing to
    save, nothing for DDP to broadcast each step. ``scaling``: Llama 3.1's rewrite of the
    frequencies (:func:`llama3_inv_freq`)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        self._inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            self._inv_freq = llama3_inv_freq(self._inv_freq, scaling)
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, device, dtype)
        if key not in self._cache:
            angles_TK2 = torch.outer(torch.arange(T, dtype=torch.float64), self._inv_freq)
            self._cache[key] = (
                angles_TK2.cos().to(device=device, dtype=dtype),
                angles_TK2.sin().to(device=device, dtype=dtype),
            )
        return self._cache[key]


def rotary_for(spec: ModelSpec) -> Rotary:
    """The RoPE tables of ``spec``'s model (head width, base, scaling)."""
    return Rotary(spec.head_dim, spec.rope_theta, spec.rope_scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequencies (Meta's ``apply_scaling``; transformers'
    ``_compute_llama3_parameters``, same formula): wavelengths 2 pi / f shorter than
    ``original_max_position_embeddings / high_freq_factor`` kept, longer than
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, those
    between interpolated by ``smooth = (original / wavelength - low) / (high - low)``."""
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x_BHTK: torch.Tensor, cos_TK2: torch.Tensor, sin_TK2: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTK.chunk(2, dim=-1)
    return torch.cat((x1 * cos_TK2 - x2 * sin_TK2, x1 * sin_TK2 + x2 * cos_TK2), dim=-1)


# ------------------------------------------------------------------ blocks


class Attention(nn.Module):
    """q, k and v are separate projections (not one fused qkv matmul) so that a
    column-parallel split of each gives every tensor-parallel rank whole heads: n_heads / tp
    query heads and the n_kv_heads / tp k/v heads they read (heads are grouped
    consecutively, so the two splits line up)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        D, kv_width = spec.d_model, spec.kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        self.q = nn.Linear(D, D, bias=spec.qkv_bias)
        self.k = nn.Linear(D, kv_width, bias=spec.qkv_bias)
        self.v = nn.Linear(D, kv_width, bias=spec.qkv_bias)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kernel) -> torch.Tensor:
        q_BHTK, k_BGTK, v_BGTK = self.heads(x_BTD, rope)
        return self.merge(kernel(q_BHTK, k_BGTK, v_BGTK))

    def heads(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q [B, H, T, K] and k, v [B, G, T, K] of ``x_BTD``, q and k rotated by ``rope``
        (the tables of x's positions; a KV cache's decoding passes later positions')."""
        B, T, _ = x_BTD.shape
        # The heads are counted from the projections' widths, not the spec: under tensor
        # parallelism q/k/v are column shards and this rank holds n_heads / tp query heads
        # and n_kv_heads / tp k/v heads.
        q_BTD, k_BTGK, v_BTGK = self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)
        H, G = q_BTD.shape[-1] // self.head_dim, k_BTGK.shape[-1] // self.head_dim
        q_BHTK = q_BTD.view(B, T, H, self.head_dim).transpose(1, 2)
        k_BGTK, v_BGTK = (t.view(B, T, G, self.head_dim).transpose(1, 2) for t in (k_BTGK, v_BTGK))
        cos, sin = rope
        q_BHTK = apply_rotary(q_BHTK, cos.to(q_BHTK.dtype), sin.to(q_BHTK.dtype))
        k_BGTK = apply_rotary(k_BGTK, cos.to(k_BGTK.dtype), sin.to(k_BGTK.dtype))
        return q_BHTK, k_BGTK, v_BGTK

    def merge(self, y_BHTK: torch.Tensor) -> torch.Tensor:
        """The heads' outputs back to [B, T, D], projected."""
        B, H, T, K = y_BHTK.shape
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, H * K))


class MLP(nn.Module):
    """GELU: down(gelu(up x)); SwiGLU: down(silu(gate x) * up x). Gate and up are separate
    linears so a column-parallel split keeps each rank's gate and up units paired."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind = spec.mlp
        hidden = mlp_hidden_width(spec)
        if self.kind == "swiglu":
            self.gate = nn.Linear(spec.d_model, hidden, bias=False)
        self.up = nn.Linear(spec.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, spec.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down(functional.silu(self.gate(x_BTD)) * self.up(x_BTD))
        return self.down(functional.gelu(self.up(x_BTD), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block. ``activation_checkpointing``: keep only the block's input
    and recompute its activations in backward (Chen et al. 2016), non-reentrant, so hooks
    applied from outside (FSDP2's, on the block) and DTensor weights stay outside the
    recomputed region and see the same calls; set per the plan by
    services/compute/parallelize.py."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.mlp = MLP(spec)
        self.activation_checkpointing = False

    def forward(self, x_BTD: torch.Tensor, rope, kernel) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._residual, x_BTD, rope, kernel, use_reentrant=False)
        return self._residual(x_BTD, rope, kernel)

    def _residual(self, x_BTD: torch.Tensor, rope, kernel) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), rope, kernel)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class Transformer(nn.Module):
    """Token ids int64 [B, T] -> logits [B, T, V] (float32, or the autocast dtype)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.norm = nn.RMSNorm(spec.d_model, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # Press & Wolf 2017
        with torch.device("cpu"):  # RoPE tables are computed, not weights: never on the meta device
            self._rotary = rotary_for(spec)

    def forward(self, idx_BT: torch.Tensor, attention: str | None = None) -> torch.Tensor:
        """Args: idx_BT int64 token ids; attention: "sdpa" | "math" (default: the spec's).

        Raises: ValueError for an unknown attention backend.
        """
        name = attention or self.spec.attention
        kernel = _KERNELS.get(name)
        if kernel is None:
            raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {name!r}")
        x_BTD = self.tok_emb(idx_BT)
        rope = self.rope(idx_BT.shape[1], x_BTD.device)
        for block in self.blocks:
            x_BTD = block(x_BTD, rope, kernel)
        return self.lm_head(self.norm(x_BTD))

    def rope(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (cos, sin) of positions 0..T-1, float32 (a KV cache's decoding
        slices its new positions from them)."""
        return self._rotary.tables(T, device, torch.float32)

    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation from ``seed`` (:func:`init_weights`)."""
        init_weights(self, self.spec, seed)


def meta_model(spec: ModelSpec, *, activation_checkpointing: bool = False) -> Transformer:
    """The model's structure on the meta device: every parameter's name, shape and dtype,
    no storage. Parallelism is laid out on it (services/compute/parallelize.py) before any
    weight exists, then :func:`materialise` allocates and fills only what this rank holds,
    so no rank ever holds the whole model (torchtitan's meta-device initialisation)."""
    with torch.device("meta"):
        model = Transformer(spec)
    for block in model.blocks:
        block.activation_checkpointing = activation_checkpointing
    return model


def materialise(module: nn.Module, spec: ModelSpec, seed: int, device: str | torch.device) -> None:
    """Give ``module`` (a :func:`meta_model`, a pipeline stage of one, laid out or not) storage
    on ``device`` and its initial weights (:func:`init_weights`), in place: with FSDP2 or
    tensor parallelism applied, each parameter is this rank's shard, allocated at its local
    size (``to_empty``: FSDP2 re-pads its shards and keeps the parameter objects)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    module.to_empty(device=device)
    # A plain meta parameter is replaced by a new one in each module that holds it, which
    # unties a shared weight (the tied embedding): tie it again, to the first name's.
    for first, *others in (group for group in names.values() if len(group) > 1):
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    init_weights(module, spec, seed)


@torch.no_grad()
def init_weights(module: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Deterministic initialisation of ``module``'s parameters from ``seed``, the same values
    whatever the module holds of the model (all of it, a pipeline stage, DTensor shards of
    any layout) and on whatever device.

    One CPU generator seeded with ``seed`` draws every parameter of the full model (of
    ``spec``) in the full model's ``named_parameters`` order (a tied weight once), each as a
    whole tensor: N(0, init_std), the residual output projections ``attn.proj`` and
    ``mlp.down`` N(0, init_std / sqrt(2 * n_layers)) (GPT-2). ``module`` keeps the slice it
    holds of each (a DTensor's local shard at its global offset) and drops the rest, so the
    peak beyond the module is one full parameter, and a sharded model equals, bit for bit,
    the one-process model of the same seed. 1-D parameters take no draw: biases (``*.bias``)
    0, norm gains 1.

    Raises AssertionError if ``module`` holds a parameter the model of ``spec`` has not.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = spec.init_std
    residual_std = std / math.sqrt(2 * spec.n_layers)
    held = dict(module.named_parameters())
    for name, like in meta_model(spec).named_parameters():  # the full model's order and shapes
        p = held.pop(name, None)
        if like.ndim == 1:
            if p is not None:
                (p.to_local() if isinstance(p, DTensor) else p).fill_(0.0 if name.endswith(".bias") else 1.0)
            continue
        s = residual_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else std
        full = torch.empty(like.shape, dtype=torch.float32).normal_(0.0, s, generator=gen)
        if p is None:  # another stage's: drawn all the same, so later draws do not shift
            continue
        if isinstance(p, DTensor):  # this rank's shard: its slice of the whole tensor
            shape, offset = compute_local_shape_and_global_offset(like.shape, p.device_mesh, p.placements)
            p.to_local().copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        else:
            p.copy_(full)
    assert not held, f"init_weights: parameters the model of this spec has not: {sorted(held)}"


def build_model(
    spec: ModelSpec, seed: int, device: str | torch.device = "cpu", *, activation_checkpointing: bool = False
) -> Transformer:
    """A freshly initialised model on ``device`` (float32 parameters); with
    ``activation_checkpointing`` every block recomputes its activations in backward.
    On ``"meta"``: the structure only (:func:`meta_model`), nothing drawn."""
    model = meta_model(spec, activation_checkpointing=activation_checkpointing)
    if torch.device(device).type != "meta":
        materialise(model, spec, seed, device)
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
