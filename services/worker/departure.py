"""A node agent's departure with notice (issue 30 item 5): on SIGTERM or SIGUSR1 it tells
control (WorkerDeparting, with its deadline) and keeps its ranks running until control has
released them (moved away after a checkpoint), the deadline passes, or control is away long
enough that nobody will release them (a stack stopping as a whole: control goes too); then
the agent stops what is left, as without notice."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from services.contract import Module, control_pb2
from services.contract.relay import pack

# Signals that announce a departure: Kubernetes' and systemd's SIGTERM, Slurm's
# `--signal=USR1@N` (N seconds before the job's end). SIGINT (a person's Ctrl-C) stops at once.
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Control unreachable this long during the wait: nobody will release the ranks (a stack
# stopping as a whole stops control too); the agent stops them instead of waiting it out.
CONTROL_AWAY_SECONDS = 2.0
POLL_SECONDS = 0.1

RELEASED, DEADLINE, CONTROL_AWAY = "released", "deadline", "control away"


def announcement(incarnation: str, deadline_s: float, signalled_unix: float, signum: int) -> control_pb2.WorkerEvent:
    """The WorkerDeparting event, routed as the node's own (its worker id is set by control's
    session relay)."""
    msg = control_pb2.WorkerDeparting(
        incarnation=incarnation,
        deadline_seconds=deadline_s,
        unix_time=signalled_unix,
        signal=signal.Signals(signum).name,
    )
    return control_pb2.WorkerEvent(routed=pack(msg, Module.EXT_HARDWARE))


def wait_for_release(
    has_ranks: Callable[[], bool],
    connected: Callable[[], bool],
    deadline_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait until no rank runs here (RELEASED), ``deadline_s`` passed (DEADLINE) or control
    was unreachable for ``CONTROL_AWAY_SECONDS`` (CONTROL_AWAY). Returns which."""
    start = clock()
    away_since = None
    while True:
        if not has_ranks():
            return RELEASED
        now = clock()
        if now - start >= deadline_s:
            return DEADLINE
        if connected():
            away_since = None
        else:
            away_since = now if away_since is None else away_since
            if now - away_since >= CONTROL_AWAY_SECONDS:
                return CONTROL_AWAY
        sleep(POLL_SECONDS)
