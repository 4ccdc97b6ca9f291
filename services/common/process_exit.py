"""Ending a process that ran torch.distributed collectives, without the gloo exit abort."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn

# A rank that raised MemoryError exits with this code (services/rank/__main__.py): its node
# agent knows the cause from the code alone (services/worker/exit_cause.py). 75 is unused by
# Python, by the shell's conventions (126-128, 128+N) and by the rank's other codes (1 failed,
# 2 bad arguments, 3 session lost).
MEMORY_ERROR_EXIT_CODE = 75


def exit_now(code: int) -> NoReturn:
    """Flush stdout/stderr and end the process with ``code``, skipping interpreter finalization.

    Why not a plain return from ``main``: a gloo worker thread
    (``ProcessGroupGloo::runLoop``) can still hold the last reference to a finished
    collective's work when the interpreter finalizes. Dropping it decrefs the work's tensors'
    Python objects, which needs the GIL; a thread taking the GIL during finalization is ended
    by ``pthread_exit``, and that unwind through a ``noexcept`` destructor calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT, exit code
    -6). Seen here in CI and in a core dump of a test rank (backtrace:
    ``runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil ->
    pthread_exit -> std::terminate``); the same failure is pytorch/pytorch#190489 and the
    (abandoned) fix pytorch/pytorch#179291. ``destroy_process_group`` does not prevent it:
    the group's threads live on while Python objects (DeviceMesh, DDP) still reference it.

    Call it last, after every result is written and closed. Never returns.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a pipe whose reader, the node agent, is gone: exit anyway)
            pass
    os._exit(code)


def last_words(text: str) -> None:
    """Write ``text`` to stderr if anyone still reads it: a rank's stderr is a pipe to its node
    agent (services/worker/rank_logs.py), and once that agent is gone a write raises
    BrokenPipeError, which must not stop the rank from leaving."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def leave_after_stop(code: int, wait_s: float = 5.0) -> NoReturn:
    """End a service whose servers and pools are stopped with ``code``: its other non-daemon
    threads get ``wait_s`` in all to end (a pool worker finishing its piece), then the process
    ends without joining the rest. A plain return joins every ``ThreadPoolExecutor`` worker at
    interpreter exit, without a deadline: one piece stuck in a read held the data service
    30 s past its SIGTERM in CI (ci15). The stragglers are named on stderr."""
    me = threading.current_thread()
    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = sorted(t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive())
    if stuck:
        last_words(
            f"exit: {len(stuck)} thread(s) still running {wait_s:g} s after the stop, not waited for: {', '.join(stuck)}\n"
        )
    exit_now(code)
