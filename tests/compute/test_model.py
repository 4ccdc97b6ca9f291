"""The transformer: shapes, causality, kernels, tied embeddings, init, generation."""

from __future__ import annotations

import pytest
import torch

from services.compute.decode import generate
from services.compute.model import build_model, count_parameters, mlp_hidden_width
from services.jobspec import ModelSpec

SMALL = {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64}


def model(**over):
    return build_model(ModelSpec(**{**SMALL, **over}), seed=0)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_logits_are_float32_B_T_V(mlp, attention):
    m = model(mlp=mlp, attention=attention)
    logits = m(torch.randint(0, 64, (3, 11)))
    assert logits.shape == (3, 11, 64) and logits.dtype == torch.float32


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_changing_a_future_token_does_not_change_earlier_logits(attention):
    m = model()
    x = torch.randint(0, 64, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 64
    a, b = m(x, attention=attention), m(y, attention=attention)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sdpa_and_math_attention_compute_the_same_function():
    m = model()
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(m(x, attention="sdpa"), m(x, attention="math"), rtol=1e-5, atol=1e-5)


def test_an_unknown_attention_kernel_is_a_one_line_error():
    with pytest.raises(ValueError, match="attention: expected one of"):
        model()(torch.zeros(1, 4, dtype=torch.long), attention="flash")


def test_tied_embeddings_share_one_tensor_and_untied_add_a_head():
    tied, untied = model(tie_embeddings=True), model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert count_parameters(untied) - count_parameters(tied) == 64 * 32


def test_initialisation_is_a_pure_function_of_the_seed():
    a, b, c = build_model(ModelSpec(**SMALL), 7), build_model(ModelSpec(**SMALL), 7), build_model(ModelSpec(**SMALL), 8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    assert a.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_mlp_hidden_width_swiglu_is_two_thirds_of_the_ratio_rounded_to_8():
    assert mlp_hidden_width(ModelSpec(d_model=128, mlp="swiglu", mlp_ratio=4.0)) == 344  # 341.3 -> 344
    assert mlp_hidden_width(ModelSpec(d_model=128, mlp="gelu", mlp_ratio=4.0)) == 512
    demo = build_model(ModelSpec(), 0)  # the demo model: 4 x 128, vocab 256
    assert 0.8e6 < count_parameters(demo) < 0.9e6


def test_greedy_generation_is_deterministic_and_extends_the_prompt():
    m = model()
    prompt = torch.tensor([1, 2, 3])
    a, b = generate(m, prompt, 5, temperature=0.0), generate(m, prompt, 5, temperature=0.0)
    assert a.shape == (8,) and torch.equal(a[:3], prompt) and torch.equal(a, b)
    with torch.no_grad():
        assert a[3].item() == m(prompt[None])[0, -1].argmax().item()


def test_top_k_sampling_draws_only_among_the_k_most_likely():
    m = model()
    prompt = torch.tensor([5, 6])
    with torch.no_grad():
        top2 = set(torch.topk(m(prompt[None])[0, -1], 2).indices.tolist())
    g = torch.Generator().manual_seed(0)
    firsts = {generate(m, prompt, 1, temperature=1.0, top_k=2, generator=g)[-1].item() for _ in range(30)}
    assert firsts <= top2


# ---------------------------------------------------------------- the shapes people fine-tune

GQA = {"n_layers": 2, "d_model": 48, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 64}


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_repeated_for_its_group(attention):
    """n_kv_heads 2 of 6: query heads 0-2 read k/v head 0, 3-5 head 1 (HF's repeat_kv
    order). The same model with n_kv_heads = n_heads and each k/v head's rows copied to its
    group's heads computes the same logits."""
    gqa = build_model(ModelSpec(**GQA), seed=0)
    mha = build_model(ModelSpec(**{**GQA, "n_kv_heads": None}), seed=1)
    assert gqa.blocks[0].attn.k.weight.shape == (2 * 8, 48) and mha.blocks[0].attn.k.weight.shape == (48, 48)
    state = gqa.state_dict()
    for name, t in list(state.items()):
        if name.endswith(("attn.k.weight", "attn.v.weight")):  # [G*K, D] -> [H*K, D]
            state[name] = t.view(2, 8, 48).repeat_interleave(3, dim=0).reshape(48, 48)
    mha.load_state_dict(state)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x, attention=attention), mha(x, attention=attention), rtol=1e-5, atol=1e-5)


def test_sdpa_and_math_attention_agree_under_grouped_query_attention():
    m = build_model(ModelSpec(**GQA, qkv_bias=True), seed=0)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(m(x, attention="sdpa"), m(x, attention="math"), rtol=1e-5, atol=1e-5)


