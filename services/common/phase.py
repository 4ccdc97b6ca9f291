"""Where a rank's main thread is: a phase marker set at phase boundaries, read by its beats.

The training loop (L2-1) and the gradient reduction unit (L3-5) mark phase boundaries
(data wait, forward, backward, in a collective, optimizer, evaluation, checkpoint staging,
compile, idle); the rank session's heartbeat thread reads the marker once per beat and
states it in ``RankHeartbeat.phase`` / ``phase_seconds`` / ``phase_progress`` /
``phase_total``, so control's fault detector keeps a progress deadline per phase and can
tell a rank that stopped computing from one waiting for it in a collective.

It is a probe, not a message: nothing reads it but the beat thread, no module reads
another's phase, and it carries no command (the same standing as a metric). The
composition root (``services/rank/__main__.py``) builds one per rank and hands it to the
modules that mark it.

Cost on the hot path: ``enter`` is three attribute stores (no lock, no allocation beyond a
float): a beat may read a phase with the previous phase's start time for a few
microseconds, which a deadline measured in seconds cannot see. ``advance`` is one integer
add. Values are ``worker_pb2.RankPhase`` numbers.

It also sums the rank's compute time per phase (``compute_time.py``: forward, backward,
optimizer, without the waits in collectives), read at each step's end for the beats:
``enter`` hands the phase it leaves to that clock (one dictionary look-up and an add on
CPU ranks; a CUDA event recorded on GPU ranks).
"""

from __future__ import annotations

import time

from services.common.compute_time import CudaComputeClock, HostComputeClock
from services.contract import worker_pb2

RankPhase = worker_pb2.RankPhase

IDLE = RankPhase.PHASE_IDLE
DATA_WAIT = RankPhase.PHASE_DATA_WAIT
FORWARD = RankPhase.PHASE_FORWARD
BACKWARD = RankPhase.PHASE_BACKWARD
COLLECTIVE = RankPhase.PHASE_COLLECTIVE
OPTIMIZER = RankPhase.PHASE_OPTIMIZER
EVALUATION = RankPhase.PHASE_EVALUATION
CHECKPOINT_STAGING = RankPhase.PHASE_CHECKPOINT_STAGING
COMPILE = RankPhase.PHASE_COMPILE
FAULT_WAIT = RankPhase.PHASE_FAULT_WAIT
FROZEN = RankPhase.PHASE_FROZEN
PROFILE_EXPORT = RankPhase.PHASE_PROFILE_EXPORT

# After a beat stating a phase was handed to the rank's session stream, how long an announcing
# thread still lets the stream's own thread send it before taking the interpreter lock for long.
ANNOUNCE_GRACE_S = 0.2
ANNOUNCE_PERIODS = 3  # how many beat periods ``announce`` waits for a beat stating the phase


def profile_export_budget_s(base_s: float, step_factor: float, profiled_seconds: float) -> float:
    """How long a profile's export may take (``liveness.phase_seconds.profile_export``): a
    base, and ``step_factor`` x the profiled steps' time (their events, hence the export's work,
    grow with them). One formula for the rank (which measures its export against it) and for
    control's fault detector (which allows it, and the silence within it)."""
    return base_s + step_factor * max(profiled_seconds, 0.0)


class PhaseMarker:
    """The current phase of one rank's main thread (``worker_pb2.RankPhase``), when it was
    entered (``time.monotonic()``), the units of it done and the units it will take (0:
    unknown)."""

    __slots__ = (
        "_compute",
        "_counted",
        "_frozen",
        "_announce_s",
        "_stated",
        "_stated_phase",
        "phase",
        "progress",
        "since",
        "total",
    )

    def __init__(self, phase: int = IDLE):
        self.phase, self.since, self.progress, self.total = phase, time.monotonic(), 0, 0
        self._compute: HostComputeClock | CudaComputeClock = HostComputeClock()
        self._counted = self.since  # the current phase's time is in the sums up to here
        self._frozen = False  # held for inspection (``freeze``): every phase reads FROZEN from then on
        # The newest phase a beat was sent with, and its start (``since``): ``stated``.
        self._stated_phase, self._stated = phase, 0.0
        self._announce_s = ANNOUNCE_PERIODS * 1.0  # how long ``announce`` waits (``stated_every``)

    def time_on_cuda(self, cuda) -> None:
        """Count compute time with CUDA events on the current stream (a GPU rank, once its
        device is chosen; ``cuda``: the ``torch.cuda`` module)."""
        self._compute = CudaComputeClock(cuda)

    def enter(self, phase: int, total: int = 0) -> None:
        """The main thread enters ``phase`` (of ``total`` units, when known)."""
        now = time.monotonic()
        self._compute.left(self.phase, self._counted, now)
        self.progress, self.total, self.since, self._counted = 0, total, now, now
        self.phase = FROZEN if self._frozen else phase

    def freeze(self) -> None:
        """L1-1 holds the rank for inspection (FreezeTraining, from any thread): its beats say
        FROZEN from now on, whatever its main thread does until the hold ends the process (a
        step finishing, a collective that breaks), so no progress deadline is kept on it.
        Only attribute stores: the compute clock is left to the main thread."""
        self._frozen = True
        self.phase, self.since, self.progress, self.total = FROZEN, time.monotonic(), 0, 0

    def thaw(self) -> None:
        """The hold is over (the rank goes on in place: a rollback loaded into it): phases
        read as entered again."""
        self._frozen = False

    def compute_seconds(self) -> tuple[float, float, float]:
        """(forward, backward, optimizer) compute seconds so far, the current phase's up to
        now included (read by the main thread at a step's end, while still in the optimizer
        phase: its update belongs to the step it ends)."""
        now = time.monotonic()
        self._compute.left(self.phase, self._counted, now)
        self._counted = now
        return self._compute.totals()

    def advance(self, units: int = 1) -> None:
        """``units`` more of the current phase done (e.g. one evaluation batch)."""
        self.progress += units

    def stated(self, phase: int, since: float) -> None:
        """The beat thread sent a beat stating ``phase``, entered at ``since`` (read before the
        phase: a phase entered between the two is not taken for stated)."""
        self._stated_phase, self._stated = phase, since

    def stated_every(self, period_s: float) -> None:
        """Beats go every ``period_s`` (the rank session, once the job's spec is known)."""
        self._announce_s = ANNOUNCE_PERIODS * period_s

    def announce(self) -> bool:
        """Wait (at most ``ANNOUNCE_PERIODS`` beat periods) until a beat has stated the current phase, so that
        control knows of a phase whose work may silence the beats (a profile's export holds
        the interpreter lock) before it starts; False if none did in time (the phase starts
        anyway: a late announcement is the next beat's). Sleeps in short slices: the lock is
        free meanwhile for the beat and stream threads."""
        phase, since, deadline = self.phase, self.since, time.monotonic() + self._announce_s
        while self._stated_phase != phase or self._stated < since:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        time.sleep(ANNOUNCE_GRACE_S)
        return True

    def read(self) -> tuple[int, float, int, int]:
        """(phase, seconds in it, progress, total), for a beat."""
        phase, since, progress, total = self.phase, self.since, self.progress, self.total
        return phase, max(0.0, time.monotonic() - since), progress, total


class NoPhase:
    """A marker that marks nothing (a module built without one, e.g. in unit tests)."""

    __slots__ = ()

    def enter(self, phase: int, total: int = 0) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass

    def freeze(self) -> None:
        pass

    def thaw(self) -> None:
        pass

    def announce(self) -> bool:
        return True


NO_PHASE = NoPhase()
