"""The global sample index (Megatron-LM GPTDataset's doc/sample/shuffle indices), on disk.

What it replaces: every stream used to read the whole split, shuffle it, filter it and cut
every row of the epoch in memory, to keep 1/dp of the rows. The index holds the same global
sample sequence as arrays of *references*, built once per (dataset version, split, sequence
length, pack mode, separator, seed, shuffle, filter rules) and epoch, and memory-mapped by
every stream: a stream seeks to (epoch, row) in O(1) and reads the tokens of its own rows
only (the prefetcher's ``TokenReader``).

The sequence is exactly the one the in-memory pipeline produced (so checkpointed positions
stay valid; ``tests/data/test_sample_index.py`` proves it against that algorithm):

* the shuffler's ``epoch_order(seed, epoch, N, shuffle)`` orders the split's documents;
* the filter's keep mask (by storage id) drops documents; what is left, in that order, is
  ``doc_idx``;
* the packer's rows: PACK, the documents back to back, each followed by the separator
  (unless -1), rows of ``seq_len + 1`` tokens every ``seq_len`` tokens (consecutive rows
  share their boundary token), the last one shorter; PAD, one document per row, a longer
  one continuing on the next row (again sharing the boundary token). Row r is
  ``sample_idx[r] = (position in doc_idx, offset in that document's unit, tokens)``: the
  unit is the document plus its separator (PACK) and the row runs on into the units after
  it; ``tokens`` is the row's length (``<= seq_len + 1``);
* ``row_order(seed, epoch, R, shuffle)`` is ``shuffle_idx``: the k-th row the global
  stream takes in the epoch is ``sample_idx[shuffle_idx[k]]``.

Files, under ``<data_root>/.index/<name>/<version>/<key>/`` (next to the version, outside
its immutable directory; ``key`` hashes everything the sequence depends on, see
:func:`index_key`)::

    epoch-<e>/doc_idx.npy      int64 [K]     kept documents (storage ids) in epoch order
    epoch-<e>/sample_idx.npy   int64 [R, 3]  (doc_idx position, offset, tokens) per row
    epoch-<e>/shuffle_idx.npy  int64 [R]     row order
    epoch-<e>/meta.json        {"format": FORMAT, "rows": R, "documents": K, "tokens": T, "key": {...}}

An epoch is built the first time a stream needs it, in a temporary directory renamed into
place (atomic), under an ``fcntl`` lock on ``<key>/.epoch-<e>.lock`` so that streams opening
together build it once. ``meta.json`` is written last and names :data:`FORMAT`; a directory
without it, naming another format, or with a file short of its counts, is rebuilt (the files
are derived data and not fsynced: see :func:`open_epoch`). When a repeating stream opens
epoch e, epoch e + 1 is built ahead on a background thread (:func:`build_ahead`), so only a
job's very first epoch is ever built while a stream waits.

Time: the build is two permutations (``permutation.py``: sorted on two threads, see
``batch_packer._build``) and linear passes over documents and rows; ~1 s for a 20 GB
corpus (5 M documents and rows, ``bench/data_plane.py``).

Memory: building needs O(N + R) integers (documents and rows, not tokens), cut in chunks; the
streams of a process share one read-only mapping of each file (:func:`mapped`), so what
they touch is resident once: at most the index's size (tens of bytes per document and row),
whatever the number of streams.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import shutil
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.contract import data_pb2

# The sample-sequence format (DataPosition.format): positions (epoch, row) into the sequence
# described above. A checkpoint written before the field existed carries "": the same
# sequence (the in-memory pipeline's), which this index reproduces exactly.
FORMAT = "rows-v1"
COMPATIBLE = frozenset({"", FORMAT})

INDEX_DIR = ".index"  # under the data root; a name the version registry skips (leading dot)
_FILES = ("doc_idx", "sample_idx", "shuffle_idx")
CHUNK = 1 << 20  # rows or documents cut at a time


def index_key(
    *,
    manifest_sha256: str,
    split: str,
    seq_len: int,
    mode: int,
    separator: int,
    seed: int,
    shuffle: bool,
    row_seed: int,
    row_shuffle: bool,
    rules: data_pb2.FilterRules,
) -> dict:
    """Everything the sample sequence depends on (JSON-able; :func:`key_name` hashes it):
    the document order's seed and switch (ShufflePlan) and the row order's (PackerConfig;
    the relay fills them from the same plan)."""
    return {
        "format": FORMAT,
        "manifest_sha256": manifest_sha256,
        "split": split,
        "seq_len": int(seq_len),
        "mode": data_pb2.PackMode.Name(mode),
        "separator": int(separator),
        "seed": int(seed) if shuffle else 0,  # without the shuffle the seed changes nothing
        "shuffle": bool(shuffle),
        "row_seed": int(row_seed) if row_shuffle else 0,
        "row_shuffle": bool(row_shuffle),
        "filter": {
            "min_tokens": int(rules.min_tokens),
            "max_tokens": int(rules.max_tokens),
            "banned": sorted({*rules.banned_bytes, *(int(t) for t in rules.banned_tokens)}),
        },
    }


def key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def count_rows(lengths: np.ndarray, seq_len: int, mode: int, separator: int) -> int:
    """How many rows :func:`cut_rows` cuts from documents of these lengths: a function of
    which documents are kept, not of their order (so the row order can be drawn while the
    document order still sorts, see ``batch_packer.py``)."""
    L = int(seq_len)
    lengths = np.asarray(lengths, dtype=np.int64)
    if mode == data_pb2.PACK:
        T = int(lengths.sum()) + (len(lengths) if separator >= 0 else 0)
        return -(-(T - 1) // L) if T >= 2 else 0
    return int(np.maximum(0, (lengths - 1 + L - 1) // L).sum())


def cut_rows(lengths_K: np.ndarray, seq_len: int, mode: int, separator: int) -> np.ndarray:
    """The epoch's rows in stream order from its kept documents' lengths (in epoch order):
    int64 [R, 3] (doc_idx position, offset in the unit, tokens). See the module docstring.
    Linear passes, no search; columns filled ``CHUNK`` rows at a time (the temporaries stay
    small next to the result)."""
    L = int(seq_len)
    lengths = np.asarray(lengths_K, dtype=np.int64)
    K = len(lengths)
    if mode == data_pb2.PACK:
        starts = np.zeros(K + 1, np.int64)  # where each unit (document + separator) starts
        np.cumsum(lengths, out=starts[1:])
        if separator >= 0:
            starts[1:] += np.arange(1, K + 1, dtype=np.int64)
        T = int(starts[-1])
        R = -(-(T - 1) // L) if T >= 2 else 0  # every token after the first is a label once
        out = np.empty((R, 3), np.int64)
        del lengths_K, lengths  # (the caller passes a temporary: freed before the rows exist)
        # The unit a row starts in is the last whose start is <= the row's (empty units
        # skipped): unit k holds the starts of rows [ceil(starts[k] / L), ceil(starts[k+1] / L))
        # (a repeat per chunk of rows instead of a search per row).
        for lo in range(0, R, CHUNK):
            hi = min(lo + CHUNK, R)
            k0 = int(np.searchsorted(starts[:K], lo * L, side="right")) - 1  # the unit row lo starts in
            k1 = int(np.searchsorted(starts[:K], (hi - 1) * L, side="right"))  # units starting a row < hi
            edges = np.clip(-(-starts[k0:k1] // L), lo, hi)
            doc = np.repeat(np.arange(k0, k1, dtype=np.int64), np.diff(edges, append=hi))
            row_starts = np.arange(lo, hi, dtype=np.int64) * L
            out[lo:hi, 0] = doc
            out[lo:hi, 1] = row_starts - starts[doc]
            out[lo:hi, 2] = np.minimum(L + 1, T - row_starts)
        return out
    per_doc = np.maximum(0, (lengths - 1 + L - 1) // L)  # a 1-token document has no label: no row
    first_row = np.zeros(K + 1, np.int64)
    np.cumsum(per_doc, out=first_row[1:])
    out = np.empty((int(first_row[-1]), 3), np.int64)
    for lo in range(0, K, CHUNK):
        hi = min(lo + CHUNK, K)
        n = per_doc[lo:hi]
        doc = np.repeat(np.arange(lo, hi, dtype=np.int64), n)
        offset = (np.arange(len(doc), dtype=np.int64) - np.repeat(first_row[lo:hi] - first_row[lo], n)) * L
        rows = slice(int(first_row[lo]), int(first_row[hi]))
        out[rows, 0] = doc
        out[rows, 1] = offset
        out[rows, 2] = np.minimum(L + 1, lengths[doc] - offset)
    return out


@dataclass(frozen=True)
class EpochIndex:
    """One epoch's index, memory-mapped read-only (see the module docstring)."""

    epoch: int
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray
    meta: dict

    @property
    def rows(self) -> int:
        return len(self.shuffle_idx)

    def row(self, k: int) -> tuple[int, int, int]:
        """The k-th row the global stream takes: (doc_idx position, offset, tokens)."""
        pos, off, n = self.sample_idx[int(self.shuffle_idx[k])]
        return int(pos), int(off), int(n)


