"""Where ``prepare`` reads documents from, and the order it reads them in.

A source is a local directory, a single local file, or an S3-compatible prefix
(``s3://bucket/prefix``, through fsspec's s3fs, as the store's checkpoint chunks are). Its
files are taken in sorted order of their path relative to the source, and each file is
read by its extension:

====================================  ===============================================
``.jsonl`` / ``.ndjson``              one document per line: a JSON object whose
(optionally ``.gz`` or ``.zst``)      ``text_field`` (default ``"text"``) is a string
``.parquet``                          one document per row of the ``text_field`` column
anything else                         the whole file is one document (as before)
====================================  ===============================================

Reading is split into :class:`Unit`s of about ``unit_bytes`` of source text, in corpus
order: many small text files, or a run of whole JSONL lines, or a batch of Parquet rows.
Units are what the tokenizing workers receive (``encode.py``); the parsing of JSON lines
happens there, in parallel, so this process only reads and cuts at line ends. Memory is a
few units, whatever the corpus size (a single text file is read whole: it is one document).
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from services.data.errors import InvalidConfig

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst")
UNIT_BYTES = 4 << 20  # source bytes per unit: large enough that a worker's call overhead is noise


@dataclass(frozen=True)
class Unit:
    """One piece of work, in corpus order.

    ``kind`` ``"text"``: ``payload`` is ``[(relative path, bytes), ...]``, one document each.
    ``"jsonl"``: ``payload`` is whole lines (bytes, ``\\n``-separated) of ``rel``; the first
    is line ``first`` (from 1). ``"parquet"``: ``payload`` is a pyarrow string/binary array of
    ``rel``'s text column; its first element is row ``first`` (from 0).
    ``source_bytes``: bytes of the source files this unit consumed (as stored: compressed
    bytes for a compressed file), for progress.
    """

    kind: str
    rel: str
    first: int
    payload: Any
    source_bytes: int


def file_kind(rel: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``, by the file's extension (case-insensitive)."""
    name = rel.lower()
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)].endswith(JSONL_SUFFIXES):
            return "jsonl"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def is_text(data: bytes) -> bool:
    """No NUL byte in the first 8000 bytes: git's ``buffer_is_binary`` test (grep's is alike).
    UTF-16 text counts as binary, Latin-1 as text (it is read as bytes anyway)."""
    return b"\0" not in data[:8000]


def glob_regex(pattern: str) -> re.Pattern[str]:
    """``pathlib``'s glob syntax (``**/`` any directories, ``*`` and ``?`` within one path
    part) as a regex over relative POSIX paths: object stores list keys, not directories."""
    out = []
    for part in re.split(r"(\*\*/|\*|\?)", pattern):
        out.append({"**/": "(?:.*/)?", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part)))
    return re.compile("".join(out) + r"\Z")


