"""Surge's model <-> a Hugging Face Llama or Qwen2 directory: the one place that maps names,
shapes and configuration in both directions (``surgectl export --format hf`` writes one;
``init_from: {hf: DIR}`` reads one).

Surge's model (services/compute/model.py) is the Llama architecture (Touvron et al. 2023):
pre-norm RMSNorm blocks, rotate-half RoPE (optionally Llama 3.1's frequency scaling),
grouped-query attention, SwiGLU MLP, optional tied embeddings; transformers'
``LlamaForCausalLM`` computes the same function, and ``Qwen2ForCausalLM`` the same with
biases on q, k and v (``model.qkv_bias``). The q and k projections need no permutation:
Surge's RoPE already rotates the two halves of each head (GPT-NeoX / HF layout), as HF's
``rotate_half`` does, and its k/v heads are grouped as HF's ``repeat_kv`` reads them (query
head h reads k/v head h // (n_heads / n_kv_heads)); tests/compute/test_hf_format.py holds
the logits equal both ways. No MLP other than SwiGLU has this form.

Names (``i``: the block)::

    Surge                          Hugging Face (LlamaForCausalLM, Qwen2ForCausalLM)
    tok_emb.weight                 model.embed_tokens.weight
    blocks.i.attn_norm.weight      model.layers.i.input_layernorm.weight
    blocks.i.attn.{q,k,v}.weight   model.layers.i.self_attn.{q,k,v}_proj.weight
    blocks.i.attn.{q,k,v}.bias     model.layers.i.self_attn.{q,k,v}_proj.bias (Qwen2)
    blocks.i.attn.proj.weight      model.layers.i.self_attn.o_proj.weight
    blocks.i.mlp_norm.weight       model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.{gate,up,down}.weight  model.layers.i.mlp.{gate,up,down}_proj.weight
    norm.weight                    model.norm.weight
    lm_head.weight                 lm_head.weight (absent from the files when tied)

The configuration half (config.json <-> ``model:``, the name map above, the submit-time
directory check: config and safetensors headers) is services/hf_config.py, without torch,
so that control checks it too; it is re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.hf_config import (  # noqa: F401 (the configuration half, re-exported: one module for callers)
    ARCHITECTURE,
    ARCHITECTURES,
    CONFIG,
    HfFormatError,
    check_config,
    check_hf_directory,
    check_spec_directory,
    check_weights,
    hf_config,
    hf_name,
    model_fields,
    read_config,
    surge_name,
)
from services.jobspec import JobSpec

WEIGHTS = "model.safetensors"

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
    tensor of the shape and dtype needed, or a DTensor: only this rank's shard is read,
    a slice of the file's tensor, so no rank holds a full copy of a sharded model; no
    communication), read with safetensors (no pickle). A tied model's ``lm_head.weight``
    is the embedding when the files hold no head of their own.

    Raises:
        HfFormatError: no config.json or weights, a file safetensors cannot read, a tensor
            the model needs in no file, or of another shape (one line naming the file and
            both names and shapes).
    """
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
    with contextlib.ExitStack() as files:
        handles: dict[Path, Any] = {}
        for name, like in wanted.items():
            try:
                key = hf_name(name)
            except KeyError:
                raise HfFormatError(f"init_from.hf: {d}: this job's {name} has no Hugging Face Llama name") from None
            if key not in where and tied and name == "lm_head.weight":
                key = hf_name("tok_emb.weight")
            if key not in where:
                raise HfFormatError(f"init_from.hf: {d}: tensor {key} (for {name}) is in no *.safetensors file")
            file = where[key]
            if file not in handles:
                handles[file] = files.enter_context(safe_open(str(file), framework="pt"))
            stored = handles[file].get_slice(key)  # nothing read yet: the shape from the header
            shape = list(stored.get_shape())
            if shape != list(like.shape):
                raise HfFormatError(
                    f"init_from.hf: {file.name}: tensor {key} has shape {shape}, "
                    f"this job's {name} needs {list(like.shape)}"
                )
            if isinstance(like, DTensor):
                out[name] = _shard_like(stored, like)
            else:
                out[name] = stored[:].to(dtype=like.dtype, device=like.device)
    return out


def _shard_like(stored: Any, like: Any) -> Any:
    """This rank's shard of ``stored`` (a safetensors slice handle, or a tensor) laid out as
    DTensor ``like`` (mesh, placements, global shape and stride): only the shard's rows and
    columns are read (DTensor's offsets, as DCP plans its reads), and nothing is sent
    (``distribute_tensor`` would scatter the whole tensor from one rank)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    local = stored[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
    local = local.to(dtype=like.dtype, device=like.to_local().device).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _umask() -> int:
    """The process's umask, read from /proc (os.umask reads it only by setting it, which a
    thread creating a file meanwhile would see); elsewhere set and restored at once."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_hf(directory: str | Path, state: Mapping[str, Any], spec: JobSpec, eos_token_id: int | None = None) -> None:
    """Write ``state`` (a Surge model's ``state_dict``, float32) and its config into
    ``directory`` (which exists): ``model.safetensors`` + ``config.json`` (``eos_token_id``:
    see :func:`hf_config`)."""
    from safetensors.torch import save_file

    config = hf_config(spec, eos_token_id=eos_token_id)  # refuses a model with no HF form before anything is written
    tensors = to_hf(state, spec.model.tie_embeddings)
    d = Path(directory)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    # safetensors >= 0.8 writes through a temp file created 0600 and renamed (safetensors#782):
    # the weights would be readable by their writer only, unlike config.json beside them.
    os.chmod(d / WEIGHTS, 0o666 & ~_umask())
    (d / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


END_OF_TEXT = "<|endoftext|>"  # the special token `dataset prepare --tokenizer bpe:N` adds (services/data/bpe.py)


def save_tokenizer(directory: str | Path, source: str | Path, seq_len: int) -> int | None:
    """Copy a dataset's tokenizer (the HF ``tokenizers`` JSON it was prepared with) into
    ``directory`` as ``tokenizer.json`` + a ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast`` (``model_max_length``: ``seq_len``), with ``<|endoftext|>`` as
    its BOS/EOS when it has that token; returns that token's id (None without one), for
    :func:`save_hf`'s ``eos_token_id``. One writer for `surgectl export` and an evaluation
    job's export: the evaluation's wrote no BOS/EOS, and lm-evaluation-harness's ``hf`` model
    (its prefix token is the BOS, else the EOS) failed on it (session 33's real run).

    Raises:
        OSError: ``source`` cannot be read or ``directory`` written.
    """
    d = Path(directory)
    shutil.copyfile(source, d / "tokenizer.json")
    try:
        added = json.loads(Path(source).read_text()).get("added_tokens") or []
    except ValueError:
        added = []
    end = next((t.get("id") for t in added if isinstance(t, dict) and t.get("content") == END_OF_TEXT), None)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    if end is not None:
        config.update(bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return end
