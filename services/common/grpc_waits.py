"""gRPC's blocking waits without their 0.1 s poll (issue 28 item 3: the stack's CPU per step).

grpcio's sync API (1.85) waits for a stream's next message, a call's end or a server's
termination in slices of ``grpc._common.MAXIMUM_WAIT_TIMEOUT`` (0.1 s), so that a main
thread blocked in it still runs its signal handlers (grpc issue 19464). Every thread of ours
that reads a stream (a rank's session reader, the node agent's control session and metric
stream, control's store watch) therefore woke ten times a second with nothing to read;
measured on the demo model (dp 2, /proc/PID/task/TID/schedstat): about 74 us of CPU per
wake-up, 0.74 ms of CPU per second for control's idle store watch alone, about 5 ms per
second over the stack's seven such threads, some 15 % of the stack's whole cost.

On POSIX the slice is not needed for signals: since Python 3.2 a lock wait (what
``Condition.wait`` and ``Event.wait`` do) is interrupted by a signal, its handler runs, and
the wait goes on. Nothing else depends on it: a message, a call's end and a cancel each
``notify_all`` the call's condition (grpc/_channel.py) and a server's stop sets its
termination event. :func:`install` widens the slice to ``WAIT_SLICE_S`` (not to "forever":
a wake-up gRPC would ever miss costs at most that long, never a hang). The knob is grpcio's
module attribute, read at each wait (``_common.wait``): no public API sets it; if a grpcio
version drops it, :func:`install` leaves gRPC as it is and says so (returns False).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

# The main thread's, opt-in for the services (``SURGE_GRPC_WAIT_SLICE_S``; default gRPC's own
# 0.1 s): at 2 s for every thread the idle wake-ups fell twenty-fold, but a data service's SIGTERM
# once took 18 s instead of 1.4 s to end (and over 30 s in CI), not explained (the data service
# holds no sync gRPC call: nothing of it waits in ``_common.wait``). Kept as gRPC has it in the
# services' main threads; their side threads wait in ``SIDE_WAIT_SLICE_S`` (below).
WAIT_SLICE_S = float(os.environ.get("SURGE_GRPC_WAIT_SLICE_S", "0.1"))
# A rank process widens it by default (``install(RANK_WAIT_SLICE_S)``): it has no Python
# signal handler to run (its SIGTERM is SIG_DFL: the kernel ends it, whatever it waits in), and
# it ends with ``os._exit``, never in a gRPC server's shutdown; its session reader was one of the
# stack's largest idle costs per rank (session 26: 0.8-0.9 ms of CPU per second each).
RANK_WAIT_SLICE_S = float(os.environ.get("SURGE_GRPC_WAIT_SLICE_S", "2.0"))


# Any thread but the main one (``SURGE_GRPC_SIDE_WAIT_SLICE_S``, default 2 s): the slice exists
# for signal handlers, which Python runs in the main thread only, so a side thread's slice
# serves nothing; the main thread keeps ``WAIT_SLICE_S``. The stream readers are all side
# threads (a node agent's control session and metric stream, control's store watch): each woke
# 10 times a second (0.7-0.9 ms of CPU per second each, session 26).
SIDE_WAIT_SLICE_S = float(os.environ.get("SURGE_GRPC_SIDE_WAIT_SLICE_S", "2.0"))


def install(seconds: float = WAIT_SLICE_S, side_seconds: float = SIDE_WAIT_SLICE_S) -> bool:
    """Widen gRPC's wait slice in this process: to ``seconds`` in the main thread, to
    ``side_seconds`` in any other (Linux/POSIX only: elsewhere a signal may wait for the
    slice's end). Returns whether it was set."""
    if os.name != "posix":
        return False
    from grpc import _common  # grpcio's only handle on its wait slice (see above)

    if not isinstance(getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None), (int, float)):
        return False
    if not callable(getattr(_common, "wait", None)) or not callable(getattr(_common, "_wait_once", None)):
        return False
    _common.MAXIMUM_WAIT_TIMEOUT = seconds
    if getattr(_common.wait, "_surge_side_slice", None) is None:
        _common.wait = _side_threads_wait(_common.wait, _common._wait_once)
    _common.wait._surge_side_slice = side_seconds
    return True


def _side_threads_wait(main_wait: Callable[..., bool], wait_once: Callable[..., None]) -> Callable[..., bool]:
    """grpcio's ``_common.wait`` (grpc/_common.py, 1.85: the same loop) with the slice read
    per thread: the main thread's as before (``MAXIMUM_WAIT_TIMEOUT``), a side thread's
    ``wait._surge_side_slice``. A message, a call's end and a cancel each notify the waiter
    (grpc/_channel.py), so a wider slice delays nothing that happens."""

    def wait(
        wait_fn: Callable[..., bool],
        wait_complete_fn: Callable[[], bool],
        timeout: float | None = None,
        spin_cb: Callable[[], None] | None = None,
    ) -> bool:
        if threading.current_thread() is threading.main_thread():
            return main_wait(wait_fn, wait_complete_fn, timeout, spin_cb)
        slice_s = wait._surge_side_slice
        if timeout is None:
            while not wait_complete_fn():
                wait_once(wait_fn, slice_s, spin_cb)
            return False
        end = time.time() + timeout
        while not wait_complete_fn():
            remaining = min(end - time.time(), slice_s)
            if remaining < 0:
                return True
            wait_once(wait_fn, remaining, spin_cb)
        return False

    wait._surge_side_slice = SIDE_WAIT_SLICE_S
    return wait
