"""L4-2 prefetcher (多线程预加载器): the data path's only reader of token files.

Why it no longer reads the split up front
-----------------------------------------
The data path used to read the whole split into memory for every stream, so that the
shuffler could order it globally and the packer cut every row of the epoch, only for the
rank to keep 1/dp of them: data-service memory grew with corpus size times world size. Now
what flows down the path is references (``documents.py``): on ``ActivateSource`` the
prefetcher opens the split's token file and hands on a :class:`~services.data.documents.Catalog`
(the split's document bounds, which the version already holds, and a :class:`TokenReader`,
its read handle). The shuffler orders documents, the filter judges them and the packer cuts
and orders rows on those references (the sample index, ``sample_index.py``); tokens are read
last, through the handle, and only those of the rows the stream's rank trains (and, once per
filter rule set, a scan for banned tokens). The data position stays one global cursor.

Reads: ``os.pread`` on the file's descriptor (a version in object storage: positioned reads
through the process's bounded block cache, ``block_cache.py``, the same typed
``DataReadError`` when one fails), never a memory map of the token file (mapped
pages count against the service's address space and resident memory: the service must run
in bounded memory whatever the corpus). They run on the IO pool the composition root shares
among all streams; ``SetPrefetch.threads`` bounds the reads in flight for one stream, and
``SetPrefetch.watermark`` the reads one request queues at once (a batch's rows). Both come
from L2-1; the prefetcher never adapts them.

Pinned bytes (issue 29 item 7): a local split's token file was found to hash to the
manifest's SHA-256 when L4-1 opened it (``manifest.verify_shard``). Every read first stats
the file's path (about a microsecond; docs/LOG.md "shard digest check"): an identity other
than the one checked (rewritten in place, or another file renamed over it) hashes the file
again, and bytes other than the pinned ones fail the read with ``DatasetCorrupt``
(FAILURE_DATA_CORRUPT: the fault class data_corrupt, which pauses the job by default),
naming the version and the shard. A path gone (the version's directory removed) is no
change of bytes: the open descriptor still reads the checked file, and the next mount names
the missing directory.

Commands it takes: ``set_prefetch`` (L2-1), ``activate_source`` (L4-1). It publishes
``SamplesRead`` (payload :class:`~services.data.documents.Catalog`, to the shuffler).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.contract.frozen import FrozenConfig
from services.data import manifest as mf
from services.data.documents import Catalog, TokenStore
from services.data.errors import ConfigAlreadyPushed, DataReadError, InvalidConfig


class TokenReader:
    """Positioned reads of one split's token file for one stream (the payload's read handle).

    ``read`` runs on the calling thread; ``read_many`` and ``chunks`` on the shared IO pool,
    at most ``threads`` reads of this stream in flight.
    """

    def __init__(self, store: TokenStore, pool: Executor, threads: int, watermark: int):
        self._store = store
        self._pool = pool
        self._slots = threading.BoundedSemaphore(threads)
        self._threads = threads
        self._watermark = watermark
        # A remote version's token file is read through the block cache (no descriptor).
        self._remote = store.remote
        self._fd = os.open(store.tokens_path, os.O_RDONLY) if self._remote is None else -1
        self._closed = False
        # The token file's identity when its bytes last hashed to the manifest's (None: not
        # pinned here, e.g. a remote version or a store built by hand in a test).
        self._verified = store.verified if store.tokens_sha256 else None
        self._verify_lock = threading.Lock()

    @property
    def dtype(self) -> np.dtype:
        return self._store.dtype

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the split (one ``pread``; for a remote
        version, the blocks' reads through the cache, fetching those it misses).

        Raises:
            DataReadError: the file is shorter than its index says, or unreadable.
            DatasetCorrupt: the file's bytes are no longer the ones its manifest pinned.
        """
        self._check_pinned()
        return self._read(start, count)

    def _check_pinned(self) -> None:
        """Stat the token file; hash it again only if its identity changed (module docstring)."""
        if self._verified is None:
            return
        try:
            now = mf.identity(self._store.tokens_path)
        except FileNotFoundError:
            return  # removed: the descriptor still reads the checked bytes (module docstring)
        if now == self._verified:
            return
        with self._verify_lock:  # (one hash for the reads that found it together)
            if now != self._verified:
                name = self._store.tokens_path.name
                self._verified = mf.verify_shard(
                    self._store.tokens_path, name, self._store.tokens_sha256, self._store.dataset
                )

    def _read(self, start: int, count: int) -> np.ndarray:
        itemsize = self._store.dtype.itemsize
        want = count * itemsize
        try:
            if self._remote is not None:
                raw = self._remote.read(start * itemsize, want) if want else b""
            else:
                raw = os.pread(self._fd, want, start * itemsize) if want else b""
        except DataReadError as e:  # the cache's, naming the object: the same typed failure
            raise DataReadError(f"dataset {self._store.dataset}: {e}") from None
        except OSError as e:
            raise DataReadError(
                f"dataset {self._store.dataset}: {self._store.tokens_path.name}: read failed at token {start} ({e})"
            ) from None
        if len(raw) != want:
            raise DataReadError(
                f"dataset {self._store.dataset}: {self._store.tokens_path.name}: short read at token {start} "
                f"(expected {want} bytes, got {len(raw)})"
            )
        return np.frombuffer(raw, dtype=self._store.dtype)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """``read`` of every ``(start, count)``, in order, on the IO pool."""
        if len(ranges) <= 1:
            return [self.read(*r) for r in ranges]
        self._check_pinned()  # (once for the batch's rows)
        out: list[np.ndarray] = []
        for lo in range(0, len(ranges), self._watermark):
            futures = [self._submit(start, count) for start, count in ranges[lo : lo + self._watermark]]
            out.extend(_results(futures))
        return out

    def chunks(self, chunk_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
        """The whole split in order, ``(first token, tokens)`` per chunk of at most
        ``chunk_tokens``, ``threads`` chunks read ahead (bounded memory)."""
        total = int(self._store.bounds_n1[-1])
        starts = range(0, total, chunk_tokens)
        pending: list[tuple[int, Future]] = []
        try:
            for start in starts:
                self._check_pinned()
                pending.append((start, self._submit(start, min(chunk_tokens, total - start))))
                if len(pending) >= self._threads:
                    first, f = pending.pop(0)
                    yield first, f.result()
            while pending:
                first, f = pending.pop(0)
                yield first, f.result()
        finally:
            _results([f for _, f in pending], wait_only=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)

    def _submit(self, start: int, count: int) -> Future:
        self._slots.acquire()  # at most `threads` reads of this stream in flight

        def run() -> np.ndarray:
            try:
                return self._read(start, count)
            finally:
                self._slots.release()

        try:
            return self._pool.submit(run)
        except BaseException:
            self._slots.release()
            raise


def _results(futures: list[Future], wait_only: bool = False) -> list[np.ndarray]:
    # Every read finishes before its fd may close; the first error is raised after that.
    error, out = None, []
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others ended
            error = error or e
    if error is not None and not wait_only:
        raise error
    return out


class Prefetcher:
    """Opens a split for one stream and hands its catalog on; reads on request."""

    def __init__(self, emit: Emitter, io_pool: Executor | None = None):
        self._emit = emit
        # Pushed once per stream (seed L4-2 red line 4: parameters all come from above and
        # are never adjusted here); the composition root builds one prefetcher per stream.
        self._spec = FrozenConfig[data_pb2.SetPrefetch](
            "L4_PREFETCHER", "prefetch watermark and threads (SetPrefetch)", error=ConfigAlreadyPushed
        )
        self._shared_pool = io_pool  # the composition root's, shared by all streams
        self._own_pool: ThreadPoolExecutor | None = None
        self._reader: TokenReader | None = None
        # "idle" | "serving" (the split's catalog handed on; reads on request) | "closed"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def set_prefetch(self, msg: data_pb2.SetPrefetch, payload: object = None) -> None:
        """Fix the reads: at most ``threads`` in flight for this stream, ``watermark`` queued
        by one request.

        Raises:
            InvalidConfig: either is 0.
            ConfigAlreadyPushed: the prefetch was already set (pushed once per stream).
        """
        self._spec.require_unset()
        for name in ("watermark", "threads"):
            if getattr(msg, name) <= 0:
                raise InvalidConfig(f"prefetch.{name}: must be > 0, got {getattr(msg, name)}")
        self._spec.set(msg)
        if self._shared_pool is None:  # a prefetcher on its own (tests): a pool of its own
            self._own_pool = ThreadPoolExecutor(max_workers=msg.threads, thread_name_prefix="prefetch")

    def activate_source(self, msg: data_pb2.ActivateSource, store: TokenStore) -> None:
        """Open ``store``'s token file and publish its catalog as ``SamplesRead`` (count: the
        split's documents). Reads nothing yet.

        Raises:
            InvalidConfig: no ``SetPrefetch`` came first.
            DataReadError: the token file cannot be opened.
        """
        if not self._spec.is_set:
            raise InvalidConfig("prefetch: activate_source before set_prefetch")
        spec = self._spec.get()
        pool = self._shared_pool or self._own_pool
        try:
            self._reader = TokenReader(store, pool, spec.threads, spec.watermark)
        except OSError as e:
            raise DataReadError(f"dataset {store.dataset}: {store.tokens_path.name}: cannot open ({e})") from None
        self._state = "serving"
        self._emit(data_pb2.SamplesRead(count=store.num_documents), Catalog(store, self._reader))

    # ---- lifecycle (composition root) -------------------------------------------------

    def close(self) -> None:
        """End of the stream: the file closes (reads in flight finished with their request)."""
        self._state = "closed"
        if self._reader is not None:
            self._reader.close()
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=False, cancel_futures=True)
