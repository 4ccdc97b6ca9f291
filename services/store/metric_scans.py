"""The store's chart reads kept between calls (ReadMetrics with ``points``): a live job's
dashboard page reloads every few seconds and asks the same thing each time; each answer
resumes the last one's scan with the bytes written since, instead of reading the job's files
again (GBs for a 64-rank job: tens of seconds a load, bench/dashboard_scale.py).

What is kept, per (job, type, ranks, points): the files read (name, inode), how far into the
newest one, and the :class:`~services.common.metric_select.Selector` (each rank's kept step
records, at most ``points``, and the other records of those ranks). The metrics logger only
appends to the newest file; a rotation (a new newest file) or a compaction (a new history
file) changes the files' names or inodes, and the next read starts over. At most ``ENTRIES``
reads kept (least recently used goes first), each of at most ``RANKS_KEPT`` ranks: tens of MB
at most (a rank's kept step records are ``points`` lines of ~600 bytes).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from services.common.metric_select import Selection, Selector
from services.store.metric_files import line_blocks, of_type

ENTRIES = 32
RANKS_KEPT = 4  # a read of more ranks (or of every rank) is not kept: each kept rank is ~1 MB


class _Scan:
    def __init__(self, sel: Selection):
        self.lock = threading.Lock()  # (one reader resumes it at a time)
        self.files: list[tuple[str, int]] = []  # (name, inode) of every file read, oldest first
        self.offset = 0  # bytes of the newest file read: whole lines only
        self.selector = Selector(sel)


class ChartScans:
    """Thread-safe: the relay's bulk pool calls :meth:`read`."""

    def __init__(self, entries: int = ENTRIES):
        self._entries = entries
        self._lock = threading.Lock()
        self._scans: OrderedDict[tuple, _Scan] = OrderedDict()

    def read(self, job_id: str, files: list[Path], sel: Selection) -> list[bytes]:
        """The selection's answer over ``files`` (the job's, oldest first, as rotated_paths
        lists them): the records that are not step records in order, then each rank's kept
        step records. A file gone since it was listed (a rotation meanwhile) is read as empty;
        the next read starts over."""
        key = (job_id, sel)
        with self._lock:
            scan = self._scans.get(key)
            if scan is None:
                scan = self._scans[key] = _Scan(sel)
            self._scans.move_to_end(key)
            while len(self._scans) > self._entries:
                self._scans.popitem(last=False)
        with scan.lock:
            ids = [_identity(f) for f in files]
            if not ids or scan.files[:-1] != ids[:-1] or scan.files[-1:] != ids[-1:]:
                if scan.files:  # (rotated or compacted since: start over)
                    scan.selector, scan.files, scan.offset = Selector(sel), [], 0
                for f in files[:-1]:
                    _feed(scan.selector, f, 0)
                scan.files, scan.offset = ids, 0
            if files:
                scan.offset = _feed(scan.selector, files[-1], scan.offset)
            return scan.selector.others() + scan.selector.steps()


def _identity(path: Path) -> tuple[str, int]:
    try:
        return path.name, os.stat(path).st_ino
    except FileNotFoundError:
        return path.name, -1


def _feed(selector: Selector, path: Path, offset: int) -> int:
    """Feed ``path``'s whole lines from ``offset`` to ``selector``; the offset after them."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - read in parts below
    except FileNotFoundError:
        return offset
    with f:
        f.seek(offset)
        for block in line_blocks(f):
            offset += len(block)
            if selector.sel.record_type:
                block = of_type(block, selector.sel.record_type)
            selector.feed(block)
    return offset