class Source:
    """The files of a local directory or file, or of an ``s3://bucket/prefix``.

    Args:
        spec: a local path, or a URL fsspec opens (``s3://...``).
        include_glob: files taken (relative to the source); None: every file, hidden files and
            directories skipped, and non-JSONL/Parquet files only if :func:`is_text`.
        storage_options: fsspec's options for a URL (``endpoint_url``; credentials come from
            the standard ``AWS_*`` variables, as the store's).

    Raises:
        InvalidConfig: the source does not exist or cannot be listed.
    """

    def __init__(self, spec: str | Path, include_glob: str | None, storage_options: dict | None = None):
        self.text_mode = include_glob is None
        spec = str(spec)
        if "://" in spec:
            from fsspec.core import url_to_fs

            self.label = spec.rstrip("/")
            try:
                self._fs, base = url_to_fs(self.label, **(storage_options or {}))
                self._base = base.rstrip("/")
                found = self._fs.find(self._base, detail=True, withdirs=False)
            except Exception as e:  # s3fs's OSErrors, and botocore's own (no credentials, a bad endpoint)
                raise InvalidConfig(f"prepare: source {self.label}: cannot list ({type(e).__name__}: {e})") from None
            sizes = {p[len(self._base) + 1 :]: int(i.get("size") or 0) for p, i in found.items() if p != self._base}
            if not sizes and self._fs.isfile(self._base):  # the URL names one object
                self._base, one = self._base.rsplit("/", 1)
                sizes = {one: int(self._fs.info(f"{self._base}/{one}").get("size") or 0)}
            elif include_glob is not None:
                rx = glob_regex(include_glob)
                sizes = {r: s for r, s in sizes.items() if rx.match(r)}
        else:
            self._fs = None
            path = Path(spec).resolve()
            self.label = str(path)
            if path.is_file():  # one file: taken whatever the glob
                self._base, sizes = str(path.parent), {path.name: path.stat().st_size}
            elif path.is_dir():
                self._base = str(path)
                pattern = "**/*" if include_glob is None else include_glob
                try:
                    sizes = {p.relative_to(path).as_posix(): 0 for p in path.glob(pattern) if p.is_file()}
                except (ValueError, NotImplementedError) as e:  # pathlib's refusals of a pattern
                    raise InvalidConfig(f"prepare: include {pattern!r}: not a relative glob ({e})") from None
            else:
                raise InvalidConfig(f"prepare: source {path}: no such file or directory")
        rels = sorted(r for r in sizes if not EXCLUDED_DIRS.intersection(r.split("/")))
        self.skipped = {"empty_files": 0, **({"binary_files": 0, "hidden_files": 0} if self.text_mode else {})}
        if self.text_mode:
            shown = [r for r in rels if not any(part.startswith(".") for part in r.split("/"))]
            self.skipped["hidden_files"] = len(rels) - len(shown)
            rels = shown
        self.files = rels
        self.kinds = {r: file_kind(r) for r in rels}
        self._sizes = sizes

    def total_bytes(self) -> int:
        """Bytes of the files to read, as stored (for a progress bar's total)."""
        if self._fs is None:
            return sum(Path(self._base, r).stat().st_size for r in self.files)
        return sum(self._sizes[r] for r in self.files)

    def has_records(self) -> bool:
        """Whether any file is read as records (JSONL lines or Parquet rows)."""
        return any(k != "text" for k in self.kinds.values())

    def units(self, text_field: str, unit_bytes: int | None = None) -> Iterator[Unit]:
        """The corpus as units of about ``unit_bytes`` (default ``UNIT_BYTES``), in order.
        Counts ``skipped`` files as it goes (complete once exhausted).

        Raises:
            InvalidConfig: a file cannot be read, decompressed, or has no ``text_field`` column
                (one line naming the file).
        """
        self.skipped.update({k: 0 for k in ("empty_files", "binary_files") if k in self.skipped})  # a new pass
        unit_bytes = unit_bytes or UNIT_BYTES
        batch: list[tuple[str, bytes]] = []
        size = 0
        for rel in self.files:
            kind = self.kinds[rel]
            if kind != "text":
                if batch:  # documents stay in file order: flush the text files before this one
                    yield Unit("text", "", 0, batch, size)
                    batch, size = [], 0
                reader = self._jsonl if kind == "jsonl" else self._parquet
                yield from self._named(rel, reader(rel, text_field, unit_bytes))
                continue
            data = self._read(rel)
            if not data:
                self.skipped["empty_files"] += 1
            elif self.text_mode and not is_text(data):
                self.skipped["binary_files"] += 1
            else:
                batch.append((rel, data))
            size += len(data)
            if size >= unit_bytes:
                yield Unit("text", "", 0, batch, size)
                batch, size = [], 0
        if batch or size:
            yield Unit("text", "", 0, batch, size)

    # ---- private ----------------------------------------------------------------------

    def _open(self, rel: str) -> BinaryIO:
        if self._fs is None:
            return open(Path(self._base, rel), "rb")
        return self._fs.open(f"{self._base}/{rel}", "rb")

    def _read(self, rel: str) -> bytes:
        try:
            with self._open(rel) as f:
                return f.read()
        except OSError as e:
            raise InvalidConfig(f"prepare: source {rel}: cannot read ({e.strerror or e})") from None
        except Exception as e:  # botocore's own errors from an object store
            raise InvalidConfig(f"prepare: source {rel}: cannot read ({type(e).__name__}: {e})") from None

    def _named(self, rel: str, units: Iterator[Unit]) -> Iterator[Unit]:
        """``units``, with a read or decompression error turned into one line naming ``rel``."""
        import zstandard

        try:
            yield from units
        except (OSError, EOFError, zstandard.ZstdError) as e:  # gzip.BadGzipFile is an OSError
            raise InvalidConfig(f"prepare: source {rel}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        except InvalidConfig:
            raise
        except Exception as e:  # pyarrow's errors (ArrowInvalid is a ValueError), botocore's own
            what = "as Parquet " if self.kinds[rel] == "parquet" else ""
            raise InvalidConfig(f"prepare: source {rel}: cannot read {what}({type(e).__name__}: {e})") from None

    def _jsonl(self, rel: str, text_field: str, unit_bytes: int) -> Iterator[Unit]:
        with self._open(rel) as raw:
            f = _decompressed(raw, rel)
            line, consumed = 1, 0
            while chunk := f.read(unit_bytes):
                if not chunk.endswith(b"\n"):
                    chunk += f.readline()  # whole lines only: read on to the line's end (or the file's)
                now = raw.tell()
                yield Unit("jsonl", rel, line, chunk, now - consumed)
                line, consumed = line + chunk.count(b"\n"), now
            if not consumed and not raw.tell():
                self.skipped["empty_files"] += 1

    def _parquet(self, rel: str, text_field: str, unit_bytes: int) -> Iterator[Unit]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with self._open(rel) as raw:
            pf = pq.ParquetFile(raw)
            schema = pf.schema_arrow
            if text_field not in schema.names:
                raise InvalidConfig(
                    f"prepare: source {rel}: no column {text_field!r} (columns: {', '.join(schema.names)}; "
                    "--text-field names it)"
                )
            kind = schema.field(text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)):
                if not pa.types.is_large_binary(kind):
                    raise InvalidConfig(f"prepare: source {rel}: column {text_field!r} is {kind}, not a string column")
            meta = pf.metadata
            if meta.num_rows == 0:
                self.skipped["empty_files"] += 1
                return
            per_row = max(
                1, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) // meta.num_rows
            )
            rows = max(1, unit_bytes // per_row)
            size = self._sizes[rel] or (Path(self._base, rel).stat().st_size if self._fs is None else 0)
            row = 0
            for batch in pf.iter_batches(batch_size=rows, columns=[text_field]):
                column = batch.column(0)
                yield Unit("parquet", rel, row, column, size * len(column) // meta.num_rows)
                row += len(column)


def _decompressed(raw: BinaryIO, rel: str) -> BinaryIO:
    name = rel.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith(".zst"):
        import zstandard

        # Buffered: the zstd reader itself has no readline.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw
