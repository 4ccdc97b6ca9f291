"""bench/stack_cost.py's accounting: which process and thread is the stack's and which the
ranks' compute, and the thread names it reads (services/common/thread_names.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.stack_cost import cost, kind_of, snapshot

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("/v/bin/python -m services.rank --session 127.0.0.1:4 --job j-1 --rank 3", "rank 3"),
        ("/v/bin/python -m services.rank.forkserver 5 --module services.rank", "rank fork server"),
        ("/v/bin/python -m services.worker --control 127.0.0.1:5", "node agent"),
        ("/v/bin/python -m services.control --port 0", "control"),
        ("/v/bin/python -m services.store --port 0", "store"),
        ("/v/bin/python -m services.data --port 0", "data"),
    ],
)
def test_each_process_of_the_stack_is_told_by_its_command_line(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_a_ranks_compute_is_its_main_thread_its_pools_and_torch_distributed_the_rest_is_the_stacks():
    def rank(main: float, pool: float, gloo: float, beat: float, grpc: float) -> dict:
        return {
            "kind": "rank 0",
            "threads": {
                10: ("python -m servi", main),
                11: ("python -m servi", pool),  # a torch pool thread: inherits the main thread's name
                12: ("pt_gloo_runloop", gloo),
                13: ("heartbeat", beat),
                14: ("event_engine", grpc),
            },
        }

    a = {10: rank(1.0, 1.0, 1.0, 1.0, 1.0), 20: {"kind": "rank fork server", "threads": {20: ("python", 5.0)}}}
    b = {10: rank(3.0, 2.0, 1.5, 1.25, 1.5), 20: {"kind": "rank fork server", "threads": {20: ("python", 5.5)}}}
    b[30] = {"kind": "control", "threads": {30: ("python", 0.25), 31: ("event-applier-0", 0.5)}}  # new: from 0
    a[10]["wakeups"] = {10: 100, 13: 5, 14: 7}
    b[10]["wakeups"] = {10: 900, 13: 8, 14: 17}  # (the main thread's are the compute's: not counted)
    b[30]["wakeups"] = {31: 4}
    spent = cost(a, b)
    assert spent["wakeups"] == {"ranks' side threads": 13, "control": 4, "rank fork server": 0}
    assert spent["ranks"] == 1 and spent["rank_compute"] == pytest.approx(3.5)
    assert spent["rank_side_threads"] == pytest.approx({"heartbeat": 0.25, "event_engine": 0.5})
    assert spent["stack"] == pytest.approx({"rank fork server": 0.5, "control": 0.75})
    assert spent["stack_threads"]["control: event-applier"] == pytest.approx(0.5)
    # by thread: the stack's as "kind: thread", a rank's side threads as "ranks' side: thread"
    assert spent["thread_wakeups"] == {
        "ranks' side: heartbeat": 3,
        "ranks' side: event_engine": 10,
        "control: event-applier": 4,
        "rank fork server: main": 0,
        "control: main": 0,
    }


def test_python_threads_carry_their_names_to_the_os_and_the_snapshot_reads_them():
    code = (
        "import threading, time, sys\n"
        "from services.common import thread_names\n"
        "thread_names.install()\n"
        "threading.Thread(target=time.sleep, args=(30,), name='heartbeat', daemon=True).start()\n"
        "print('up', flush=True)\n"
        "time.sleep(30)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "up"
        seen = snapshot([child.pid])[child.pid]
        names = [name for name, _ in seen["threads"].values()]
        assert set(seen["wakeups"]) == set(seen["threads"]) and sum(seen["wakeups"].values()) > 0
        assert "heartbeat" in names and seen["kind"].startswith("other")
    finally:
        child.kill()
        child.wait(timeout=10)


def test_grpcs_unnamed_threads_are_grouped_by_what_they_are():
    from bench.stack_cost import _thread_group

    assert _thread_group("Thread-2 (_run)") == _thread_group("Thread-17 (_run") == "gRPC spin/request (Thread-N (_run))"
    assert _thread_group("Thread-2 (_serv") == "gRPC server (Thread-N (_serve))"
    assert _thread_group("Thread-1 (_poll") == "gRPC aio poller (Thread-N (_poll_wrapper))"
    assert (_thread_group("data-io_3"), _thread_group("event_engine")) == ("data-io", "event_engine")
