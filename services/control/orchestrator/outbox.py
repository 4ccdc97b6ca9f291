"""A decision's commands wait for its journal write (``Outbox``): a command to a job's ranks
(or the release of its resources) is queued, under the decision lock, behind the job's last
journal write, and sent only once that write is committed, in the order decided, with no
lock of the orchestrator held.

Why: a decision used to wait for its write's commit under the decision lock (every other
job's decisions waited for the disk) so that its commands followed their record: a control
killed between the decision and the commit must lose the decision and its commands together
(``_send_again`` after a restart sends again only what the journal holds). Now the decision
queues its write and its commands and returns; the thread that made it waits for its writes
outside the lock and then sends what is ready (``drain``). A command tied to a write that
failed is not sent (nothing goes out that the journal does not hold); the ones after it are.

Who sends: any thread that finished a decision drains the jobs it touched; only one thread
drains a job at a time, and one that finds the job being drained leaves it to that thread,
which looks again before it stops (``_again``), so a drain never blocks on another (a command
sent may come back, in process, as a decision on the same thread, which drains too). An
entry whose write is not committed yet stops its job's drain: the thread that queued that
write drains once it is committed. Not on the journal's writer thread: a command may call
back into the orchestrator, whose decisions wait on that thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import structlog

from services.control.metrics import OUTBOX_DEPTH

_log = structlog.get_logger("orchestrator.outbox")


class Outbox:
    """Per job: commands waiting for the journal write queued before them. Thread-safe (one
    leaf lock; nothing is called under it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque[tuple[Future | None, Callable[[], object]]]] = {}
        self._draining: set[str] = set()
        self._again: set[str] = set()

    def put(self, job_id: str, after: Future | None, command: Callable[[], object]) -> None:
        """Queue ``command`` for the job, to be called once ``after`` (None: nothing) is done."""
        with self._lock:
            self._queues.setdefault(job_id, deque()).append((after, command))
        OUTBOX_DEPTH.inc()

    def waiting(self, job_id: str) -> int:
        """How many of the job's commands are not sent yet."""
        with self._lock:
            return len(self._queues.get(job_id, ()))

    def drain(self, job_ids: Iterable[str]) -> None:
        """Send, in order, each job's commands whose write is committed (see the module
        docstring). Call with no orchestrator lock held."""
        for job_id in job_ids:
            self._drain(job_id)

    def _drain(self, job_id: str) -> None:
        with self._lock:
            if job_id in self._draining:
                self._again.add(job_id)  # (that thread looks again before it stops)
                return
            self._draining.add(job_id)
        while True:
            command = self._next(job_id)
            if command is None:
                with self._lock:
                    if job_id not in self._again:
                        self._draining.discard(job_id)
                        if not self._queues.get(job_id):
                            self._queues.pop(job_id, None)
                        return
                    self._again.discard(job_id)
                continue
            try:
                command()
            except Exception:  # noqa: BLE001 - as a command sent under the lock was: logged, the rest go on
                _log.exception("command after the journal write failed", job_id=job_id)

    def _next(self, job_id: str) -> Callable[[], object] | None:
        """The job's next command to send (None: none ready); a command whose write failed
        is dropped."""
        while True:
            with self._lock:
                queue = self._queues.get(job_id)
                if not queue:
                    return None
                after, command = queue[0]
                if after is not None and not after.done():
                    return None
                queue.popleft()
            OUTBOX_DEPTH.dec()
            if after is None or after.exception() is None:
                return command
            _log.error("command not sent: its journal write failed", job_id=job_id, error=str(after.exception()))
