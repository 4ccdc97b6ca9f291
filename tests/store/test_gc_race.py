"""L5-1's garbage collection runs off the manager's lock: a save that begins and commits while
a long sweep of its own job is removing chunks is neither held up by the sweep nor robbed of
a chunk it reuses. Real commits, a real sweep (its batches slowed down so the race is
certain to happen), the real chunk writer and reader."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from services.contract import store_pb2
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkWriter, DirectorySource, iter_chunk_files
from services.store.checkpoint_manager import CheckpointManager
from services.store.checkpoint_manager import chunks as checkpoint_chunks

CHUNK = 8192  # one row of `trained` (2048 float32) is one chunk
ROWS = 48
BATCH_SECONDS = 0.15  # each batch of the sweep takes this long at least


def state(seed: int, step: int) -> dict:
    return {
        "model": {"trained": torch.randn(ROWS, 2048, generator=torch.Generator().manual_seed(seed))},
        "train": {"step": step},
    }


def begin(manager: CheckpointManager, step: int) -> store_pb2.SaveStaged:
    return manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id="j", step=step, rank=0, baseline_every=100))


def write(staged: store_pb2.SaveStaged, value: dict) -> None:
    writer = ChunkWriter(staged.staging_path, staged.chunk_path, chunk_bytes=CHUNK, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(value, storage_writer=writer, no_dist=True)


def commit(manager: CheckpointManager, step: int, keep_last: int) -> store_pb2.SaveCompleted:
    return manager.commit_checkpoint(
        store_pb2.CommitCheckpoint(job_id="j", step=step, world_size=1, spec_json="{}", keep_last=keep_last)
    )


def read(info: store_pb2.CheckpointInfo) -> dict:
    out = {"model": {"trained": torch.zeros(ROWS, 2048)}, "train": {"step": -1}}
    manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
    reader = ChunkReader(
        info.path, [DirectorySource(info.chunk_path)], digests={f["path"]: f for f in manifest["files"]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def test_a_save_begun_during_a_long_sweep_is_not_held_up_and_keeps_the_chunks_it_reuses(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):  # epoch 1: three versions, each with ROWS chunks of its own
        staged = begin(manager, step)
        write(staged, state(step, step))
        if step < 3:
            commit(manager, step, keep_last=0)
    # The sweep of step 3's commit (keep_last=1: v1 and v2 go) removes 2 * ROWS chunks, 4 per batch.
    monkeypatch.setattr(checkpoint_chunks, "_SWEEP_BATCH", 4)
    root = manager._chunks
    real_remove = root.remove
    batches = []
    sweeping = threading.Event()

    def slow_remove(job, epoch, names):
        batches.append(list(names))
        sweeping.set()
        time.sleep(BATCH_SECONDS)
        return real_remove(job, epoch, names)

    monkeypatch.setattr(root, "remove", slow_remove)
    done: dict[str, object] = {}
    committer = threading.Thread(target=lambda: done.setdefault("v3", commit(manager, 3, keep_last=1)))
    committer.start()
    assert sweeping.wait(30)
    # Step 4's trained part is step 1's again: every one of its chunks is garbage being swept.
    t0 = time.perf_counter()
    staged = begin(manager, 4)
    began_s = time.perf_counter() - t0
    write(staged, state(1, 4))
    v4 = commit(manager, 4, keep_last=0)
    committer.join(30)
    assert not committer.is_alive() and done["v3"].version == "j:3"
    whole_sweep_s = (2 * ROWS / 4) * BATCH_SECONDS
    assert began_s < whole_sweep_s / 4, (began_s, whole_sweep_s)  # waited for one batch at most, not the sweep
    got = read(manager.load_checkpoint(store_pb2.LoadCheckpoint(version=v4.version)).info)
    assert got["train"]["step"] == 4 and torch.equal(got["model"]["trained"], state(1, 4)["model"]["trained"])
    assert all(v.ok for v in manager.verify_checkpoints(store_pb2.VerifyCheckpoints(job_id="j", rehash=True)).versions)
    assert len(batches) < 2 * ROWS / 4  # the sweep stopped when the save began
    # The next commit with no save beside it sweeps what was left: the epoch holds exactly what
    # the kept versions reference.
    monkeypatch.setattr(root, "remove", real_remove)
    staged = begin(manager, 5)
    write(staged, state(5, 5))
    v5 = commit(manager, 5, keep_last=2)  # keeps v4 and v5
    need = {c["sha"] for c in json.loads((Path(v5.path) / "manifest.json").read_bytes())["chunks"]}
    need |= {
        c["sha"] for c in json.loads((Path(load_path(manager, v4.version)) / "manifest.json").read_bytes())["chunks"]
    }
    assert {p.name for p in iter_chunk_files(Path(staged.chunk_path))} == need


def load_path(manager: CheckpointManager, version: str) -> str:
    return manager.load_checkpoint(store_pb2.LoadCheckpoint(version=version)).info.path
