"""Python threads named to the OS, so the stack's own cost can be read from outside.

``bench/stack_cost.py`` reads each thread's CPU time from ``/proc/PID/task/TID/stat`` and
its name from ``.../comm``. CPython 3.11 gives its threads no OS name: every thread a rank
starts (its heartbeat, its session reader, its data pump) shows the process's name, and the
rank's side work cannot be told from its training thread. :func:`install` makes every thread
started from the ``threading`` module afterwards write its Python name (the first 15 bytes,
the kernel's limit) to ``/proc/thread-self/comm`` as it starts.

How, with public APIs only: ``threading.setprofile`` sets a profile function in each new
thread before its ``run``; ours names the thread on its first event and removes itself
(``sys.setprofile(None)``), so a thread pays one call, not one per function call. A thread
whose code sets a profile function of its own keeps it (ours is gone by then). Off Linux,
or where ``/proc`` is not writable, threads keep their names as before.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


def _name_this_thread(frame: Any, event: str, arg: Any) -> None:
    sys.setprofile(None)  # once per thread: never in the way of its work
    try:
        with open("/proc/thread-self/comm", "w") as comm:
            comm.write(threading.current_thread().name[:15])
    except OSError:  # not Linux, or no /proc: the name is only for a reader from outside
        pass


def install() -> None:
    """Every thread started from the ``threading`` module from now on carries its name to
    the OS (``/proc/PID/task/TID/comm``)."""
    threading.setprofile(_name_this_thread)
