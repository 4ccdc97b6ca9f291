"""Queues that bridge control's threads and its gRPC server's asyncio loop.

Bus handlers and the event applier run on threads; the session, watch and log handlers
run on the server's loop (``grpc.aio``). A :class:`LoopQueue` is ``put`` from any thread and
read with ``await get()`` on the loop; :func:`put_all` delivers many items with one wake-up
of each loop (a wake-up is a write to its self-pipe).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any


class LoopQueue:
    """A session's command queue as its asyncio handler reads it: ``put`` from any thread
    (bus handlers, the applier), ``get`` on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._queue = loop, asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: control is stopping, the stream is gone
            pass

    async def get(self) -> Any:
        return await self._queue.get()

    def empty(self) -> bool:
        return self._queue.empty()


def put_all(items: list[tuple[Any, Any]]) -> None:
    """``queue.put(item)`` for each ``(queue, item)``; the ``LoopQueue``s of one loop with
    a single ``call_soon_threadsafe``."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for q, item in items:
        if isinstance(q, LoopQueue):
            by_loop[q._loop].append((q._queue, item))
        else:
            q.put(item)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: control is stopping
            pass


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
