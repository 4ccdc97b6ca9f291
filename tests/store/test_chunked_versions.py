"""L5-1 with incremental (chunked) versions: epochs and baselines decided at BeginSave, the
commit's chunk checks, the manifest, verification, and garbage collection after retention.
The ranks' side is the real chunk writer (services/state/chunk_store.py) in this process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.contract import store_pb2
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkWriter, DirectorySource, iter_chunk_files
from services.store.checkpoint_manager import CheckpointIncomplete, CheckpointManager, CheckpointRejected

from .conftest import load

CHUNK = 8192


def state_at(step: int) -> dict:
    """A frozen part (never changes) and a trained part (changes every step)."""
    frozen = torch.Generator().manual_seed(0)
    trained = torch.Generator().manual_seed(step)
    return {
        "model": {"frozen": torch.randn(256, 64, generator=frozen), "trained": torch.randn(16, 64, generator=trained)},
        "train": {"step": step},
    }


def begin(manager: CheckpointManager, job: str, step: int, every: int) -> store_pb2.SaveStaged:
    return manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0, baseline_every=every))


def write(staged: store_pb2.SaveStaged, state: dict) -> ChunkWriter:
    writer = ChunkWriter(staged.staging_path, staged.chunk_path, chunk_bytes=CHUNK, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def commit(manager: CheckpointManager, job: str, step: int, keep_last: int = 0) -> store_pb2.SaveCompleted:
    return manager.commit_checkpoint(
        store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json="{}", keep_last=keep_last)
    )


def save(manager: CheckpointManager, job: str, step: int, every: int = 3, keep_last: int = 0):
    staged = begin(manager, job, step, every)
    write(staged, state_at(step))
    return staged, commit(manager, job, step, keep_last)


def read(info: store_pb2.CheckpointInfo) -> dict:
    out = {"model": {k: torch.zeros_like(v) for k, v in state_at(0)["model"].items()}, "train": {"step": -1}}
    manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
    reader = ChunkReader(
        info.path, [DirectorySource(info.chunk_path)], digests={f["path"]: f for f in manifest["files"]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def manifest_of(path: str) -> dict:
    return json.loads((Path(path) / "manifest.json").read_bytes())


def added_by(manager: CheckpointManager, done: store_pb2.SaveCompleted) -> int:
    """What a version added to its epoch: its index files and the chunks no earlier version
    of the epoch references."""
    mine = manifest_of(done.path)
    earlier = set()
    for info in manager.checkpoint_query(store_pb2.CheckpointQuery(job_id=done.job_id)).checkpoints:
        m = manifest_of(info.path)
        if info.version != done.version and m["epoch"] == mine["epoch"] and info.step < done.step:
            earlier |= {c["sha"] for c in m["chunks"]}
    new = sum(c["bytes"] for c in mine["chunks"] if c["sha"] not in earlier)
    return new + sum(f["bytes"] for f in mine["files"])


def assert_is_step(info: store_pb2.CheckpointInfo, step: int) -> None:
    got, want = read(info), state_at(step)
    assert got["train"]["step"] == step
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), (info.version, k)


def test_every_nth_version_is_a_baseline_in_a_new_epoch_and_the_deltas_write_what_changed(manager):
    told = []
    for step in range(1, 8):
        staged, done = save(manager, "j", step, every=3)
        told.append((staged.epoch, staged.baseline, done.baseline))
        if done.baseline:  # every chunk and index file is new: it writes its whole size
            assert done.written_bytes == done.bytes
        else:  # the frozen 64 KiB is not written again; the trained 4 KiB, the step and the index are
            assert done.written_bytes == added_by(manager, done), step
            assert done.written_bytes < done.bytes / 5, (step, done.written_bytes, done.bytes)
    assert told == [(1, True, True), (1, False, False), (1, False, False), (2, True, True), (2, False, False)] + [
        (2, False, False),
        (3, True, True),
    ]
    manifest = json.loads((Path(load(manager, "j:5").path) / "manifest.json").read_bytes())
    assert manifest["chunk_dir"] == "chunks/2" and manifest["epoch_index"] == 1 and not manifest["baseline"]
    assert {c["sha"] for c in manifest["chunks"]} <= {
        p.name for p in iter_chunk_files(Path(load(manager, "j:5").chunk_path))
    }
    for n in range(1, 8):
        assert_is_step(load(manager, f"j:{n}"), n)  # baseline + deltas: every version bit-exact


def test_a_commit_checks_the_manifest_a_missing_chunk_or_one_of_another_size_is_refused(manager):
    save(manager, "j", 1)
    staged = begin(manager, "j", 2, 3)
    write(staged, state_at(2))
    index = json.loads((Path(staged.staging_path) / "chunks.json").read_bytes())
    v1 = {c["sha"] for c in json.loads((Path(load(manager, "j:1").path) / "manifest.json").read_bytes())["chunks"]}
    new = next(c["sha"] for c in index["chunks"] if c["sha"] not in v1)
    chunk = Path(staged.chunk_path) / new[:2] / new
    data = chunk.read_bytes()
    chunk.unlink()
    with pytest.raises(CheckpointIncomplete, match=f"chunks/1/{new}: named by chunks.json, which is not there"):
        commit(manager, "j", 2)
    chunk.write_bytes(data[:-1])  # torn: one byte short
    with pytest.raises(
        CheckpointIncomplete, match=f"chunks/1/{new}: {len(data) - 1} bytes, chunks.json says {len(data)}"
    ):
        commit(manager, "j", 2)
    chunk.write_bytes(data)
    assert commit(manager, "j", 2).version == "j:2"


def test_a_chunks_index_that_contradicts_itself_is_refused(manager):
    staged = begin(manager, "j", 1, 3)
    write(staged, state_at(1))
    path = Path(staged.staging_path) / "chunks.json"
    index = json.loads(path.read_bytes())
    index["bytes"] += 1
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointIncomplete, match=r"chunks.json: bytes \d+, its chunks sum to"):
        commit(manager, "j", 1)
    index["bytes"] -= 1
    index["chunks"].append(dict(index["chunks"][0]))
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointIncomplete, match="a chunk is listed twice"):
        commit(manager, "j", 1)


def test_a_chunk_changed_in_place_after_its_write_is_not_rehashed_at_commit_but_caught_by_reader_and_verify(manager):
    """Commit by manifest: the bytes are the writer's (hashed as written, renamed into place
    whole); bits flipped afterwards are found where every byte is read: the reader and the
    store's re-hash (verify / scrub)."""
    staged = begin(manager, "j", 1, 3)
    write(staged, state_at(1))
    sha = json.loads((Path(staged.staging_path) / "chunks.json").read_bytes())["chunks"][0]["sha"]
    chunk = Path(staged.chunk_path) / sha[:2] / sha
    data = chunk.read_bytes()
    chunk.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # its size, not its bytes
    info = load(manager, commit(manager, "j", 1).version)
    with pytest.raises(CheckpointException, match=f"chunks/{sha}: sha256 mismatch"):  # (DCP wraps the reader's)
        read(info)
    verdict = manager.verify_checkpoints(store_pb2.VerifyCheckpoints(job_id="j", rehash=True)).versions[0]
    assert not verdict.ok and verdict.reason == f"checkpoint j:1: chunks/1/{sha}: sha256 mismatch"