def open_epoch(
    directory: Path,
    epoch: int,
    key: dict,
    build: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray, int]],
) -> EpochIndex:
    """Epoch ``epoch`` of the index in ``directory`` (the key's directory), built first with
    ``build() -> (doc_idx, sample_idx, shuffle_idx, tokens)`` when it is not there yet.

    Raises:
        OSError: the index cannot be written or read.
    """
    final = directory / f"epoch-{epoch}"
    index = _load(final, epoch)
    if index is not None:
        return index
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / f".epoch-{epoch}.lock"):  # (per epoch: the next one builds ahead meanwhile)
        index = _load(final, epoch)  # another stream built it while this one waited
        if index is not None:
            return index
        for stale in directory.glob(f".epoch-{epoch}.tmp-*"):  # a builder that died (the lock is free)
            shutil.rmtree(stale, ignore_errors=True)
        doc_idx, sample_idx, shuffle_idx, tokens = build()
        tmp = directory / f".epoch-{epoch}.tmp-{os.getpid()}"
        tmp.mkdir()
        # No fsync: the index is derived data. A process that dies leaves its files in the
        # page cache; a machine that dies before writeback may leave short files under the
        # final name, which _load finds short of meta.json's counts and has rebuilt.
        for name, array in zip(_FILES, (doc_idx, sample_idx, shuffle_idx)):
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array, dtype=np.int64))
        meta = {"format": FORMAT, "epoch": epoch, "rows": len(shuffle_idx), "documents": len(doc_idx)}
        meta.update(tokens=int(tokens), key=key)
        (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))  # last: marks it complete
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no meta.json, short files)
        os.rename(tmp, final)
    index = _load(final, epoch)
    if index is None:
        raise OSError(f"sample index {final}: unreadable right after it was built")
    return index


