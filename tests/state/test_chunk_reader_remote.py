"""ChunkReader with a remote authoritative source (the store's data plane or an object store:
``get_many``, one call per tensor) behind local ones, and with its index given by name
(``files``, no directory): single process, no service."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.contract import store_pb2
from services.rank.checkpoint_transfer import read_files
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkIntegrityError, ChunkWriter, DirectorySource, chunk_path

CHUNK = 4096


class Batched:
    """A remote source: ``get_many`` counted, its bytes from a directory (or ``wrong``)."""

    name = "store"

    def __init__(self, root: Path, wrong: set[str] = frozenset()):
        self.inner = DirectorySource(root)
        self.wrong = set(wrong)
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    def get(self, sha: str, nbytes: int):
        self.singles.append(sha)
        return self.inner.get(sha, nbytes)

    def get_many(self, items):
        self.batches.append([sha for sha, _ in items])
        return {sha: (b"\0" * n if sha in self.wrong else self.inner.get(sha, n)) for sha, n in items}


class Memory:
    """A local source holding some chunks (one of them wrong)."""

    name = "memory"

    def __init__(self, chunks: dict[str, bytes]):
        self.chunks = chunks

    def get(self, sha: str, nbytes: int):
        return self.chunks.get(sha)


def _saved(tmp_path: Path) -> tuple[dict, Path, Path]:
    g = torch.Generator().manual_seed(1)
    state = {"model": {"a": torch.randn(64, 100, generator=g), "b": torch.randn(8000, generator=g)}}
    version, chunks = tmp_path / "v", tmp_path / "c"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=ChunkWriter(version, chunks, chunk_bytes=CHUNK, sync_files=False), no_dist=True)
    return state, version, chunks


def _load(version: Path, sources, **kw) -> dict:
    out = {"model": {"a": torch.zeros(64, 100), "b": torch.zeros(8000)}}
    files = {name: (version / name).read_bytes() for name in (".metadata",)}
    reader = ChunkReader("/nonexistent/version", sources, files=files.__getitem__, chunk_label="c", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out, reader


def test_a_remote_source_is_asked_once_per_tensor_for_what_the_local_ones_lack(tmp_path):
    state, version, chunks = _saved(tmp_path)
    shas = sorted(p.name for p in chunks.rglob("*") if p.is_file())
    held = {sha: chunk_path(chunks, sha).read_bytes() for sha in shas[:5]}
    held[shas[0]] = b"x" * len(held[shas[0]])  # a wrong copy: refused, taken from the store instead
    remote = Batched(chunks)
    out, reader = _load(version, [Memory(held), remote])
    assert all(torch.equal(out["model"][k], state["model"][k]) for k in state["model"])
    asked = [sha for batch in remote.batches for sha in batch]
    assert shas[0] in asked and not set(shas[1:5]) & set(asked)  # the right local copies were not fetched
    assert len(remote.batches) <= 2 and reader.mismatches["memory"] == 1
    assert reader.served["memory"] == 4


def test_wrong_bytes_from_the_remote_source_name_the_chunk(tmp_path):
    _, version, chunks = _saved(tmp_path)
    victim = sorted(p.name for p in chunks.rglob("*") if p.is_file())[3]
    with pytest.raises(CheckpointException) as e:  # DCP gathers a rank's read failure
        _load(version, [Batched(chunks, wrong={victim})])
    ((error, _),) = e.value.failures.values()
    assert isinstance(error, ChunkIntegrityError) and not error.missing
    assert error.file == f"c/{victim}" and "sha256 mismatch (source store)" in str(error)


def test_a_stream_of_file_parts_is_reassembled_and_a_cut_one_is_refused():
    parts = [
        store_pb2.CheckpointFileData(name="a", size=5, data=b"ab"),
        store_pb2.CheckpointFileData(data=b"cde"),
        store_pb2.CheckpointFileData(name="gone", missing=True),
        store_pb2.CheckpointFileData(name="e", size=0),
    ]
    assert read_files(parts) == {"a": b"abcde", "gone": None, "e": b""}
    with pytest.raises(Exception, match="the stream ended after 2 of 5 bytes"):
        read_files(parts[:1])
