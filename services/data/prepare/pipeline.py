"""``prepare_dataset``: a source (files, JSONL, Parquet, a directory tree, an S3 prefix) ->
an immutable dataset version, streamed in bounded memory over worker processes.

Flow (one pass; two with ``bpe:N``, whose first pass trains the tokenizer)::

    sources.Source.units()  --in order-->  N worker processes (encode.Encoder)
        --results in the same order-->  split_files.SplitFiles x2  --> version_dir (rename)

The main process reads and cuts the source into units (~4 MB of text), keeps at most
``2 * workers`` of them in flight, and appends each result as it comes back, in corpus
order; a version is therefore byte-identical whatever ``workers`` is. Memory is those
units plus a constant, whatever the corpus size (one text file is one document and is read
whole). ``workers`` 1 runs in this process, without a pool.

The held-out split is decided per document by a hash of its id (``encode.py``): stable when
documents are added elsewhere; a text file's id is its relative path, so a directory of text
files prepares to the same version as the single-process implementation did. If the rule
holds out nothing while ``val_fraction`` > 0 and there are at least two documents, the
training document with the smallest key is moved to val (as before), so a tiny corpus still
has a validation split.
"""

from __future__ import annotations

import os
import re
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from services.data import manifest as mf
from services.data.bpe import bpe_vocab_size, train_bpe
from services.data.errors import InvalidConfig
from services.data.prepare import sources
from services.data.prepare.encode import Encoded, Encoder, encode_in_worker, start_worker
from services.data.prepare.sources import EXCLUDED_DIRS, Source, Unit
from services.data.prepare.split_files import SplitFiles
from services.data.prepare.version_dir import VersionDir

SPLITS = ("train", "val")
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # no leading dot: temp dirs use one


def label_problem(value: str) -> str:
    """What is wrong with a dataset name or version label ("" when nothing): it names a folder
    under the datasets root, so no separator, no leading dot (``../evil``), not empty."""
    if not value:
        return "empty"
    if not _LABEL.match(value):
        return f"{value!r} must match {_LABEL.pattern} (a folder name: no '/', no leading '.')"
    return ""


SPLIT_RULE = (
    "val iff int(sha256(document id)[:8 bytes], big-endian) / 2**64 < val_fraction; a document's id is its "
    "relative path (a text file), path:line (a JSONL line, from 1) or path:row (a Parquet row, from 0)"
)
Progress = Callable[[int, int, int], None]  # (documents so far, source bytes so far, source bytes in all)


@dataclass(frozen=True)
class PreparedDataset:
    """What ``prepare_dataset`` made (or found already made, ``created=False``)."""

    name: str
    version: str
    path: Path
    manifest_sha256: str
    content_sha256: str
    tokenizer: str
    vocab_size: int
    train_documents: int
    train_tokens: int
    val_documents: int
    val_tokens: int
    created: bool
    seconds: float
    warnings: tuple[str, ...] = ()  # also in the manifest's "warnings" (e.g. no held-out split)
    source_bytes: int = 0  # bytes of source files read (as stored), for MB/s
    workers: int = 1  # processes that tokenized (1: this one); at most one per unit of the source

    def __str__(self) -> str:
        verb = "written" if self.created else "already present, unchanged"
        return (
            f"{self.name}@{self.version}: {self.train_documents:,} train documents "
            f"({self.train_tokens:,} tokens), {self.val_documents:,} val documents "
            f"({self.val_tokens:,} tokens), tokenizer {self.tokenizer} (vocab {self.vocab_size}), "
            f"sha256 {self.manifest_sha256[:12]}, {verb} at {self.path}"
        )


def default_stdlib_source() -> Path:
    """The standard library directory of the running Python (e.g. ``/usr/lib/python3.11``)."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def default_workers() -> int:
    """min(usable cores, 8): tokenizing scales with processes until reading and writing
    in the main process become the bottleneck."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 8))


