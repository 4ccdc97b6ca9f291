"""A synthetic tokenized dataset version written directly (no tokenizer run): uint16 tokens
generated with numpy in chunks, documents of random lengths, the manifest sealed as
``prepare.py`` seals it. For tests and benchmarks that need a corpus of a given size in
seconds (tests/data/test_bounded_memory.py, bench/data_plane.py)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

from services.data import manifest as mf

CHUNK_TOKENS = 32 << 20  # tokens generated and written at a time (64 MiB)


def write_corpus(root: Path, name: str, version: str, tokens: int, *, mean_doc: int = 2048, seed: int = 0) -> Path:
    """``root/name/version`` with ``tokens`` train tokens (bytes vocab kept below 256 so the
    bytes tokenizer's rules apply) in documents of 1..2*mean_doc tokens, and a small val
    split. Returns the version's directory."""
    rng = np.random.default_rng(seed)
    path = Path(root) / name / version
    path.mkdir(parents=True, exist_ok=True)
    files = {}
    splits = {}
    for split, count in (("train", tokens), ("val", max(mean_doc * 4, tokens // 1000))):
        bin_name, idx_name = f"{split}.bin", f"{split}.idx.npy"
        h, lengths, written = hashlib.sha256(), [], 0
        with open(path / bin_name, "wb") as f:
            while written < count:
                n = min(CHUNK_TOKENS, count - written)
                chunk = rng.integers(1, 256, size=n, dtype=np.uint16)
                data = chunk.astype("<u2").tobytes()
                h.update(data)
                f.write(data)
                written += n
        while sum(lengths) < count:  # documents: random lengths summing to count
            lengths.extend(rng.integers(1, 2 * mean_doc, size=max(1, (count - sum(lengths)) // mean_doc + 1)).tolist())
        lengths_a = np.asarray(lengths, np.int64)
        cut = int(np.searchsorted(np.cumsum(lengths_a), count))
        lengths_a = lengths_a[: cut + 1]
        lengths_a[-1] -= int(lengths_a.sum()) - count
        bounds = np.zeros(len(lengths_a) + 1, np.int64)
        np.cumsum(lengths_a, out=bounds[1:])
        buf = io.BytesIO()
        np.save(buf, bounds)
        idx = buf.getvalue()
        (path / idx_name).write_bytes(idx)
        files[bin_name] = {"sha256": h.hexdigest(), "bytes": count * 2}
        files[idx_name] = {"sha256": mf.sha256_bytes(idx), "bytes": len(idx)}
        splits[split] = {
            "documents": len(lengths_a),
            "tokens": count,
            "tokens_file": bin_name,
            "index_file": idx_name,
        }
    manifest = mf.seal(
        {
            "format": mf.FORMAT,
            "name": name,
            "version": version,
            "created_unix": 0.0,
            "source": "synthetic",
            "tokenizer_kind": "bytes",
            "tokenizer": "bytes",
            "vocab_size": 256,
            "dtype": "uint16",
            "splits": splits,
            "files": files,
        }
    )
    (path / mf.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path
