"""One split's three files, written as the documents come: ``<split>.bin`` (tokens back to
back), ``<split>.idx.npy`` (int64 [documents + 1] token offsets) and ``<split>.docs.txt``
(one document id per line).

Tokens and ids are appended to their files; the offsets go to a raw int64 side file and
become the ``.npy`` at :meth:`SplitFiles.close` (a ``.npy`` header holds the array's length,
known only at the end). The bytes are exactly what ``np.save`` of the whole offset array
would write, and what the data service reads (``dataset_versions._token_store``). Memory is
constant: nothing of a split is held beyond the last few units.

Writing and SHA-256 hashing (for the manifest) run on one thread per split, in order, while
the main thread reads the source and collects the workers' results: both release the GIL,
and hashing is the one serial pass over every token byte.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from services.data import manifest as mf
from services.data.prepare.encode import Part

_COPY = 8 << 20  # bytes per copy step when finishing or rewriting a file
_QUEUED = 4  # appends waiting for the writer thread at most (each holds one unit's tokens)


class SplitFiles:
    """The files of ``split`` in ``directory`` (a version's temp dir)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype):
        self.split = split
        self.documents = 0
        self.tokens = 0
        self._dir = directory
        self._itemsize = dtype.itemsize
        self._dtype = dtype
        self._names = {"tokens": f"{split}.bin", "index": f"{split}.idx.npy", "ids": f"{split}.docs.txt"}
        self._offsets_path = directory / f".{split}.offsets"
        self._files = {
            "tokens": open(directory / self._names["tokens"], "wb"),
            "ids": open(directory / self._names["ids"], "wb"),
            "offsets": open(self._offsets_path, "wb"),
        }
        self._sha = {"tokens": hashlib.sha256(), "ids": hashlib.sha256()}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"prepare-{split}")
        self._queued: deque[Future] = deque()

    def append(self, part: Part) -> None:
        """Add ``part``'s documents after those already written (on the writer thread; a
        write error is raised by a later call)."""
        if not len(part.lengths):
            return
        offsets = self.tokens + np.cumsum(part.lengths, dtype=np.int64)
        self.documents += len(part.lengths)
        self.tokens += part.tokens.size
        self._queued.append(self._writer.submit(self._write, part.tokens, part.ids.encode(), offsets))
        while len(self._queued) > _QUEUED:
            self._queued.popleft().result()

    def _write(self, tokens: np.ndarray, ids: bytes, offsets: np.ndarray) -> None:
        tokens = tokens.astype(self._dtype, copy=False)  # uint8 bytes-tokenizer ids widen here
        for key, data in (("tokens", tokens), ("ids", ids)):
            self._files[key].write(data)
            self._sha[key].update(data)
        self._files["offsets"].write(offsets.astype("<i8", copy=False).tobytes())

    def _drain(self) -> None:
        while self._queued:
            self._queued.popleft().result()

    def take(self, index: int) -> Part:
        """Remove document ``index`` (from 0) and return it as a one-document part: the
        fallback that holds out one document when the rule held out none (``pipeline.py``).
        Rewrites the split's files (this happens only when no document's key fell below
        the fraction, i.e. a small corpus)."""
        self._drain()
        for f in self._files.values():
            f.flush()
        offsets = np.fromfile(self._offsets_path, dtype="<i8")
        start = int(offsets[index - 1]) if index else 0
        end = int(offsets[index])
        lines = (self._dir / self._names["ids"]).read_bytes().split(b"\n")  # small: see above
        doc_id = lines.pop(index).decode()
        with open(self._dir / self._names["tokens"], "rb") as f:
            f.seek(start * self._itemsize)
            tokens = f.read((end - start) * self._itemsize)
        _cut(self._dir / self._names["tokens"], start * self._itemsize, end * self._itemsize)
        offsets = np.concatenate([offsets[:index], offsets[index + 1 :] - (end - start)])
        for key, data in (("ids", b"\n".join(lines)), ("offsets", offsets.astype("<i8").tobytes())):
            self._files[key].seek(0)
            self._files[key].truncate()
            self._files[key].write(data)
        self._files["tokens"].seek(0, os.SEEK_END)
        self._sha = {}  # rewritten: hashed from the files at close
        self.documents -= 1
        self.tokens -= end - start
        return Part(np.frombuffer(tokens, dtype=self._dtype), np.array([end - start], dtype=np.int64), doc_id + "\n")

    def close(self) -> tuple[dict, dict[str, dict]]:
        """Finish the files (the ``.npy`` from the offsets), fsync them. -> (the manifest's
        ``splits`` entry, ``{file name: {"sha256", "bytes"}}``)."""
        self._drain()
        self._writer.shutdown()
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        index_path = self._dir / self._names["index"]
        with open(index_path, "wb") as out, open(self._offsets_path, "rb") as src:
            # The header np.save writes for int64 [documents + 1] (format 1.0), then offset 0.
            header = {"descr": np.dtype("<i8").str, "fortran_order": False, "shape": (self.documents + 1,)}
            np.lib.format.write_array_header_1_0(out, header)
            out.write(np.zeros(1, dtype="<i8").tobytes())
            shutil.copyfileobj(src, out, _COPY)
            out.flush()
            os.fsync(out.fileno())
        self._offsets_path.unlink()
        files = {}
        for key in ("tokens", "index", "ids"):
            path = self._dir / self._names[key]
            digest = self._sha[key].hexdigest() if key in self._sha else mf.sha256_file(path)
            files[self._names[key]] = {"sha256": digest, "bytes": path.stat().st_size}
        entry = {
            "documents": self.documents,
            "tokens": self.tokens,
            "tokens_file": self._names["tokens"],
            "index_file": self._names["index"],
            "paths_file": self._names["ids"],
        }
        return entry, files

    def abort(self) -> None:
        self._writer.shutdown(cancel_futures=True)
        for f in self._files.values():
            f.close()


def _cut(path: Path, start: int, end: int) -> None:
    """Remove bytes [start, end) of the file at ``path``, moving the rest forward."""
    with open(path, "r+b") as f:
        read_at, write_at = end, start
        while True:
            f.seek(read_at)
            block = f.read(_COPY)
            if not block:
                break
            f.seek(write_at)
            f.write(block)
            read_at += len(block)
            write_at += len(block)
        f.truncate(write_at)
