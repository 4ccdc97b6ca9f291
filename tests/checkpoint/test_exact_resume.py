"""Exact resume with real processes: two gloo rank processes, the real `data` and `store`
services, and the test as node agent and orchestrator.

One job runs 30 steps uninterrupted. Another is killed (SIGKILL, both ranks) after a
checkpoint and resumed from it via ``InitJob.resume_version``, three times: once in the
first epoch and twice in the second (the dataset is tiny, an epoch is ~10 steps), the last
time from a version whose shard was damaged, which the store refuses (the rank reports
``checkpoint_integrity``) so the orchestrator's choice falls back to the newest intact
version. Every step the resumed job replays must report the same loss, and every version
both jobs committed at the same step must hold the same bytes of state: model, optimizer,
step, loss scale, data position and every rank's RNG streams. Saves are asynchronous but in
the last leg, which saves synchronously: its versions hold what the uninterrupted job's
asynchronous saves hold at the same steps (a third job for it cost a launch and 30 steps).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.contract import store_pb2
from services.data.prepare import prepare_dataset
from services.jobspec import JobSpec

from .harness import Cluster, Processes, full_state, own_chunk, start_data, start_store, verify, versions_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS, EVERY = 30, 4


def spec(*, name: str = "resume", steps: int = STEPS, **checkpoint) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "steps": steps,
            "seed": 3,
            "model": {"n_layers": 1, "d_model": 32, "n_heads": 2},
            "data": {
                "dataset": "tiny@v1",
                "seq_len": 32,
                "micro_batch_size": 2,
                "shuffle_seed": 11,
                "prefetch": {"watermark": 8, "threads": 1},
            },
            "parallel": {"dp": 2},
            "optimizer": {"lr": 3e-3, "warmup_steps": 3},
            "checkpoint": {"every_steps": EVERY, "keep_last": 0, "at_end": True, **checkpoint},
            "eval": {"every_steps": 0, "at_end": False, "batches": 1},
        }
    )


def corpus(directory: Path) -> Path:
    """16 small Python-like files (~60..200 bytes): a rank's epoch is ~10 steps."""
    rng = random.Random(5)
    for i in range(16):
        lines = [f"def f{i}_{j}(x):\n    return x * {rng.randint(2, 99)}\n" for j in range(rng.randint(2, 6))]
        (directory / f"m{i:02d}.py").write_text("".join(lines))
    return directory


def state_of(info: store_pb2.CheckpointInfo) -> dict:
    """Every key of a committed version, flattened (``model.*``, ``optim.*``, ``train.*``)."""
    return _flatten(full_state(info))


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        flat = {}
        for k, v in tree.items():
            flat.update(_flatten(v, f"{prefix}{k}."))
        return flat
    return {prefix[:-1]: tree}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("exact")
    src = home / "src"
    src.mkdir()
    prepare_dataset(corpus(src), "tiny", "v1", home / "datasets", val_fraction=0.1)
    procs = Processes(home / "logs")
    try:
        _, data = start_data(procs, home / "datasets")
        _, store = start_store(procs, home / "store")
        c = Cluster(procs, data, store)
        c.home = home
        yield c
        c.close()
    finally:
        procs.close()


def test_a_job_killed_and_resumed_three_times_ends_bit_identical_to_one_never_interrupted(cluster):
    straight = cluster.run("straight", spec())
    assert straight.finished and not straight.failed, straight.failed
    assert sorted(straight.losses) == list(range(1, STEPS + 1))
    theirs_steps = [*range(EVERY, STEPS, EVERY), STEPS]
    assert sorted(straight.saved) == theirs_steps
    epochs = straight.epochs
    # The resume points below: step 8 in the first epoch, 16 and 20 both in the second
    # (20: the fallback from a damaged version at 24).
    assert (epochs[8], epochs[16], epochs[20]) == (0, 1, 1) and epochs[STEPS] >= 2, epochs

    job, losses = "killed", {}

    def leg(resume: str, kill_after: int, start: int):
        out = cluster.run(job, spec(), resume=resume, kill_after_saved=kill_after)
        assert out.start_step == start
        assert not out.failed and not out.finished and out.killed_after_step > kill_after, out
        losses.update(out.losses)
        assert out.losses == {s: straight.losses[s] for s in out.losses}, (resume, out.losses)
        return out

    first = leg("", 8, 0)
    second = leg(first.saved[8], 16, 8)
    third = leg(second.saved[16], 24, 16)

    # The newest version is damaged on disk: one flipped byte in a chunk only it references
    # (an incremental save shares unchanged chunks with the versions before it).
    *older, newest = versions_of(cluster.store_address, job)
    assert newest.step >= 24
    shard = own_chunk(newest, older)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    refused = cluster.run(job, spec(), resume=newest.version)
    assert not refused.finished and refused.losses == {}
    assert {f.fault_class for f in refused.failed} == {"checkpoint_integrity"}
    # Found by the ranks' own read (the store re-hashed nothing at load), the file named,
    # and reported with its typed cause.
    chunk = f"chunks/{Path(newest.chunk_path).name}/{shard.name}"
    assert all(f"{newest.version}: {chunk}: sha256 mismatch" in f.detail for f in refused.failed)
    assert {(s.operation, s.cause, s.version) for s in refused.snapshot_failed} == {
        ("load", store_pb2.CORRUPT, newest.version)
    }
    # The orchestrator's choice: the newest version the store reports intact once re-hashed.
    assert verify(cluster.store_address, job)[-1].ok  # recorded at commit; nobody re-hashed it yet
    verdicts = verify(cluster.store_address, job, rehash=True)
    assert [(v.info.version, v.ok) for v in verdicts][-1] == (newest.version, False)
    assert "sha256 mismatch" in verdicts[-1].reason
    good = [v.info for v in verdicts if v.ok][-1]
    assert good.step == newest.step - EVERY and good.version == third.saved[good.step]

    # The last leg saves synchronously (checkpoint.async false): a synchronous save writes
    # exactly what an asynchronous one does, compared below at every step both committed.
    last = cluster.run(job, spec(**{"async": False}), resume=good.version)
    assert last.finished and not last.failed and last.start_step == good.step
    assert sorted(last.saved) == [s for s in theirs_steps if s > good.step]
    losses.update(last.losses)
    assert losses == straight.losses  # every step of the job, replays included

    # Every version committed by both jobs at the same step holds the same state, bit for
    # bit: the final one (weights and optimizer after step 30) and all those before it.
    ours = {v.step: v for v in versions_of(cluster.store_address, job) if v.version != newest.version}
    theirs = {v.step: v for v in versions_of(cluster.store_address, "straight")}
    assert set(ours) == set(theirs)
    for step in sorted(ours):
        a, b = state_of(theirs[step]), state_of(ours[step])
        assert a.keys() == b.keys(), step
        different = [k for k in a if not same(a[k], b[k])]
        assert not different, f"step {step}: {different}"
    final = state_of(ours[STEPS])
    assert int(final["train.step"]) == STEPS
    assert {k.split(".")[1] for k in final if k.startswith("train.rank") and k != "train.ranks"} == {"rank0", "rank1"}
    assert int(final["train.ranks"]) == 2
    assert final["train.data_position"].tolist()[0] == epochs[STEPS]  # one global position
    for r in (0, 1):
        assert {"torch", "numpy_words", "python_words"} <= {k.split(".")[-1] for k in final if f"rank{r}.rng" in k}
