"""Two real gloo ranks agree on every save through their checkpoint relays: a save one rank
cannot stage, or one whose previous commit still waits for the store, is skipped by both
(never a collective one rank enters alone), reported once, and the next save works."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from rank_fakes import free_port

from services.contract import store_pb2, store_pb2_grpc
from tests.conftest import run_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class SlowStore(store_pb2_grpc.StoreServiceServicer):
    """Step 10: rank 1's BeginSave is refused UNAVAILABLE. Step 20: fine, but its commit
    takes 3 s (past the ranks' 1 s wait), so step 30's save finds it pending. Step 30: fine."""

    def __init__(self, root: Path):
        self.root, self.begun, self.commits = root, [], []
        self.lock = threading.Lock()

    def BeginSave(self, request, context):
        with self.lock:
            self.begun.append((request.step, request.rank))
        if request.step == 10 and request.rank == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        path = self.root / f"step{request.step}"
        path.mkdir(exist_ok=True)
        return store_pb2.SaveStaged(job_id=request.job_id, step=request.step, staging_path=str(path))

    def CommitSave(self, request, context):
        if request.step == 20:
            time.sleep(3.0)
        with self.lock:
            self.commits.append(request.step)
        return store_pb2.SaveCompleted(job_id=request.job_id, version=f"j:{len(self.commits)}", step=request.step)

    def Record(self, request_iterator, context):
        for rec in request_iterator:
            yield store_pb2.MetricsAck(records=1, seq=rec.seq)


@pytest.mark.timeout(120)
def test_both_ranks_skip_a_save_that_one_cannot_stage_or_whose_previous_commit_is_pending(tmp_path):
    store = SlowStore(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    store_pb2_grpc.add_StoreServiceServicer_to_server(store, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        port = free_port()
        env = {**os.environ, "SURGE_STORE_RPC_TIMEOUT_S": "1.0", "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
        outs = run_to_end(
            [[sys.executable, str(HERE / "save_agreement_main.py"), str(r), str(port), address] for r in (0, 1)],
            timeout=100,
            tail=3000,
            cwd=REPO,
            env=env,
        )
    finally:
        server.stop(0)
    got = {d["rank"]: d for d in (json.loads(o.strip().splitlines()[-1]) for o in outs)}
    # Step 10: rank 1 could not stage, so neither wrote; step 20 was written by both; step 30
    # was skipped by both because step 20's commit still waited for the store.
    for r in (0, 1):
        assert got[r]["staged"] == {"10": "", "20": str(tmp_path / "step20"), "30": ""}, got[r]
    assert sorted(store.begun) == [(10, 0), (10, 1), (20, 0), (20, 1)]  # nobody asked for 30
    assert store.commits == [20]
    # Reported once per failed save, by the committing rank, with the typed cause.
    assert got[0]["failed"] == [[10, store_pb2.UNREACHABLE], [30, store_pb2.TIMEOUT]]
    assert got[1]["failed"] == []
    assert not (tmp_path / "step10").exists() or not any((tmp_path / "step10").iterdir())
    # The relay's collectives (its agreement, DCP's, on its writer thread too) are registered
    # exceptions (services/contract/exceptions.yaml), attributed to L5-1 at run time.
    for r in (0, 1):
        assert [c for c in got[r]["crossings"] if not c[3]] == [], got[r]["crossings"]
        assert {c[3] for c in got[r]["crossings"]} == {
            "store-relay-save-agreement",
            "store-relay-distributed-checkpoint",
        }
