"""Surge's model <-> a Hugging Face Llama or Qwen2 directory (services/compute/hf_format.py),
checked against the real ``transformers`` package with small models made here (no download):
configs shaped like Llama-3.2-1B, Qwen2.5-0.5B, SmolLM2-135M and (untied) Llama-3-8B,
scaled down, with logits equal both ways."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.compute import hf_format
from services.compute.model import build_model
from services.hf_config import safetensors_header
from services.jobspec import JobSpec, JobSpecError, ModelSpec, model_parameter_shapes, model_parameters, parse_job_spec

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
        ({"hidden_size": 64, "head_dim": 16}, "hidden_size 64 differs from model.d_model 32"),
        ({"head_dim": 16}, "head_dim 16 differs from hidden_size / num_attention_heads = 8"),
        ({"num_hidden_layers": 3}, "num_hidden_layers 3 differs from model.n_layers 2"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2 differs from model.n_kv_heads 4"),
        ({"intermediate_size": 96}, "intermediate_size 96 differs from the MLP width of model.mlp_ratio 4 (88)"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta 10000.0 differs"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0}}, "rope type 'yarn': only the default"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}},
            "rope scaling {'type': 'llama3', 'factor': 8.0, ",
        ),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "architecture Qwen2 (q/k/v biases) differs"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "only LlamaForCausalLM and Qwen2"),
        ({"attention_bias": True}, "attention_bias true: Surge's model has biases on q, k and v only"),
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
    with pytest.raises(
        hf_format.HfFormatError,
        match=r"intermediate_size 120 .* \(model.mlp_ratio 5.625 gives it, or model.ffn_hidden 120\)$",
    ):
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


# ---------------------------------------------------------------- the shapes people fine-tune

# Published configs (their config.json, transformers 4's form: rope_theta at the top, Llama
# 3's scaling as rope_scaling) scaled down for a CPU: the same query / k-v head counts, heads
# 8 wide, the MLP in the published ratio to the width, 2 layers, a vocabulary of 512. Llama
# 3.2's original context is cut to 64 tokens with it, so that its scaling changes the
# positions the test reads (at 8192 it would only move channels that turn < 0.01 rad in 48).
SHAPES = {
    "llama-3.2-1b": {  # 2048 wide, 32 / 8 heads, 8192 MLP, tied, theta 5e5 with llama3 scaling x32
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": 8,
    },
    "qwen2.5-0.5b": {  # 896 wide, 14 / 2 heads, 4864 MLP, q/k/v biases, tied, theta 1e6
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 112,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 608,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "tie_word_embeddings": True,
    },
    "smollm2-135m": {  # 576 wide, 9 / 3 heads, 1536 MLP, tied, theta 1e5
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 72,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "llama-3-8b-untied": {  # 4096 wide, 32 / 8 heads, 14336 MLP, untied, theta 5e5
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 896,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}
COMMON = {"num_hidden_layers": 2, "vocab_size": 512, "hidden_act": "silu", "torch_dtype": "float32"}


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every 1-D parameter (norm gains, q/k/v biases) drawn away from its initial 1 or 0, so
    that a swapped, dropped or misnamed one shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g) + (0.5 if name.endswith("weight") else -0.5))
    return model.eval()


def logits_diff(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    idx_BT = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ours(idx_BT) - theirs(idx_BT).logits).abs().max().item()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hugging_face_model_imports_with_its_shape_from_config_json_and_the_same_logits(tmp_path, shape):
    """HF -> Surge: a model transformers builds from the config, saved by transformers with
    the published form of config.json; a job that names the directory and has no ``model:``
    section takes its shape from it, and the tensors read into Surge's model give
    transformers' logits (1e-5)."""
    transformers = pytest.importorskip("transformers")
    config = {**SHAPES[shape], **COMMON}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    randomised(hf, seed=1).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))  # (the published form, not transformers 5's)
    spec = parse_job_spec(
        f"name: ft\nsteps: 2\ndata: {{dataset: corpus@v1, seq_len: 48}}\ninit_from: {{hf: {tmp_path}}}\n", "ft.yaml"
    )
    m = spec.model
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.n_layers, m.ffn_hidden, m.vocab_size) == (
        config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], 2,
        config["intermediate_size"], 512,
    )  # fmt: skip
    assert (m.tie_embeddings, m.qkv_bias, m.rope_theta) == (
        config["tie_word_embeddings"], shape.startswith("qwen"), config["rope_theta"],
    )  # fmt: skip
    assert (m.rope_scaling is not None) == ("rope_scaling" in config)
    hf_format.check_spec_directory(spec, "ft.yaml")  # control's check agrees with the filled-in model
    ours = build_model(m, seed=0)
    ours.load_state_dict(hf_format.read_hf_tensors(tmp_path, ours.state_dict()))
    assert (ours.lm_head.weight is ours.tok_emb.weight) is config["tie_word_embeddings"]
    diff = logits_diff(ours.eval(), hf)
    assert diff < 1e-5, diff
    if m.rope_scaling is not None:  # the test can see the scaling: without it the logits differ
        plain = build_model(m.model_copy(update={"rope_scaling": None}), seed=0)
        plain.load_state_dict(ours.state_dict())
        assert logits_diff(plain.eval(), hf) > 1e-3


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_surge_model_exports_to_the_same_hugging_face_class_with_the_same_logits(tmp_path, shape):
    """Surge -> HF: the model of the shape's ``model:`` fields (as the import reads them),
    randomly initialised, written by save_hf; transformers loads the class the shape
    publishes (Qwen2 for q/k/v biases), with its grouped heads and RoPE scaling, and gives
    Surge's logits (1e-5)."""
    transformers = pytest.importorskip("transformers")
    config = {**SHAPES[shape], **COMMON}
    fields = hf_format.model_fields(config, "config.json")
    spec = JobSpec.model_validate(
        {"name": "x", "steps": 1, "data": {"dataset": "corpus@v1", "seq_len": 48}, "model": fields}
    )
    model = randomised(build_model(spec.model, seed=2), seed=3)
    hf_format.save_hf(tmp_path, model.state_dict(), spec)
    written = json.loads((tmp_path / "config.json").read_text())
    assert hf_format.model_fields(written, "config.json") == fields  # config.json -> model: -> config.json
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == config["architectures"][0] and theirs.dtype == torch.float32
    assert theirs.config.num_key_value_heads == config["num_key_value_heads"]
    assert theirs.config.rope_parameters["rope_type"] == ("llama3" if "rope_scaling" in config else "default")
    assert ("lm_head.weight" in load_file(tmp_path / hf_format.WEIGHTS)) is not config["tie_word_embeddings"]
    diff = logits_diff(model, theirs)
    assert diff < 1e-5, diff


