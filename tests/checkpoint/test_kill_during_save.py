"""A kill at any moment of a save leaves the previous version loadable, and a damaged
version is detected, never loaded, while the older ones stay usable. Real processes: the
`store` service, and a rank's checkpoint writer (``save_main.py``: the rank's relay,
dcp.save from its thread, commit after the write) killed with SIGKILL at several delays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from services.contract import store_pb2

from .harness import REPO, Processes, child_env, chunk_files, read_version, start_store, store_stub, verify, versions_of
from .save_main import state_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
MIB = 64


def write(address: str, job: str, step: int, kill_after: float | None = None) -> tuple[int, list[str]]:
    """Run the writer; with ``kill_after``, SIGKILL it that many seconds after it starts
    saving. -> (exit code, the progress lines it printed)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "save_main.py"), address, job, str(step), str(MIB)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    said: list[str] = []
    try:
        for line in proc.stdout:
            word = line.strip()
            if word in ("saving", "staged", "committed"):
                said.append(word)
            if word == "saving" and kill_after is not None:
                threading.Timer(kill_after, proc.send_signal, args=(signal.SIGKILL,)).start()
        return proc.wait(60), said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def load_back(address: str, version: str) -> store_pb2.CheckpointInfo:
    """Load ``version`` as a rank does (the store verifies, the reader reads it); check the
    content is the writer's for that step."""
    ch, stub = store_stub(address)
    with ch:
        info = stub.Load(store_pb2.LoadCheckpoint(version=version), timeout=60).info
    back = {"model": {"w": torch.zeros(MIB * 262144)}, "train": {"step": torch.tensor(0)}}
    read_version(info, back)
    assert int(back["train"]["step"]) == info.step
    assert torch.equal(back["model"]["w"], state_for(info.step, MIB)["model"]["w"])
    return info


@pytest.fixture
def procs(tmp_path):
    p = Processes(tmp_path / "logs")
    yield p
    p.close()


def flip_a_byte(info: store_pb2.CheckpointInfo) -> Path:
    """One bit of the version's largest chunk (a chunk a delta shares would strike every
    version sharing it: with baseline_every unset, every version here is a baseline)."""
    shard = chunk_files(info)[0]
    with open(shard, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x01]))
    return shard


def test_a_writer_killed_at_any_moment_of_a_save_leaves_the_previous_version_loadable(procs, tmp_path):
    root = tmp_path / "store"
    _, address = start_store(procs, root)
    assert write(address, "job", 1) == (0, ["saving", "staged", "committed"])
    good = {1}
    # From "before the staging copy" through "writing" to "committing / just committed".
    for i, delay in enumerate((0.0, 0.05, 0.15, 0.3)):
        step = 10 + i
        code, said = write(address, "job", step, kill_after=delay)
        time.sleep(0.5)  # a commit the writer sent before it died finishes in the store
        listed = versions_of(address, "job")
        assert code in (0, -signal.SIGKILL), (delay, code, said)
        if code == 0 or any(v.step == step for v in listed):  # done, or the commit got through
            good.add(step)
        assert [v.step for v in listed] == sorted(good), (delay, said)
        info = load_back(address, "job:latest")  # the newest committed version, intact
        assert info.step == max(good)
    assert len(good) < 5  # at least one save died before its commit
    # Half-written staging directories of dead saves never block the next one.
    assert write(address, "job", 99) == (0, ["saving", "staged", "committed"])
    assert list((root / "checkpoints" / "job" / ".staging").iterdir()) == []
    assert all(v.ok for v in verify(address, "job"))

    # One flipped bit in a chunk of the newest version: a scrub finds it (a load re-hashes
    # nothing: the reader checks digests as it reads), then it is refused and reported; the
    # version before it still loads and is what latest names.
    newest = versions_of(address, "job")[-1]
    shard = flip_a_byte(newest)
    ch, stub = store_stub(address)
    with ch:
        scrubbed = stub.Scrub(store_pb2.ScrubCheckpoints(job_id="job"), timeout=60)
        assert [c.version for c in scrubbed.newly_corrupt] == [newest.version]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Load(store_pb2.LoadCheckpoint(version=newest.version), timeout=60)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    chunk = f"chunks/{Path(newest.chunk_path).name}/{shard.name}"
    assert refused.value.details() == f"checkpoint {newest.version}: {chunk}: sha256 mismatch"
    assert load_back(address, "job:latest").step == max(good)
    verdicts = verify(address, "job")
    assert [(v.info.step, v.ok) for v in verdicts] == [(s, s != 99) for s in sorted(good | {99})]
    assert verdicts[-1].reason == refused.value.details()
    assert load_back(address, [v.info.version for v in verdicts if v.ok][-1]).step == max(good)


def stage_bytes(stub, step: int, blob: bytes) -> None:
    path = Path(stub.BeginSave(store_pb2.SaveCheckpoint(job_id="job", step=step, rank=0), timeout=10).staging_path)
    (path / "__0_0.distcp").write_bytes(blob)


def commit(step: int) -> store_pb2.CommitCheckpoint:
    return store_pb2.CommitCheckpoint(job_id="job", step=step, world_size=1, spec_json="{}")


def test_a_store_killed_while_committing_keeps_its_chain_and_the_next_save_works(procs, tmp_path):
    root = tmp_path / "store"
    proc, address = start_store(procs, root, name="store-0")
    blob = os.urandom(1 << 20) * 128  # 128 MiB: hashing it takes a while
    ch, stub = store_stub(address)
    with ch:
        stage_bytes(stub, 1, b"first version")
        assert stub.CommitSave(commit(1), timeout=60).version == "job:1"
    for i, delay in enumerate((0.0, 0.02, 0.06, 0.15)):
        step = 10 + i
        ch, stub = store_stub(address)
        with ch:
            stage_bytes(stub, step, blob)
            pending = stub.CommitSave.future(commit(step), timeout=60)
            time.sleep(delay)
            proc.kill()
            proc.wait()
            try:
                acknowledged = pending.result().version
            except grpc.RpcError:
                acknowledged = ""
        proc, address = start_store(procs, root, name=f"store-{i + 1}")
        listed = versions_of(address, "job")
        # The chain is what it was, or one version longer if the commit got through; an
        # acknowledged commit is always there, and every listed version is intact.
        assert [v.step for v in listed][:1] == [1] and {v.step for v in listed} <= {1, 10, 11, 12, 13}
        if acknowledged:
            assert acknowledged in [v.version for v in listed]
        assert all(v.ok for v in verify(address, "job")), delay
    ch, stub = store_stub(address)
    with ch:
        assert stub.Load(store_pb2.LoadCheckpoint(version="job:1"), timeout=60).info.step == 1
        stage_bytes(stub, 99, b"after the crashes")
        done = stub.CommitSave(commit(99), timeout=60)
        assert stub.Load(store_pb2.LoadCheckpoint(version="job:latest"), timeout=60).info.version == done.version
    assert list((root / "checkpoints" / "job" / ".staging").iterdir()) == []
