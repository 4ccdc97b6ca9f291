"""Control's own lag, as numbers: how late its gRPC loop runs, how long the oldest message
waits for its event applier (``ControlHealth``).

Why: a node agent's beat is read on the server's loop (beat_stamps.py) and its other
messages applied on the applier's queues; when control itself falls behind (a starved
2-core host, 10,000 agents' streams), beats wait unread and deadlines fire that no agent
missed. L1-3 reads these numbers before it declares an agent silent and holds its verdicts
while control is behind (fault_detector/disruption.py): slowness is never death.

A probe on the loop runs every ``PERIOD`` seconds and records how late it ran (the loop's
lag) and the applier's oldest unapplied message; a probe that has not run for longer than
its period is itself the loop's lag (the loop is stuck: ``loop_lag`` counts it). Plain
floats: nothing reachable from here acts (L1-3 holds this, tests/redlines/wiring.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.control.metrics import LOOP_LAG

PERIOD = 0.25  # seconds between two probes on the loop


class ControlHealth:
    """The lag figures a probe on control's loop keeps (``watch``); none before it runs (an
    in-process control that serves no gRPC is never behind)."""

    def __init__(self) -> None:
        self.probed: float | None = None  # time.monotonic() of the last probe (None: not watched)
        self.late = 0.0  # how late the last probe ran
        self.applier_lag = 0.0  # seconds the applier's oldest unapplied message had waited then

    def loop_lag(self, now: float | None = None) -> float:
        """Seconds the loop is behind now (0: not watched)."""
        if self.probed is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(self.late, now - self.probed - PERIOD)

    def behind(self, limit_s: float, now: float | None = None) -> tuple[str, float] | None:
        """("loop", seconds) or ("applier", seconds) when control is behind by more than
        ``limit_s``; None when it keeps up (or is not watched)."""
        if self.probed is None:
            return None
        loop = self.loop_lag(now)
        if loop > limit_s:
            return "loop", loop
        if self.applier_lag > limit_s:
            return "applier", self.applier_lag
        return None

    def watch(self, loop: asyncio.AbstractEventLoop, oldest_unapplied: Callable[[], float]) -> None:
        """Probe ``loop`` from now on (its first probe is queued on it)."""
        loop.call_soon_threadsafe(self._probe, loop, oldest_unapplied, time.monotonic())

    def _probe(self, loop: asyncio.AbstractEventLoop, oldest_unapplied: Callable[[], float], due: float) -> None:
        now = time.monotonic()
        self.late = max(0.0, now - due)
        self.applier_lag = oldest_unapplied()
        self.probed = now
        LOOP_LAG.set(self.late)
        loop.call_later(PERIOD, self._probe, loop, oldest_unapplied, now + PERIOD)
