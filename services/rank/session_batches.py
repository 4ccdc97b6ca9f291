"""The messages of a rank's ``RankSession`` stream (issue 28 item 3: the stack's CPU per step).

One message per wake-up of the stream's sender: the first event queued, with every event
queued behind it by then in its ``more`` (a step's StepCompleted and its metric record are
queued together by the step's end). Each message costs a wake-up of the sender thread, the
channel's threads and the node agent's; a batch keeps the events' order.

A rank other than 0 sends its step's events with its next heartbeat (``ride_s``: at most one
beat period), not each step: its StepCompleted tells control nothing the beat does not (the
node agent keeps it: services/worker/step_summaries.py) and its metric record waits in the
agent for the node's next batch to the store anyway (services/worker/metric_stream.py). So at
dp 2 a step costs the rank-to-agent hop of rank 0 only, and another rank sends once a beat.
Anything else queued (a heartbeat, any other routed event: a save, a pause, a fault, the
loop's end; a record that is not a step's; the session's end) sends what waits at once, in
order. The trade-off: a rank other than 0 whose process dies abruptly (SIGKILL, a lost node)
loses its step records of at most the last beat period (its own series in the store; the
job's loss curve and status are rank 0's). Rank 0's step goes at once, as before: control
applies each (the job's progress, the commands agreed at its boundary).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator

from services.contract import worker_pb2

STEP_COMPLETED = "surge.v1.StepCompleted"
# "0": every rank's step events go at once, as rank 0's (what the stack did before session 31).
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


def messages(out: queue.Queue, ride_s: Callable[[], float] = _at_once) -> Iterator[worker_pb2.RankEvent]:
    """The stream's messages from the queue ``out`` (RankEvents; None ends it, after what came
    before it): each the first event waiting with those behind it in ``more``. ``ride_s()`` > 0
    (read per message: the beat period may change): a message whose events are all a step's
    waits up to that long for something else to go with (module docstring)."""
    while (event := out.get()) is not None:
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
            event.more.append(behind)
            if due is not None and not rides(behind):
                due = None  # (it goes now, with whatever else is queued)
        yield event
