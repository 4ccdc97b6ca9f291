"""Many queued datagrams in one system call, without letting go of the GIL: ``recvmmsg(2)``.

Why: Python's ``socket.recv`` releases the GIL around its system call, and a thread that
released it waits for it again behind the busy one (up to the switch interval, 5 ms) before
it can take the datagram it just read. control's liveness reader (liveness_datagrams.py)
shares the process with the gRPC loop and the applier: at 4,000 agents it read each datagram
that way, and the p99 from an agent's send to its stamp was 500 ms (p50 2.5 ms) while the
loop was busy. ``recvmmsg`` with ``MSG_DONTWAIT`` through ``ctypes.PyDLL`` (a call that keeps the
GIL) takes everything queued, up to ``batch`` datagrams, in one call that never blocks: the
reader waits for the GIL once per batch, not once per datagram.

Linux only; elsewhere (or without libc's ``recvmmsg``) ``DatagramReads`` is None and the reader
reads one datagram at a time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket

MSG_DONTWAIT = 0x40  # <sys/socket.h> on Linux


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.POINTER(_IOVec)),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


def _recvmmsg():
    try:
        libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # (PyDLL: keeps the GIL)
        fn = libc.recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MMsgHdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_RECVMMSG = _recvmmsg()


class _Reads:
    """``take(sock)``: the datagrams queued on ``sock`` now (up to ``batch``, each at most
    ``size`` bytes; a longer one is cut), never waiting; [] when none is queued."""

    def __init__(self, batch: int = 256, size: int = 512):
        self.batch, self._n, self._size = batch, batch, size
        self._bufs = (ctypes.c_char * size * batch)()
        self._iov = (_IOVec * batch)()
        self._msgs = (_MMsgHdr * batch)()
        base = ctypes.addressof(self._bufs)
        for i in range(batch):
            self._iov[i].iov_base = base + i * size
            self._iov[i].iov_len = size
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
        self._base = base

    def take(self, sock: socket.socket) -> list[bytes]:
        n = _RECVMMSG(sock.fileno(), self._msgs, self._n, MSG_DONTWAIT, None)
        if n <= 0:  # (-1: EAGAIN, nothing queued; or the socket closed: the caller's recv says so)
            return []
        at, size, msgs = ctypes.string_at, self._size, self._msgs
        return [at(self._base + i * size, msgs[i].msg_len) for i in range(n)]


DatagramReads = _Reads if _RECVMMSG is not None else None
