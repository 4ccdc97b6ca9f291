"""Per-job JobEvent subscribers (``WatchHub``): what ``WatchJob`` streams read, fed by the
orchestrator's events (no polling)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from services.contract import control_pb2


class WatchHub:
    """Per-job subscriber queues fed by the orchestrator's JobEvent (as EXT_USER)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subscribers: dict[str, set[Any]] = defaultdict(set)

    def on_job_event(self, msg: control_pb2.JobEvent, payload: Any = None) -> None:
        with self._lock:
            for q in self._subscribers.get(msg.job_id, ()):
                q.put(msg)

    def subscribe(self, job_id: str, q: Any) -> None:
        """``q`` (anything with a thread-safe ``put``) receives each JobEvent of ``job_id``."""
        with self._lock:
            self._subscribers[job_id].add(q)

    def unsubscribe(self, job_id: str, q: Any) -> None:
        with self._lock:
            self._subscribers[job_id].discard(q)
            if not self._subscribers[job_id]:
                del self._subscribers[job_id]
