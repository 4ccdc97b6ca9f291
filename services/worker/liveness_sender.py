"""A node agent's liveness beat as one UDP datagram to control (``AgentLiveness``).

Control grants each session a slot, a session number and a key (the ``surge-liveness-bin``
header of its registration's answer, services/control/liveness_datagrams.py); the agent then
sends its own beat, every period, as one signed datagram instead of a message on its session:
microseconds at both ends where a gRPC message costs control ~200 us to read (issue 28).

Sending is fire and forget: a send that fails is counted, never acted on. Whether the
datagrams arrive is control's to say (``BeatOnSession`` on the session: beat there).
"""

from __future__ import annotations

import socket
import threading

from services.common.liveness_mac import liveness_mac
from services.contract import control_pb2


def control_host(address: str) -> str:
    """The host part of control's ``host:port`` (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class LivenessSender:
    """One session's liveness datagrams: ``send`` one per beat (any thread); ``close`` at the
    session's end.

    Raises:
        OSError: control's host does not resolve (the agent beats on its session instead).
    """

    def __init__(self, grant: control_pb2.LivenessGrant, host: str):
        family, _, _, _, addr = socket.getaddrinfo(host, grant.port, type=socket.SOCK_DGRAM)[0]
        self._addr = addr
        self._sock = socket.socket(family, socket.SOCK_DGRAM)
        self._grant = grant
        self._lock = threading.Lock()  # the seq (the keeper's thread and the session's)
        self._seq = 0
        self.sent = 0
        self.failed = 0  # sends the kernel refused (counted, not acted on: control decides)

    def send(self, interval_seconds: float, unix_time: float, progress: bytes = b"") -> None:
        """One datagram: the agent's beat, with ``progress`` (a serialized LivenessProgress:
        its ranks' beats riding, services/common/liveness_progress.py) when given."""
        with self._lock:
            self._seq += 1
            msg = control_pb2.AgentLiveness(
                slot=self._grant.slot,
                session=self._grant.session,
                seq=self._seq,
                interval_seconds=interval_seconds,
                unix_time=unix_time,
                progress=progress,
            )
            msg.mac = liveness_mac(self._grant.key, msg)
            try:
                self._sock.sendto(msg.SerializeToString(), self._addr)
                self.sent += 1
            except OSError:
                self.failed += 1

    def close(self) -> None:
        self._sock.close()
