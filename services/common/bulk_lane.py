"""A bulk lane between two node agents: a heal's chunks as raw bytes on a plain TCP socket
(issue 27, item 4).

gRPC's Python streams copy every message several times (serialize, frame, deserialize into
a new ``bytes``), and keeping a fetched chunk in the receiving agent's shared memory for its
rank to read costs a write and a read of tmpfs: a heal through them cost the receiving node
about 2.3 CPU seconds per GB. On a lane the holder sends each chunk with ``sendfile`` from
its shared-memory file (no copy through user space), and the rank that needs the chunks
receives them with ``recv_into`` straight into its own buffers (one copy, the kernel's),
the way torchft moves a checkpoint between replicas on a plain socket.

The lane is negotiated on the gRPC service, which carries the identity check: the rank's
agent calls ``MemoryCopyService.OpenBulkRead`` on its peer (a peer agent, EXT_HARDWARE,
only), the holder binds the chunks it holds of the query to a one-time random token
(:meth:`LaneServer.grant`, valid ``GRANT_TTL_S``) and names its lane's port; a connection
that does not open with a live token is closed unanswered, and a token serves one
connection. The asking agent opens the connection itself (:func:`connect`) and hands the
connected socket to its local rank (:class:`LaneRelay`: ``SCM_RIGHTS`` on a Unix socket in
its shared-memory directory, against a second one-time key it gave the rank in its
GetChunks reply): the rank talks to its own agent only, and the bytes go from the peer's
memory to the rank's without a copy in between. Nothing on the lane is trusted: the reader
verifies every chunk's SHA-256 as on the gRPC path.

Wire, holder -> asker, after the asker's token: per chunk of the grant, a header
(:data:`HEADER`: its index in the grant's list, its size, or :data:`GONE` when it was freed
since the grant), then its bytes. Not under TLS (the lane is plaintext; an agent under TLS
opens none, and GetChunks is used).
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<IQ")  # chunk index in the grant, its size in bytes (GONE: not sent)
GONE = 2**64 - 1
TOKEN_BYTES = 32
GRANT_TTL_S = 30.0  # a granted lane not connected within this is forgotten
IO_TIMEOUT_S = 10.0  # a lane that moves nothing this long is broken (either side)

# What the holder sends for a chunk: (its shared-memory file, or its bytes) or None (freed).
Lookup = Callable[[str], "str | bytes | None"]


@dataclass
class _Grant:
    shas: list[str]
    expires: float


class LaneServer:
    """The holder's side: a listening socket on ``host`` and the live grants.

    Args:
        host: where to listen (the agent's gRPC host).
        lookup: a chunk's file or bytes by digest (None: not held any more).
        log: a structlog logger.
    """

    def __init__(self, host: str, lookup: Lookup, log: Any):
        self._lookup = lookup
        self._log = log
        self._grants: dict[bytes, _Grant] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept_loop, name="memory-lane-accept", daemon=True).start()

    def grant(self, shas: list[str]) -> bytes:
        """A one-time token for sending ``shas`` in this order on one connection."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, g in self._grants.items() if g.expires < now]:
                del self._grants[old]
            self._grants[token] = _Grant(list(shas), now + GRANT_TTL_S)
        return token

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        _accept(self._sock, lambda: self._closed, self._serve, "memory-lane-send")

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                token = bytes(recv_exact(conn, TOKEN_BYTES))
            except OSError:
                return
            with self._lock:
                grant = self._grants.pop(token, None)
            if grant is None or grant.expires < time.monotonic():
                self._log.warning("memory_lane_refused", reason="no live grant for the token")
                return
            try:
                for i, sha in enumerate(grant.shas):
                    self._send_one(conn, i, sha)
            except OSError as e:  # the asker went away (done from another source, or gone)
                self._log.info("memory_lane_closed", error=f"{type(e).__name__}: {e}")

    def _send_one(self, conn: socket.socket, i: int, sha: str) -> None:
        held = self._lookup(sha)
        if isinstance(held, bytes):
            conn.sendall(HEADER.pack(i, len(held)))
            conn.sendall(memoryview(held))
            return
        try:
            f = open(held, "rb") if held else None  # noqa: SIM115 - closed below
        except FileNotFoundError:  # freed since the look-up
            f = None
        if f is None:
            conn.sendall(HEADER.pack(i, GONE))
            return
        with f:
            n = os.fstat(f.fileno()).st_size  # (a chunk file is written once: its size is its chunk's)
            conn.sendall(HEADER.pack(i, n))
            if n:
                conn.sendfile(f, 0, n)  # sendfile(2): shared memory's pages to the socket, no user copy


class LaneRelay:
    """The asking agent's side: lanes it opened, handed once each to a local rank that names
    the key (a Unix socket named ``path``: an abstract one, see MemoryCopies)."""

    def __init__(self, path: str, log: Any):
        self.path = path
        self._log = log
        self._offers: dict[bytes, tuple[socket.socket, float]] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._closed = False
        threading.Thread(target=self._accept_loop, name="memory-lane-relay", daemon=True).start()

    def offer(self, lane: socket.socket) -> bytes:
        """A one-time key for taking ``lane`` (this agent's copy is closed once it is taken,
        or after ``GRANT_TTL_S`` untaken)."""
        key = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            stale = [k for k, (_, t) in self._offers.items() if t < now]
            for k in stale:
                self._offers.pop(k)[0].close()
            self._offers[key] = (lane, now + GRANT_TTL_S)
        return key

    def close(self) -> None:
        self._closed = True
        with self._lock:
            offers, self._offers = list(self._offers.values()), {}
        for lane, _ in offers:
            lane.close()
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        _accept(self._sock, lambda: self._closed, self._hand, "memory-lane-hand")

    def _hand(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            try:
                key = bytes(recv_exact(conn, TOKEN_BYTES))
            except OSError:
                return
            with self._lock:
                lane, _ = self._offers.pop(key, (None, 0.0))
            if lane is None:
                return  # (closed unanswered: the taker sees no descriptor)
            with lane:
                try:
                    socket.send_fds(conn, [b"L"], [lane.fileno()])
                except OSError as e:
                    self._log.info("memory_lane_not_handed", error=f"{type(e).__name__}: {e}")


def take(path: str, key: bytes) -> socket.socket:
    """The rank's side: the lane its agent opened, from the agent's relay at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(IO_TIMEOUT_S)
        conn.connect(path)
        conn.sendall(key)
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    if not fds:
        raise ConnectionError("the agent handed no lane (its offer expired)")
    lane = socket.socket(fileno=fds[0])
    # Blocking, with the stall limit in the kernel (SO_RCVTIMEO): a chunk is then one
    # recv(MSG_WAITALL) call, not one per segment that arrived (each a trip through the GIL).
    lane.settimeout(None)
    lane.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(IO_TIMEOUT_S), 0))
    return lane


def connect(address: str, port: int, token: bytes) -> socket.socket:
    """The asker's side: a connection to the lane of the agent at ``address`` (its gRPC
    host:port), the token sent."""
    host = address.rpartition(":")[0].strip("[]") or address
    sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(token)
    return sock


def read_header(sock: socket.socket) -> tuple[int, int]:
    """The next chunk's (index in the grant, size or GONE)."""
    return HEADER.unpack(recv_exact(sock, HEADER.size))


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_all(sock, memoryview(buf))
    return buf


def recv_into_all(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the lane ends first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError(f"the lane ended {n - got} bytes short of a chunk")
        got += k


def _accept(
    sock: socket.socket, closed: Callable[[], bool], handle: Callable[[socket.socket], None], name: str
) -> None:
    """Accept connections on ``sock`` until it is closed, each handled on a thread of its own
    (a heal opens a few lanes, not one per chunk)."""
    while not closed():
        try:
            conn, _ = sock.accept()
        except OSError:
            return  # closed
        threading.Thread(target=handle, args=(conn,), name=name, daemon=True).start()
