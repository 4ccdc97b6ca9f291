"""Surge's model <-> a Hugging Face Llama directory: the one place that maps names, shapes
and configuration in both directions (``surgectl export --format hf`` writes one;
``init_from: {hf: DIR}`` reads one).

Surge's model (services/compute/model.py) is the Llama architecture (Touvron et al. 2023):
pre-norm RMSNorm blocks, rotate-half RoPE, SwiGLU MLP, no biases, optional tied
embeddings; transformers' ``LlamaForCausalLM`` computes the same function. The q and k
projections need no permutation: Surge's RoPE already rotates the two halves of each head
(GPT-NeoX / HF layout), as HF's ``rotate_half`` does; tests/compute/test_hf_format.py holds
the logits equal. Surge has no grouped-query attention (``num_key_value_heads`` equals
``num_attention_heads``), no RoPE scaling and no MLP other than SwiGLU for this format.

Names (``i``: the block)::

    Surge                          Hugging Face (LlamaForCausalLM)
    tok_emb.weight                 model.embed_tokens.weight
    blocks.i.attn_norm.weight      model.layers.i.input_layernorm.weight
    blocks.i.attn.{q,k,v}.weight   model.layers.i.self_attn.{q,k,v}_proj.weight
    blocks.i.attn.proj.weight      model.layers.i.self_attn.o_proj.weight
    blocks.i.mlp_norm.weight       model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.{gate,up,down}.weight  model.layers.i.mlp.{gate,up,down}_proj.weight
    norm.weight                    model.norm.weight
    lm_head.weight                 lm_head.weight (absent from the files when tied)

Importable without torch (the configuration half is read where a spec is validated, at
submit, by processes that hold no tensor library); the tensor functions import it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.jobspec import JobSpec, JobSpecError, ModelSpec, mlp_hidden_width

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLM"

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK_BACK = {hf: surge for surge, hf in _BLOCK.items()}
_TOP_BACK = {hf: surge for surge, hf in _TOP.items()}
_SURGE_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HfFormatError(ValueError):
    """A directory, configuration or tensor that does not fit: one line naming the file and
    the field or tensor."""


def hf_name(surge_name: str) -> str:
    """The Hugging Face name of Surge parameter ``surge_name``. Raises KeyError if it has none."""
    if surge_name in _TOP:
        return _TOP[surge_name]
    m = _SURGE_BLOCK.match(surge_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise KeyError(surge_name)


def surge_name(hf: str) -> str:
    """The Surge name of Hugging Face tensor ``hf``. Raises KeyError if it has none."""
    if hf in _TOP_BACK:
        return _TOP_BACK[hf]
    m = _HF_BLOCK.match(hf)
    if m and m.group(2) in _BLOCK_BACK:
        return f"blocks.{m.group(1)}.{_BLOCK_BACK[m.group(2)]}"
    raise KeyError(hf)


# ------------------------------------------------------------------ configuration


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


# ------------------------------------------------------------------ tensors


def to_hf(state: Mapping[str, Any], tied: bool) -> dict[str, Any]:
    """Surge's ``state_dict`` (names of services/compute/model.py) as Hugging Face tensors,
    contiguous and unshared (safetensors refuses shared storage); ``lm_head.weight`` left
    out when ``tied`` (transformers ties it back from ``tie_word_embeddings``)."""
    out = {}
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        out[hf_name(name)] = t.detach().contiguous().clone()
    return out


def read_hf_tensors(directory: str | Path, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of the Hugging Face directory for Surge names ``wanted`` (name -> a
    tensor of the shape and dtype needed, or a DTensor: the full tensor is split into this
    rank's shard locally, no communication), read with safetensors (no pickle). A tied
    model's ``lm_head.weight`` is the embedding when the files hold no head of their own.

    Raises:
        HfFormatError: no config.json or weights, a file safetensors cannot read, a tensor
            the model needs in no file, or of another shape (one line naming the file and
            both names and shapes).
    """
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    d = Path(directory)
    tied = bool(read_config(d).get("tie_word_embeddings", False))
    where: dict[str, Path] = {}
    for file in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    where.setdefault(key, file)
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: a file it cannot read
            raise HfFormatError(
                f"init_from.hf: {file}: not a readable safetensors file: {' '.join(str(e).split())}"
            ) from None
    out: dict[str, Any] = {}
    handles: dict[Path, Any] = {}
    try:
        for name, like in wanted.items():
            key = hf_name(name)
            if key not in where and tied and name == "lm_head.weight":
                key = hf_name("tok_emb.weight")
            if key not in where:
                raise HfFormatError(f"init_from.hf: {d}: tensor {key} (for {name}) is in no *.safetensors file")
            file = where[key]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            full = handles[file].get_tensor(key)
            shape = tuple(like.shape)
            if tuple(full.shape) != shape:
                raise HfFormatError(
                    f"init_from.hf: {file.name}: tensor {key} has shape {list(full.shape)}, "
                    f"this job's {name} needs {list(shape)}"
                )
            if isinstance(like, DTensor):
                out[name] = _shard_like(full, like)
            else:
                out[name] = full.to(dtype=like.dtype, device=like.device if isinstance(like, torch.Tensor) else "cpu")
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out


def _shard_like(full: Any, like: Any) -> Any:
    """This rank's shard of ``full`` laid out as DTensor ``like`` (mesh, placements, global
    shape and stride), cut locally: every rank read the whole tensor, so nothing is sent
    (``distribute_tensor`` would scatter it from one rank)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
    local = local.to(dtype=like.dtype, device=like.to_local().device).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def save_hf(directory: str | Path, state: Mapping[str, Any], spec: JobSpec, eos_token_id: int | None = None) -> None:
    """Write ``state`` (a Surge model's ``state_dict``, float32) and its config into
    ``directory`` (which exists): ``model.safetensors`` + ``config.json`` (``eos_token_id``:
    see :func:`hf_config`)."""
    from safetensors.torch import save_file

    config = hf_config(spec, eos_token_id=eos_token_id)  # refuses a model with no Llama form before anything is written
    tensors = to_hf(state, spec.model.tie_embeddings)
    d = Path(directory)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    (d / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
