"""services/common/deadlines.py: Timer semantics on one heap."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.deadlines import Deadlines


@pytest.mark.timeout(20)
def test_due_deadlines_fire_once_in_time_order_and_cancelled_ones_never():
    deadlines = Deadlines("test", workers=1)  # one callback thread: firing order is visible
    fired: list[str] = []
    done = threading.Event()
    t0 = time.monotonic()
    deadlines.after(0.30, fired.append, ("late",))
    deadlines.after(0.10, fired.append, ("early",))
    cancelled = deadlines.after(0.20, fired.append, ("cancelled",))
    deadlines.after(0.40, done.set)
    cancelled.cancel()
    assert done.wait(5)
    assert fired == ["early", "late"]
    assert time.monotonic() - t0 >= 0.40
    assert deadlines.pending() == 0


@pytest.mark.timeout(20)
def test_a_blocking_callback_does_not_hold_back_other_deadlines():
    deadlines = Deadlines("test", workers=2)
    release, other = threading.Event(), threading.Event()
    deadlines.after(0.0, release.wait, (10,))  # blocks one callback thread
    t0 = time.monotonic()
    deadlines.after(0.05, other.set)
    assert other.wait(5)
    assert time.monotonic() - t0 < 2.0
    release.set()


@pytest.mark.timeout(20)
def test_rearming_many_deadlines_starts_no_thread_per_deadline():
    deadlines = Deadlines("test", workers=2)
    before = threading.active_count()
    handles = [deadlines.after(60, lambda: None) for _ in range(2000)]
    for h in handles:
        h.cancel()
    assert threading.active_count() - before <= 2
    assert deadlines.pending() == 0


@pytest.mark.timeout(20)
def test_after_close_no_deadline_fires_armed_before_or_after():
    deadlines = Deadlines("test", workers=1)
    fired: list[str] = []
    deadlines.after(0.2, fired.append, ("armed before",))
    deadlines.close()
    deadlines.after(0.0, fired.append, ("armed after",))
    deadlines.close()  # idempotent
    time.sleep(0.5)
    assert fired == [] and deadlines.pending() == 0
