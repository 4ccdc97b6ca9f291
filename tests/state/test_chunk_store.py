"""The content-addressed DCP storage (services/state/chunk_store.py), single process."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import (
    CHUNKS_FILE,
    ChunkIntegrityError,
    ChunkWriter,
    DirectorySource,
    chunk_path,
    iter_chunk_files,
)

CHUNK = 4096  # small chunks: several per tensor


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(64, 100, generator=g),  # 25,600 bytes: 7 chunks
            "half": torch.randn(30, 7, generator=g).to(torch.bfloat16),
            "frozen": torch.randn(50, 50, generator=g),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
        },
        "train": {"step": 7, "name": "run", "data": {"epoch": 2, "offsets": [1, 2, 3]}},
    }


def _empty_like(state: dict) -> dict:
    return {
        "model": {k: torch.full_like(v, -1) for k, v in state["model"].items()},
        "train": {"step": 0, "name": "", "data": {"epoch": 0, "offsets": []}},
    }


def _save(state: dict, version: Path, chunks: Path, **kw) -> ChunkWriter:
    writer = ChunkWriter(version, chunks, chunk_bytes=CHUNK, sync_files=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming single process"
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _load(version: Path, sources, like: dict, **kw) -> tuple[dict, ChunkReader]:
    out = _empty_like(like)
    reader = ChunkReader(version, sources, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out, reader


def _assert_bit_exact(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert v.dtype == b["model"][k].dtype and v.shape == b["model"][k].shape, k
        assert torch.equal(v.view(-1).view(torch.uint8), b["model"][k].view(-1).view(torch.uint8)), k
    assert a["train"] == b["train"]


class MemorySource:
    def __init__(self, chunks: dict[str, bytes], name: str = "memory"):
        self.name, self.chunks, self.asked = name, chunks, 0

    def get(self, sha: str, nbytes: int) -> bytes | None:
        self.asked += 1
        return self.chunks.get(sha)


def test_roundtrip_is_bit_exact_and_index_names_every_chunk(tmp_path):
    state = _state()
    writer = _save(state, tmp_path / "v1", tmp_path / "chunks" / "1")
    out, reader = _load(tmp_path / "v1", [DirectorySource(tmp_path / "chunks" / "1")], state)
    _assert_bit_exact(out, state)
    index = json.loads((tmp_path / "v1" / CHUNKS_FILE).read_text())
    on_disk = {p.name: p.stat().st_size for p in iter_chunk_files(tmp_path / "chunks" / "1")}
    assert {c["sha"]: c["bytes"] for c in index["chunks"]} == on_disk
    assert index["epoch"] == "1" and index["written_bytes"] == sum(on_disk.values()) == index["bytes"]
    assert set(index["slots"]) == {"model", "train"}
    for sha, size in on_disk.items():  # content-addressed: each file's name is its SHA-256
        assert hashlib.sha256(chunk_path(tmp_path / "chunks" / "1", sha).read_bytes()).hexdigest() == sha
        assert size <= CHUNK
    assert writer.stats.written_bytes == writer.stats.bytes  # nothing there before: all written
    assert reader.served["store"] == len(on_disk) and not reader.mismatches


def test_unchanged_chunks_are_not_written_again_and_slot_digests_follow_the_bytes(tmp_path):
    chunks = tmp_path / "chunks" / "1"
    first = _state()
    _save(first, tmp_path / "v1", chunks)
    before = {p.name: p.stat().st_mtime_ns for p in iter_chunk_files(chunks)}
    second = _state()
    second["model"]["big"][10, 3] += 1.0  # one chunk of "big" changes (row 10 lies in its 2nd chunk)
    second["train"]["step"] = 8
    seen: list[str] = []
    writer = _save(second, tmp_path / "v2", chunks, sink=lambda sha, data: seen.append(sha))
    after = {p.name: p.stat().st_mtime_ns for p in iter_chunk_files(chunks)}
    assert {k: v for k, v in after.items() if k in before} == before  # never rewritten
    new = set(after) - set(before)
    assert writer.stats.written_chunks == len(new) == 2  # the changed chunk of "big" + the train bytes
    assert writer.stats.written_bytes <= CHUNK + 2000  # + torch.save of one int (~1.2 KB)
    assert writer.stats.bytes > 7 * writer.stats.written_bytes
    # The sink saw every chunk of the save, written or already there.
    v2 = json.loads((tmp_path / "v2" / CHUNKS_FILE).read_text())
    assert set(seen) == {c["sha"] for c in v2["chunks"]}
    v1 = json.loads((tmp_path / "v1" / CHUNKS_FILE).read_text())
    assert v2["written_bytes"] == writer.stats.written_bytes
    assert v1["slots"]["model"] != v2["slots"]["model"] and v1["slots"]["train"] != v2["slots"]["train"]
    out1, _ = _load(tmp_path / "v1", [DirectorySource(chunks)], first)
    out2, _ = _load(tmp_path / "v2", [DirectorySource(chunks)], second)
    _assert_bit_exact(out1, first)
    _assert_bit_exact(out2, second)


def test_reader_takes_the_first_source_whose_bytes_match_and_counts_the_others(tmp_path):
    state = _state()
    chunks = tmp_path / "chunks" / "1"
    _save(state, tmp_path / "v1", chunks)
    good = {p.name: p.read_bytes() for p in iter_chunk_files(chunks)}
    bad_sha = sorted(good)[0]
    peer = MemorySource({**good, bad_sha: b"x" + good[bad_sha][1:]}, "peer")
    local = MemorySource({}, "local")  # has nothing: asked, skipped, not a mismatch
    out, reader = _load(tmp_path / "v1", [local, peer, DirectorySource(chunks)], state)
    _assert_bit_exact(out, state)
    assert reader.mismatches == {"peer": 1}
    assert reader.served["store"] == 1 and reader.served["peer"] == len(good) - 1
    assert local.asked == len(good)


def test_corrupt_or_missing_chunk_in_the_last_source_is_an_integrity_error_naming_it(tmp_path):
    state = _state()
    chunks = tmp_path / "chunks" / "7"
    _save(state, tmp_path / "v1", chunks)
    victim = max(iter_chunk_files(chunks), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ChunkIntegrityError) as e:
        ChunkReader(tmp_path / "v1", [DirectorySource(chunks)], chunk_label="chunks/7").fetch(victim.name, len(data))
    assert e.value.file == f"chunks/7/{victim.name}" and not e.value.missing and "sha256 mismatch" in str(e.value)
    with pytest.raises(CheckpointException) as wrapped:  # through DCP, which wraps a read's failure
        _load(tmp_path / "v1", [DirectorySource(chunks)], state)
    (failure,) = [exc for exc, _ in wrapped.value.failures.values()]
    assert isinstance(failure, ChunkIntegrityError) and victim.name in failure.file
    victim.unlink()
    with pytest.raises(ChunkIntegrityError) as e:
        ChunkReader(tmp_path / "v1", [DirectorySource(chunks)]).fetch(victim.name, len(data))
    assert e.value.missing


def test_metadata_is_checked_against_the_manifest_before_it_is_read(tmp_path):
    state = _state()
    _save(state, tmp_path / "v1", tmp_path / "c")
    meta = (tmp_path / "v1" / ".metadata").read_bytes()
    digests = {".metadata": {"bytes": len(meta), "sha256": hashlib.sha256(meta).hexdigest()}}
    out, _ = _load(tmp_path / "v1", [DirectorySource(tmp_path / "c")], state, digests=digests)
    _assert_bit_exact(out, state)
    digests[".metadata"]["sha256"] = "0" * 64
    with pytest.raises(ChunkIntegrityError) as e:  # (DCP would turn it into an AssertionError of its own)
        ChunkReader(tmp_path / "v1", [DirectorySource(tmp_path / "c")], digests=digests).read_metadata()
    assert e.value.file == ".metadata" and "sha256 mismatch" in str(e.value)


def test_a_row_range_reads_only_the_chunks_that_cover_it(tmp_path):
    """What a reshard reads (a dp change narrows a stored tensor along dim 0)."""
    state = _state()
    chunks = tmp_path / "c"
    _save(state, tmp_path / "v1", chunks)
    src = MemorySource({p.name: p.read_bytes() for p in iter_chunk_files(chunks)}, "store")
    reader = ChunkReader(tmp_path / "v1", [src])
    meta = reader.read_metadata()
    reader.set_up_storage_reader(meta, True)
    (index,) = [i for i in reader.storage_data if i.fqn == "model.big"]
    info = reader.storage_data[index]
    assert len(info["chunks"]) == 7
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        rows = reader._bytes_of(info, 20 * 400, 30 * 400, pool)  # rows 20..29 (400 bytes each)
    assert rows == state["model"]["big"][20:30].contiguous().view(torch.uint8).numpy().tobytes()
    assert src.asked == 2  # bytes 8000..12000 lie in chunks 1 and 2 of 4096
