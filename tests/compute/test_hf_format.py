"""Surge's model <-> a Hugging Face Llama directory (services/compute/hf_format.py), checked
against the real ``transformers`` package with small models made here (no download)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.compute import hf_format
from services.compute.model import build_model
from services.jobspec import JobSpec, JobSpecError, model_parameters

pytestmark = pytest.mark.timeout(120)


def small_spec(init_from=None, **model) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "hf",
            "steps": 2,
            "data": {"dataset": "corpus@v1", "seq_len": 16},
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "rope_theta": 500.0, **model},
            "init_from": init_from,
        }
    )


@pytest.mark.parametrize("tied", [True, False])
def test_an_exported_model_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    spec = small_spec(tie_embeddings=tied, norm_eps=1e-6)
    model = build_model(spec.model, seed=3).eval()
    with torch.no_grad():  # norm gains away from 1, so a swapped or dropped norm would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    hf_format.save_hf(tmp_path, model.state_dict(), spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings is tied
    assert hf.config.eos_token_id is None  # no tokenizer said which: not Llama's default 2
    idx_BT = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(idx_BT) - hf(idx_BT).logits).abs().max().item()
    assert diff < 1e-5, diff
    files = set(load_file(tmp_path / hf_format.WEIGHTS))
    assert ("lm_head.weight" in files) is not tied


def test_every_parameter_name_maps_to_hugging_face_and_back():
    for tied in (True, False):
        names = [n for n, _, _ in model_parameters(small_spec(tie_embeddings=tied).model)]
        assert all(hf_format.surge_name(hf_format.hf_name(n)) == n for n in names)
        assert len({hf_format.hf_name(n) for n in names}) == len(names)
    assert hf_format.hf_name("blocks.1.attn.proj.weight") == "model.layers.1.self_attn.o_proj.weight"
    with pytest.raises(KeyError):
        hf_format.surge_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_a_gelu_model_has_no_hugging_face_form():
    with pytest.raises(hf_format.HfFormatError, match=r"^model\.mlp: gelu has no Hugging Face Llama form"):
        hf_format.hf_config(small_spec(mlp="gelu"))


def exported(tmp_path, **model):
    spec = small_spec(**model)
    hf_format.save_hf(tmp_path, build_model(spec.model, seed=1).state_dict(), spec)
    return spec


@pytest.mark.parametrize(
    "change, words",
    [
        ({"hidden_size": 64}, "hidden_size 64 differs from model.d_model 32"),
        ({"num_hidden_layers": 3}, "num_hidden_layers 3 differs from model.n_layers 2"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 differs from num_attention_heads 4"),
        ({"intermediate_size": 96}, "intermediate_size 96 differs from the MLP width of model.mlp_ratio 4 (88)"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta 10000.0 differs"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0}}, "rope type 'llama3'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings False differs from model.tie_embeddings True"),
    ],
)
def test_a_config_that_is_not_the_specs_model_is_one_line_naming_key_and_field(tmp_path, change, words):
    spec = exported(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf_format.HfFormatError) as e:
        hf_format.check_hf_directory(str(tmp_path), spec.model)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"init_from.hf: {tmp_path / 'config.json'}: ")


def test_the_intermediate_size_refusal_names_the_mlp_ratio_that_gives_it(tmp_path):
    exported(tmp_path, mlp_ratio=5.5)  # F = 120
    with pytest.raises(hf_format.HfFormatError, match=r"intermediate_size 120 .* \(model.mlp_ratio 5.625 gives it\)"):
        hf_format.check_hf_directory(str(tmp_path), small_spec().model)


def test_a_directory_without_config_or_weights_is_refused_naming_it(tmp_path):
    spec = small_spec()
    with pytest.raises(hf_format.HfFormatError, match="config.json: missing"):
        hf_format.check_hf_directory(str(tmp_path), spec.model)
    exported(tmp_path)
    (tmp_path / hf_format.WEIGHTS).unlink()
    with pytest.raises(hf_format.HfFormatError, match=r"no \*\.safetensors file"):
        hf_format.check_hf_directory(str(tmp_path), spec.model)
    with pytest.raises(JobSpecError, match=r"^job.yaml: init_from.hf: .*/nowhere: not a directory$"):
        hf_format.check_spec_directory(small_spec(init_from={"hf": str(tmp_path / "nowhere")}), "job.yaml")


def test_a_tensor_of_another_shape_is_one_line_naming_both_names_and_shapes(tmp_path):
    spec = exported(tmp_path, tie_embeddings=False)
    tensors = load_file(tmp_path / hf_format.WEIGHTS)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(80, 32)
    save_file(tensors, tmp_path / hf_format.WEIGHTS)
    wanted = build_model(spec.model, seed=0).state_dict()
    with pytest.raises(hf_format.HfFormatError) as e:
        hf_format.read_hf_tensors(tmp_path, wanted)
    assert str(e.value) == (
        "init_from.hf: model.safetensors: tensor model.layers.1.mlp.up_proj.weight has shape [80, 32], "
        "this job's blocks.1.mlp.up.weight needs [88, 32]"
    )
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / hf_format.WEIGHTS)
    with pytest.raises(
        hf_format.HfFormatError,
        match=r"tensor model.layers.1.mlp.up_proj.weight \(for blocks.1.mlp.up.weight\) is in no",
    ):
        hf_format.read_hf_tensors(tmp_path, wanted)