def is_built(directory: Path, epoch: int) -> bool:
    """Whether epoch ``epoch`` of the index in ``directory`` is complete on disk."""
    return _load(directory / f"epoch-{epoch}", epoch) is not None


def build_ahead(
    directory: Path,
    epoch: int,
    key: dict,
    build: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray, int]],
) -> None:
    """Have epoch ``epoch`` built (:func:`open_epoch`) in the background, so a stream that
    reaches it finds it on disk: the packer asks for the next epoch's index when a stream
    opens an epoch, and an epoch boundary is then no pause. Returns at once; one thread per
    process builds, at a lower CPU priority (nice 10: streams' batches first, yet not so low
    that a stream waiting on its lock at a boundary waits on a starved thread), one epoch at
    a time (the build's temporaries never add up), each (directory, epoch) once. A build
    that fails here is left to the stream that needs the epoch: its own build raises the
    error the usual way."""
    with _AHEAD_LOCK:
        job = (str(directory), int(epoch))
        if job in _AHEAD_QUEUED:
            return
        _AHEAD_QUEUED.add(job)
        _AHEAD.put((directory, epoch, key, build))
        global _AHEAD_THREAD
        if _AHEAD_THREAD is None:
            # A daemon thread: a service that stops does not wait for a build nobody needs yet.
            _AHEAD_THREAD = threading.Thread(target=_build_ahead_loop, name="sample-index-ahead", daemon=True)
            _AHEAD_THREAD.start()


