"""A Hugging Face Llama or Qwen2 ``config.json`` <-> Surge's ``model:`` spec, both
directions, the tensor names (Surge's <-> Hugging Face's: the table is in
services/compute/hf_format.py's docstring), and the submit-time check of ``init_from.hf``
(the directory, its config, and its safetensors headers: every tensor the model needs, of
its shape): the half of services/compute/hf_format.py (which reads and writes the tensors)
that needs no tensor library, so that control's submit (no torch, no lower-layer code)
checks a spec's directory too. A job with ``init_from.hf`` takes the fields its ``model:`` leaves out
from the directory's config (:func:`model_from_hf`, called by services/jobspec/__init__.py's
``parse_job_spec``, so that surgectl and control read a spec alike).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from services.jobspec import JobSpec, JobSpecError, ModelSpec, RopeScaling, mlp_hidden_width, model_parameter_shapes

CONFIG = "config.json"
# The architectures read and written: transformers' class -> its model_type. Surge's model is
# both (services/compute/model.py): Llama when model.qkv_bias is false, Qwen2 when it is
# true (Qwen2 is Llama with biases on q, k and v; Llama's own attention_bias also puts one
# on o_proj, which Surge has not).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURE = "LlamaForCausalLM"  # (the default; kept for callers that name it)


class HfFormatError(ValueError):
    """A directory, configuration or tensor that does not fit: one line naming the file and
    the field or tensor."""


# ------------------------------------------------------------------ names

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.bias": "self_attn.v_proj.bias",
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


# ------------------------------------------------------------------ config.json


def hf_config(spec: JobSpec, dtype: str = "float32", eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``spec``'s model as a ``LlamaConfig`` (or, with
    ``model.qkv_bias``, a ``Qwen2Config``; transformers): sizes, grouped-query heads, MLP
    width, norm epsilon, RoPE base and Llama 3 scaling (both as ``rope_theta`` /
    ``rope_scaling``, transformers 4, and ``rope_parameters``, transformers 5), tied
    embeddings; ``max_position_embeddings`` is the job's ``data.seq_len`` (the longest
    context it was trained on; with RoPE scaling at least the context the scaling is for,
    ``original_max_position_embeddings x factor``). ``eos_token_id``: the tokenizer's
    end-of-text token, also the BOS (GPT-2's convention), else none (null: not transformers'
    Llama defaults 1 and 2, which would end a generation at an ordinary token).

    Raises:
        HfFormatError: ``model.mlp`` is not ``swiglu`` (Llama's MLP is SwiGLU).
    """
    m = spec.model
    if m.mlp != "swiglu":
        raise HfFormatError(f"model.mlp: {m.mlp} has no Hugging Face Llama form (Llama's MLP is swiglu)")
    architecture = "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    context = spec.data.seq_len
    if m.rope_scaling is not None:
        r = m.rope_scaling
        scaling = {
            "rope_type": r.type,
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        }
        rope = {**scaling, "rope_theta": m.rope_theta}
        context = max(context, round(r.original_max_position_embeddings * r.factor))
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "hidden_size": m.d_model,
        "intermediate_size": mlp_hidden_width(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": context,
        "torch_dtype": dtype,
        "dtype": dtype,
        "initializer_range": m.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if m.rope_scaling is not None:
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if architecture == "LlamaForCausalLM":
        config.update(attention_bias=False, mlp_bias=False)
    else:  # Qwen2: full attention in every layer (Surge has no sliding window)
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
    return config


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


def model_fields(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The ``model:`` fields (services/jobspec/model.py ModelSpec) of the architecture
    ``config`` (a Hugging Face ``config.json``: Llama or Qwen2) describes: n_layers, d_model,
    n_heads, n_kv_heads (None when it equals n_heads), mlp (swiglu), ffn_hidden, qkv_bias,
    tie_embeddings, vocab_size, rope_theta, rope_scaling, norm_eps. RoPE is read in both
    transformers' forms (``rope_parameters``, 5; ``rope_theta`` and ``rope_scaling``, 4).

    Raises:
        HfFormatError: an architecture or feature Surge's model lacks, or a size that is
            missing or not a positive integer; one line naming ``source`` and the key.
    """

    def refuse(text: str) -> NoReturn:
        raise HfFormatError(f"init_from.hf: {source}: {text}")

    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    known = [a for a in archs if a in ARCHITECTURES] if isinstance(archs, list) else []
    if model_type not in ARCHITECTURES.values() and not known:
        refuse(f"architectures {archs} / model_type {model_type!r}: only {' and '.join(ARCHITECTURES)} are read")
    qwen2 = model_type == "qwen2" or "Qwen2ForCausalLM" in known
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) matches Surge's model")
    if not qwen2 and config.get("attention_bias"):
        refuse("attention_bias true: Surge's model has biases on q, k and v only (Qwen2's), not on o_proj")
    if config.get("mlp_bias"):
        refuse("mlp_bias true: Surge's MLP has no biases")
    if config.get("use_sliding_window"):
        refuse("use_sliding_window true: Surge's attention has no sliding window")
    sizes = {}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            refuse(f"{key} {value!r}: expected a positive integer")
        sizes[key] = value
    heads = sizes["num_attention_heads"]
    kv = config.get("num_key_value_heads")
    kv = heads if kv is None else kv
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        refuse(f"num_key_value_heads {kv!r}: expected a positive integer")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != sizes["hidden_size"] // heads:
        refuse(
            f"head_dim {head_dim} differs from hidden_size / num_attention_heads = {sizes['hidden_size'] // heads} "
            "(Surge's heads are d_model / n_heads wide)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        refuse(f"rope_parameters {rope!r}: expected a mapping")
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "llama3":
        try:
            scaling = RopeScaling(
                factor=float(rope.get("factor", 8.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            ).model_dump()
        except (TypeError, ValueError) as e:  # (pydantic's ValidationError is a ValueError)
            refuse(f"rope llama3 parameters {rope!r}: {' '.join(str(e).split())[:200]}")
    elif kind != "default":
        refuse(f"rope type {kind!r}: only the default RoPE and Llama 3's scaling (llama3) are supported")
    theta = rope.get("rope_theta")
    if theta is None:
        theta = config.get("rope_theta", 10000.0)  # transformers 4 keeps it at the top; Llama's default
    return {
        "n_layers": sizes["num_hidden_layers"],
        "d_model": sizes["hidden_size"],
        "n_heads": heads,
        "n_kv_heads": None if kv == heads else kv,
        "mlp": "swiglu",
        "ffn_hidden": sizes["intermediate_size"],
        "qkv_bias": qwen2,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "vocab_size": sizes["vocab_size"],
        "rope_theta": float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta,
        "rope_scaling": scaling,
        "norm_eps": config.get("rms_norm_eps", 1e-6 if qwen2 else 1e-5),  # (each class's default)
    }


def check_config(config: Mapping[str, Any], model: ModelSpec, source: str) -> None:
    """That ``config`` (a Hugging Face ``config.json``) describes the architecture of
    ``model``: a difference is refused (:func:`model_from_hf` fills in what a spec leaves
    out before this check).

    Raises:
        HfFormatError: one line naming ``source``, the config key and the spec field
            (``...config.json: hidden_size 64 differs from model.d_model 32``).
    """

    def refuse(text: str) -> NoReturn:
        raise HfFormatError(f"init_from.hf: {source}: {text}")

    if model.mlp != "swiglu":
        refuse(f"model.mlp: {model.mlp}: a Llama model's MLP is swiglu")
    fields = model_fields(config, source)
    got = ModelSpec.model_construct(**fields)  # (the config's values as they are: compared, not validated)
    wanted = (
        ("hidden_size", "model.d_model", got.d_model, model.d_model),
        ("num_hidden_layers", "model.n_layers", got.n_layers, model.n_layers),
        ("num_attention_heads", "model.n_heads", got.n_heads, model.n_heads),
        ("num_key_value_heads", "model.n_kv_heads", got.n_kv_heads or got.n_heads, model.kv_heads),
        ("vocab_size", "model.vocab_size", got.vocab_size, model.vocab_size),
        ("tie_word_embeddings", "model.tie_embeddings", got.tie_embeddings, model.tie_embeddings),
    )
    for key, field, value, spec_value in wanted:
        if value != spec_value:
            refuse(f"{key} {value!r} differs from {field} {spec_value!r}")
    if fields["qkv_bias"] != model.qkv_bias:
        arch = "Qwen2 (q/k/v biases)" if fields["qkv_bias"] else "Llama (no biases)"
        refuse(f"architecture {arch} differs from model.qkv_bias {model.qkv_bias}")
    hidden = mlp_hidden_width(model)
    if fields["ffn_hidden"] != hidden:
        got_f = fields["ffn_hidden"]
        if model.ffn_hidden is not None:
            refuse(f"intermediate_size {got_f!r} differs from model.ffn_hidden {model.ffn_hidden}")
        hint = f" (model.mlp_ratio {got_f * 3 / (2 * model.d_model):g} gives it, or model.ffn_hidden {got_f})"
        refuse(
            f"intermediate_size {got_f!r} differs from the MLP width of model.mlp_ratio {model.mlp_ratio:g} ({hidden}){hint}"
        )
    if not _close(fields["norm_eps"], model.norm_eps):
        refuse(f"rms_norm_eps {fields['norm_eps']!r} differs from model.norm_eps {model.norm_eps!r}")
    if not _close(fields["rope_theta"], model.rope_theta):
        refuse(f"rope_theta {fields['rope_theta']!r} differs from model.rope_theta {model.rope_theta!r}")
    mine = model.rope_scaling.model_dump() if model.rope_scaling is not None else None
    if fields["rope_scaling"] != mine:
        refuse(f"rope scaling {fields['rope_scaling']!r} differs from model.rope_scaling {mine!r}")


def model_from_hf(directory: str, written: object, source: str) -> object:
    """The ``model:`` mapping of a job whose ``init_from.hf`` is ``directory``: the fields
    it leaves out that describe the architecture taken from ``directory``'s config.json
    (:func:`model_fields`), those it writes kept and checked against it (``freeze``,
    ``init_std`` and ``attention`` are the job's own). ``mlp_ratio`` or ``ffn_hidden``
    written: the config's MLP width is not filled in, the written one is compared.

    ``written`` (the section as the file has it, None when it has none) is returned as it
    is when it is not a mapping (the spec's validation names it) or when the directory
    cannot be read here: a file is still read where its directory is not (a job file
    checked on a laptop, an example), and every submit checks the directory
    (:func:`check_spec_directory`, surgectl's ``check_init_from``), naming what is wrong.

    Raises:
        JobSpecError: the config describes an architecture Surge lacks, or differs from a
            written field (one line naming ``source``, the config key and the field).
    """
    if written is not None and not isinstance(written, dict):
        return written
    try:
        config = read_config(directory)
    except HfFormatError:
        return written
    written = written or {}
    try:
        path = str(Path(directory) / CONFIG)
        merged = {**_taken(model_fields(config, path), written), **written}
        try:
            model = ModelSpec.model_validate(merged)
        except ValidationError:
            return merged  # (the job spec's validation names the field at fault)
        check_config(config, model, path)
    except HfFormatError as e:
        raise JobSpecError(f"{source}: {e}") from None
    return merged


def _taken(fields: Mapping[str, Any], written: Mapping[str, Any]) -> dict[str, Any]:
    """The config's model ``fields`` that ``written`` (the spec's ``model:``) leaves out: None
    ones (MHA's n_kv_heads, no RoPE scaling) are the spec's defaults already; with
    ``mlp_ratio`` written the MLP width is the ratio's."""
    taken = {k: v for k, v in fields.items() if v is not None and k not in written}
    if "mlp_ratio" in written:
        taken.pop("ffn_hidden", None)
    return taken


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) <= 1e-12 * max(1.0, abs(b))


def unread_directory(directory: str, written: object) -> str:
    """Why ``directory`` gave a spec's ``model:`` (``written``, as the file has it) none of
    its shape ("" when it did, or when ``written`` states the shape itself: n_layers,
    d_model, n_heads and vocab_size): then ModelSpec's defaults stand in for it, and a
    refusal of one of them (``model.vocab_size: 256``) would name a value the user never
    wrote, so :func:`services.jobspec.parse_job_spec` names the directory instead."""
    if isinstance(written, dict) and {"n_layers", "d_model", "n_heads", "vocab_size"} <= written.keys():
        return ""
    try:
        read_config(directory)
    except HfFormatError as e:
        return str(e)
    return ""


# ------------------------------------------------------------------ safetensors headers

# The floating-point dtypes the loader converts from (safetensors' names -> bytes per element;
# services/compute/hf_format.py read_hf_tensors casts to the model's dtype). Integer or
# boolean tensors are quantized or other data, not weights Surge can load.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the header (MAX_HEADER_SIZE)


def safetensors_header(file: str | Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> ``{"dtype", "shape", "data_offsets"}`` of one ``.safetensors`` file,
    read from its header alone (no tensor library, no data read): the format is an 8-byte
    little-endian header length N, then N bytes of JSON, then the data, each tensor's
    ``[begin, end)`` offsets relative to it (huggingface/safetensors, "Format"). Checked as
    safetensors checks it: the header fits the file, each entry is well formed, and each
    tensor's bytes lie inside the file (a truncated download is caught here, not on the
    ranks). The ``__metadata__`` entry is left out.

    Raises:
        HfFormatError: unreadable or malformed (one line naming the file).
    """
    path = Path(file)

    def refuse(text: str) -> NoReturn:
        raise HfFormatError(f"init_from.hf: {path}: not a readable safetensors file: {text}")

    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                refuse(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                refuse(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        refuse(e.strerror or str(e))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        refuse(f"header is not JSON: {' '.join(str(e).split())}")
    if not isinstance(header, dict):
        refuse("header is not a JSON object")
    data = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        ints = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
        if not ints or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape + offsets):
            refuse(f"tensor {name}: expected dtype, shape and data_offsets, got {entry!r:.200}")
        if not isinstance(entry.get("dtype"), str):
            refuse(f"tensor {name}: dtype {entry.get('dtype')!r}")
        if not offsets[0] <= offsets[1] <= data:
            refuse(f"tensor {name}: bytes {offsets[0]}..{offsets[1]} lie beyond its {data} bytes of data (truncated?)")
        width = FLOAT_DTYPES.get(entry["dtype"])  # (other dtypes are refused by the caller, by name)
        if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
            refuse(f"tensor {name}: {offsets[1] - offsets[0]} bytes for {entry['dtype']} of shape {shape}")
        tensors[name] = entry
    return tensors


def check_weights(directory: str | Path, model: ModelSpec) -> tuple[int, int]:
    """That ``directory``'s ``*.safetensors`` files hold every tensor ``model`` needs, of
    its shape and a floating-point dtype, by their headers alone (milliseconds for an 8B
    model's shards): the names of :func:`hf_name`, the shapes of
    services/jobspec/model.py ``model_parameter_shapes``; a tied model's ``lm_head.weight`` may
    be absent (the embedding is the head), as read_hf_tensors reads it. A tensor in several
    files is the first file's (sorted names), as there. Tensors the model does not use
    (``rotary_emb.inv_freq``) are ignored.

    Returns:
        (files, tensors checked).

    Raises:
        HfFormatError: a file that is not safetensors, a tensor in no file, of another shape
            or not floating point; one line naming the file (the directory for a missing
            tensor), the Hugging Face tensor and the Surge parameter.
    """
    d = Path(directory)
    files = sorted(d.glob("*.safetensors"))
    where: dict[str, tuple[Path, dict[str, Any]]] = {}
    for file in files:
        for key, entry in safetensors_header(file).items():
            where.setdefault(key, (file, entry))
    checked = 0
    for name, _, shape in model_parameter_shapes(model):
        key = hf_name(name)
        if key not in where and name == "lm_head.weight" and model.tie_embeddings:
            continue  # tied: the embedding is the head (transformers' files leave it out)
        if key not in where:
            raise HfFormatError(
                f"init_from.hf: {d}: tensor {key} (for {name}) is in none of its {len(files)} *.safetensors files"
            )
        file, entry = where[key]
        if entry["shape"] != list(shape):
            raise HfFormatError(
                f"init_from.hf: {file}: tensor {key} has shape {entry['shape']}, this job's {name} needs {list(shape)}"
            )
        if entry["dtype"] not in FLOAT_DTYPES:
            raise HfFormatError(
                f"init_from.hf: {file}: tensor {key} (for {name}) is {entry['dtype']}: only floating-point "
                f"weights are read ({', '.join(FLOAT_DTYPES)}; a quantized model is not)"
            )
        checked += 1
    return len(files), checked


# ------------------------------------------------------------------ at submit


def check_hf_directory(directory: str, model: ModelSpec) -> tuple[int, int]:
    """``init_from.hf`` at submit: the directory holds config.json and safetensors weights,
    the config is ``model``'s architecture, and the files' headers hold each of its tensors
    of its shape (:func:`check_weights`, whose counts it returns). Raises HfFormatError
    (one line)."""
    config = read_config(directory)
    check_config(config, model, str(Path(directory) / CONFIG))
    return check_weights(directory, model)


def check_spec_directory(spec: JobSpec, source: str) -> None:
    """A submitted spec's ``init_from.hf`` (nothing to check without one): see
    :func:`check_hf_directory`. Raises JobSpecError, one line naming ``source``."""
    if spec.init_from is not None and spec.init_from.hf is not None:
        try:
            check_hf_directory(spec.init_from.hf, spec.model)
        except HfFormatError as e:
            raise JobSpecError(f"{source}: {e}") from None


def source_report(spec: JobSpec, written: object) -> list[str]:
    """``submit --dry-run``'s lines on ``init_from.hf`` (none without it), for a spec whose
    directory the submit's checks accepted: which ``model:`` fields came from its
    config.json (``written``: the section as the file has it), and what of the weights was
    checked."""
    if spec.init_from is None or spec.init_from.hf is None:
        return []
    d = Path(spec.init_from.hf)
    written = written if isinstance(written, dict) else {}
    taken = _taken(model_fields(read_config(d), str(d / CONFIG)), written)
    files, tensors = check_weights(d, spec.model)
    shape = (
        f"model: {', '.join(taken)} from {d / CONFIG} (the fields the spec's model: leaves out)"
        if taken
        else f"model: as the spec writes it, which {d / CONFIG} agrees with"
    )
    weights = f"weights: each of the model's {tensors} tensors in {d}'s {files} *.safetensors file(s), of its shape"
    return [shape, weights + " (their headers read; the data is read by the ranks)"]
