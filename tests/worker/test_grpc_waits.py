"""services/common/grpc_waits.py: a thread reading an idle gRPC stream sleeps instead of
waking ten times a second, and a main thread blocked in a gRPC wait still runs its signal
handlers at once. Each case runs in a child process: the slice is process-wide."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A child with an in-process server whose stream never sends: a reader thread waits on it for
# 1.5 s and the child prints the reader's context switches (its wake-ups); then the main
# thread blocks on the same kind of stream until a SIGTERM, whose handler prints and exits.
CHILD = """
import signal, sys, threading, time, os
from concurrent import futures
import grpc
from services.common import grpc_waits
if sys.argv[1] == "install":
    assert grpc_waits.install(2.0)  # (the opt-in slice: SURGE_GRPC_WAIT_SLICE_S)
if sys.argv[1] == "side":
    assert grpc_waits.install()  # (the services' default: gRPC's 0.1 s in the main thread, 2 s elsewhere)
    from grpc import _common
    assert _common.MAXIMUM_WAIT_TIMEOUT == 0.1

def never(request, context):
    while context.is_active():
        time.sleep(0.05)
    return iter(())

server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("t.T", {"Watch": grpc.unary_stream_rpc_method_handler(never)}),)
)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
watch = channel.unary_stream("/t.T/Watch")
tid = []

def read():
    tid.append(threading.get_native_id())
    for _ in watch(b""):
        pass

threading.Thread(target=read, daemon=True).start()
time.sleep(0.5)

def switches():
    with open(f"/proc/self/task/{tid[0]}/status") as f:
        return sum(int(l.split()[1]) for l in f if "ctxt_switches" in l)

a = switches()
time.sleep(1.5)
print("wakeups", switches() - a, flush=True)

def on_term(signum, frame):
    print("handled", flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)
print("blocked", flush=True)
for _ in watch(b""):  # the main thread in gRPC's wait
    pass
"""


def _run(mode: str) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline().split()
        assert line[0] == "wakeups", line
        assert child.stdout.readline().strip() == "blocked"
        time.sleep(0.3)  # (into the wait)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "handled"
        return int(line[1]), time.monotonic() - t0
    finally:
        child.kill()
        child.wait(timeout=10)


def test_an_idle_stream_reader_sleeps_and_a_blocked_main_thread_still_handles_signals():
    polled, _ = _run("default")
    quiet, handled_s = _run("install")
    assert polled >= 10  # gRPC's own 0.1 s slice: ~15 wake-ups in 1.5 s
    assert quiet <= 3  # (the slice is 2 s: at most one, plus the scheduler's own)
    assert handled_s < 1.0  # a signal interrupts the wait: not held to the 2 s slice


def test_by_default_only_side_threads_wait_in_wide_slices_the_main_thread_keeps_grpcs():
    quiet, handled_s = _run("side")
    assert quiet <= 3  # the reader (a side thread): 2 s slices
    assert handled_s < 1.0  # the main thread in gRPC's wait: its handler runs at once
