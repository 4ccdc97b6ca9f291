"""Which of one node agent incarnation's sequenced events are applied for good (``WorkerCursor``).

A node agent numbers its ``WorkerEvent``s (``seq``, per incarnation); control applies the
events of each job on that job's own queue (services/control/event_applier.py), so one
agent's events are applied in order per job but not in seq order across its jobs: seq 7 (job
B) may be journaled while seq 6 (job A) still waits on A's queue. The cursor is therefore a
watermark (every seq up to it is done: what an ``EventAck`` says and where the agent's resend starts
after a control restart) and the seqs done above it (``ahead``: dropped as duplicates when
the resend brings them again). An event with a journaled effect is done once the cursor's
row is committed in the transaction of that effect (services/control/job_store.py), so a
restarted control applies it exactly once. An event with none (a beat, a rank's step other
than rank 0's) is done once applied, in memory only: its seq reaches the journal with the
next effect's row, if any. After a restart the journaled watermark may therefore be behind
what the agent was acknowledged; the agent resends from its own ack on, and control skips
the seqs between (``skip``: none of them had an effect to lose; issue 28: a beat cost a
journal write, ~730 commits/s at 1,000 agents).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable


class WorkerCursor:
    """The journaled seqs of one node agent incarnation. Thread-safe.

    Args:
        worker_id, incarnation: whose events.
        watermark: every seq up to it is journaled.
        ahead: seqs above ``watermark`` journaled too.
    """

    def __init__(self, worker_id: str, incarnation: str, watermark: int = 0, ahead: Iterable[int] = ()):
        self.worker_id, self.incarnation = worker_id, incarnation
        self._lock = threading.Lock()
        self._watermark = watermark
        self._ahead = {s for s in ahead if s > watermark}

    @property
    def watermark(self) -> int:
        return self._watermark

    def has(self, seq: int) -> bool:
        """``seq`` is journaled (a resend of it is a duplicate)."""
        with self._lock:
            return seq <= self._watermark or seq in self._ahead

    def row_with(self, seqs: Iterable[int]) -> tuple[str, str, int, str]:
        """The journal row ``(worker_id, incarnation, watermark, ahead as JSON)`` once
        ``seqs`` are journaled too (the caller commits it, then calls :meth:`mark`)."""
        with self._lock:
            watermark, ahead = _advance(self._watermark, self._ahead | set(seqs))
        return self.worker_id, self.incarnation, watermark, json.dumps(sorted(ahead)) if ahead else ""

    def mark(self, seqs: Iterable[int]) -> None:
        """``seqs`` are done: journaled (their row committed), or applied with no journaled
        effect (a beat: nothing of it needs to survive a restart, see SessionHub)."""
        with self._lock:
            self._watermark, self._ahead = _advance(self._watermark, self._ahead | set(seqs))

    def skip(self, first: int, last: int) -> None:
        """Seqs ``first``..``last`` will never come: the agent no longer holds them (acked by
        an earlier control without a journaled effect, or dropped by its full outbox). Done
        as ``mark`` would, without a set of every seq when they follow the watermark (the
        common case: after a restart, every beat since the agent's last journaled effect)."""
        if last < first:
            return
        with self._lock:
            if first <= self._watermark + 1:
                self._watermark, self._ahead = _advance(max(self._watermark, last), self._ahead)
            else:  # (a hole below them: a seq still on its way holds the watermark)
                self._watermark, self._ahead = _advance(self._watermark, self._ahead | set(range(first, last + 1)))


def _advance(watermark: int, ahead: set[int]) -> tuple[int, set[int]]:
    while watermark + 1 in ahead:
        watermark += 1
        ahead.discard(watermark)
    return watermark, {s for s in ahead if s > watermark}


def parse_ahead(text: str) -> list[int]:
    """The ``ahead`` column as journaled ("" or a JSON list of seqs)."""
    return json.loads(text) if text else []
