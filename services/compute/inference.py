"""Load a committed checkpoint into a fresh model for sampling (single process, no group).

Checkpoints are torch.distributed.checkpoint (DCP) directories written by the ranks; the
model's weights are the ``model.*`` keys (see ``services/rank/store_client.py``). Loading
never unpickles arbitrary objects: tensors are read with ``torch.load(weights_only=True)``
(DCP's own reader), :class:`SafeLoadPlanner` reads DCP's non-tensor entries the same way
(plain numbers, strings, lists, dicts only), and :class:`SafeFileSystemReader` reads the
``.metadata`` index (a pickle) with an unpickler that knows only DCP's metadata classes.

Given the version's manifest digests, the reader also checks every file it opens: the bytes
it reads are hashed (SHA-256) as they stream in and compared with the manifest before any of
them is used; a mismatch or a missing file raises :class:`ShardDigestMismatch` naming the
file. Verification is thus part of the read, never a separate pass before it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pathlib
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from services.compute.decode import generate, text_codec
from services.compute.model import build_model
from services.jobspec import JobSpec, spec_from_json
from services.state.chunk_reader import CHUNKED_METADATA_CLASSES, ChunkReader, enum_member
from services.state.chunk_store import ChunkIntegrityError, DirectorySource

# A key one rank owns: a path component ``rank<r>`` (e.g. the loop's ``train.rank3.rng.*``).
PER_RANK_KEY = re.compile(r"(?:^|\.)rank\d+\.")
# Keys read at the size the checkpoint holds, whatever the template's: the training loop's
# data position and the data order that names its format (a checkpoint of an older format
# must load, so that the loop can refuse it by name instead of DCP failing on a size).
AS_SAVED_KEY = re.compile(r"(?:^|\.)data_(?:order|position)$")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, except that non-tensor values are loaded with weights_only=True,
    and a per-rank key (:data:`PER_RANK_KEY`) the checkpoint lacks is left as it is instead
    of failing the load: that rank did not exist at the size the checkpoint was written at
    (a resume at a larger data-parallel size). The owner of the key knows its own keys and
    tells a missing one from a loaded one (the loop: ``train.ranks``). Every other key must
    be in the checkpoint, as with DCP's default. A plain tensor under :data:`AS_SAVED_KEY`
    is read at the size it was saved at."""

    def create_local_plan(self):
        held = self.metadata.state_dict_metadata if self.metadata is not None else {}
        absent = [k for k in self.state_dict if k not in held and PER_RANK_KEY.search(k)]
        for k in absent:
            del self.state_dict[k]
        for k, v in list(self.state_dict.items()):
            md = held.get(k)
            if (
                AS_SAVED_KEY.search(k)
                and type(v) is torch.Tensor
                and isinstance(md, TensorStorageMetadata)
                and tuple(md.size) != tuple(v.shape)
            ):
                self.state_dict[k] = torch.zeros(md.size, dtype=v.dtype)
                if self.flatten_state_dict:
                    set_element(self.original_state_dict, self.mappings[k], self.state_dict[k])
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# What a DCP ``.metadata`` pickle of torch 2.x's FileSystemWriter may name: what a chunked
# one may (services/state/chunk_store.py), plus its storage info and the writer's path type.
# Nothing that can run code.
_METADATA_CLASSES = CHUNKED_METADATA_CLASSES | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return enum_member  # an enum member as some Python 3.11 releases pickle it
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "PurePosixPath"):
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"checkpoint .metadata: refusing to load {module}.{name}")


_CHUNK = 1 << 20
# Files up to this size are read once into memory while hashed, and DCP reads that very
# copy; larger ones are hashed as they stream, then read again by DCP (from the page cache).
_BUFFER_LIMIT = 1 << 30


class ShardDigestMismatch(Exception):
    """A checkpoint file read for a load does not match the version's manifest.

    ``missing``: the file is gone (else its size or SHA-256 differs); ``file``: its path
    relative to the version. Picklable (DCP gathers a rank's failure to every rank)."""

    def __init__(self, message: str, file: str = "", missing: bool = False):
        super().__init__(message, file, missing)
        self.file, self.missing = file, missing

    def __str__(self) -> str:
        return str(self.args[0])


