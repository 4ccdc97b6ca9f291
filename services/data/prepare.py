"""Offline preparation: a directory of source files -> an immutable dataset version.

Layout written (``root/<name>/<version>/``, like nanoGPT's ``train.bin`` / Megatron's
``.bin`` + ``.idx``)::

    manifest.json     every file with SHA-256 and size, tokenizer, vocab, counts, source,
                      content_sha256 and the manifest's own manifest_sha256 (manifest.py)
    train.bin         the training documents' tokens back to back, little-endian uint16
                      (vocab <= 65536) or uint32, no separators
    train.idx.npy     int64 [documents + 1] offsets (in tokens) of each document in train.bin
    train.docs.txt    source path of each document (relative to the source), one per line
    val.bin, val.idx.npy, val.docs.txt    the same for the held-out split
    tokenizer.json    a copy of the tokenizers JSON (only when one was used)

One source file is one document. The held-out split is chosen BY FILE from a hash of the
file's relative path, so it is deterministic, stable when files are added elsewhere, and no
file contributes to both splits. Empty files are skipped (they hold no token; counted in
the manifest). Quality rules (length, banned bytes) are not applied here: a version records
its source as it is, and the stream-time filter (L4-4) drops and counts by the job's rules.

The default corpus is this Python's standard library (``default_stdlib_source``):
~1,800 files, ~31 MB. ``site-packages``/``dist-packages`` (third-party code) and
``__pycache__`` are excluded. The ``test/`` packages are kept: they are ordinary, idiomatic
Python and more than half of the corpus (19 of 31 MB), which a small demo model needs; the
four deliberately non-UTF-8 test files stay as raw bytes under the bytes tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.data import manifest as mf
from services.data.bpe import bpe_vocab_size, train_bpe
from services.data.errors import DatasetCorrupt, InvalidConfig, VersionConflict

SPLITS = ("train", "val")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # no leading dot: temp dirs use one


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


def prepare_dataset(
    source_dir: Path,
    name: str,
    version: str,
    root: Path,
    tokenizer: str = "bytes",
    val_fraction: float = 0.02,
    include_glob: str | None = "**/*.py",
) -> PreparedDataset:
    """Tokenize every file under ``source_dir`` matching ``include_glob`` into the immutable
    version ``root/name/version``. Full stdlib, bytes tokenizer: ~2 s on 2 cores.
    ``include_glob`` None: every text file (:func:`is_text`: no NUL byte in its first
    8000 bytes, git's and grep's test), skipping hidden files and directories (a path part
    starting with "."); binary and hidden files are counted in the manifest's ``skipped``.

    A version with no held-out document (``val_fraction`` 0, or one file) is written with a
    warning (``PreparedDataset.warnings``, and the manifest's ``warnings``): a job that
    evaluates on it is refused at submit (services/cli/evaluation.py).

    Args:
        tokenizer: ``"bytes"`` (a token is a byte, vocab 256) or the path of a HF
            ``tokenizers`` JSON file (vocab from the file, added tokens included; text is
            decoded as UTF-8 with replacement, no special tokens added).
        val_fraction: share of files held out, in [0, 1). If it is > 0 and the hash picks
            no file while there are at least two, the file with the smallest hash is held
            out, so a tiny corpus still has a validation split.

    Returns the prepared version. Re-preparing identical content is a no-op.

    Raises:
        InvalidConfig: bad name/version/fraction/tokenizer, or no document found.
        VersionConflict: ``name@version`` exists with different content (versions are
            immutable: prepare a new version instead).
    """
    t0 = time.monotonic()
    for field, value in (("name", name), ("version", version)):
        if not _LABEL.match(value):
            raise InvalidConfig(f"prepare: {field}: {value!r} must match {_LABEL.pattern}")
    if not 0.0 <= val_fraction < 1.0:
        raise InvalidConfig(f"prepare: val_fraction: must be in [0, 1), got {val_fraction}")
    bpe_vocab_size(tokenizer)  # a bad bpe:N is refused before any file is read
    source_dir = Path(source_dir).resolve()
    if not source_dir.is_dir():
        raise InvalidConfig(f"prepare: source {source_dir}: not a directory")

    rels, blobs, skipped = _read_sources(source_dir, include_glob)
    if not blobs:
        if include_glob is None:
            raise InvalidConfig(
                f"prepare: source {source_dir}: no non-empty text file ({skipped['binary_files']} binary, "
                f"{skipped['hidden_files']} hidden skipped; --include picks files by glob)"
            )
        raise InvalidConfig(f"prepare: source {source_dir}: no non-empty file matches {include_glob!r}")
    is_val = _held_out(rels, val_fraction)
    encode, kind, vocab_size, tok_json, tok_source = _tokenizer(
        tokenizer, [blobs[i] for i in range(len(rels)) if not is_val[i]]
    )
    dtype = np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")

    files: dict[str, bytes] = {}
    splits: dict[str, dict] = {}
    for split in SPLITS:
        chosen = [i for i in range(len(rels)) if is_val[i] == (split == "val")]
        tokens, bounds = encode([blobs[i] for i in chosen], dtype)
        files[f"{split}.bin"] = tokens.tobytes()
        files[f"{split}.idx.npy"] = _npy_bytes(bounds)
        files[f"{split}.docs.txt"] = "".join(rels[i] + "\n" for i in chosen).encode()
        splits[split] = {
            "documents": len(chosen),
            "tokens": int(bounds[-1]),
            "tokens_file": f"{split}.bin",
            "index_file": f"{split}.idx.npy",
            "paths_file": f"{split}.docs.txt",
        }
    if tok_json is not None:
        files["tokenizer.json"] = tok_json
    no_val = splits["val"]["documents"] == 0
    warnings = [no_held_out_warning(f"{name}@{version}", val_fraction, len(rels))] if no_val else []

    manifest = mf.seal(
        {
            "format": mf.FORMAT,
            "name": name,
            "version": version,
            "created_unix": time.time(),
            "source": str(source_dir),
            "include_glob": include_glob,
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "tokenizer_kind": kind,
            "tokenizer": "bytes" if tok_json is None else "tokenizer.json",
            "tokenizer_source": tok_source,
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            "split_rule": "val iff int(sha256(relative path)[:8 bytes], big-endian) / 2**64 < val_fraction",
            "splits": splits,
            "skipped": skipped,
            **({"warnings": list(warnings)} if warnings else {}),
            "files": {n: {"sha256": mf.sha256_bytes(b), "bytes": len(b)} for n, b in sorted(files.items())},
        }
    )
    path, created = _commit(Path(root), name, version, files, manifest)
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
    )


def _read_sources(source_dir: Path, include_glob: str | None) -> tuple[list[str], list[bytes], dict[str, int]]:
    """Relative POSIX paths (sorted) and bytes of the matching non-empty regular files, and
    what was skipped (``empty_files``; with ``include_glob`` None also ``binary_files`` and
    ``hidden_files``: text mode, see ``prepare_dataset``)."""
    text_mode = include_glob is None
    rels = sorted(
        {
            p.relative_to(source_dir).as_posix()
            for p in source_dir.glob("**/*" if text_mode else include_glob)
            if not EXCLUDED_DIRS.intersection(p.relative_to(source_dir).parts) and p.is_file()
        }
    )
    kept, blobs = [], []
    skipped = {"empty_files": 0, **({"binary_files": 0, "hidden_files": 0} if text_mode else {})}
    for rel in rels:
        if text_mode and any(part.startswith(".") for part in rel.split("/")):
            skipped["hidden_files"] += 1
            continue
        data = (source_dir / rel).read_bytes()
        if not data:
            skipped["empty_files"] += 1
            continue
        if text_mode and not is_text(data):
            skipped["binary_files"] += 1
            continue
        kept.append(rel)
        blobs.append(data)
    return kept, blobs, skipped


def is_text(data: bytes) -> bool:
    """No NUL byte in the first 8000 bytes: git's ``buffer_is_binary`` test (grep's is alike).
    UTF-16 text counts as binary, Latin-1 as text (it is read as bytes anyway)."""
    return b"\0" not in data[:8000]


def no_held_out_warning(label: str, val_fraction: float, files: int) -> str:
    """The one line ``prepare`` warns with when a version has no held-out document."""
    why = f"val_fraction {val_fraction:g}" if val_fraction == 0 else f"{files} file(s): the split is by file"
    return (
        f"{label}: no held-out split ({why}); a job evaluating on it is refused at submit: turn "
        "eval off (eval: {every_steps: 0, at_end: false}) or prepare a version with --val-fraction > 0 "
        "from at least two files"
    )


def _held_out(rels: list[str], val_fraction: float) -> list[bool]:
    keys = [int.from_bytes(hashlib.sha256(r.encode()).digest()[:8], "big") for r in rels]
    is_val = [k < val_fraction * 2**64 for k in keys]
    if val_fraction > 0 and not any(is_val) and len(rels) >= 2:
        is_val[keys.index(min(keys))] = True
    if all(is_val):
        raise InvalidConfig(f"prepare: val_fraction {val_fraction} leaves no training document")
    return is_val


def _tokenizer(spec: str, train_blobs: list[bytes]):
    """-> (encode(blobs, dtype) -> (tokens [T], bounds int64 [n+1]), kind, vocab, the
    tokenizers JSON to store (None for bytes), where it came from (the file's path, or
    ``bpe:N`` and what it was trained on)). ``bpe:N`` trains one on ``train_blobs``."""
    if spec == "bytes":

        def encode_bytes(blobs: list[bytes], dtype: np.dtype):
            tokens = np.frombuffer(b"".join(blobs), dtype=np.uint8).astype(dtype)
            return tokens, _bounds([len(b) for b in blobs])

        return encode_bytes, "bytes", 256, None, None

    from tokenizers import Tokenizer

    bpe_vocab = bpe_vocab_size(spec)
    if bpe_vocab is not None:
        texts = [b.decode("utf-8", "replace") for b in train_blobs]
        tok_json = train_bpe(texts, bpe_vocab).encode()
        tok = Tokenizer.from_str(tok_json.decode())
        source = f"{spec}: byte-level BPE trained on the train split ({len(texts)} documents)"
    else:
        path = Path(spec).resolve()
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise InvalidConfig(f"prepare: tokenizer {spec}: not a tokenizers JSON file ({e})") from None
        tok_json, source = path.read_bytes(), str(path)

    def encode_json(blobs: list[bytes], dtype: np.dtype):
        encs = tok.encode_batch([b.decode("utf-8", "replace") for b in blobs], add_special_tokens=False)
        parts = [np.asarray(e.ids, dtype=dtype) for e in encs]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return tokens, _bounds([len(p) for p in parts])

    return encode_json, "tokenizers-json", tok.get_vocab_size(with_added_tokens=True), tok_json, source


def _bounds(lengths: list[int]) -> np.ndarray:
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=bounds[1:])
    return bounds


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _commit(root: Path, name: str, version: str, files: dict[str, bytes], manifest: dict) -> tuple[Path, bool]:
    """Write into a temp dir beside the target, fsync, rename atomically. -> (path, created)."""
    parent = root / name
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / version
    if target.exists():
        return _same_or_conflict(target, name, version, manifest), False
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.tmp-", dir=parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a version is readable by all
        for fname, data in files.items():
            _write(tmp / fname, data)
        _write(tmp / mf.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")
        _fsync_dir(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another writer got there first
        except OSError:
            if not target.exists():
                raise
            return _same_or_conflict(target, name, version, manifest), False
        _fsync_dir(parent)
        return target, True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _same_or_conflict(target: Path, name: str, version: str, manifest: dict) -> Path:
    label = f"{name}@{version}"
    try:
        existing = mf.read(target, label)
    except DatasetCorrupt as e:
        raise VersionConflict(f"{e}; refusing to overwrite an existing version") from None
    if existing["content_sha256"] != manifest["content_sha256"]:
        raise VersionConflict(
            f"dataset {label} already exists with different content (content "
            f"{existing['content_sha256'][:12]}…, new {manifest['content_sha256'][:12]}…); "
            f"versions are immutable, prepare a new version"
        )
    return target


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