def test_every_parameter_name_of_a_qwen2_shaped_model_maps_to_hugging_face_and_back():
    spec = ModelSpec(n_layers=2, d_model=48, n_heads=6, n_kv_heads=2, qkv_bias=True, vocab_size=64)
    names = [n for n, _, _ in model_parameters(spec)]
    assert "blocks.1.attn.k.bias" in names
    assert all(hf_format.surge_name(hf_format.hf_name(n)) == n for n in names)
    assert hf_format.hf_name("blocks.1.attn.v.bias") == "model.layers.1.self_attn.v_proj.bias"
    with pytest.raises(KeyError):
        hf_format.hf_name("blocks.0.attn.proj.bias")  # (Surge's o_proj has no bias, nor does Qwen2's)


def test_a_spec_that_restates_the_model_must_agree_with_config_json_naming_the_field(tmp_path):
    """``init_from.hf`` with a ``model:`` section: the fields it writes are checked against
    the directory's config (one line naming the key and the field), those it leaves out are
    filled in, and the job's own fields (freeze) are kept."""
    config = {**SHAPES["smollm2-135m"], **COMMON}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # (the parse reads config.json only)
    head = f"name: ft\nsteps: 2\ndata: {{dataset: corpus@v1, seq_len: 48}}\ninit_from: {{hf: {tmp_path}}}\n"
    spec = parse_job_spec(head + "model: {n_layers: 2, freeze: ['tok_emb.weight']}\n", "ft.yaml")
    assert (spec.model.n_kv_heads, spec.model.ffn_hidden, spec.model.freeze) == (3, 192, ["tok_emb.weight"])
    cases = {
        "model: {d_model: 144}": "hidden_size 72 differs from model.d_model 144",
        "model: {n_kv_heads: 9}": "num_key_value_heads 3 differs from model.n_kv_heads 9",
        "model: {qkv_bias: true}": "architecture Llama (no biases) differs from model.qkv_bias True",
        "model: {ffn_hidden: 256}": "intermediate_size 192 differs from model.ffn_hidden 256",
        "model: {rope_theta: 5.0e5}": "rope_theta 100000.0 differs from model.rope_theta 500000.0",
        "model: {tie_embeddings: false}": "tie_word_embeddings True differs from model.tie_embeddings False",
    }
    for section, words in cases.items():
        with pytest.raises(JobSpecError) as e:
            parse_job_spec(head + section + "\n", "ft.yaml")
        assert str(e.value) == f"ft.yaml: init_from.hf: {tmp_path / 'config.json'}: {words}", section
    # A directory not here: the file still reads (as written), and a submit's check names it.
    elsewhere = parse_job_spec(head.replace(str(tmp_path), str(tmp_path / "nowhere")), "ft.yaml")
    assert elsewhere.model == ModelSpec()
    with pytest.raises(JobSpecError, match=r"^ft.yaml: init_from.hf: .*/nowhere: not a directory$"):
        hf_format.check_spec_directory(elsewhere, "ft.yaml")
    config["architectures"], config["model_type"] = ["GemmaForCausalLM"], "gemma"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobSpecError, match=r"^ft.yaml: init_from.hf: .*config.json: architectures \['Gemma"):
        parse_job_spec(head, "ft.yaml")