AHEAD_NICE = 10
_AHEAD: queue.SimpleQueue = queue.SimpleQueue()


def beside(compute: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """Run ``compute`` on a thread of its own now (NumPy's sorts release the GIL: a build's
    two sorts overlap); the returned function joins it and gives its result or raises its
    error. A daemon thread, not a pool: a service stopping never waits for a build (one ahead
    of need, at the lowest priority, may take long on a busy machine)."""
    out: list = []

    def run() -> None:
        try:
            out.append(compute())
        except BaseException as e:  # noqa: BLE001 - raised by the joining caller
            out.append(e)

    thread = threading.Thread(target=run, name="index-build-beside", daemon=True)
    thread.start()

    def join() -> np.ndarray:
        thread.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return join


_AHEAD_LOCK = threading.Lock()
_AHEAD_QUEUED: set[tuple[str, int]] = set()
_AHEAD_THREAD: threading.Thread | None = None


def _build_ahead_loop() -> None:
    with contextlib.suppress(OSError, AttributeError):  # (Linux: a thread's own niceness)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), AHEAD_NICE)
    while True:
        directory, epoch, key, build = _AHEAD.get()
        try:
            if not is_built(directory, epoch):
                open_epoch(directory, epoch, key, build)
        except Exception:  # noqa: BLE001 - the stream that needs this epoch builds it and reports
            pass
        finally:
            with _AHEAD_LOCK:
                _AHEAD_QUEUED.discard((str(directory), int(epoch)))


def cached_array(path: Path, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The array in ``path`` (memory-mapped), built by ``build`` and written atomically under
    a lock next to it first when missing (e.g. the filter's keep mask)."""
    if path.is_file():
        return _np_load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / ".lock"):
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, build())
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
    return _np_load(path)


def _load(path: Path, epoch: int) -> EpochIndex | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT:
        return None
    try:
        doc_idx, sample_idx, shuffle_idx = (_np_load(path / f"{name}.npy") for name in _FILES)
    except (OSError, ValueError, EOFError):  # a file cut short (see open_epoch): rebuilt
        return None
    if doc_idx.shape != (meta.get("documents"),) or sample_idx.shape != (meta.get("rows"), 3):
        return None
    if shuffle_idx.shape != (meta.get("rows"),):
        return None
    return EpochIndex(epoch, doc_idx, sample_idx, shuffle_idx, meta)


# np.load parses the .npy header with ast.literal_eval, and CPython 3.11's AST constructor is
# not safe when two threads compile at once ("SystemError: AST constructor recursion depth
# mismatch", python/cpython#106905): two ranks opening their streams together hit it.
NPY_HEADER_LOCK = threading.Lock()


# One read-only mapping per file in the process, shared by every stream: a page one stream
# touched is resident once, not once per stream (the resident set counts pages per mapping,
# and a fault maps the cached pages around it too). Dropped when no stream holds it.
_MAPPED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mapped(path: Path) -> tuple[np.ndarray, bool]:
    """``path`` (a .npy file) memory-mapped read-only, shared; and whether this call mapped
    it (False: an existing mapping of the same file, unchanged since, was reused).

    Raises:
        OSError, ValueError: the file cannot be read as .npy.
    """
    st = os.stat(path)
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with NPY_HEADER_LOCK:
        array = _MAPPED.get(key)
        if array is not None:
            return array, False
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        _MAPPED[key] = array
        return array, True


def forget(path: Path) -> None:
    """Drop the shared mapping of ``path`` (found bad: the next open maps and checks it anew)."""
    with NPY_HEADER_LOCK:
        for key in [k for k in _MAPPED.keys() if k[0] == str(path)]:
            _MAPPED.pop(key, None)


def _np_load(path: Path) -> np.ndarray:
    return mapped(path)[0]


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
