"""A decision's journal writes, in the order decided, and the commands held behind them (a part
of ``Orchestrator``, see core.py for the locks).

A job's JobEvents are emitted by the writer, once their write is committed, in journal
order (``_emitted``): a watcher never sees an event the journal could lose. No decision waits
for its journal write under the decision lock: it queues the write (``_write``) and its
commands to the ranks and the release of its resources (``_after_journal``: in the job's
``Outbox``, behind the job's last queued write), and returns; once the lock is let go, the
thread that decided waits for the writes it queued and sends the commands whose write is
committed (``_after_decision``), so a command still follows its record (as ``_send_again``
after a restart assumes) and a control killed before the commit loses the decision and its
commands together. An operator command's reply is made once its write is committed (the wait
is outside the lock), and raises the write's error if it failed.

``_record`` appends one event to a job's log (status and event in one write); ``_keep``
journals its bookkeeping without an event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from services.contract import control_pb2
from services.contract.bus import Reply
from services.control.orchestrator.job import _Job
from services.control.orchestrator.job_journal import _runtime

_log = structlog.get_logger("orchestrator")


class DecisionWrites:
    """A decision's journal writes and its held commands (a part of ``Orchestrator``, see core.py)."""

    def _keep(self, job: _Job) -> None:
        """Journal the job's bookkeeping (``_runtime``) without an event, with the cursor of
        the worker event being applied. Why: an event that changes only the bookkeeping (one
        rank of several finished or paused) was otherwise journaled as applied with no trace,
        and a control restarted before the last rank's event forgot it: it then took the
        finished rank's clean exit for a lost rank and relaunched a finished job (seen in
        tests/cli/test_restart.py)."""
        self._publish(job)
        if self._held_for_one_write(job.status, None, runtime := _runtime(job), None):  # (one_write.py; built once)
            return
        with self._journal_lock(job.status.job_id):
            self._queued(job.status.job_id, self._journal.save_status(job.status, None, runtime, wait=False))

    def _journal_lock(self, job_id: str) -> threading.RLock:
        return self._journal_locks.get(job_id) or self._journal_locks.setdefault(job_id, threading.RLock())

    def _write_later(self, job: _Job) -> threading.RLock:
        """Under the lock: the job's journal lock, taken (so no later decision's write of the
        job is queued before the caller's, queued after it lets the decision lock go); the
        caller queues them and releases it."""
        lock = self._journal_lock(job.status.job_id)
        lock.acquire()
        return lock

    def _record(
        self,
        job: _Job,
        source: int,
        kind: str,
        message: str,
        *,
        status_message: str | None = None,
        spec_json: str | None = None,
        later: list | None = None,
    ) -> None:
        """Append one event to the job's log: journal status + event atomically (with the
        job's new spec, ``spec_json``, when it changed), publish. ``later``: the write is
        appended there instead, for the caller to make after the decision lock
        (``_write_later``)."""
        now = time.time()
        s = job.status
        s.updated_unix = now
        if job.running_since:  # frozen at TERMINATED: no event follows that one
            s.elapsed_seconds = now - job.running_since
        if status_message is not None:
            s.message = status_message
        s.queue_position = self._queue.position(s.job_id)
        job.seq += 1
        event = control_pb2.JobEvent(
            job_id=s.job_id, seq=job.seq, unix_time=now, source=source, type=kind, message=message, status=s
        )
        job.last_persist = time.monotonic()
        self._publish(job)
        write = (event, _runtime(job), spec_json)
        if later is not None:
            later.append(write)
        else:
            self._write(*write)

    def _write(self, event: control_pb2.JobEvent, runtime: dict, spec_json: str | None = None) -> None:
        """Journal one event of ``_record`` (its status a copy made under the lock), under its
        job's journal lock; the event is emitted once committed. Not waited for under the
        decision lock (``_after_decision`` waits once the lock is let go)."""
        if self._held_for_one_write(event.status, event, runtime, spec_json):  # (one_write.py)
            return
        with self._journal_lock(event.job_id):
            future = self._journal.save_status(
                event.status, event, runtime, spec_json=spec_json, on_commit=self._emitted(event), wait=False
            )
            self._queued(event.job_id, future)

    def _queued(self, job_id: str, future: Future) -> None:
        """A journal write of the job was queued: the job's commands decided after it wait for
        it, and so does the decision (outside the lock); out of any decision (a restore),
        it is waited for now."""
        self._last_write[job_id] = future
        if not self._lock.held():
            future.result()
            return
        writes = getattr(self._decided, "writes", None)
        if writes is None:
            writes = self._decided.writes = []
        writes.append((job_id, future))

    def _after_journal(self, port: Callable[..., Any], only: tuple[type, ...] = ()) -> Callable[..., Any]:
        """``port`` (to the ranks, or the allocator for ``only`` its messages) as the orchestrator
        calls it: a message of a job, decided under the lock, waits in the job's outbox for the
        journal write queued before it and is sent once that is committed, after the lock is
        let go (``_after_decision``). Its reply is None: nothing waits for one."""

        def deferred(msg: Any, payload: Any = None) -> Any:
            job_id = getattr(msg, "job_id", "")
            if not job_id or (only and not isinstance(msg, only)):
                return port(msg, payload)
            after = self._last_write.get(job_id)
            self._outbox.put(job_id, after, lambda: port(msg, payload))
            # The deciding thread waits for that write too, then drains: a write nobody waits
            # for (a rank 0 step's) would otherwise leave the command until the job's next decision.
            if self._lock.held():
                jobs = getattr(self._decided, "jobs", None)
                if jobs is None:
                    jobs = self._decided.jobs = {}
                jobs.setdefault(job_id, after)
            else:
                self._after_decision(None, {job_id: after})
            return Reply(None)

        return deferred

    def _after_decision(self, error: BaseException | None, jobs: dict[str, Future | None] | None = None) -> None:
        """The decision lock was let go by this thread: wait for the journal writes its
        decision queued and those its commands wait for (``jobs``: job -> the first one), then
        send the commands they hold back (``Outbox.drain``). A write of the decision that
        failed is raised (the operator's reply says so) unless the decision raised."""
        writes, self._decided.writes = getattr(self._decided, "writes", None) or [], None
        commanded, self._decided.jobs = jobs or getattr(self._decided, "jobs", None) or {}, None
        undos, self._decided.undos = getattr(self._decided, "undos", None) or [], None
        failed: BaseException | None = None
        lost: dict[str, BaseException] = {}  # job id -> the first of its writes that failed
        for job_id, future in writes:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - raised below, once the commands committed are sent
                failed = failed or e
                lost.setdefault(job_id, e)
        for after in commanded.values():
            if after is not None:
                try:
                    after.result()
                except Exception:  # noqa: BLE001 - an earlier decision's write: its own caller says so
                    pass
        # (the jobs written too: a command another thread decided may wait for one of these writes)
        self._outbox.drain(dict.fromkeys([*commanded, *(job_id for job_id, _ in writes)]))
        if error is None:  # (a decision that raised undid itself: the handlers' own except paths)
            self._undo(undos, lost)
        if getattr(self._decided, "start", False):  # (the queue's head, asked for once the releases went)
            self._decided.start = False
            with self._lock:
                self._start_soon()
        if failed is not None and error is None:
            raise failed

    def _emitted(self, *events: control_pb2.JobEvent) -> Callable[[], None]:
        """What the journal's writer does once ``events`` are committed: log and emit them
        (on the writer's thread, in journal order; the emitter takes leaf locks only)."""

        def emit() -> None:
            for event in events:
                _log.info("job event", job_id=event.job_id, seq=event.seq, type=event.type, message=event.message)
                self._emit(event)

        return emit
