"""A two-ended read of a load's chunks (issue 27, item 4): the peer's memory from the front,
the store from the back, so a heal takes about the faster source's time, never the slower's.

The reader (``ChunkReader``) names every chunk of its load to its bulk source (the peer's
memory through the rank's agent, which streams them front to back) and, at the same time,
:class:`TailRead` reads the same list from its back from the authoritative source (the
store's files) on a few threads, each chunk verified (SHA-256, the reader's ``accept``) on
the thread that read it and held until the load takes it. Each chunk is claimed by one end:

* the tail stops where the front already has a chunk in hand (the ends met);
* the front (the load, in its order) claims a chunk when it needs it and waits for the bulk
  source to bring it, unless the tail can read no more (it met the front, or holds
  ``buffer_bytes`` the load has not taken yet): then the load reads that chunk from the
  store itself rather than wait (a peer that slowed down or died costs no more than the
  store does).

Read twice at most: the chunks the peer had on their way when the load took them from the
store (a bulk lane stops where the tail's end begins, ``tail_took``; the reader cancels the
bulk read when the load ends). Every chunk is still verified
exactly once before the load uses it, by whichever end read it; a chunk the tail could not
read right (missing, or wrong bytes) is asked of the peer, and the store's verdict stands if
the peer has no right copy either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

TAIL_BUFFER_BYTES = 512 << 20  # chunks the tail read that the load has not reached yet
_FRONT, _TAIL = "front", "tail"

Accept = Callable[[Any, str, int, bytes], bool]  # (source, sha, nbytes, data) -> verified (and counted)


class TailRead:
    """The store's end of a two-ended read.

    Args:
        order: the chunks (sha, nbytes) in the order the bulk source sends them.
        source: the authoritative source (``get(sha, nbytes)``).
        accept: verifies (and counts) one chunk's bytes; False when they are wrong.
        front_has: whether the bulk source has a chunk in hand (arrived).
        threads: reads in parallel (a disk wants several in flight).
        buffer_bytes: at most this many read bytes wait for the load.
    """

    def __init__(
        self,
        order: Sequence[tuple[str, int]],
        source: Any,
        accept: Accept,
        front_has: Callable[[str], bool],
        *,
        threads: int = 4,
        buffer_bytes: int = TAIL_BUFFER_BYTES,
    ):
        self._order = list(order)
        self._covered = {sha for sha, _ in self._order}
        self._source = source
        self._accept = accept
        self._front_has = front_has
        self._buffer_bytes = buffer_bytes
        self._next = len(self._order) - 1  # the next chunk from the back
        self._claimed: dict[str, str] = {}
        self._ready: dict[str, tuple[bool, bytes | None, BaseException | None]] = {}
        self._buffered = 0
        self._stopped = False
        self._cond = threading.Condition()
        self.tail_chunks = 0  # read by the tail
        self.stolen = 0  # read from the store by the front (the bulk source had not brought them)
        for _ in range(max(1, threads)):
            threading.Thread(target=self._run, name="chunk-tail", daemon=True).start()

    def covers(self, sha: str) -> bool:
        return sha in self._covered

    # -- the front (the load's threads)

    def claim(self, sha: str) -> bool:
        """The front takes ``sha`` (True), or the tail has it (False: :meth:`take` it)."""
        with self._cond:
            if self._claimed.get(sha) == _TAIL:
                return False
            self._claimed[sha] = _FRONT
            return True

    def take(self, sha: str) -> tuple[bool, bytes | None]:
        """The tail's read of ``sha`` (waits for it): (verified, its bytes or None). Raises
        what the source raised."""
        with self._cond:
            while sha not in self._ready:
                self._cond.wait()
            ok, data, error = self._ready.pop(sha)
            # A chunk that occurs twice in the load (the same bytes in two places: zero-filled
            # tensors) is handed over once; its next claim is the front's, which reads it again,
            # not a wait on the tail's copy already taken (that wait never ended).
            self._claimed[sha] = _FRONT
            if ok and data is not None:
                self._buffered -= len(data)
                self._cond.notify_all()
        if error is not None:
            raise error
        return ok, data

    def wait_front(self, sha: str, resolved: Callable[[str], bool]) -> bool:
        """Wait until the bulk source has resolved ``sha`` (brought it or said it lacks it:
        True), or until the tail can read no more (False: read it from the store now)."""
        with self._cond:
            while True:
                if resolved(sha):
                    return True
                if self._stopped or self._next < 0 or self._buffered >= self._buffer_bytes:
                    self.stolen += 1
                    return False
                self._cond.wait(0.5)  # (woken by the bulk source's arrivals: notify)

    def tail_took(self, sha: str) -> bool:
        """Whether the tail claimed ``sha`` (then it claimed every chunk after it too: it reads
        a contiguous end of the list): the bulk source may stop before it."""
        with self._cond:
            return self._claimed.get(sha) == _TAIL

    def notify(self) -> None:
        """The bulk source brought something (or ended): a waiting front looks again."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """The load is over: the tail reads no more; what it holds is dropped."""
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()

    # -- the tail

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._next >= 0 and self._buffered >= self._buffer_bytes:
                    self._cond.wait()
                if self._stopped or self._next < 0:
                    self._cond.notify_all()  # (a front waiting for the tail to finish)
                    return
                sha, n = self._order[self._next]
                if sha in self._claimed or self._front_has(sha):
                    self._next = -1  # the ends met
                    self._cond.notify_all()
                    return
                self._next -= 1
                self._claimed[sha] = _TAIL
                self._buffered += n
            data: bytes | None = None
            ok, error = False, None
            try:
                data = self._source.get(sha, n)
                ok = data is not None and self._accept(self._source, sha, n, data)
            except Exception as e:  # noqa: BLE001 - the load raises it when it takes this chunk
                error = e
            with self._cond:
                self.tail_chunks += ok
                if not ok:
                    self._buffered -= n
                if not self._stopped:
                    self._ready[sha] = (ok, data, error)
                elif ok:
                    self._buffered -= n
                self._cond.notify_all()
