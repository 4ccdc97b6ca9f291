"""``recvmmsg`` through ctypes (services/control/datagram_reads.py): what is queued, in order,
a batch at a time, never waiting. Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import time

import pytest

from services.control.datagram_reads import DatagramReads

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(DatagramReads is None, reason="no recvmmsg (not Linux)"),
]


def test_queued_datagrams_are_read_in_order_a_batch_at_a_time_and_an_empty_socket_returns_at_once():
    into = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        into.bind(("127.0.0.1", 0))
        reads = DatagramReads(batch=8, size=64)
        t = time.monotonic()
        assert reads.take(into) == []  # (nothing queued: no wait, the socket is blocking)
        assert time.monotonic() - t < 1.0
        sent = [b"d%02d" % i * (1 + i % 3) for i in range(20)]
        for d in sent:
            out.sendto(d, into.getsockname())
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < len(sent) and time.monotonic() < deadline:
            batch = reads.take(into)
            assert len(batch) <= 8
            got.extend(batch)
        assert got == sent
        out.sendto(b"x" * 100, into.getsockname())  # longer than a buffer: cut, not lost
        deadline = time.monotonic() + 10
        while not (cut := reads.take(into)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cut == [b"x" * 64]
    finally:
        into.close()
        out.close()
