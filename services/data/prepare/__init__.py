"""Offline preparation: a corpus as users keep it -> an immutable dataset version.

Layout written (``root/<name>/<version>/``, like nanoGPT's ``train.bin`` / Megatron's
``.bin`` + ``.idx``)::

    manifest.json     every file with SHA-256 and size, tokenizer, vocab, counts, source,
                      content_sha256 and the manifest's own manifest_sha256 (manifest.py)
    train.bin         the training documents' tokens back to back, little-endian uint16
                      (vocab <= 65536) or uint32, no separators
    train.idx.npy     int64 [documents + 1] offsets (in tokens) of each document in train.bin
    train.docs.txt    each document's id, one per line: its path relative to the source (a
                      text file), path:line (a JSONL line) or path:row (a Parquet row)
    val.bin, val.idx.npy, val.docs.txt    the same for the held-out split
    tokenizer.json    a copy of the tokenizers JSON (only when one was used)

Sources: a directory tree, one file, or an ``s3://`` prefix; plain text files (one document
each), JSONL (optionally gzip or zstd compressed) and Parquet (one document per line or row,
from a named text field). Empty documents are skipped (counted in the manifest). Quality
rules (length, banned bytes) are not applied here: a version records its source as it is,
and the stream-time filter (L4-4) drops and counts by the job's rules.

The parts, one concern each::

    sources.py      files of the source, in sorted order, cut into units of ~4 MB of text
    encode.py       a unit -> its documents' tokens, split by a hash of each document's id
                    (the work spread over worker processes)
    split_files.py  one split's .bin / .idx.npy / .docs.txt, appended as results come
    version_dir.py  the temp dir renamed into place at the end (nothing half-written)
    pipeline.py     prepare_dataset: the order, the worker pool, the fallback split, the manifest

The default corpus is this Python's standard library (``default_stdlib_source``):
~1,800 files, ~31 MB. ``site-packages``/``dist-packages`` (third-party code) and
``__pycache__`` are excluded. The ``test/`` packages are kept: they are ordinary, idiomatic
Python and more than half of the corpus (19 of 31 MB), which a small demo model needs; the
four deliberately non-UTF-8 test files stay as raw bytes under the bytes tokenizer.
"""

from services.data.prepare.pipeline import (
    SPLITS,
    PreparedDataset,
    default_stdlib_source,
    default_workers,
    label_problem,
    no_held_out_warning,
    prepare_dataset,
)
from services.data.prepare.sources import EXCLUDED_DIRS, is_text

__all__ = [
    "EXCLUDED_DIRS",
    "SPLITS",
    "PreparedDataset",
    "default_stdlib_source",
    "default_workers",
    "is_text",
    "label_problem",
    "no_held_out_warning",
    "prepare_dataset",
]
