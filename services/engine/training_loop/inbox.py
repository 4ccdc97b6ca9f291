"""The loop's batch inbox: a bounded queue whose producer, once it found the queue full, is
woken when the loop has taken it down to half, not at every batch the loop takes.

The producer is the data relay's stream thread (services/rank/data_client.py): it runs ahead
of the loop by the queue's size and blocks when the queue is full. A ``queue.Queue`` wakes it
at every ``get``, so it woke once per micro-batch only to put one and wait again; woken at
half, it puts half a queue at once (issue 28 item 3: the stack's wake-ups per step). The
loop itself is woken as before (at the first batch put into an empty queue), and at least
half the queue (``maxsize // 2``) is still read ahead when the producer wakes.
"""

from __future__ import annotations

import queue
import threading


class Inbox(queue.Queue):
    """``queue.Queue(maxsize)`` but for when a full queue's ``put`` returns: once the queue
    holds ``maxsize // 2`` items or fewer (for ``maxsize`` 1 or 2, at every ``get``, as before)."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.low = maxsize // 2
        self.not_full = _WhenDrained(self.mutex, self)  # (queue.Queue.get notifies it after each item)


class _WhenDrained(threading.Condition):
    """``not_full`` of an :class:`Inbox`: a notify (``get``'s, under the queue's mutex) wakes
    the producer only once the queue is down to its low mark."""

    def __init__(self, lock, inbox: Inbox):
        super().__init__(lock)
        self._inbox = inbox

    def notify(self, n: int = 1) -> None:
        if self._inbox._qsize() <= self._inbox.low:
            super().notify(n)
