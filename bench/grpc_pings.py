"""What one small, paced message costs gRPC's threads, with and without the BDP probe (session 36).

    .venv/bin/python bench/grpc_pings.py [--seconds 10] [--period 1.0] [--out bench/results/grpc_pings.json]

A server (a child process, sync ``grpc.server`` as the node agent's) streams one 1 KiB message
every ``--period`` seconds to a client (this process, a sync channel as a rank's session);
for each case the voluntary context switches (wake-ups) of both processes' threads are read
from ``/proc`` over ``--seconds``, summed by thread name, per second. Cases: gRPC's defaults;
the client without the BDP probe (``SMALL_MESSAGES``: services/common/grpc_server.py, the
receiver is who pings); the server with ``SMALL_AND_BULK`` only (it receives nothing here:
no change expected). Why it matters: the stack's per-second floor (issue 28 item 3) is
mostly gRPC's ``event_engine`` threads waking for messages a second apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from services.common.grpc_server import SMALL_AND_BULK, SMALL_MESSAGES  # noqa: E402
from services.contract import data_pb2, data_pb2_grpc  # noqa: E402

CASES = {
    "default": ([], []),
    "client SMALL_MESSAGES": (SMALL_MESSAGES, []),
    "server SMALL_AND_BULK": ([], SMALL_AND_BULK),
}


def wakeups(pid: int) -> dict[str, int]:
    """Voluntary context switches of ``pid``'s threads, summed by thread name."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[name] = out.get(name, 0) + int(line.split()[1])
        except OSError:
            continue
    return out


def _rate(a: dict[str, int], b: dict[str, int], seconds: float) -> dict[str, float]:
    return {k: round((v - a.get(k, 0)) / seconds, 1) for k, v in b.items() if v - a.get(k, 0)}


def serve(period: float, options: list) -> None:
    class Streamer(data_pb2_grpc.DataServiceServicer):
        def Stream(self, request, context):
            while context.is_active():
                yield data_pb2.MicroBatch(input_ids=b"x" * 1024)
                time.sleep(period)

    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    data_pb2_grpc.add_DataServiceServicer_to_server(Streamer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    sys.stdin.read()  # until the parent closes it


def measure(case: str, period: float, seconds: float) -> dict:
    client_opts, server_opts = CASES[case]
    args = [c.PY, __file__, "--serve", json.dumps([list(o) for o in server_opts]), "--period", str(period)]
    srv = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=list(client_opts))
        call = data_pb2_grpc.DataServiceStub(ch).Stream(data_pb2.OpenStream())
        got = [0]

        def read() -> None:
            try:
                for _ in call:
                    got[0] += 1
            except grpc.RpcError:
                pass  # (cancelled at the end)

        threading.Thread(target=read, daemon=True).start()
        time.sleep(2 * period + 1)  # (the stream open and its first messages: not counted)
        a, sa, n0 = wakeups(os.getpid()), wakeups(srv.pid), got[0]
        time.sleep(seconds)
        b, sb, n1 = wakeups(os.getpid()), wakeups(srv.pid), got[0]
        call.cancel()
        ch.close()
    finally:
        srv.stdin.close()
        srv.wait(timeout=10)
    client, server = _rate(a, b, seconds), _rate(sa, sb, seconds)
    return {
        "messages_per_second": round((n1 - n0) / seconds, 2),
        "client": client,
        "server": server,
        "event_engine_per_second": {
            "client": client.get("event_engine", 0.0),
            "server": server.get("event_engine", 0.0),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--period", type=float, default=1.0)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=c.RESULTS / "grpc_pings.json")
    a = ap.parse_args()
    if a.serve is not None:
        serve(a.period, [tuple(o) for o in json.loads(a.serve)])
        return
    cases = {case: measure(case, a.period, a.seconds) for case in CASES}
    result = {"machine": c.machine(), "loadavg": os.getloadavg(), "period_s": a.period, "cases": cases}
    rows = [
        (
            case,
            f"{r['messages_per_second']}",
            f"{r['event_engine_per_second']['client']}",
            f"{r['event_engine_per_second']['server']}",
        )
        for case, r in cases.items()
    ]
    print(c.table(rows, ("case", "messages/s", "client event_engine wake-ups/s", "server event_engine wake-ups/s")))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
