"""A rank's compute time per phase (services/common/phase.py, compute_time.py): forward,
backward and optimizer counted, a collective's or a data wait's time not."""

from __future__ import annotations

import time

from services.common import phase as ph
from services.common.compute_time import CudaComputeClock


def test_compute_seconds_count_the_compute_phases_and_not_the_waits_in_collectives():
    mark = ph.PhaseMarker()
    for p, seconds in ((ph.DATA_WAIT, 0.05), (ph.FORWARD, 0.02), (ph.BACKWARD, 0.03), (ph.COLLECTIVE, 0.08),
                       (ph.OPTIMIZER, 0.01), (ph.COLLECTIVE, 0.05), (ph.OPTIMIZER, 0.01)):  # fmt: skip
        mark.enter(p)
        time.sleep(seconds)
    f, b, o = mark.compute_seconds()  # read at the step's end, in the optimizer phase
    assert 0.02 <= f < 0.035 and 0.03 <= b < 0.045 and 0.02 <= o < 0.035
    assert mark.phase == ph.OPTIMIZER  # (reading changes no phase)
    mark.enter(ph.DATA_WAIT)
    assert mark.compute_seconds()[2] < o + 0.005  # counted once, not again at the next mark


class _Event:
    """A stand-in for torch.cuda.Event at the hardware boundary: records a time and
    completes when ``done`` says."""

    clock = 0.0
    done = True

    def __init__(self, enable_timing: bool = False):
        self.t = 0.0

    def record(self) -> None:
        self.t = _Event.clock

    def query(self) -> bool:
        return _Event.done

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1000.0


class _Cuda:
    Event = _Event


def test_the_cuda_clock_sums_event_pairs_of_compute_phases_once_they_completed():
    clock = CudaComputeClock(_Cuda)
    clock.left(ph.DATA_WAIT, 0.0, 0.0)  # the forward begins (host times are not used)
    for p, gpu_s in ((ph.FORWARD, 0.2), (ph.BACKWARD, 0.5), (ph.COLLECTIVE, 0.3)):
        _Event.clock += gpu_s  # the GPU spends this in the phase
        clock.left(p, 0.0, 0.0)
    _Event.done = False  # the optimizer's kernels are still running when the sums are read
    _Event.clock += 0.1
    clock.left(ph.OPTIMIZER, 0.0, 0.0)
    assert clock.totals() == (0.0, 0.0, 0.0)  # nothing completed: nothing counted yet, nothing lost
    _Event.done = True
    f, b, o = clock.totals()
    assert (round(f, 6), round(b, 6), round(o, 6)) == (0.2, 0.5, 0.1)  # the collective's 0.3 s is not in
