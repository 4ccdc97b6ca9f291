"""Bulk upload throughput to a sync gRPC server by its stream window, over a link with a
round-trip time (session 37: cpu36's open question on ``SMALL_AND_BULK``'s fixed 16 MiB
window, services/common/grpc_server.py).

    .venv/bin/python bench/grpc_window.py [--rtt-ms 10] [--mib 256] [--out bench/results/grpc_window.json]

A server (a child process, a sync ``grpc.server`` as the store's and the node agent's) takes
a client stream of 1 MiB messages (as checkpoint chunks and memory copies reach them) from a
client (another child) through a TCP relay in this process that holds every chunk it
forwards, either way, for half of ``--rtt-ms``: loopback's own RTT (~0.05 ms) would hide any
window, and this machine's kernel has no netem. HTTP/2's flow control is end to end, so the
relay's RTT is the one a stream window meets; the relay's own buffers add none. Each case's
MB/s is over ``--mib`` MiB, best of ``--tries``; the relay's copying caps all cases alike.
Cases (server options): gRPC's defaults (BDP probe on: the window grows with the link),
``SMALL_AND_BULK`` (probe off, a fixed 16 MiB window) and ``SMALL_MESSAGES`` (probe off,
gRPC's 64 KiB stream window: what a bulk server must not have). A window W
caps a stream at W / RTT.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from services.common.grpc_server import GRPC_OPTIONS, SMALL_AND_BULK, SMALL_MESSAGES  # noqa: E402

CASES = {"default (BDP probe)": (), "SMALL_AND_BULK": SMALL_AND_BULK, "SMALL_MESSAGES": SMALL_MESSAGES}
METHOD = "/bench.Window/Upload"


class _Relay:
    """A TCP relay on 127.0.0.1 to ``target`` that forwards each chunk ``delay_s`` after it
    read it (each direction: a reader thread and a writer thread per connection)."""

    def __init__(self, target: int, delay_s: float):
        self._target, self._delay = target, delay_s
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._listen.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self._target))
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in ((a, b), (b, a)):
                q: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, q), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, q), daemon=True).start()

    def _read(self, src: socket.socket, q: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(1 << 18)
            except OSError:
                data = b""
            q.put((time.monotonic() + self._delay, data))
            if not data:
                return

    def _write(self, dst: socket.socket, q: queue.Queue) -> None:
        while True:
            due, data = q.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._listen.close()


def serve(port: int, case: str) -> None:
    """The child: a sync server whose Upload counts the bytes of a client stream."""

    def upload(requests, context):
        return str(sum(len(r) for r in requests)).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Window", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[*GRPC_OPTIONS, *CASES[case]])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def upload(port: int, mib: int) -> float:
    """The client: ``mib`` 1 MiB messages up one stream; MB/s."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.stream_unary(METHOD)
    chunk = os.urandom(1 << 20)
    t0 = time.perf_counter()
    got = int(call(chunk for _ in range(mib)))
    seconds = time.perf_counter() - t0
    channel.close()
    assert got == mib << 20
    return (mib << 20) / seconds / 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=10.0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tries", type=int, default=2)
    ap.add_argument("--out", type=Path, default=c.RESULTS / "grpc_window.json")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)  # (the child: PORT CASE)
    ap.add_argument("--upload", nargs=2, type=int, help=argparse.SUPPRESS)  # (the client: PORT MIB)
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return
    if args.upload:
        print(upload(*args.upload))
        return
    py, me = sys.executable, str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONPATH": str(c.REPO)}
    results: dict[str, float] = {}
    for case in CASES:
        port = _free_port()
        server = subprocess.Popen([py, me, "--serve", str(port), case], env=env)
        relay = _Relay(port, args.rtt_ms / 2000)
        try:
            time.sleep(1.0)  # (the server binds)
            rates = []
            for _ in range(args.tries):
                out = subprocess.run(
                    [py, me, "--upload", str(relay.port), str(args.mib)],
                    env=env, capture_output=True, text=True, timeout=900, check=True,
                )  # fmt: skip
                rates.append(float(out.stdout.strip().splitlines()[-1]))
            results[case] = round(max(rates), 1)
            print(f"{case}: {results[case]} MB/s (tries {[round(r, 1) for r in rates]})", flush=True)
        finally:
            relay.close()
            server.terminate()
            server.wait(10)
    report = {"rtt_ms": args.rtt_ms, "mib": args.mib, "mb_per_s": results, "loadavg": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
