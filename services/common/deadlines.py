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

    __slots__ = ("when", "fn", "args", "cancelled", "post")

    def __init__(
        self, when: float, fn: Callable[..., Any], args: tuple, post: Callable[[Callable[[], None]], None] | None = None
    ):
        self.when, self.fn, self.args, self.cancelled, self.post = when, fn, args, False, post

    def run(self) -> None:
        """``fn(*args)``, unless cancelled (a posted deadline, re-armed before its turn came)."""
        if not self.cancelled:
            self.fn(*self.args)

    def cancel(self) -> None:
        """Idempotent; a deadline already handed to the pool still runs (as with Timer)."""
        self.cancelled = True


class Deadlines:
    """A heap of deadlines served by one thread and ``workers`` callback threads (daemons)."""

    def __init__(self, name: str, workers: int = 4):
        if workers < 1:
            raise ValueError(f"deadlines: workers must be >= 1, got {workers}")
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()  # ties keep arming order
        self._cond = threading.Condition()
        self._closed = False
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
        deadline = Deadline(time.monotonic() + max(0.0, seconds), fn, args, post)
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

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, due = heapq.heappop(self._heap)
            if not due.cancelled:
                try:
                    if due.post is not None:
                        self._pool.submit(due.post, due.run)
                    else:
                        self._pool.submit(due.fn, *due.args)
                except RuntimeError:  # the interpreter is exiting: no deadline matters any more
                    return
