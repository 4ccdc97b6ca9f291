"""A Hugging Face Llama ``config.json`` <-> Surge's ``model:`` spec, both directions, and the
submit-time check of ``init_from.hf`` (the directory and its config): the configuration half
of services/compute/hf_format.py (which maps the tensors), here without torch so that
control's submit (no tensor library, no lower-layer code) checks a spec's directory too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.jobspec import JobSpec, JobSpecError, ModelSpec, mlp_hidden_width

CONFIG = "config.json"
ARCHITECTURE = "LlamaForCausalLM"


class HfFormatError(ValueError):
    """A directory, configuration or tensor that does not fit: one line naming the file and
    the field or tensor."""


def hf_config(spec: JobSpec, dtype: str = "float32", eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``spec``'s model as a ``LlamaConfig`` (transformers): sizes,
    norm epsilon, RoPE base (both as ``rope_theta``, transformers 4, and ``rope_parameters``,
    transformers 5), tied embeddings; ``max_position_embeddings`` is the job's
    ``data.seq_len`` (the longest context it was trained on). ``eos_token_id``: the
    tokenizer's end-of-text token, also the BOS (GPT-2's convention), else none (null: not
    transformers' Llama defaults 1 and 2, which would end a generation at an ordinary token).

    Raises:
        HfFormatError: ``model.mlp`` is not ``swiglu`` (Llama's MLP is SwiGLU).
    """
    m = spec.model
    if m.mlp != "swiglu":
        raise HfFormatError(f"model.mlp: {m.mlp} has no Hugging Face Llama form (Llama's MLP is swiglu)")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": m.d_model,
        "intermediate_size": mlp_hidden_width(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.d_model // m.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": spec.data.seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
        "initializer_range": m.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


def read_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory, which must also hold weights
    (``*.safetensors``).

    Raises:
        HfFormatError: not an absolute path, not a directory, no config.json, not JSON,
            no safetensors file (one line naming the path).
    """
    d = Path(directory)
    if not d.is_absolute():
        raise HfFormatError(f"init_from.hf: {directory}: must be an absolute path (the ranks read it on their node)")
    if not d.is_dir():
        raise HfFormatError(f"init_from.hf: {d}: not a directory")
    path = d / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HfFormatError(f"init_from.hf: {path}: missing (a Hugging Face model directory has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HfFormatError(f"init_from.hf: {path}: cannot be read as JSON: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise HfFormatError(f"init_from.hf: {path}: expected a JSON object")
    if not sorted(d.glob("*.safetensors")):
        raise HfFormatError(f"init_from.hf: {d}: no *.safetensors file (only safetensors weights are read)")
    return config


def check_config(config: Mapping[str, Any], model: ModelSpec, source: str) -> None:
    """That ``config`` (a Hugging Face ``config.json``) describes the architecture of
    ``model``: nothing is filled in from it, a difference is refused.

    Raises:
        HfFormatError: one line naming ``source``, the config key and the spec field
            (``...config.json: hidden_size 64 differs from model.d_model 32``).
    """

    def refuse(text: str) -> None:
        raise HfFormatError(f"init_from.hf: {source}: {text}")

    archs = config.get("architectures") or []
    if config.get("model_type") != "llama" and ARCHITECTURE not in archs:
        refuse(f"architectures {archs} / model_type {config.get('model_type')!r}: only {ARCHITECTURE} (llama) is read")
    if model.mlp != "swiglu":
        refuse(f"model.mlp: {model.mlp}: a Llama model's MLP is swiglu")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) matches Surge's model")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            refuse(f"{key} true: Surge's model has no biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(
            f"rope type {rope.get('rope_type', rope.get('type'))!r}: only the default RoPE (no scaling) is supported"
        )
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if theta is None:
        theta = config.get("rope_theta", 10000.0)  # transformers 4 keeps it at the top; Llama's default
    heads = config.get("num_attention_heads")
    wanted = (
        ("hidden_size", "model.d_model", model.d_model),
        ("num_hidden_layers", "model.n_layers", model.n_layers),
        ("num_attention_heads", "model.n_heads", model.n_heads),
        ("vocab_size", "model.vocab_size", model.vocab_size),
        ("tie_word_embeddings", "model.tie_embeddings", model.tie_embeddings),
    )
    for key, field, value in wanted:
        got = config.get(key, False if key == "tie_word_embeddings" else None)
        if got != value:
            refuse(f"{key} {got!r} differs from {field} {value!r}")
    kv = config.get("num_key_value_heads", heads)
    if kv != heads:
        refuse(
            f"num_key_value_heads {kv} differs from num_attention_heads {heads}: Surge has no grouped-query attention"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != model.d_model // model.n_heads:
        refuse(f"head_dim {head_dim} differs from model.d_model / model.n_heads = {model.d_model // model.n_heads}")
    hidden = mlp_hidden_width(model)
    if config.get("intermediate_size") != hidden:
        got = config.get("intermediate_size")
        hint = (
            f" (model.mlp_ratio {got * 3 / (2 * model.d_model):g} gives it)" if isinstance(got, int) and got > 0 else ""
        )
        refuse(
            f"intermediate_size {got!r} differs from the MLP width of model.mlp_ratio {model.mlp_ratio:g} ({hidden}){hint}"
        )
    if not _close(config.get("rms_norm_eps"), model.norm_eps):
        refuse(f"rms_norm_eps {config.get('rms_norm_eps')!r} differs from model.norm_eps {model.norm_eps!r}")
    if not _close(theta, model.rope_theta):
        refuse(f"rope_theta {theta!r} differs from model.rope_theta {model.rope_theta!r}")


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) <= 1e-12 * max(1.0, abs(b))


def check_hf_directory(directory: str, model: ModelSpec) -> None:
    """``init_from.hf`` at submit: the directory holds config.json and safetensors weights,
    and the config is ``model``'s architecture. Raises HfFormatError (one line)."""
    config = read_config(directory)
    check_config(config, model, str(Path(directory) / CONFIG))


def check_spec_directory(spec: JobSpec, source: str) -> None:
    """A submitted spec's ``init_from.hf`` (nothing to check without one): see
    :func:`check_hf_directory`. Raises JobSpecError, one line naming ``source``."""
    if spec.init_from is not None and spec.init_from.hf is not None:
        try:
            check_hf_directory(spec.init_from.hf, spec.model)
        except HfFormatError as e:
            raise JobSpecError(f"{source}: {e}") from None
