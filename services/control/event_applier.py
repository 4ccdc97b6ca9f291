"""The one thread that applies every node agent session's messages (``EventApplier``)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from services.contract import control_pb2
from services.control.metrics import APPLIER_LAG
from services.control.session_hub import AgentSession, SessionHub

_log = structlog.get_logger("control.server")


class EventApplier:
    """The one thread that applies every node agent session's messages, in the order the
    server's loop read them (so each session's own order), and opens and closes sessions
    in that same order (a session's exit reports come before its close).

    Messages are applied a burst at a time (``SessionHub.on_worker_events``: up to
    ``max_burst`` queued back to back), so a burst's effect-less cursors cost one commit.
    The thread starts with the first item (an in-process control that serves no gRPC
    starts none).

    Receipt is stamped on the server's loop, as a message is queued (``event``): a
    heartbeat carries it to the fault detector in ``RankHeartbeat.received_monotonic``, so
    its deadlines count from when control received the beat, never from when this thread
    got to it; ``surge_control_applier_lag_seconds`` is the wait of each burst's oldest
    message between the two.

    Args:
        hub: the sessions it applies to.
        max_burst: most messages applied before their cursors are journaled and acked.
    """

    def __init__(self, hub: SessionHub, max_burst: int = 1024):
        self._hub, self._max_burst = hub, max_burst
        # (session, event, received monotonic) | (None, callable) | None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def event(self, session: AgentSession, ev: control_pb2.WorkerEvent) -> None:
        """Queue one message of ``session``'s stream, stamped with its receipt (a
        heartbeat's ``received_monotonic``)."""
        received = time.monotonic()
        if ev.HasField("rank_event") and ev.rank_event.HasField("heartbeat"):
            ev.rank_event.heartbeat.received_monotonic = received
        self._put((session, ev, received))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the applier thread, after everything queued before it."""
        self._put((None, fn))

    async def open(self, reg: control_pb2.WorkerRegistration, commands: Any) -> AgentSession:
        """``SessionHub.open`` on the applier thread; awaited on the server's loop. If the
        caller is cancelled meanwhile, the session is closed again."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future = loop.create_future()

        def deliver(result: AgentSession | BaseException) -> None:
            if opened.cancelled():
                if isinstance(result, AgentSession):
                    self.call(lambda: self._hub.close(result, reason="session cancelled while opening"))
            elif isinstance(result, BaseException):
                opened.set_exception(result)
            else:
                opened.set_result(result)

        def do() -> None:
            try:
                result: AgentSession | BaseException = self._hub.open(reg, commands)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                result = e
            loop.call_soon_threadsafe(deliver, result)

        self.call(do)
        return await opened

    def close(self, session: AgentSession, reason: str = "session closed") -> None:
        """``SessionHub.close`` after the messages of ``session`` already queued."""
        self.call(lambda: self._hub.close(session, reason))

    def stop(self) -> None:
        """End the thread after what is queued (idempotent)."""
        with self._start_lock:  # (not while a first event is starting the thread)
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10.0)

    def _put(self, item: tuple) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name="event-applier", daemon=True)
                    thread.start()
                    self._thread = thread  # (published started: a stop on another thread joins it)
        self._queue.put(item)

    def _run(self) -> None:
        get, burst, oldest = self._queue.get, [], 0.0
        while True:
            item = get()
            while True:
                if item is None:
                    self._flush(burst, oldest)
                    return
                if item[0] is None:
                    self._flush(burst, oldest)
                    burst = []
                    try:
                        item[1]()
                    except Exception:  # noqa: BLE001 - the thread must outlive one bad call
                        _log.exception("session open/close failed")
                else:
                    if not burst:
                        oldest = item[2]
                    burst.append((item[0], item[1]))
                if len(burst) >= self._max_burst or self._queue.empty():
                    break
                item = get()
            if burst:
                self._flush(burst, oldest)
                burst = []

    def _flush(self, burst: list, received: float = 0.0) -> None:
        if not burst:
            return
        if received:
            APPLIER_LAG.observe(max(0.0, time.monotonic() - received))
        try:
            self._hub.on_worker_events(burst)
        except Exception:  # noqa: BLE001 - e.g. the journal's disk is full: the acks wait
            _log.exception("worker event burst failed", size=len(burst))
