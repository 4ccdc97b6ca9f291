"""A bounded local block cache in front of token files kept in object storage.

A remote version's token file is never downloaded whole (a split may be terabytes): it is
read in fixed-size blocks (``block_bytes``, 8 MiB by default), each fetched with one ranged
GET (fsspec ``cat_file(path, start, end)``) and kept as a file of its own under
``<data_root>/.cache/blocks/``. The files are named by the token file's SHA-256 (from the
manifest), the block size and the block's number: a version is immutable, so a block never
goes stale, and two versions with the same file share its blocks. A restart adopts the
blocks left (least recently read first) and drops partial ones.

The directory never holds more than ``capacity_bytes``: room is made for a block before it
is fetched (the least recently used blocks go first), and a block being read is pinned so
it is not deleted under its reader. Concurrent misses of one block are fetched once (the
others wait for it). A fetch that fails or comes back short is retried with exponential
backoff (``attempts``); after the last it raises :class:`DataReadError` (FAILURE_IO), the
same typed path as a failed local read. Memory stays at most one block per read in flight.

One cache per process (the composition root's), shared by every stream.

Prometheus (the data service's /metrics): ``surge_data_cache_hits_total`` (block reads the
cache held, a read that waited for another's fetch included) and
``surge_data_cache_misses_total`` (blocks fetched: their hit ratio is
``hits / (hits + misses)`` over a window), ``surge_data_cache_fetched_bytes_total``,
``surge_data_cache_evictions_total``, and the gauges ``surge_data_cache_bytes`` (held plus
reserved for fetches in flight) and ``surge_data_cache_capacity_bytes`` (0: no cache, a
data service without ``--remote``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from services.data.errors import DataReadError, InvalidConfig

CACHE_DIR = ".cache/blocks"  # under the data root
BLOCK_BYTES = 8 << 20
CAPACITY_BYTES = 2 << 30
_TMP = ".part"

HITS = Counter("surge_data_cache_hits_total", "Block reads the data service's block cache held.")
MISSES = Counter("surge_data_cache_misses_total", "Blocks the data service's block cache fetched (misses).")
FETCHED_BYTES = Counter("surge_data_cache_fetched_bytes_total", "Bytes the block cache fetched from object storage.")
EVICTIONS = Counter("surge_data_cache_evictions_total", "Blocks the block cache evicted to make room.")
# Read when scraped (set_function) from the newest cache (one per process; tests build more).
HELD_BYTES = Gauge("surge_data_cache_bytes", "Bytes the block cache holds (and has reserved for fetches in flight).")
CAPACITY_BYTES_GAUGE = Gauge("surge_data_cache_capacity_bytes", "The block cache's bound in bytes (0: no cache).")


@dataclass(frozen=True)
class RemoteFile:
    """One immutable object: where it is (``fs``, ``path``), its manifest size and SHA-256
    (the cache's key), and the ``url`` messages name."""

    fs: object
    path: str
    size: int
    sha256: str
    url: str


@dataclass(frozen=True)
class CachedFile:
    """A remote file as a reader sees it: positioned reads through the cache."""

    cache: BlockCache
    file: RemoteFile

    @property
    def url(self) -> str:
        return self.file.url

    def read(self, offset: int, length: int) -> bytes:
        return self.cache.read(self.file, offset, length)


class BlockCache:
    """LRU cache of fixed-size blocks of remote files, on local disk, bounded. Thread-safe."""

    def __init__(
        self,
        directory: Path,
        block_bytes: int = BLOCK_BYTES,
        capacity_bytes: int = CAPACITY_BYTES,
        attempts: int = 4,
        backoff_s: float = 0.2,
    ):
        if block_bytes <= 0:
            raise InvalidConfig(f"cache block size: must be > 0, got {block_bytes}")
        if capacity_bytes < block_bytes:
            raise InvalidConfig(f"cache capacity: must hold one block ({block_bytes} bytes), got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._cond = threading.Condition()
        self._blocks: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recent first
        self._pins: dict[str, int] = {}
        self._fetching: dict[str, threading.Event] = {}
        self._used = 0  # bytes of the blocks held plus the room reserved for fetches
        self.fetches = 0  # ranged GETs that succeeded (for tests and the bench)
        self._recover()
        ref = weakref.ref(self)
        HELD_BYTES.set_function(lambda: float(c.used_bytes()) if (c := ref()) is not None else 0.0)
        CAPACITY_BYTES_GAUGE.set_function(lambda: float(c.capacity_bytes) if (c := ref()) is not None else 0.0)

    def read(self, file: RemoteFile, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``file``, block by block (a range may span
        several).

        Raises:
            DataReadError: the range lies past the file's end, or a block could not be
                fetched whole after the retries.
        """
        if offset < 0 or offset + length > file.size:
            raise DataReadError(f"{file.url}: range {offset}+{length} past its end ({file.size} bytes)")
        out = bytearray(length)
        view = memoryview(out)
        done = 0
        while done < length:
            pos = offset + done
            index, within = divmod(pos, self.block_bytes)
            n = min(length - done, self.block_bytes - within)
            name = self._pin(file, index)
            try:
                fd = os.open(self._dir / name, os.O_RDONLY)
                try:
                    got = os.preadv(fd, [view[done : done + n]], within)
                finally:
                    os.close(fd)
            except OSError as e:
                raise DataReadError(f"{file.url}: cached block {index} unreadable ({e})") from None
            finally:
                self._unpin(name)
            if got != n:
                raise DataReadError(f"{file.url}: cached block {index} short (expected {n} bytes past {within})")
            done += n
        return bytes(out)

    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    # ---- private ----------------------------------------------------------------------

    def _pin(self, file: RemoteFile, index: int) -> str:
        """The block's file name, present and pinned (fetched first on a miss)."""
        name = f"{file.sha256}.{self.block_bytes}.{index}"  # (a block size changed: other names)
        start = index * self.block_bytes
        want = min(self.block_bytes, file.size - start)
        while True:
            with self._cond:
                if name in self._blocks:
                    self._blocks.move_to_end(name)
                    self._pins[name] = self._pins.get(name, 0) + 1
                    HITS.inc()
                    return name
                waiting = self._fetching.get(name)
                if waiting is None:  # this thread fetches it; the others wait on the event
                    waiting = self._fetching[name] = threading.Event()
                    self._reserve(want)
                    mine = True
                else:
                    mine = False
            if not mine:
                waiting.wait()
                continue  # present now, or the fetch failed and this thread tries in turn
            try:
                self._fetch(file, start, want, name)
            except BaseException:
                with self._cond:
                    self._used -= want
                    del self._fetching[name]
                    self._cond.notify_all()
                waiting.set()
                raise
            MISSES.inc()
            FETCHED_BYTES.inc(want)
            with self._cond:
                self._blocks[name] = want
                self._pins[name] = self._pins.get(name, 0) + 1
                del self._fetching[name]
                self._cond.notify_all()
            waiting.set()
            return name

    def _unpin(self, name: str) -> None:
        with self._cond:
            left = self._pins[name] - 1
            if left:
                self._pins[name] = left
            else:
                del self._pins[name]
                self._cond.notify_all()  # it may be evicted now

    def _reserve(self, size: int) -> None:
        """Make room for ``size`` bytes (caller holds the lock): evict unpinned blocks, least
        recently used first; wait while the rest are pinned or being fetched."""
        while self._used + size > self.capacity_bytes:
            victim = next((n for n in self._blocks if n not in self._pins), None)
            if victim is None:
                self._cond.wait()  # a reader unpins or a fetch ends soon: neither waits on us
                continue
            self._used -= self._blocks.pop(victim)
            (self._dir / victim).unlink(missing_ok=True)
            EVICTIONS.inc()
        self._used += size

    def _fetch(self, file: RemoteFile, start: int, want: int, name: str) -> None:
        """One ranged GET into the block's file, checked by size, retried with backoff."""
        tmp = self._dir / (name + _TMP)
        error = ""
        for attempt in range(self._attempts):
            if attempt:
                time.sleep(self._backoff_s * (2 ** (attempt - 1)))
            try:
                data = file.fs.cat_file(file.path, start=start, end=start + want)
            except FileNotFoundError:
                raise DataReadError(f"{file.url}: missing from the object store") from None
            except Exception as e:  # noqa: BLE001 - s3fs's OSErrors and botocore's own: retried
                error = f"{type(e).__name__}: {e}"
                continue
            if len(data) != want:
                error = f"got {len(data)} bytes of {want}"
                continue
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._dir / name)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise DataReadError(f"{file.url}: block {start // self.block_bytes}: cannot cache ({e})") from None
            with self._cond:
                self.fetches += 1
            return
        raise DataReadError(
            f"{file.url}: block {start // self.block_bytes} unreadable after {self._attempts} attempts ({error})"
        )

    def _recover(self) -> None:
        """Adopt the blocks a previous run left (oldest access first), drop partial ones, and
        cut down to the capacity (it may have been lowered)."""
        held = []
        for p in self._dir.iterdir():
            if not p.is_file():
                continue
            if p.name.endswith(_TMP):
                p.unlink(missing_ok=True)
                continue
            st = p.stat()
            held.append((st.st_atime, p.name, st.st_size))
        for _, name, size in sorted(held):
            self._blocks[name] = size
            self._used += size
        with self._cond:
            self._reserve(0)
