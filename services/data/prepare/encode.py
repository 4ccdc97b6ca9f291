"""A unit of source text -> its documents' tokens, split into train and val.

This is the work ``prepare`` spreads over processes (``pipeline.py``): parsing JSON lines,
tokenizing, and deciding each document's split. It is a pure function of the unit and the
:class:`Encoder`'s settings, so a version's bytes do not depend on how many processes ran
it or how the corpus was cut into units.

A document's id is its relative path (a text file), ``path:line`` (a JSONL line, from 1)
or ``path:row`` (a Parquet row, from 0). The split rule, from the id: held out iff
``int(sha256(id)[:8 bytes], big-endian) / 2**64 < val_fraction`` (for text files, the rule
this code has always had, so a text corpus prepares to the same version as before).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from services.data.errors import InvalidConfig
from services.data.prepare.sources import Unit


def split_key(doc_id: str) -> int:
    """The 64-bit key the split rule compares: the first 8 bytes of sha256(id), big-endian."""
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")


@dataclass
class Part:
    """One split's share of a unit: ``tokens`` (the documents' tokens back to back, 1-D, in
    the version's little-endian dtype, or uint8 for the bytes tokenizer), ``lengths`` (int64 [documents], tokens each), ``ids`` (one
    id per line, ``\\n``-terminated); for train, the smallest split key and the index of its
    first document (the fallback held-out document, ``pipeline.py``)."""

    tokens: np.ndarray
    lengths: np.ndarray
    ids: str
    min_key: int = 1 << 64
    min_at: int = -1


@dataclass
class Encoded:
    """A unit's result: its ``train`` and ``val`` parts, and the records skipped as empty."""

    train: Part
    val: Part
    empty_documents: int


