"""The simulated ranks' stand-in for torch.distributed: one round trip through rank 0.

A real rank joins a gloo (or NCCL) process group at ``master_addr:master_port`` and its
ranks meet every step in the gradient all-reduce and at every save in the checkpoint
relay's agreements (services/rank/store_client.py ``_agree``, ``_generation``). A simulated
rank has no torch, so its ranks meet here instead: rank 0 listens at the same address
(the rendezvous L1-2 handed out), every other rank keeps one TCP connection to it, and
:meth:`Collective.exchange` is one round: every rank sends rank 0 a JSON value, rank 0
reduces the world's values (in rank order) and sends every rank the result. That is an
all-reduce (``max``, ``sum``), a barrier (``None``) or a gather (rank 0 keeps the list) in
one call. A round costs rank 0 one read and one write per peer: O(world) small messages,
what a ring all-reduce of a few bytes costs too.

A peer that goes away (EOF, a reset) or a round that takes longer than ``timeout_s`` raises
:class:`CollectiveBroken` on the rank that saw it; the other ranks see their connection
closed when that rank exits, as gloo peers do.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

CONNECT_RETRY_S = 0.1


class CollectiveBroken(RuntimeError):
    """A peer left or a round timed out (the communicator is broken)."""

    fault_class = "comm_error"  # as a real rank's broken process group


class Collective:
    """The world's rendezvous at rank 0 (module docstring).

    Args:
        rank, world_size: this rank's coordinates (RankAssignment).
        address: ``(master_addr, master_port)``; rank 0 listens there, the others connect.
        timeout_s: how long set-up (every peer connected) and each round may take.

    Raises:
        CollectiveBroken: the world did not form within ``timeout_s``.
    """

    def __init__(self, rank: int, world_size: int, address: tuple[str, int], timeout_s: float):
        self._rank, self._world, self._timeout = rank, world_size, timeout_s
        self._peers: list[Any] = []  # rank 0: one file per peer, in rank order
        self._hub: Any = None  # the others: their file to rank 0
        self._sockets: list[socket.socket] = []  # closed with the files (a file's close leaves its socket open)
        deadline = time.monotonic() + timeout_s
        if world_size == 1:
            return
        if rank == 0:
            self._listen(address, deadline)
        else:
            self._connect(address, deadline)

    def exchange(
        self, value: Any, reduce: Callable[[list[Any]], Any] = lambda values: None, timeout_s: float | None = None
    ) -> Any:
        """One round: every rank's ``value`` (JSON), reduced by rank 0 with ``reduce`` (over
        the world's values in rank order); every rank returns the result. ``timeout_s``: this
        round's own limit (a save's agreements wait as long as a peer's staging may take, as
        a real rank's side groups do), else the one given at construction.

        Raises:
            CollectiveBroken: a peer left, or the round took longer than its timeout.
        """
        if self._world == 1:
            return reduce([value])
        if timeout_s is not None:
            self._set_timeout(timeout_s)
        try:
            if self._rank != 0:
                self._hub.write(json.dumps({"v": value}).encode() + b"\n")
                self._hub.flush()
                return _read(self._hub, "rank 0")["v"]
            values = [value] + [_read(f, f"rank {r}")["v"] for r, f in enumerate(self._peers, start=1)]
            out = json.dumps({"v": reduce(values)}).encode() + b"\n"
            for f in self._peers:
                f.write(out)
                f.flush()
            return json.loads(out)["v"]
        except (OSError, ValueError) as e:  # (socket.timeout is an OSError)
            raise CollectiveBroken(f"collective round of rank {self._rank}: {type(e).__name__}: {e}") from None
        finally:
            if timeout_s is not None:
                self._set_timeout(self._timeout)

    def close(self) -> None:
        for f in [*self._peers, self._hub, *self._sockets]:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    # ------------------------------------------------------------------ private

    def _set_timeout(self, timeout_s: float) -> None:
        for conn in self._sockets:  # (their files read through them: the new limit applies)
            try:
                conn.settimeout(timeout_s)
            except OSError:  # closed: the round reports it
                pass

    def _listen(self, address: tuple[str, int], deadline: float) -> None:
        server = socket.create_server(address, backlog=self._world)
        server.settimeout(max(0.1, deadline - time.monotonic()))
        found: dict[int, Any] = {}
        try:
            while len(found) < self._world - 1:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self._world)) - set(found))
                    raise CollectiveBroken(
                        f"collective: {len(missing)} rank(s) never connected to rank 0 at {address[0]}:{address[1]} "
                        f"within {self._timeout:g} s (first: {missing[:5]})"
                    ) from None
                self._sockets.append(conn)
                conn.settimeout(self._timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                f = conn.makefile("rwb")
                found[int(_read(f, "a peer's hello")["rank"])] = f
        finally:
            server.close()
        self._peers = [found[r] for r in range(1, self._world)]

    def _connect(self, address: tuple[str, int], deadline: float) -> None:
        while True:
            try:
                conn = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:  # rank 0 not listening yet
                if time.monotonic() > deadline:
                    raise CollectiveBroken(
                        f"collective: rank {self._rank} could not reach rank 0 at {address[0]}:{address[1]} "
                        f"within {self._timeout:g} s: {e}"
                    ) from None
                time.sleep(CONNECT_RETRY_S)
        self._sockets.append(conn)
        conn.settimeout(self._timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hub = conn.makefile("rwb")
        self._hub.write(json.dumps({"rank": self._rank}).encode() + b"\n")
        self._hub.flush()


def _read(f: Any, who: str) -> dict:
    line = f.readline()
    if not line:
        raise CollectiveBroken(f"collective: {who} closed the connection")
    return json.loads(line)