# ---------------------------------------------------------------- the weights, by their headers, at submit


def test_the_parameter_shapes_without_torch_are_the_built_models():
    """services/jobspec/model.py model_parameter_shapes (what a directory's headers are checked
    against, in control too) is the model services/compute/model.py builds."""
    for model in (
        ModelSpec(n_layers=2, d_model=48, n_heads=6, n_kv_heads=2, qkv_bias=True, vocab_size=64, ffn_hidden=40),
        ModelSpec(n_layers=1, d_model=32, n_heads=4, tie_embeddings=False, vocab_size=96),
        ModelSpec(n_layers=1, d_model=32, n_heads=4, mlp="gelu", vocab_size=64),
    ):
        built = list(build_model(model, seed=0).named_parameters(remove_duplicate=False))
        assert [(n, s) for n, _, s in model_parameter_shapes(model)] == [(n, tuple(p.shape)) for n, p in built]


def test_the_headers_read_without_torch_are_what_safetensors_reads(tmp_path):
    from safetensors import safe_open

    file = tmp_path / "a.safetensors"
    tensors = {"x": torch.zeros(3, 5, dtype=torch.bfloat16), "y": torch.ones(7), "z": torch.zeros(0, 2)}
    save_file(tensors, file, metadata={"format": "pt"})
    header = safetensors_header(file)
    with safe_open(str(file), framework="pt") as f:
        theirs = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    assert {k: (e["shape"], e["dtype"]) for k, e in header.items()} == theirs
    assert theirs["x"] == ([3, 5], "BF16")
    whole = file.read_bytes()
    file.write_bytes(whole[:-8])  # a download cut short: y's last bytes missing
    with pytest.raises(hf_format.HfFormatError) as e:
        safetensors_header(file)
    assert str(e.value).startswith(f"init_from.hf: {file}: not a readable safetensors file: tensor ")
    assert "(truncated?)" in str(e.value) and "\n" not in str(e.value)
    lying = json.dumps({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    junks = {
        b"abc": "shorter than the 8-byte header length",
        b"\xff" * 16: "header length",
        len(lying).to_bytes(8, "little") + lying + bytes(12): r"tensor x: 12 bytes for F32 of shape \[2, 2\]$",
    }
    for junk, words in junks.items():
        file.write_bytes(junk)
        with pytest.raises(hf_format.HfFormatError, match=f"^init_from.hf: .*a.safetensors: .*{words}"):
            safetensors_header(file)


def test_a_directory_missing_a_tensor_or_with_one_of_another_shape_is_refused_at_submit(tmp_path):
    """The user trial's two directories (the tiny model minus one tensor, and one with a
    tensor of another shape) passed the submit's check and failed on the ranks: now the
    headers are read at submit, one line naming the file, the HF tensor and the Surge name."""
    spec = exported(tmp_path, tie_embeddings=False)
    full = load_file(tmp_path / hf_format.WEIGHTS)
    assert hf_format.check_hf_directory(str(tmp_path), spec.model) == (1, len(full))

    def refusal(tensors, files=None) -> str:
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        for name, part in (files or {hf_format.WEIGHTS: tensors}).items():
            save_file(part, tmp_path / name)
        with pytest.raises(hf_format.HfFormatError) as e:
            hf_format.check_hf_directory(str(tmp_path), spec.model)
        with pytest.raises(JobSpecError) as control:  # control's check: the same line, naming the job file
            hf_format.check_spec_directory(small_spec(init_from={"hf": str(tmp_path)}, tie_embeddings=False), "j.yaml")
        assert str(control.value) == f"j.yaml: {e.value}" and "\n" not in str(e.value)
        return str(e.value)

    up = "model.layers.1.mlp.up_proj.weight"
    assert refusal({k: v for k, v in full.items() if k != up}) == (
        f"init_from.hf: {tmp_path}: tensor {up} (for blocks.1.mlp.up.weight) is in none of its 1 *.safetensors files"
    )
    assert refusal({**full, up: torch.zeros(80, 32)}) == (
        f"init_from.hf: {tmp_path / hf_format.WEIGHTS}: tensor {up} has shape [80, 32], "
        "this job's blocks.1.mlp.up.weight needs [88, 32]"
    )
    assert refusal({k: v for k, v in full.items() if k != "lm_head.weight"}).endswith(
        "tensor lm_head.weight (for lm_head.weight) is in none of its 1 *.safetensors files"
    )  # untied: the head is a tensor of its own
    assert refusal({**full, up: torch.zeros(88, 32, dtype=torch.int8)}).endswith(
        f"tensor {up} (for blocks.1.mlp.up.weight) is I8: only floating-point weights are read "
        "(F64, F32, F16, BF16, F8_E4M3, F8_E5M2; a quantized model is not)"
    )
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for i, (name, t) in enumerate(full.items()):  # shards as transformers writes them, in bf16
        if name != up:
            shards[list(shards)[i % 2]][name] = t.to(torch.bfloat16)
    shards[list(shards)[1]][up] = torch.zeros(88, 16)
    assert refusal(None, shards).startswith(f"init_from.hf: {tmp_path / list(shards)[1]}: tensor {up} has shape")
    shards[list(shards)[1]][up] = full[up]
    for name, part in shards.items():
        save_file(part, tmp_path / name)
    assert hf_format.check_hf_directory(str(tmp_path), spec.model) == (2, len(full))


def test_a_tied_models_directory_may_leave_the_head_out(tmp_path):
    spec = exported(tmp_path)  # tied: save_hf leaves lm_head out, as transformers does
    assert "lm_head.weight" not in load_file(tmp_path / hf_format.WEIGHTS)
    assert hf_format.check_hf_directory(str(tmp_path), spec.model) == (1, len(list(model_parameters(spec.model))) - 1)


def test_an_8b_models_four_shards_are_checked_in_milliseconds(tmp_path):
    """Llama-3-8B's shapes in four shard files as large as the real ones (16 GB of bf16,
    sparse: only the headers are written): the submit's check reads the headers alone."""
    import time

    spec = JobSpec.model_validate(
        {
            "name": "big",
            "steps": 1,
            "data": {"dataset": "corpus@v1", "seq_len": 8192},
            "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
                      "vocab_size": 128256, "tie_embeddings": False, "rope_theta": 5.0e5},
        }
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf_format.hf_config(spec, dtype="bfloat16")))
    params = list(model_parameter_shapes(spec.model))
    for k in range(4):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, _, shape in params[k::4]:
            size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
            header[hf_format.hf_name(name)] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, size + offset],
            }
            offset += size
        raw = json.dumps(header).encode()
        with open(tmp_path / f"model-0000{k + 1}-of-00004.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # (a hole: no data written)
    assert sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) > 16e9
    start = time.perf_counter()
    assert hf_format.check_hf_directory(str(tmp_path), spec.model) == (4, 291)
    seconds = time.perf_counter() - start
    assert seconds < 0.5, seconds  # (a few ms here; generous for a loaded CI machine)


