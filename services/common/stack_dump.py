"""Every thread's Python stack on SIGUSR2, written to the process's stderr (its log).

Why: a hung rank or service (a collective that never completes, a lock never let go) is
diagnosed from its stacks; py-spy is rarely on a training host and needs ptrace rights.
``kill -USR2 PID`` asks for them without stopping the process (faulthandler writes from its
signal handler, so a thread stuck in C code is shown too). SIGUSR1 is the node agent's
departure notice (services/worker/departure.py), so the dump takes the other one.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

DUMP_SIGNAL = signal.SIGUSR2


def install() -> None:
    """Dump every thread's stack to stderr on :data:`DUMP_SIGNAL` (chained to nothing: the
    process goes on). The process's own fd 2 (``sys.__stderr__``): a ``sys.stderr`` replaced
    in-process (a test's capture) may have no file descriptor for the handler to write to."""
    faulthandler.register(DUMP_SIGNAL, file=sys.__stderr__, all_threads=True, chain=False)
