"""``model.freeze`` is checked against the model's real parameter names wherever a spec is
validated (surgectl submit, control's SubmitJob, the rank): a pattern that matches nothing
and patterns that freeze every parameter are one line naming the field, before anything is
allocated; the shard loader freezes by the same rule."""

from __future__ import annotations

import json

import pytest
import torch

from services.compute.model import Transformer, build_model
from services.compute.shard_loader import ShardLoader, _freeze
from services.contract import engine_pb2
from services.jobspec import JobSpecError, ModelSpec, model_parameters, parse_job_spec, spec_from_json, spec_to_json

JOB = """\
name: frozen
steps: 4
data: {{dataset: tiny@v1, seq_len: 16, micro_batch_size: 2}}
model: {{n_layers: 2, d_model: 32, n_heads: 2, tie_embeddings: {tie}, freeze: {freeze}}}
"""


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(n_layers=2, d_model=32, n_heads=2),
        ModelSpec(n_layers=3, d_model=48, n_heads=4, mlp="gelu", mlp_ratio=3.0, tie_embeddings=False, vocab_size=300),
        ModelSpec(n_layers=2, d_model=48, n_heads=6, n_kv_heads=2, qkv_bias=True, ffn_hidden=40),
    ],
    ids=["swiglu-tied", "gelu-untied", "gqa-qkv-bias-ffn-hidden"],
)
def test_the_spec_names_the_parameters_the_built_model_has(spec):
    with torch.device("meta"):
        model = Transformer(spec)
    built = list(model.named_parameters(remove_duplicate=False))
    first = {}
    for name, p in built:
        first.setdefault(id(p), name)
    assert list(model_parameters(spec)) == [(name, first[id(p)], p.numel()) for name, p in built]


def test_a_pattern_matching_no_parameter_is_refused_in_one_line_naming_its_index():
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(JOB.format(tie="true", freeze="['blocks.0.attn.*', 'blocks.*.atn.*']"), "ft.yaml")
    line = str(e.value)
    assert line.startswith("ft.yaml: model.freeze[1]: 'blocks.*.atn.*' matches no parameter (names look like: ")
    assert ".attn." in line.split("look like: ")[1] and "\n" not in line  # the nearest real names


def test_patterns_freezing_every_parameter_are_refused_in_one_line():
    # Tied: freezing tok_emb freezes lm_head.weight too (one tensor, two names).
    for tie, freeze, n in (("true", "['tok_emb.*', 'blocks.*', 'norm.weight']", 20), ("false", "['*']", 21)):
        with pytest.raises(JobSpecError) as e:
            parse_job_spec(JOB.format(tie=tie, freeze=freeze), "ft.yaml")
        line = str(e.value)
        assert line.startswith("ft.yaml: model.freeze: ") and "\n" not in line
        assert f"freezes all {n} parameters; nothing would train" in line


def test_a_partial_freeze_is_accepted_and_the_shard_loader_freezes_exactly_it():
    spec = parse_job_spec(JOB.format(tie="true", freeze="['tok_emb.weight', 'blocks.0.*']")).model
    model = build_model(spec, seed=0)
    _freeze(model, spec.freeze)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert frozen == {"tok_emb.weight", "lm_head.weight"} | {n for n, _ in model.named_parameters() if "blocks.0." in n}
    assert any(p.requires_grad for p in model.parameters())


def test_a_spec_read_back_loads_and_the_shard_loader_refuses_it_by_the_same_rule():
    # A job journaled before the rule still loads (control's restart, a checkpoint's spec);
    # the rank's shard loader applies the rule to the built model's own names, in one line.
    good = json.loads(spec_to_json(parse_job_spec(JOB.format(tie="true", freeze="['blocks.0.*']"))))
    for freeze, words in ((["blocks.7.*"], r"model\.freeze\[0\]: 'blocks\.7\.\*' matches no parameter"),
                          (["*"], r"model\.freeze: \['\*'\] freezes all 20 parameters; nothing would train")):  # fmt: skip
        good["model"]["freeze"] = freeze
        model = spec_from_json(json.dumps(good)).model
        loader = ShardLoader(lambda *a, **k: None, lambda m: None)
        loader.parallel_plan(engine_pb2.ParallelPlan(dp=1, pp=1, tp=1, device="cpu"))
        with pytest.raises(ValueError, match=f"^{words}"):
            loader.load_model(engine_pb2.LoadModel(model_json=model.model_dump_json(), seed=0))
