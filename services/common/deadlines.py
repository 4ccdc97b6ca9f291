"""One-shot deadlines without a thread per deadline (control's fault detector and orchestrator,
the store's metric series lingering after a job's end).

``threading.Timer`` starts a thread per deadline; re-armed on every heartbeat, that is one
new thread per rank per beat (1,000 ranks at 1 Hz: 1,000 thread starts a second, measured
as a quarter of control's CPU in ``bench/control_scale.py``). Here one thread keeps every
deadline in a heap and hands the due ones to a small pool, so a callback that blocks (a
fault report the orchestrator acts on) delays no other deadline.

Semantics are Timer's: ``after(seconds, fn, args)`` calls ``fn(*args)`` once, ``seconds``
from now, unless ``cancel()`` on the returned handle came first. Cancelled entries stay in
the heap until their time and are skipped (no search on cancel).

``Deadline.move(seconds)`` re-arms a deadline for later without touching the heap: its entry
stays, and when that entry comes due the deadline is put back for its new time. A rank's
silence deadline, re-armed by each of its beats, costs a float per beat, not a heap push and
a cancelled entry (8,192 ranks at 1 Hz: 16,384 pushes a second, a third of the beat's cost).

``after(..., post=P)`` decides a due deadline where ``P`` puts it: ``P(run)`` is called when it
is due and ``run()`` calls ``fn(*args)`` unless the deadline was cancelled by then. Why: control
applies a node agent's messages on ordered queues (services/control/event_applier.py); a
silence deadline posted on the queue of the messages that re-arm it is decided after every
beat received before it fired. Decided at once, a beat that waited in a backlog (control's
own lag, e.g. 1,024 agents' beats at a job's start) was taken for the agent's silence.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Deadline:
    """Handle of one armed deadline."""

    __slots__ = ("when", "fn", "args", "cancelled", "post", "_owner", "_done")

    def __init__(
        self,
        when: float,
        fn: Callable[..., Any],
        args: tuple,
        post: Callable[[Callable[[], None]], None] | None = None,
        owner: Deadlines | None = None,
    ):
        self.when, self.fn, self.args, self.cancelled, self.post = when, fn, args, False, post
        self._owner, self._done = owner, False

    def run(self) -> None:
        """Due: ``fn(*args)``, unless cancelled meanwhile, or moved later (``move``, e.g. by a
        beat applied before a posted deadline's turn came): then armed again for its new time."""
        if self.cancelled:
            return
        if self.when > time.monotonic() and self._owner is not None:
            self._owner._again(self)
            return
        self._done = True
        self.fn(*self.args)

    def move(self, seconds: float) -> bool:
        """Re-arm for ``seconds`` from now, keeping its heap entry (module docstring). False,
        changing nothing, where that cannot be: cancelled, run already, or due earlier than
        it is now armed for (the caller cancels it and arms a new one)."""
        when = time.monotonic() + max(0.0, seconds)
        if self.cancelled or self._done or when < self.when or self._owner is None:
            return False
        self.when = when
        return True

    def cancel(self) -> None:
        """Idempotent; a deadline handed to the pool still runs if its callback began."""
        self.cancelled = True


TICK_S = 1.0  # the serving thread wakes at least this often, to see a stall of its process
STALL_S = 2.0  # a wake this much later than asked: the process was stopped or starved


class Deadlines:
    """A heap of deadlines served by one thread and ``workers`` callback threads (daemons)."""

    def __init__(self, name: str, workers: int = 4):
        if workers < 1:
            raise ValueError(f"deadlines: workers must be >= 1, got {workers}")
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()  # ties keep arming order
        self._cond = threading.Condition()
        self._closed = False
        self.put_off = 0.0  # seconds every deadline was put off for stalls of the process (_put_off)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-deadline")
        threading.Thread(target=self._serve, name=f"{name}-deadlines", daemon=True).start()

    def after(
        self,
        seconds: float,
        fn: Callable[..., Any],
        args: tuple = (),
        post: Callable[[Callable[[], None]], None] | None = None,
    ) -> Deadline:
        """Arm: ``fn(*args)`` in ``seconds`` (monotonic clock) unless cancelled first; with
        ``post``, decided where ``post`` puts it (the module docstring)."""
        deadline = Deadline(time.monotonic() + max(0.0, seconds), fn, args, post, self)
        with self._cond:
            if self._closed:
                return deadline
            heapq.heappush(self._heap, (deadline.when, next(self._order), deadline))
            if self._heap[0][2] is deadline:
                self._cond.notify()  # a new earliest: the server sleeps less
        return deadline

    def close(self) -> None:
        """No deadline fires any more, armed or armed later (the process is stopping).
        Idempotent; a callback already handed to the pool still runs."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def pending(self) -> int:
        """Armed and not cancelled (for tests and metrics)."""
        with self._cond:
            return sum(1 for _, _, d in self._heap if not d.cancelled)

    def _again(self, deadline: Deadline) -> None:
        """A due deadline that was moved later after its entry came due: back on the heap."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (deadline.when, next(self._order), deadline))
            if self._heap[0][2] is deadline:
                self._cond.notify()

    def _put_off(self, seconds: float) -> None:
        """Under ``_cond``: this thread woke ``seconds`` late (less a tick): the process was
        stopped (SIGSTOP) or starved meanwhile, and so were the messages that re-arm its
        deadlines, which wait unread in its sockets. Every armed deadline is put off by that
        much (the time the process did not run does not count; a tick more for the estimate's
        error), so that a pause of control is no one's silence: a frozen control blamed a
        healthy rank 17.5 s silent after a 20 s SIGSTOP and relaunched it (a fresh user's trial)."""
        self._heap = [(key + seconds, order, d) for key, order, d in self._heap]  # (a uniform shift: still a heap)
        for _, _, d in self._heap:
            d.when += seconds
        self.put_off += seconds

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = TICK_S if not self._heap else min(TICK_S, self._heap[0][0] - time.monotonic())
                    asked = time.monotonic() + wait
                    self._cond.wait(wait)
                    late = time.monotonic() - asked
                    if late > STALL_S:
                        self._put_off(late + TICK_S)
                if self._closed:
                    return
                key, _, due = heapq.heappop(self._heap)
                if not due.cancelled and due.when > key:  # moved later meanwhile: its new time
                    heapq.heappush(self._heap, (due.when, next(self._order), due))
                    continue
            if not due.cancelled:
                try:
                    if due.post is not None:
                        self._pool.submit(due.post, due.run)
                    else:
                        self._pool.submit(due.run)
                except RuntimeError:  # the interpreter is exiting: no deadline matters any more
                    return
