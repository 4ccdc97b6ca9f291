"""When a rank beats: on a grid its node agent's ranks share (issue 28 item 3).

A rank's heartbeat thread beats every ``interval`` seconds. Beating on a free-running clock,
the eight ranks of a node reach their agent at eight scattered moments, and the agent has to
send eight messages a period up to control. On a grid (the times ``k * interval + offset`` on
the machine's wall clock) every rank of a node beats within milliseconds of the others, so
the agent sends them as one message (services/worker/rank_beats.py). The offset is the node's
(a fraction of the period from its node agent, :data:`PHASE_ENV`): nodes spread their beats
over the period instead of all of them reaching control in the same instant.

The first beat still goes right after a rank's hello (the deadline covers its set-up); the
grid only sets when the next ones go. A beat is never later than one period after the one
before it (the fault detector's deadlines count periods).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping

PHASE_ENV = "SURGE_BEAT_PHASE"  # the node's fraction of the period, in [0, 1), set by its agent


def node_phase(worker_id: str) -> float:
    """The node's offset as a fraction of the period, in [0, 1): a stable hash of its id,
    so a restarted agent keeps its place and different nodes spread evenly."""
    digest = hashlib.blake2b(worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def phase_from(env: Mapping[str, str] = os.environ) -> float:
    """The phase its agent gave this rank (0 when none, or not a number in [0, 1))."""
    try:
        phase = float(env.get(PHASE_ENV, "0"))
    except ValueError:
        return 0.0
    return phase if 0.0 <= phase < 1.0 else 0.0


def seconds_to_next_beat(now: float, interval: float, phase: float) -> float:
    """Seconds from wall-clock time ``now`` to the next grid point ``k * interval + phase *
    interval`` after it, in (0, interval]: a beat due exactly now waits a whole period (it
    was just sent)."""
    if interval <= 0:
        return 0.0
    offset = phase * interval
    k = math.floor((now - offset) / interval) + 1
    wait = k * interval + offset - now
    return wait if wait > 1e-9 else interval
