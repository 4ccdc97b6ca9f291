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


@pytest.mark.timeout(20)
def test_a_deadline_moved_later_fires_once_at_its_new_time_keeping_one_heap_entry():
    # A rank's silence deadline is moved by each beat: a float per beat, no heap push (8,192
    # ranks at 1 Hz were 16,384 pushes a second and their cancelled entries).
    deadlines = Deadlines("test", workers=1)
    fired: list[float] = []
    done = threading.Event()
    t0 = time.monotonic()
    d = deadlines.after(0.2, lambda: (fired.append(time.monotonic() - t0), done.set()))
    for _ in range(5):
        time.sleep(0.1)
        assert d.move(0.2)  # later than it is armed for: moved in place
    assert len(deadlines._heap) == 1
    assert done.wait(5)
    assert len(fired) == 1 and fired[0] >= 0.7, fired  # (0.5 s of moves + 0.2 s)
    assert not d.move(0.2)  # run already: the caller arms a new one
    # Sooner than it is armed for, or cancelled: not moved (the caller cancels and arms anew).
    e = deadlines.after(5.0, fired.append, (-1.0,))
    assert not e.move(0.1)
    e.cancel()
    assert not e.move(10.0)


@pytest.mark.timeout(20)
def test_a_posted_deadline_moved_before_its_turn_is_armed_again_not_run():
    # Decided where ``post`` puts it (control's ordered queue): a beat applied ahead of it moved
    # it later, so it goes back on the heap for its new time instead of running.
    deadlines = Deadlines("test", workers=1)
    queued: list = []
    ran: list[float] = []
    done = threading.Event()
    t0 = time.monotonic()
    d = deadlines.after(0.05, lambda: (ran.append(time.monotonic() - t0), done.set()), post=queued.append)
    while not queued:
        time.sleep(0.01)
    assert d.move(0.3)  # the beat that waited in the queue, applied first
    queued.pop()()  # its turn: moved, so armed again
    assert ran == []
    while not queued:
        time.sleep(0.01)
    queued.pop()()
    assert done.wait(5) and ran[0] >= 0.3, ran


_STOPPED_CHILD = """
import sys, threading, time
from services.common.deadlines import Deadlines
d = Deadlines("t", workers=1)
fired = threading.Event()
t0 = time.monotonic()
d.after(1.5, fired.set)
print("armed", flush=True)
fired.wait(30)
print(f"fired {time.monotonic() - t0:.2f} {getattr(d, 'put_off', 0.0):.2f}", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_process_stopped_past_its_deadline_puts_the_deadline_off_by_the_stop():
    # A pause of control is no one's silence: after a 20 s SIGSTOP of control, a healthy rank
    # was declared 17.5 s silent (its beats waited unread in control's sockets). The time the
    # process did not run does not count: a 1.5 s deadline stopped 5 s at 0.5 s fires ~1 s
    # after the process continues, not at once.
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout.readline().strip() == "armed"
        time.sleep(0.5)
        child.send_signal(signal.SIGSTOP)
        time.sleep(5.0)
        child.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        line = child.stdout.readline().split()
        fired_after_resume = time.monotonic() - resumed
        assert line[0] == "fired" and float(line[2]) >= 3.5, line  # (put off by the stop, less what it slept anyway)
        assert fired_after_resume >= 0.5, fired_after_resume  # (not at once: its beats get read first)
    finally:
        child.kill()
        child.wait(10)
