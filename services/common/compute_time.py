"""A rank's compute time per phase (forward, backward, optimizer), without its waits.

The phase marker (``phase.py``) hands each phase it leaves to a clock here; the rank session
reads the sums at each step's end and states them in its heartbeat
(``RankHeartbeat.forward_compute_seconds`` ...), from which control's slow-rank detector
(services/control/slow_ranks.py) compares the ranks' compute per step. What a rank spends in
a collective (``PHASE_COLLECTIVE``: DDP's gradient all-reduce from its last bucket on, the
step's statistics all-reduce), waiting for data, in an evaluation or a checkpoint save, and
its first step (``PHASE_COMPILE``) is not compute here: a fast rank that waits for a slow
peer must not look slow itself.

Two clocks, one per kind of device:

* :class:`HostComputeClock` (CPU ranks, gloo): the host's monotonic time between phase marks
  is the compute time, since a CPU op runs when it is called.
* :class:`CudaComputeClock` (GPU ranks): host time between marks is only the time to launch
  the kernels. As torchtitan's and Megatron-LM's timers do, it records a CUDA event on the
  current stream at each mark and sums ``start.elapsed_time(end)`` of the compute phases once
  both events have completed (``query()``: never a synchronisation on the hot path), so the
  GPU's own time in each phase is counted, and a compute stream made to wait for the NCCL
  stream waits inside the collective phase, not in a compute one. Events still in flight
  when the sums are read are counted at a later read: sums are kept, not lost.

Limit: under FSDP2 the all-gathers of forward and backward are waited for inside those
phases (their waits are per block, not marked), so a fast rank's forward and backward include
some wait for a slow peer; the DDP and single-group layouts are exact.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from services.contract import worker_pb2

RankPhase = worker_pb2.RankPhase
# The phases whose time is this rank's own compute, in RankHeartbeat's order.
COMPUTE_PHASES = (RankPhase.PHASE_FORWARD, RankPhase.PHASE_BACKWARD, RankPhase.PHASE_OPTIMIZER)
_INDEX = {p: i for i, p in enumerate(COMPUTE_PHASES)}


class HostComputeClock:
    """Compute seconds per phase from the host clock (CPU ranks)."""

    __slots__ = ("_seconds",)

    def __init__(self) -> None:
        self._seconds = [0.0, 0.0, 0.0]

    def left(self, phase: int, since: float, now: float) -> None:
        """The main thread spent ``since``..``now`` (``time.monotonic()``) in ``phase``."""
        i = _INDEX.get(phase)
        if i is not None:
            self._seconds[i] += now - since

    def totals(self) -> tuple[float, float, float]:
        """(forward, backward, optimizer) compute seconds so far."""
        f, b, o = self._seconds
        return f, b, o


class CudaComputeClock:
    """Compute seconds per phase from CUDA events on the current stream (GPU ranks).

    Args:
        cuda: the ``torch.cuda`` module (an argument so that the rank imports torch once,
            where it chooses the device).
    """

    __slots__ = ("_cuda", "_last", "_pending", "_seconds")

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        self._seconds = [0.0, 0.0, 0.0]
        self._last: Any = None  # the event recorded at the last mark: where the next phase starts
        self._pending: deque[tuple[int, Any, Any]] = deque()  # (index, start, end) not yet completed

    def left(self, phase: int, since: float, now: float) -> None:
        """Mark the end of ``phase`` on the device's current stream (the host times are not
        used: the GPU's own clock is)."""
        end = self._cuda.Event(enable_timing=True)
        end.record()
        start, self._last = self._last, end
        i = _INDEX.get(phase)
        if i is not None and start is not None:
            self._pending.append((i, start, end))

    def totals(self) -> tuple[float, float, float]:
        """(forward, backward, optimizer) compute seconds of the phases whose events have
        completed; the ones still running are counted at a later call (in stream order)."""
        while self._pending and self._pending[0][2].query():
            i, start, end = self._pending.popleft()
            self._seconds[i] += start.elapsed_time(end) / 1000.0  # (milliseconds)
        f, b, o = self._seconds
        return f, b, o