def test_a_directory_that_gives_the_model_nothing_is_named_before_the_defaults_it_left(tmp_path):
    """No ``model:`` section and a directory with no config.json or no weights: the spec's
    own refusals would name ModelSpec's defaults (a freeze pattern the 4-layer default has
    no block for); the directory's problem is named instead."""
    head = f"name: ft\nsteps: 2\ndata: {{dataset: corpus@v1, seq_len: 16}}\ninit_from: {{hf: {tmp_path}}}\n"
    frozen = head + "model: {freeze: ['blocks.20.*']}\n"
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(frozen, "ft.yaml")
    assert (
        str(e.value)
        == f"ft.yaml: init_from.hf: {tmp_path / 'config.json'}: missing (a Hugging Face model directory has one)"
    )
    (tmp_path / "config.json").write_text(json.dumps(hf_format.hf_config(small_spec(n_layers=24))))
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(frozen, "ft.yaml")
    assert (
        str(e.value) == f"ft.yaml: init_from.hf: {tmp_path}: no *.safetensors file (only safetensors weights are read)"
    )
    stated = head + "model: {n_layers: 2, d_model: 32, n_heads: 4, vocab_size: 64, freeze: ['blocks.20.*']}\n"
    # The shape written: the spec's own refusal.
    with pytest.raises(JobSpecError, match=r"^ft.yaml: model.freeze\[0\]: 'blocks.20.\*' matches no parameter"):
        parse_job_spec(stated, "ft.yaml")


def test_greedy_generation_with_the_kv_cache_is_transformers_on_the_export(tmp_path):
    """`surgectl generate`'s decoding (services/compute/decode.py, with its KV cache) and
    transformers' greedy generate on the exported directory give the same tokens."""
    transformers = pytest.importorskip("transformers")
    from services.compute.decode import generate

    spec = small_spec(norm_eps=1e-6)
    model = build_model(spec.model, seed=11).eval()
    hf_format.save_hf(tmp_path, model.state_dict(), spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([7, 3, 9, 1])
    ours = generate(model, prompt, 12, temperature=0.0, context_len=spec.data.seq_len)  # (16 positions: all kept)
    theirs = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0]
    assert torch.equal(ours, theirs), (ours.tolist(), theirs.tolist())


def test_the_exported_weights_have_the_mode_of_the_config_beside_them(tmp_path):
    # safetensors' writer creates its file 0600 whatever the umask (safetensors#782): another
    # user (a serving container's) could read config.json but not the weights.
    spec = small_spec()
    old = os.umask(0o022)
    try:
        hf_format.save_hf(tmp_path, build_model(spec.model, seed=1).state_dict(), spec)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes[hf_format.WEIGHTS] == modes[hf_format.CONFIG] == 0o644, modes
