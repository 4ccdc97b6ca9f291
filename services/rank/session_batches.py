"""The messages of a rank's ``RankSession`` stream (issue 28 item 3: the stack's CPU per step).

One message per wake-up of the stream's sender: the first event queued, with every event
queued behind it by then in its ``more`` (a step's StepCompleted and its metric record are
queued together by the step's end). Each message costs a wake-up of the sender thread, the
channel's threads and the node agent's; a batch keeps the events' order.

A rank sends its step's events with its next heartbeat (``ride_s``: at most one beat period),
not each step. Another rank's StepCompleted tells control nothing the beat does not (the node
agent keeps it: services/worker/step_summaries.py), and every rank's metric record waits in
the agent for the node's next batch to the store anyway (services/worker/metric_stream.py).
Rank 0's StepCompleted is the job's step summary: control applies every one (its status, its
journal of steps), and they all still reach it, in order, a beat's worth in one message; only
a step control decides on at once goes at once (:class:`StepUrgency`: the first step of a
loop, which ends a recovery or a resize; a step whose all-reduce agreed on a new boundary
command, where a pause, stop, scale or revoke takes effect; a skipped step). So at dp 2 no
rank-to-agent hop (and no agent-to-control hop) is made per step any more, one per beat is.
Anything else queued (a heartbeat, any other routed event: a save, a pause, a fault, the
loop's end; a record that is not a step's; the session's end; :data:`NOW`) sends what waits
at once, in order. The trade-offs: a rank whose process dies abruptly (SIGKILL, a lost node)
loses its step records of at most the last beat period (its own series in the store; for rank
0 also the job's curve and the journal's step rows of those steps, which the recovery trains
and records again from the last checkpoint); control's status (step, loss, tokens/s) is up to
a beat period behind the loop.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from services.contract import worker_pb2

STEP_COMPLETED = "surge.v1.StepCompleted"
# Put on a rank's queue after an event that must not wait: what waits goes at once (not sent itself).
NOW = object()
# "0": every rank's step events go at once, each step (what the stack did before session 31).
STEPS_RIDE = os.environ.get("SURGE_RANK_STEPS_RIDE_BEATS", "1") != "0"


def rides(event: worker_pb2.RankEvent) -> bool:
    """Whether ``event`` is a step's (its StepCompleted or its metric record), which a rank
    other than 0 may hold until its next heartbeat."""
    kind = event.WhichOneof("event")
    if kind == "metrics":
        return event.metrics.WhichOneof("record") == "step"
    return kind == "routed" and event.routed.type == STEP_COMPLETED


def _at_once() -> float:
    return 0.0


class StepUrgency:
    """Which of rank 0's StepCompleted control decides on at once (module docstring): the
    first of a loop (after its TrainingLoopStarted), one whose ``commands_agreed`` is higher
    than the last step's, a skipped one. Fed every StepCompleted and TrainingLoopStarted the
    rank sends, in order (the loop's thread)."""

    def __init__(self) -> None:
        self._first, self._agreed = True, 0

    def started(self) -> None:
        self._first = True

    def at_once(self, step: Any) -> bool:
        """Whether ``step`` (a StepCompleted) must not wait for the next beat."""
        urgent = self._first or step.commands_agreed > self._agreed or step.skipped
        self._first, self._agreed = False, max(self._agreed, step.commands_agreed)
        return urgent


class Outgoing:
    """A rank's queue of events for its session (``queue.Queue``'s ``put``, ``get`` and
    ``get_nowait``), whose ``put`` of a step's event does not wake the sender while it waits
    for the beat with another step's (:func:`messages`): a step's StepCompleted and its metric
    record would otherwise wake it twice a step for nothing (it would go back to waiting).
    ``notified``: the wake-ups it was given (a counter, for tests)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._riding = False  # the sender waits, with a timeout, for the beat (messages)
        self.notified = 0

    def put(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            if self._riding and item is not None and item is not NOW and rides(item):
                return  # (it goes with the beat, or at the wait's end: nothing to do now)
            self.notified += 1
            self._cond.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self._cond:
            if timeout is None and block:
                while not self._items:
                    self._cond.wait()
                return self._items.popleft()
            end = time.monotonic() + (timeout or 0.0)
            self._riding = True
            try:
                while not self._items:
                    left = end - time.monotonic()
                    if not block or left <= 0:
                        raise queue.Empty
                    self._cond.wait(left)
            finally:
                self._riding = False
            return self._items.popleft()

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)


def messages(out: queue.Queue | Outgoing, ride_s: Callable[[], float] = _at_once) -> Iterator[worker_pb2.RankEvent]:
    """The stream's messages from the queue ``out`` (RankEvents; None ends it, after what came
    before it; :data:`NOW` sends what waits at once): each the first event waiting with those
    behind it in ``more``. ``ride_s()`` > 0 (read per message: the beat period may change): a
    message whose events are all a step's waits up to that long for something else to go
    with (module docstring)."""
    while (event := out.get()) is not None:
        if event is NOW:
            continue  # (nothing waits: what came before it went)
        wait = ride_s() if rides(event) else 0.0
        due = time.monotonic() + wait if wait > 0 else None
        while True:
            try:
                behind = out.get_nowait() if due is None else out.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                break
            if behind is None:  # closing: what came before it still goes
                yield event
                return
            if behind is NOW:
                due = None
                continue
            event.more.append(behind)
            if due is not None and not rides(behind):
                due = None  # (it goes now, with whatever else is queued)
        yield event
