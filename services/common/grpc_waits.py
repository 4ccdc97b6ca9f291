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

# Opt-in (``SURGE_GRPC_WAIT_SLICE_S``; default gRPC's own 0.1 s): at 2 s the idle wake-ups fell
# twenty-fold, but a data service's SIGTERM once took 18 s instead of 1.4 s to end (and over 30 s
# in CI): some wait of gRPC's shutdown does depend on the slice. Kept off until that is found.
WAIT_SLICE_S = float(os.environ.get("SURGE_GRPC_WAIT_SLICE_S", "0.1"))


def install(seconds: float = WAIT_SLICE_S) -> bool:
    """Widen gRPC's wait slice in this process (Linux/POSIX only: elsewhere a signal may
    wait for the slice's end). Returns whether it was set."""
    if os.name != "posix":
        return False
    from grpc import _common  # grpcio's only handle on its wait slice (see above)

    if not isinstance(getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None), (int, float)):
        return False
    _common.MAXIMUM_WAIT_TIMEOUT = seconds
    return True
