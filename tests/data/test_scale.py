"""The data service at scale, as a real process over gRPC: more streams than a thread-per-
stream server had threads all start and flow; a corpus larger than the service's address
space limit (RLIMIT_AS) streams, and a stream reopened at a batch's ``next`` continues
exactly as an unlimited run does."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.contract import data_pb2, data_pb2_grpc
from services.data.__main__ import build_stream
from tests.callers import any_caller_channel
from tests.ports import free_port

from .helpers import open_stream
from .synthetic import write_corpus
from .test_service_process import service  # noqa: F401 - the real service's fixture

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


def key(b: data_pb2.MicroBatch):
    return b.input_ids, b.labels, b.tokens, (b.next.epoch, b.next.row)


def open_token_files(pid: int) -> int:
    """How many descriptors of the service process are open on a split's token file."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd).endswith(".bin"))


def test_more_streams_than_the_old_server_had_threads_all_start_and_a_mount_is_not_queued(service):  # noqa: F811
    proc, stub = service
    # 48 distinct requests (max_batches differs, never reached), so 48 pipelines: identical
    # ones would share one (stream_share.py) and not load the server as 48 ranks do.
    calls = [
        stub.Stream(open_stream(rank=k % 4, world_size=4, repeat=True, seq_len=32, max_batches=1000 + k), timeout=60)
        for k in range(48)
    ]
    try:
        # Every stream's first batch arrives while all 48 stay open (a 32-thread server
        # never started the 33rd).
        first = [next(call) for call in calls]
        assert len(first) == 48 and all(b.batch_size == 4 for b in first)
        started = time.monotonic()
        ready = stub.Mount(data_pb2.MountDataset(name="tiny", version="v1"), timeout=10)
        assert ready.name == "tiny" and time.monotonic() - started < 5  # not behind the streams
        assert [key(next(call)) for call in calls[:4]] == [key(next(call)) for call in calls[4:8]]  # same ranks agree
        assert open_token_files(proc.pid) == 48  # one per stream
    finally:
        for call in calls:
            call.cancel()
    # Hung-up streams are cancelled and free what they held (their token files), and the
    # service still serves a fresh one.
    deadline = time.monotonic() + 20
    while open_token_files(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_token_files(proc.pid) == 0
    assert len(list(stub.Stream(open_stream(max_batches=2), timeout=30))) == 2


LIMIT = 1 << 30  # the service's address space: below the corpus (1.2 GB of tokens)
TOKENS = 600_000_000


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big") / "datasets"
    write_corpus(root, "big", "v1", TOKENS, mean_doc=2048)
    assert (root / "big" / "v1" / "train.bin").stat().st_size > LIMIT
    return root


def _limited() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def test_a_corpus_larger_than_the_services_memory_limit_streams_and_resumes_exactly(big, tmp_path):
    port = free_port()
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "SURGE_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.data", "--port", str(port), "--data-root", str(big)],
        cwd=REPO,
        env=env,
        preexec_fn=_limited,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ch = any_caller_channel(f"127.0.0.1:{port}")
    kw = dict(name="big", seq_len=1024, micro_batch_size=2, rank=1, world_size=2, repeat=True, min_tokens=16)
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        stub = data_pb2_grpc.DataServiceStub(ch)
        req = open_stream(max_batches=24, **kw)
        served = list(stub.Stream(req, timeout=120))
        assert len(served) == 24
        resumed = open_stream(max_batches=13, start=served[10].next, **kw)
        assert [key(b) for b in stub.Stream(resumed, timeout=120)] == [key(b) for b in served[11:]]
        status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        assert proc.poll() is None and int(status["VmHWM"].split()[0]) * 1024 < LIMIT
    finally:
        ch.close()
        proc.kill()
        _, err = proc.communicate(timeout=30)
    # The same stream in this process, with no limit: the same batches.
    unlimited = build_stream(big).batches(req)
    assert [key(b) for b in unlimited] == [key(b) for b in served], err[-2000:]
