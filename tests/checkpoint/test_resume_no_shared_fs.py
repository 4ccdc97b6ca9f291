"""Exact resume of real training with checkpoints that never touch a shared path (issue 17
part 2): the real `data` service, a real `store` deployed with ``--transfer stream`` (the
ranks stream their files to it) or ``--backend s3`` (chunks in moto's S3 server on
127.0.0.1, the index streamed), two gloo rank processes training dp=2 with asynchronous
saves (incremental: every other version a delta), and the test as node agent and
orchestrator (``harness.Cluster``).

The job is killed (SIGKILL, both ranks) once its step-4 version is committed and it has
trained past it; relaunched from that version, every step it replays must report the loss
the killed run reported, bit for bit, and it runs to its end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.contract import store_pb2
from services.data.prepare import prepare_dataset
from services.jobspec import JobSpec
from tests.conftest import free_ports

from .harness import Cluster, Processes, start_data, verify, versions_of, wait_ready
from .test_exact_resume import corpus
from .test_exact_resume import spec as exact_resume_spec
from .test_no_shared_fs import s3  # noqa: F401 - the fixture: moto's S3 server and a bucket

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS, EVERY = 10, 4


def spec() -> JobSpec:
    """test_exact_resume's job, shorter, a baseline every 2 versions (so a delta is among them)."""
    return exact_resume_spec(name="resume-stream", steps=STEPS, baseline_every=2)


@pytest.mark.parametrize("deployment", ["stream", "s3"])
def test_a_job_resumed_from_a_checkpoint_on_no_shared_path_replays_its_steps_bit_identically(
    deployment, tmp_path, request
):
    if deployment == "s3":
        endpoint = request.getfixturevalue("s3")
        store_args = ["--backend", "s3", "--s3-url", "s3://surge-ckpt/resume", "--s3-endpoint", endpoint]
    else:
        store_args = ["--transfer", "stream"]
    src = tmp_path / "src"
    src.mkdir()
    prepare_dataset(corpus(src), "tiny", "v1", tmp_path / "datasets", val_fraction=0.1)
    procs = Processes(tmp_path / "logs")
    try:
        _, data = start_data(procs, tmp_path / "datasets")
        port, metrics = free_ports(2)
        root = tmp_path / "store-root"
        argv = [sys.executable, "-m", "services.store", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--metrics-port", str(metrics), "--root", str(root), *store_args]
        store_proc = procs.start("store", argv)
        store = f"127.0.0.1:{port}"
        wait_ready(store, store_proc, "store")
        cluster = Cluster(procs, data, store)
        try:
            first = cluster.run("job", spec(), kill_after_saved=EVERY)
            assert not first.failed and not first.finished and first.killed_after_step > EVERY, first
            resumed = cluster.run("job", spec(), resume=first.saved[EVERY])
        finally:
            cluster.close()
        assert resumed.finished and not resumed.failed and resumed.start_step == EVERY, resumed
        replayed = {s: first.losses[s] for s in first.losses if s > EVERY}
        assert replayed and {s: resumed.losses[s] for s in replayed} == replayed  # bit for bit
        assert sorted(resumed.saved) == [8, STEPS]
        # Every version committed through the stream verifies when re-hashed; the store's log
        # shows the files arrived over PutCheckpointFiles (the ranks wrote nothing themselves).
        assert all(v.ok for v in verify(store, "job", rehash=True))
        infos = versions_of(store, "job")
        assert [v.step for v in infos][:1] == [EVERY]
        expected = store_pb2.TRANSFER_FSSPEC if deployment == "s3" else store_pb2.TRANSFER_STREAM
        assert {v.transfer for v in infos} == {expected}
        assert any(not v.baseline for v in infos)  # a delta: its ranks sent only the chunks its epoch lacked
        assert "checkpoint_files_received" in Path(tmp_path / "logs" / "store.log").read_text()
    finally:
        procs.close()
