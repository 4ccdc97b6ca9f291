"""Which of one node agent incarnation's sequenced events are applied for good (``WorkerCursor``).

A node agent numbers its ``WorkerEvent``s (``seq``, per incarnation); control applies the
events of each job on that job's own queue (services/control/event_applier.py), so one
agent's events are applied in order per job but not in seq order across its jobs: seq 7 (job
B) may be journaled while seq 6 (job A) still waits on A's queue. The cursor is therefore a
watermark (every seq up to it is journaled: what an ``EventAck`` says and where the agent's
resend starts after a control restart) and the seqs journaled above it (``ahead``: dropped as
duplicates when the resend brings them again). It is journaled whole, in the transaction of
the effect it covers (services/control/job_store.py), so a restarted control applies each
event exactly once.
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
        """``seqs`` are journaled (their row committed)."""
        with self._lock:
            self._watermark, self._ahead = _advance(self._watermark, self._ahead | set(seqs))


def _advance(watermark: int, ahead: set[int]) -> tuple[int, set[int]]:
    while watermark + 1 in ahead:
        watermark += 1
        ahead.discard(watermark)
    return watermark, {s for s in ahead if s > watermark}


def parse_ahead(text: str) -> list[int]:
    """The ``ahead`` column as journaled ("" or a JSON list of seqs)."""
    return json.loads(text) if text else []
