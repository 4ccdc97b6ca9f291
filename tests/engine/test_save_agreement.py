"""Two real gloo ranks agree on every save through their checkpoint relays: a save one rank
cannot stage, or one whose previous commit still waits for a store that stopped answering,
is skipped by both (never a collective one rank enters alone), reported once, and the next
save works; a previous commit that is slow while the store answers is waited for (a busy
store is not an outage: services/rank/store_liveness.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rank_fakes import free_port

from services.contract import store_pb2, store_pb2_grpc
from tests.rank_forks import run_ranks_to_end

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class SlowStore(store_pb2_grpc.StoreServiceServicer):
    """Step 10: rank 1's BeginSave is refused UNAVAILABLE. Step 20: its commit takes 3 s (past
    the ranks' 1 s probe window) while the store answers health probes: step 30's save waits
    for it. Step 30: the store goes silent during its commit (health probes unanswered: a
    stopped store) until a probe has gone unanswered past the ranks' window, so step 40's
    save finds it pending and is skipped; then it answers again and the commit ends."""

    def __init__(self, root: Path):
        self.root, self.begun, self.commits = root, [], []
        self.lock = threading.Lock()
        self.answering = threading.Event()  # cleared: the health probes get no answer
        self.answering.set()
        self.ignored = threading.Event()  # a probe went unanswered past the ranks' 1 s window

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
        elif request.step == 30:
            self.answering.clear()
            self.ignored.wait(30.0)
            self.answering.set()
        with self.lock:
            self.commits.append(request.step)
        return store_pb2.SaveCompleted(job_id=request.job_id, version=f"j:{len(self.commits)}", step=request.step)

    def Record(self, request_iterator, context):
        for rec in request_iterator:
            yield store_pb2.MetricsAck(records=1, seq=rec.seq)


class SlowStoreHealth(health_pb2_grpc.HealthServicer):
    """The fake store's health: SERVING, unless the store is silent (then no answer until it
    is not; the probe's deadline ends the wait first)."""

    def __init__(self, store: SlowStore):
        self.store = store

    def Check(self, request, context):
        if not self.store.answering.wait(1.5):  # (the prober gave up after its 1 s)
            self.store.ignored.set()
            self.store.answering.wait(10.0)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(120)
def test_both_ranks_skip_a_save_that_one_cannot_stage_or_whose_previous_commit_is_pending(tmp_path):
    store = SlowStore(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    store_pb2_grpc.add_StoreServiceServicer_to_server(store, server)
    health_pb2_grpc.add_HealthServicer_to_server(SlowStoreHealth(store), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        port = free_port()
        env = {**os.environ, "SURGE_STORE_RPC_TIMEOUT_S": "1.0", "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
        outs = run_ranks_to_end(  # (forked with torch imported: tests/rank_forks.py)
            [[str(HERE / "save_agreement_main.py"), str(r), str(port), address] for r in (0, 1)],
            timeout=100,
            tail=3000,
            cwd=REPO,
            env=env,
        )
    finally:
        server.stop(0)
    got = {d["rank"]: d for d in (json.loads(o.strip().splitlines()[-1]) for o in outs)}
    # Step 10: rank 1 could not stage, so neither wrote; steps 20 and 30 were written by both
    # (30 waited for 20's slow commit: the store answered meanwhile); step 40 was skipped by
    # both because 30's commit still waited for a store that did not answer.
    for r in (0, 1):
        assert got[r]["staged"] == {
            "10": "",
            "20": str(tmp_path / "step20"),
            "30": str(tmp_path / "step30"),
            "40": "",
        }, got[r]
    assert sorted(store.begun) == [(10, 0), (10, 1), (20, 0), (20, 1), (30, 0), (30, 1)]  # nobody asked for 40
    assert store.commits == [20, 30]
    # Reported once per failed save, by the committing rank, with the typed cause.
    assert got[0]["failed"] == [[10, store_pb2.UNREACHABLE], [40, store_pb2.TIMEOUT]]
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