def prepare_dataset(
    source_dir: Path | str,
    name: str,
    version: str,
    root: Path,
    tokenizer: str = "bytes",
    val_fraction: float = 0.02,
    include_glob: str | None = "**/*.py",
    *,
    text_field: str = "text",
    workers: int = 1,
    storage_options: dict | None = None,
    progress: Progress | None = None,
) -> PreparedDataset:
    """Tokenize the documents of ``source_dir`` into the immutable version
    ``root/name/version``. Full stdlib, bytes tokenizer: ~2 s on 2 cores.

    ``source_dir``: a directory (its files by ``include_glob``, recursively, in sorted
    order), one file, or an ``s3://bucket/prefix`` URL (``storage_options``: fsspec's, e.g.
    ``{"endpoint_url": ...}``). Each file is read by extension (``sources.py``): ``.jsonl``
    / ``.ndjson`` (also ``.gz``, ``.zst``) one document per line from the string field
    ``text_field``; ``.parquet`` one per row of the column ``text_field``; any other file
    is one document. ``include_glob`` None: every file, skipping hidden files and directories
    (a path part starting with ".") and, among plain files, binary ones (:func:`is_text`);
    what was skipped is counted in the manifest's ``skipped``.

    A version with no held-out document (``val_fraction`` 0, or one document) is written with
    a warning (``PreparedDataset.warnings``, and the manifest's ``warnings``): a job that
    evaluates on it is refused at submit (services/cli/evaluation.py).

    Args:
        tokenizer: ``"bytes"`` (a token is a byte, vocab 256), ``bpe:N`` (a byte-level BPE
            of N tokens trained on the train split, a first pass over the corpus) or the path
            of a HF ``tokenizers`` JSON file (vocab from the file, added tokens included; text
            files are decoded as UTF-8 with replacement, no special tokens added).
        val_fraction: share of documents held out, in [0, 1) (see the module docstring).
        workers: tokenizing processes (1: in this process). The output does not depend on it.
        progress: called after each unit with (documents, source bytes) so far and the
            source's total bytes (as stored, e.g. compressed).

    Returns the prepared version. Re-preparing identical content is a no-op.

    Raises:
        InvalidConfig: bad name/version/fraction/tokenizer/workers, no document found, or bad
            input (an unreadable file, a JSONL line that is not a JSON object with the string
            field, a non-UTF-8 record): one line naming the file and line or row. Nothing is
            left under ``root``.
        VersionConflict: ``name@version`` exists with different content (versions are
            immutable: prepare a new version instead).
    """
    t0 = time.monotonic()
    for field, value in (("name", name), ("version", version)):
        if problem := label_problem(value):
            raise InvalidConfig(f"prepare: {field}: {problem}")
    if not 0.0 <= val_fraction < 1.0:
        raise InvalidConfig(f"prepare: val_fraction: must be in [0, 1), got {val_fraction}")
    if workers < 1:
        raise InvalidConfig(f"prepare: workers: must be >= 1, got {workers}")
    bpe_vocab_size(tokenizer)  # a bad bpe:N is refused before any file is read
    source = Source(source_dir, include_glob, storage_options)
    if not source.files:
        raise _no_documents(source, include_glob)
    # No more processes than units: a small corpus is tokenized here, without a pool's start-up.
    total_bytes = source.total_bytes()
    workers = min(workers, max(1, -(-total_bytes // sources.UNIT_BYTES)))

    tok_json, kind, vocab_size, tok_source = _tokenizer(tokenizer, source, val_fraction, text_field)
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")
    settings = (None if tok_json is None else tok_json.decode(), dtype.str, val_fraction, text_field)

    with VersionDir(root, name, version) as out:
        files: dict[str, dict] = {}
        splits: dict[str, dict] = {}
        writers = {split: SplitFiles(out.tmp, split, dtype) for split in SPLITS}
        encoded = _encoded(source.units(text_field), settings, workers)  # closed below: that ends the pool
        try:
            documents, source_bytes, empty, fallback = 0, 0, 0, (1 << 64, -1)
            for unit_bytes, enc in encoded:
                train_before = writers["train"].documents
                writers["train"].append(enc.train)
                writers["val"].append(enc.val)
                if enc.train.min_at >= 0 and enc.train.min_key < fallback[0]:  # strictly: the first such
                    fallback = (enc.train.min_key, train_before + enc.train.min_at)
                documents += len(enc.train.lengths) + len(enc.val.lengths)
                source_bytes += unit_bytes
                empty += enc.empty_documents
                if progress is not None:
                    progress(documents, source_bytes, total_bytes)
            if documents == 0:
                raise _no_documents(source, include_glob)
            if val_fraction > 0 and writers["val"].documents == 0 and documents >= 2:
                writers["val"].append(writers["train"].take(fallback[1]))
            if writers["train"].documents == 0:
                raise InvalidConfig(f"prepare: val_fraction {val_fraction} leaves no training document")
            for split in SPLITS:
                splits[split], written = writers[split].close()
                files.update(written)
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        finally:
            encoded.close()
        if tok_json is not None:
            out.write("tokenizer.json", tok_json)
            files["tokenizer.json"] = {"sha256": mf.sha256_bytes(tok_json), "bytes": len(tok_json)}

        skipped = dict(source.skipped)
        if source.has_records():
            skipped["empty_documents"] = empty
        no_val = splits["val"]["documents"] == 0
        warnings = [no_held_out_warning(f"{name}@{version}", val_fraction, documents)] if no_val else []
        lopsided = lopsided_split_warning(f"{name}@{version}", val_fraction, splits)
        warnings += [lopsided] if lopsided else []
        manifest = mf.seal(
            {
                "format": mf.FORMAT,
                "name": name,
                "version": version,
                "created_unix": time.time(),
                "source": source.label,
                "include_glob": include_glob,
                "excluded_dirs": sorted(EXCLUDED_DIRS),
                **({"text_field": text_field} if source.has_records() else {}),
                "tokenizer_kind": kind,
                "tokenizer": "bytes" if tok_json is None else "tokenizer.json",
                "tokenizer_source": tok_source,
                "vocab_size": vocab_size,
                "dtype": dtype.name,
                "val_fraction": val_fraction,
                "split_rule": SPLIT_RULE,
                "splits": splits,
                "skipped": skipped,
                **({"warnings": list(warnings)} if warnings else {}),
                "files": dict(sorted(files.items())),
            }
        )
        path, created = out.commit(manifest)
    final = manifest if created else mf.read(path, f"{name}@{version}")
    return PreparedDataset(
        name=name,
        version=version,
        path=path,
        manifest_sha256=final["manifest_sha256"],
        content_sha256=final["content_sha256"],
        tokenizer=final["tokenizer"],
        vocab_size=final["vocab_size"],
        train_documents=final["splits"]["train"]["documents"],
        train_tokens=final["splits"]["train"]["tokens"],
        val_documents=final["splits"]["val"]["documents"],
        val_tokens=final["splits"]["val"]["tokens"],
        created=created,
        seconds=time.monotonic() - t0,
        warnings=tuple(final.get("warnings", ())),
        source_bytes=source_bytes,
        workers=workers,
    )


def no_held_out_warning(label: str, val_fraction: float, documents: int) -> str:
    """The one line ``prepare`` warns with when a version has no held-out document."""
    why = f"val_fraction {val_fraction:g}" if val_fraction == 0 else f"{documents} document(s)"
    return (
        f"{label}: no held-out split ({why}); a job evaluating on it is refused at submit: turn "
        "eval off (eval: {every_steps: 0, at_end: false}) or prepare a version with --val-fraction > 0 "
        "from at least two files"
    )


# The held-out split is drawn per document, so a corpus of a few documents of uneven sizes can
# hold out far more than ``val_fraction`` of its tokens (one large file of 16: 79 %). Said when
# it holds out more than this many times its share, and at least a quarter of the tokens.
LOPSIDED_TIMES, LOPSIDED_SHARE = 5.0, 0.25


def lopsided_split_warning(label: str, val_fraction: float, splits: dict) -> str | None:
    """The line ``prepare`` warns with when the held-out split took far more tokens than
    ``val_fraction`` asked (None when it did not)."""
    val, train = splits["val"]["tokens"], splits["train"]["tokens"]
    share = val / max(1, val + train)
    if val_fraction <= 0 or share <= max(LOPSIDED_SHARE, LOPSIDED_TIMES * val_fraction):
        return None
    return (
        f"{label}: the held-out split has {share:.0%} of the tokens ({val:,} of {val + train:,}, "
        f"{splits['val']['documents']} of {splits['val']['documents'] + splits['train']['documents']} documents; "
        f"--val-fraction {val_fraction:g} asked): documents are held out whole; split large files or add "
        "documents to train on more of it"
    )


def _no_documents(source: Source, include_glob: str | None) -> InvalidConfig:
    s = source.skipped
    if include_glob is None:
        return InvalidConfig(
            f"prepare: source {source.label}: no non-empty text file ({s['binary_files']} binary, "
            f"{s['hidden_files']} hidden skipped; --include picks files by glob)"
        )
    return InvalidConfig(f"prepare: source {source.label}: no non-empty file matches {include_glob!r}")


def _encoded(units: Iterator[Unit], settings: tuple, workers: int) -> Iterator[tuple[int, Encoded]]:
    """``(unit's source bytes, its Encoded)`` for each unit, in order. With ``workers`` > 1
    the units are encoded in a process pool, at most ``2 * workers`` in flight (a pool's
    ``imap`` would read the whole source ahead). A bad record or unreadable file raises when
    its turn comes, after every unit before it: the error named is the first in corpus order,
    whatever ``workers`` is."""
    if workers == 1:
        encoder = Encoder(*settings)
        for unit in units:
            yield unit.source_bytes, encoder(unit)
        return
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=start_worker, initargs=settings)
    pending: deque[tuple[int, Future]] = deque()
    read_error: InvalidConfig | None = None
    try:
        while True:
            while read_error is None and len(pending) < 2 * workers:
                try:
                    unit = next(units)
                except StopIteration:
                    break
                except InvalidConfig as e:  # raised after the units before it (see above)
                    read_error = e
                    break
                pending.append((unit.source_bytes, pool.submit(encode_in_worker, unit)))
            if not pending:
                break
            size, future = pending.popleft()
            yield size, future.result()
        if read_error is not None:
            raise read_error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _tokenizer(spec: str, source: Source, val_fraction: float, text_field: str):
    """-> (the tokenizers JSON to use and store (bytes), None for bytes; kind; vocab size;
    where it came from: the file's path, or ``bpe:N`` and what it was trained on)."""
    if spec == "bytes":
        return None, "bytes", 256, None
    from tokenizers import Tokenizer

    bpe_vocab = bpe_vocab_size(spec)
    if bpe_vocab is not None:
        texts = _train_texts(source, val_fraction, text_field)
        tok_json = train_bpe(texts, bpe_vocab)
        tok = Tokenizer.from_str(tok_json)
        return (
            tok_json.encode(),
            "tokenizers-json",
            tok.get_vocab_size(with_added_tokens=True),
            f"{spec}: byte-level BPE trained on the train split ({texts.count} documents)",
        )
    path = Path(spec).resolve()
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise InvalidConfig(f"prepare: tokenizer {spec}: not a tokenizers JSON file ({e})") from None
    return path.read_bytes(), "tokenizers-json", tok.get_vocab_size(with_added_tokens=True), str(path)


class _train_texts:
    """The train split's texts, streamed once for BPE training (decoded as UTF-8 with
    replacement). The split's fallback document (see the module docstring) is known only at
    the end, so the document with the smallest key so far is held back and yielded last
    unless it turns out to be the fallback; BPE training counts words and pairs, so it does
    not depend on the order. ``count``: texts yielded."""

    def __init__(self, source: Source, val_fraction: float, text_field: str):
        self._source, self._val_fraction, self._field = source, val_fraction, text_field
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        encoder = Encoder(None, "<u2", self._val_fraction, self._field)
        held: tuple[int, str] | None = None
        any_val, documents = False, 0
        for unit in self._source.units(self._field):
            for doc_id, text in encoder.documents(unit):
                if not text:
                    continue
                documents += 1
                val, key = encoder.held_out(doc_id)
                if val:
                    any_val = True
                    continue
                text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
                if held is None or key < held[0]:  # hold this one back, release the one held
                    held, released = (key, text), (held[1] if held else None)
                else:
                    released = text
                if released is not None:
                    self.count += 1
                    yield released
        fallback = self._val_fraction > 0 and not any_val and documents >= 2
        if held is not None and not fallback:
            self.count += 1
            yield held[1]