class Encoder:
    """Tokenizes units. ``tokenizer_json``: a HF ``tokenizers`` JSON, or None for bytes (a
    token is a byte of the UTF-8 text). ``dtype``: the token files' numpy dtype string."""

    def __init__(self, tokenizer_json: str | None, dtype: str, val_fraction: float, text_field: str):
        self._dtype = np.dtype(dtype).newbyteorder("<")  # token files are little-endian
        self._threshold = val_fraction * 2**64  # compared as the rule has always been: int < float
        self._field = text_field
        self._tok = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(tokenizer_json)

    def documents(self, unit: Unit) -> Iterator[tuple[str, bytes | str]]:
        """``(id, text)`` of each document of ``unit``, in order: text files as bytes (any
        encoding: the bytes tokenizer keeps them as they are), records as str (possibly empty:
        a record whose text is ``""`` is skipped by the caller, and counted).

        Raises:
            InvalidConfig: a bad record, in one line naming the file and line or row.
        """
        if unit.kind == "text":
            yield from unit.payload
        elif unit.kind == "jsonl":
            yield from self._jsonl(unit)
        else:
            yield from self._parquet(unit)

    def held_out(self, doc_id: str) -> tuple[bool, int]:
        """(whether ``doc_id`` is in the val split by the rule, its split key)."""
        key = split_key(doc_id)
        return key < self._threshold, key

    def __call__(self, unit: Unit) -> Encoded:
        """Raises InvalidConfig as :meth:`documents`."""
        texts: tuple[list, list] = ([], [])
        ids: tuple[list[str], list[str]] = ([], [])
        min_key, min_at, empty = 1 << 64, -1, 0
        for doc_id, text in self.documents(unit):
            if not text:
                empty += 1
                continue
            val, key = self.held_out(doc_id)
            if not val and key < min_key:
                min_key, min_at = key, len(ids[0])
            texts[val].append(text)
            ids[val].append(doc_id)
        train, val = (self._part(texts[i], ids[i], unit) for i in (0, 1))
        train.min_key, train.min_at = min_key, min_at
        return Encoded(train, val, empty)

    # ---- private ----------------------------------------------------------------------

    def _part(self, texts: list, ids: list[str], unit: Unit) -> Part:
        if self._tok is None:
            blobs = [t if isinstance(t, bytes) else self._utf8(t, unit, ids[k]) for k, t in enumerate(texts)]
            # A token is a byte. Sent back as uint8 (half the bytes through the pipe of uint16);
            # widened to the version's dtype on the split's writer thread (split_files.py).
            tokens = np.frombuffer(b"".join(blobs), dtype=np.uint8)
            lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
        else:
            decoded = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in texts]
            encs = self._tok.encode_batch(decoded, add_special_tokens=False)
            parts = [np.asarray(e.ids, dtype=self._dtype) for e in encs]
            tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=self._dtype)
            lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        return Part(tokens, lengths, "".join(i + "\n" for i in ids))

    def _utf8(self, text: str, unit: Unit, doc_id: str) -> bytes:
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, from a \ud800 escape in the JSON
            where = doc_id.rsplit(":", 1)[1]
            raise InvalidConfig(
                f"prepare: source {unit.rel}: {_where(unit)} {where}: {self._field!r} is not valid Unicode "
                "(a lone surrogate escape)"
            ) from None

    def _jsonl(self, unit: Unit) -> Iterator[tuple[str, str]]:
        chunk: bytes = unit.payload
        try:
            text = chunk.decode("utf-8")  # once for the chunk: json.loads of bytes decodes line by line
        except UnicodeDecodeError as e:
            line_start = chunk.rfind(b"\n", 0, e.start) + 1
            n = unit.first + chunk.count(b"\n", 0, e.start)
            raise self._bad(unit, n, f"not UTF-8 (byte {e.start - line_start + 1})") from None
        if unit.first == 1 and text.startswith("\ufeff"):
            text = text[1:]  # a byte-order mark (json.loads of the file's bytes would skip it too)
        lines = text.split("\n")
        if lines and not lines[-1]:
            lines.pop()  # the chunk's final line end
        for k, line in enumerate(lines):
            n = unit.first + k
            if not line.strip():
                continue  # a blank line (e.g. a trailing one) holds no record
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise self._bad(
                    unit, n, f"not JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')})"
                ) from None
            if not isinstance(obj, dict):
                raise self._bad(unit, n, f"not a JSON object (a {type(obj).__name__})")
            if self._field not in obj:
                fields = ", ".join(list(obj)[:8]) or "none"
                raise self._bad(unit, n, f"no field {self._field!r} (fields: {fields}; --text-field names it)")
            text = obj[self._field]
            if not isinstance(text, str):
                raise self._bad(unit, n, f"field {self._field!r} is {_json_type(text)}, not a string")
            yield f"{unit.rel}:{n}", text

    def _parquet(self, unit: Unit) -> Iterator[tuple[str, str]]:
        for k, text in enumerate(unit.payload.to_pylist()):
            n = unit.first + k
            if text is None:
                raise self._bad(unit, n, f"column {self._field!r} is null")
            if isinstance(text, bytes):  # a binary column: its bytes must be UTF-8 text
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise self._bad(unit, n, f"column {self._field!r} is not UTF-8 (byte {e.start + 1})") from None
            yield f"{unit.rel}:{n}", text

    def _bad(self, unit: Unit, n: int, what: str) -> InvalidConfig:
        return InvalidConfig(f"prepare: source {unit.rel}: {_where(unit)} {n}: {what}")


def _where(unit: Unit) -> str:
    return "line" if unit.kind == "jsonl" else "row"


def _json_type(value: object) -> str:
    return {dict: "an object", list: "an array", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), "null"
    )


# ---- worker processes -------------------------------------------------------------------

_worker: Encoder | None = None


def start_worker(tokenizer_json: str | None, dtype: str, val_fraction: float, text_field: str) -> None:
    """A worker process's initializer: one Encoder per process, built once."""
    global _worker
    # One process is one core: tokenizers' own thread pool would oversubscribe N processes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = Encoder(tokenizer_json, dtype, val_fraction, text_field)


def encode_in_worker(unit: Unit) -> Encoded:
    assert _worker is not None, "start_worker runs first (the pool's initializer)"
    return _worker(unit)
