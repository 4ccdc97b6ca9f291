"""The version a recovery loads is one the real store verified (issue 4, checkpoints): the
control plane in-process, the store as a real `python -m services.store` process over gRPC,
checkpoints committed through it with real files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.contract import control_pb2, engine_pb2, store_pb2, store_pb2_grpc
from services.control.__main__ import build
from services.control.job_store import JobStore
from tests.callers import any_caller_channel
from tests.store.test_store_service import store  # noqa: F401 (the real store process fixture)

from .conftest import Plane, drain

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def commit(stub, job_id: str, step: int) -> store_pb2.SaveCompleted:
    """One rank's checkpoint files written into the staging dir the store hands out, then
    committed (hashed, renamed, cataloged) by the store."""
    staged = stub.BeginSave(store_pb2.SaveCheckpoint(job_id=job_id, step=step, rank=0), timeout=30)
    path = Path(staged.staging_path)
    (path / "__0_0.distcp").write_bytes(f"{job_id}@{step}".encode() * 4096)
    (path / ".metadata").write_bytes(b"meta")
    return stub.CommitSave(
        store_pb2.CommitCheckpoint(job_id=job_id, step=step, world_size=1, spec_json="{}"), timeout=30
    )


def test_recovery_uses_a_version_committed_after_its_report_was_lost_asking_the_store_without_blocking(tmp_path, store):  # noqa: F811
    journal = JobStore(tmp_path / "control.db")
    plane = Plane(build(journal, data_address="d:1", store_address=f"127.0.0.1:{store.port}", persist_interval_s=0.0))
    a, b = plane.register("wa"), plane.register("wb")
    job_id = plane.submit(dp=2, steps=40, extra="liveness: {attribution_seconds: 0}").job_id
    for rank, session in ((0, a), (1, b)):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    drain(a), drain(b)
    with any_caller_channel(f"127.0.0.1:{store.port}") as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        v1, v2, v3 = (commit(stub, job_id, step) for step in (4, 8, 12))
        for v in (v1, v2):  # the commit of v3 reached the store, its report never reached control
            plane.rank_event(a, job_id, 0, saved=v)
        plane.rank_exited(b, job_id, 1, exit_code=-9)
    # The store's answer comes back as an event (the relay does not block control's
    # applier): wait for the relaunch it leads to.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        events = [e.message for e in plane.events(job_id)]
        if any(m.startswith("ranks killed and relaunched") for m in events):
            break
        time.sleep(0.05)
    assert (
        f"checkpoint {v3.version} at step 12 verified: committed by the store, its completion report never arrived"
        in events
    )
    (relaunch,) = [m for m in events if m.startswith("ranks killed and relaunched")]
    assert f"resume from checkpoint {v3.version};" in relaunch
    launches = [c.launch for s in (a, b) for c in drain(s) if c.WhichOneof("command") == "launch"]
    assert {launch.init.resume_version for launch in launches} == {v3.version}
    assert plane.get(job_id).state == control_pb2.FAULT_FROZEN  # until the relaunched ranks restore
    journal.close()