class _VerifyingFileSystem:
    """DCP's FileSystem, except that a file opened for reading is checked against the
    manifest (``digests``: relative path -> {"bytes", "sha256"}) as it is read."""

    def __init__(self, fs: Any, root: pathlib.Path, digests: Mapping[str, Mapping[str, Any]], what: str):
        self._fs, self._root, self._digests, self._what = fs, root, digests, what

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "r" not in mode:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        full = pathlib.Path(path)
        rel = full.relative_to(self._root).as_posix()
        expected = self._digests.get(rel)
        if expected is None:
            raise ShardDigestMismatch(f"{self._what}: {rel}: not in the manifest", rel)
        try:
            size = full.stat().st_size
            keep = size <= _BUFFER_LIMIT
            h, buf, read = hashlib.sha256(), io.BytesIO() if keep else None, 0
            with open(full, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    read += len(chunk)
                    if buf is not None:
                        buf.write(chunk)
        except FileNotFoundError:
            raise ShardDigestMismatch(f"{self._what}: {rel}: missing", rel, missing=True) from None
        if read != expected["bytes"]:
            raise ShardDigestMismatch(f"{self._what}: {rel}: size {read} bytes, manifest says {expected['bytes']}", rel)
        if h.hexdigest() != expected["sha256"]:
            raise ShardDigestMismatch(f"{self._what}: {rel}: sha256 mismatch", rel)
        if buf is not None:
            buf.seek(0)
            yield buf
        else:
            with self._fs.create_stream(path, mode) as stream:
                yield stream


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is unpickled with an allowlist of DCP's own
    metadata classes: a tampered index raises ``pickle.UnpicklingError`` instead of running
    whatever it names. With ``digests`` (the manifest's files), every file it opens is
    checked as it is read (:class:`ShardDigestMismatch`)."""

    def __init__(
        self, path: str | os.PathLike, digests: Mapping[str, Mapping[str, Any]] | None = None, what: str = "checkpoint"
    ):
        super().__init__(path)
        if digests is not None:
            self.fs = _VerifyingFileSystem(self.fs, pathlib.Path(self.path), digests, what)

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_load(
    state: dict, path: str, digests: Mapping[str, Mapping[str, Any]] | None = None, what: str = "checkpoint", **kwargs
) -> None:
    """``dcp.load`` of the checkpoint at ``path`` into ``state`` (tensors, Stateful objects)
    without unpickling anything but plain data and DCP's metadata classes; with ``digests``
    (relative path -> {"bytes", "sha256"}, the manifest's files) each file read is checked
    as it is read (ShardDigestMismatch, possibly wrapped in DCP's CheckpointException)."""
    reader = SafeFileSystemReader(path, digests=digests, what=what)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), **kwargs)


def load_model_for_inference(checkpoint_path: str, spec: JobSpec) -> nn.Module:
    """A model built from ``spec.model`` with the weights of the DCP checkpoint at
    ``checkpoint_path``, on the CPU, in eval mode.

    A committed version (it has a ``manifest.json``) is checked file by file against its
    manifest as it is read.

    Raises:
        FileNotFoundError: no checkpoint there.
        RuntimeError: the checkpoint does not hold this model's keys or shapes.
        ShardDigestMismatch: a file of a committed version differs from its manifest or is gone.
    """
    model = build_model(spec.model, seed=spec.seed)
    state = {"model": model.state_dict()}
    manifest = _manifest(checkpoint_path)
    digests = {f["path"]: f for f in manifest["files"]} if manifest else None
    with warnings.catch_warnings():  # "assuming single process": yes, that is the intent
        warnings.simplefilter("ignore", UserWarning)
        try:
            if manifest and "chunk_dir" in manifest:  # a chunked version: its chunks, each checked
                reader = _chunk_reader(checkpoint_path, manifest, digests)
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
            else:
                safe_load(state, checkpoint_path, digests=digests, no_dist=True)
        except ChunkIntegrityError as e:
            raise ShardDigestMismatch(str(e), e.file, e.missing) from None
        except CheckpointException as e:  # DCP wraps even a single process's failure
            mismatch = [exc for exc, _ in e.failures.values() if isinstance(exc, ShardDigestMismatch)]
            chunk = [exc for exc, _ in e.failures.values() if isinstance(exc, ChunkIntegrityError)]
            if mismatch:
                raise mismatch[0] from None
            if chunk:
                raise ShardDigestMismatch(str(chunk[0]), chunk[0].file, chunk[0].missing) from None
            raise
    model.load_state_dict(state["model"])
    return model.eval()


def _manifest(checkpoint_path: str) -> dict[str, Any] | None:
    """A committed version's ``manifest.json``, or None for a bare DCP save."""
    import json

    path = pathlib.Path(checkpoint_path) / "manifest.json"
    return json.loads(path.read_bytes()) if path.exists() else None


def _chunk_reader(checkpoint_path: str, manifest: dict[str, Any], digests: Mapping[str, Any] | None) -> ChunkReader:
    """The reader of a chunked version: its chunks under ``<job dir>/<chunk_dir>``."""
    root = pathlib.Path(checkpoint_path).parent / manifest["chunk_dir"]
    reader = ChunkReader(
        checkpoint_path,
        [DirectorySource(root)],
        digests=digests,
        what=f"checkpoint {manifest.get('version', '')}",
        chunk_label=manifest["chunk_dir"],
    )
    reader.read_metadata()  # checked first: DCP would hide its failure in an error of its own
    return reader


def manifest_digests(checkpoint_path: str) -> dict[str, Any] | None:
    """The files of a committed version's ``manifest.json`` (path -> {bytes, sha256}), or
    None for a directory that has none (a bare DCP save)."""
    import json

    path = pathlib.Path(checkpoint_path) / "manifest.json"
    if not path.exists():
        return None
    return {f["path"]: f for f in json.loads(path.read_bytes())["files"]}


# A token at a time, a small model's matrix products ([1, d_model] x [d_model, 4 d_model]) are
# too small for torch's intra-op threads to pay, and on a shared host their spinning costs
# most: 200 tokens of the demo model (d_model 128) took 1.7 s on one thread and 27.6 s on two
# (the fastest of 5 each, interleaved, a 2-core host at load ~15; docs/LOG.md, session 31).
ONE_THREAD_MAX_D_MODEL = 512


def generate_text(
    checkpoint_path: str,
    spec_json: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    tokenizer: str = "bytes",
) -> str:
    """Continue ``prompt`` with the model of a committed checkpoint (:func:`generate_texts`
    with one prompt).

    Raises:
        ValueError: a byte-level tokenizer for a model whose vocabulary is not 256.
    """
    return generate_texts(checkpoint_path, spec_json, [prompt], max_new_tokens, temperature, top_k, seed, tokenizer)[0]


def generate_texts(
    checkpoint_path: str,
    spec_json: str,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    tokenizer: str = "bytes",
) -> list[str]:
    """Continue each of ``prompts`` with the model of a committed checkpoint, loaded once; the
    texts in the prompts' order.

    ``tokenizer`` is "bytes" (token = UTF-8 byte, vocab 256) or the path of the HF
    ``tokenizers`` JSON file the dataset was prepared with. Prompts of the same length in
    tokens are decoded together, as one [B, T] batch sharing the KV cache's steps (no padding,
    so each row's logits are its own: greedy output is each prompt's alone); sampled
    (temperature > 0) rows draw from one generator, so a prompt's draw depends on its batch.

    Raises:
        ValueError: a byte-level tokenizer for a model whose vocabulary is not 256.
    """
    spec = spec_from_json(spec_json)
    encode, decode = text_codec(tokenizer, spec.model.vocab_size)
    model = load_model_for_inference(checkpoint_path, spec)
    encoded = [encode(p) or [0] for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    texts: list[str] = [""] * len(prompts)
    threads = torch.get_num_threads()
    if spec.model.d_model <= ONE_THREAD_MAX_D_MODEL:
        torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(seed)
        for rows in by_length.values():
            out_BT = generate(
                model,
                torch.tensor([encoded[i] for i in rows], dtype=torch.int64),
                max_new_tokens,
                temperature,
                top_k,
                generator=generator,
                context_len=spec.data.seq_len,
            )
            for i, ids in zip(rows, out_BT.tolist()):
                texts[i] = decode(ids)
    finally:
        torch.set_num_threads(threads)
    return texts
