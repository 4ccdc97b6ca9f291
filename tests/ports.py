"""Free TCP ports for tests that start servers.

Binding port 0 hands out a port from the kernel's ephemeral range, the same range every
outgoing connection takes its local port from. Between the probe and the server's bind, a
client socket of any process on the host (another xdist worker's gRPC channel, a gloo
connect) can take that port: CI saw rank 0's rendezvous fail with "port in use" that way.
So these ports come from below the ephemeral range, which no outgoing connection uses,
from a slice of its own per xdist worker, so parallel workers never pick the same one, and
each is probed by a bind before it is handed out.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

_LOWEST = 10_000  # below the registered ports most services listen on (Prometheus 9090 and so on)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _slice() -> range:
    """This xdist worker's share of [_LOWEST, ephemeral low)."""
    high = max(_ephemeral_low(), _LOWEST + 2_000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) % count if worker.isdigit() else 0
    width = (high - _LOWEST) // count
    return range(_LOWEST + index * width, _LOWEST + (index + 1) * width)


# One walk through the slice per process, from a random start, so that two calls in a row
# (or a test and the rank processes it starts, which inherit the worker's slice) do not
# hand out the same port before either has bound it.
_candidates = None


def _next_candidate() -> int:
    global _candidates
    if _candidates is None:
        ports = _slice()
        start = random.randrange(len(ports))
        _candidates = itertools.cycle([*ports[start:], *ports[:start]])
    return next(_candidates)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and no outgoing connection will take."""
    for _ in range(10_000):
        port = _next_candidate()
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {_slice()}")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