def test_qkv_biases_start_at_zero_and_change_the_function_once_set():
    m = build_model(ModelSpec(**GQA, qkv_bias=True), seed=0)
    attn = m.blocks[1].attn
    assert [b.shape for b in (attn.q.bias, attn.k.bias, attn.v.bias)] == [(48,), (16,), (16,)]
    assert attn.proj.bias is None and all(not b.any() for b in (attn.q.bias, attn.k.bias, attn.v.bias))
    assert torch.equal(m.blocks[1].attn_norm.weight, torch.ones(48))  # (norm gains still 1)
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        before = m(x)
        attn.v.bias.fill_(0.5)
        assert not torch.allclose(m(x), before, atol=1e-4)


def test_ffn_hidden_is_the_mlp_width_whatever_the_ratio():
    spec = ModelSpec(**SMALL, ffn_hidden=40, mlp_ratio=8.0)
    assert mlp_hidden_width(spec) == 40 and build_model(spec, 0).blocks[0].mlp.up.weight.shape == (40, 32)
    gelu = ModelSpec(**SMALL, mlp="gelu", ffn_hidden=24)
    assert build_model(gelu, 0).blocks[0].mlp.down.weight.shape == (32, 24)


def test_llama3_rope_scaling_gives_transformers_frequencies():
    """Llama-3.2-1B's RoPE (head width 64, theta 5e5, factor 32, 1 / 4, 8192 tokens) against
    transformers' ``_compute_llama3_parameters``: the three bands (kept, smoothed, divided)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from services.compute.model import rotary_for

    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    spec = ModelSpec(d_model=2048, n_heads=32, rope_theta=500000.0, rope_scaling=scaling)
    ours = rotary_for(spec)._inv_freq
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    plain = rotary_for(ModelSpec(d_model=2048, n_heads=32, rope_theta=500000.0))._inv_freq
    kept, divided = ours == plain, torch.isclose(ours, plain / 32)
    assert kept.sum() > 0 and divided.sum() > 0 and (~kept & ~divided).sum() > 0  # all three bands are there


def test_initialisation_is_one_seeded_cpu_draw_per_parameter_in_order():
    # The rule every layout reproduces (services/compute/model.py init_weights), written out:
    # one generator, each matrix drawn whole in named_parameters order (the tied one once),
    # the residual projections at init_std / sqrt(2 L), 1-D gains 1 without a draw.
    spec = ModelSpec(**{**SMALL, "tie_embeddings": False})
    gen = torch.Generator().manual_seed(9)
    want = {}
    for name, p in build_model(spec, 9, "meta").named_parameters():
        if p.ndim == 1:
            want[name] = torch.ones(p.shape)
            continue
        std = (
            spec.init_std / (2 * spec.n_layers) ** 0.5
            if name.endswith(("attn.proj.weight", "mlp.down.weight"))
            else spec.init_std
        )
        want[name] = torch.empty(p.shape).normal_(0.0, std, generator=gen)
    got = dict(build_model(spec, 9).named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_meta_model_has_no_storage_and_materialises_with_its_tied_weight_tied():
    from services.compute.model import materialise, meta_model

    spec = ModelSpec(**SMALL)
    m = meta_model(spec)
    assert all(p.is_meta for p in m.parameters()) and m.lm_head.weight is m.tok_emb.weight
    materialise(m, spec, 3, "cpu")
    assert m.lm_head.weight is m.tok_emb.weight and not any(p.is_meta for p in m.parameters())
    ref = build_model(spec, 3)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values(), strict=True))
    assert m(torch.randint(0, 64, (1, 5))).shape == (1, 5, 64)  # RoPE tables are real tensors


def test_a_pipeline_stage_materialised_alone_holds_the_whole_models_values():
    # Stage 1 of 2 draws every tensor (so its own come out as the whole model's) and keeps its own.
    from services.compute.model import materialise, meta_model
    from services.compute.pipeline_stage import stage_of
    from services.engine.parallel_strategy import plan_message
    from services.engine.sharding_plan import plan
    from services.jobspec import ParallelSpec

    spec = ModelSpec(**{**SMALL, "n_layers": 4, "tie_embeddings": False})
    stage = stage_of(meta_model(spec), plan_message(plan(spec, 2, ParallelSpec(pp=2)), 1, "cpu"), None)
    materialise(stage, spec, 4, "cpu")
    whole = build_model(spec, 4).state_dict()
    held = stage.state_dict()
    assert sorted(held) == sorted(k for k in whole if k.startswith(("blocks.2.", "blocks.3.", "norm.", "lm_head.")))
    assert all(torch.equal(v, whole[k]) for k, v in held.items())