def test_retention_then_gc_keeps_every_chunk_a_kept_version_needs_and_removes_the_rest(manager, tmp_path):
    for step in range(1, 8):  # epochs: 1 = {1,2,3}, 2 = {4,5,6}, 3 = {7}
        save(manager, "j", step, every=3)
    # A killed delta: chunks written into epoch 3, never committed.
    orphan = write(begin(manager, "j", 8, 3), {"model": {"x": torch.arange(5000.0)}, "train": {"step": 8}})
    assert orphan.stats.written_chunks > 0
    root = tmp_path / "checkpoints" / "j" / "chunks"
    assert sorted(p.name for p in root.iterdir()) == ["1", "2", "3"]
    save(manager, "j", 9, every=3, keep_last=3)  # keeps the versions of steps 6, 7 and 9
    kept = [c.version for c in manager.checkpoint_query(store_pb2.CheckpointQuery(job_id="j")).checkpoints]
    assert kept == ["j:6", "j:7", "j:8"]  # (n counts commits: step 9 is j:8)
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]  # epoch 1: no kept version, removed whole
    need = set()
    for v in kept:
        need |= {c["sha"] for c in json.loads((Path(load(manager, v).path) / "manifest.json").read_bytes())["chunks"]}
    assert {p.name for d in ("2", "3") for p in iter_chunk_files(root / d)} == need  # no more, no less
    for v, step in zip(kept, (6, 7, 9)):
        assert_is_step(load(manager, v), step)
    assert all(v.ok for v in manager.verify_checkpoints(store_pb2.VerifyCheckpoints(job_id="j", rehash=True)).versions)


def test_a_damaged_shared_chunk_strikes_every_version_using_it_and_the_next_save_starts_a_new_epoch(manager):
    for step in (1, 2):
        save(manager, "j", step, every=10)
    v1, v2 = load(manager, "j:1"), load(manager, "j:2")
    frozen = {c["sha"] for c in json.loads((Path(v1.path) / "manifest.json").read_bytes())["chunks"]} & {
        c["sha"] for c in json.loads((Path(v2.path) / "manifest.json").read_bytes())["chunks"]
    }
    sha = sorted(frozen)[0]
    path = Path(v1.chunk_path) / sha[:2] / sha
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(bytes(data))
    scrubbed = manager.scrub_checkpoints(store_pb2.ScrubCheckpoints(job_id="j"))
    assert [c.version for c in scrubbed.newly_corrupt] == ["j:1", "j:2"]
    assert scrubbed.newly_corrupt[0].reason == f"checkpoint j:1: chunks/1/{sha}: sha256 mismatch"
    with pytest.raises(CheckpointRejected, match=f"chunks/1/{sha}: sha256 mismatch"):
        load(manager, "j:2")
    staged, done = save(manager, "j", 3, every=10)
    assert (staged.epoch, staged.baseline, done.baseline) == (2, True, True)  # never a delta on a damaged epoch
    assert_is_step(load(manager, "j:3"), 3)


def test_what_a_save_wrote_is_counted_by_the_store_never_more_than_the_version(manager):
    """Two ranks that both find a chunk absent both write it and each counts it: the ranks'
    sum in chunks.json can exceed the version (a delta that "wrote" more than its total).
    The store counts what the version added to its epoch instead."""
    save(manager, "j", 1)
    staged = begin(manager, "j", 2, 3)
    write(staged, state_at(2))
    path = Path(staged.staging_path) / "chunks.json"
    index = json.loads(path.read_bytes())
    index["written_bytes"] = 3 * index["bytes"]  # as the ranks' double counting would say it
    path.write_text(json.dumps(index))
    done = commit(manager, "j", 2)
    assert done.written_bytes == added_by(manager, done) < done.bytes
