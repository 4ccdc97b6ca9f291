"""Today's in-memory algorithm (the data path before the sample index), kept as the test
oracle: the whole split in memory, ``epoch_order`` -> filter -> every row of the epoch cut
(PACK / PAD) -> ``row_order`` -> the deal to ranks. The sample index must give exactly
these micro-batches (tests/data/test_sample_index.py). This is the code of
``batch_packer._epoch_rows`` / ``_finish_epoch`` / ``_gather`` and
``sample_filter.on_samples_shuffled`` as they stood, in one function.
"""

from __future__ import annotations

import numpy as np

from services.contract import data_pb2
from services.data.batch_packer import IGNORE


def epoch_order(seed: int, epoch: int, n: int, enabled: bool) -> np.ndarray:
    """The shuffler's document order as it stood: the stable argsort of raw PCG64 outputs
    (the service sorts them faster now, ``permutation.py``; this oracle keeps the argsort)."""
    if not enabled:
        return np.arange(n, dtype=np.int64)
    return np.argsort(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])).random_raw(n), kind="stable")


def row_order(seed: int, epoch: int, n: int, enabled: bool) -> np.ndarray:
    """The packer's row order as it stood (the same, on the stream ``[seed, epoch, 1]``)."""
    if not enabled:
        return np.arange(n, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 1])).random_raw(n)
    return np.argsort(keys, kind="stable")


def reference_batches(
    tokens_T: np.ndarray,
    bounds_n1: np.ndarray,
    req: data_pb2.OpenStream,
    epochs: int,
) -> list[tuple[bytes, bytes, int, tuple[int, int]]]:
    """(input_ids, labels, tokens, next) of every micro-batch of ``req``'s rank, for
    ``epochs`` epochs from its start (a single pass when not ``req.repeat``: one epoch)."""
    cfg, rules = req.packer, req.filter
    L, B, W, sep = cfg.seq_len, cfg.micro_batch_size, max(cfg.world_size, 1), cfg.separator_id
    banned = np.unique(np.asarray([*rules.banned_bytes, *rules.banned_tokens], dtype=np.int64))
    n = len(bounds_n1) - 1
    start = req.start
    out = []
    pending: list[tuple[np.ndarray, int, int, tuple[int, int]]] = []  # (buf, start, len, next)
    dealt = 0  # rows since the stream's start
    last_epoch = start.epoch + (epochs if req.repeat else 1)
    for epoch in range(start.epoch, last_epoch):
        order = epoch_order(req.shuffle.seed, epoch, n, req.shuffle.enabled)
        docs = [tokens_T[bounds_n1[i] : bounds_n1[i + 1]] for i in order]
        lengths = np.array([len(d) for d in docs], np.int64)
        too_short = lengths < rules.min_tokens
        too_long = ~too_short & (lengths > rules.max_tokens) if rules.max_tokens else np.zeros(n, bool)
        has_banned = (
            np.array([bool(np.isin(d, banned).any()) for d in docs], bool) if len(banned) else np.zeros(n, bool)
        )
        keep = ~(too_short | too_long | (~too_short & ~too_long & has_banned))
        kept = [d for d, k in zip(docs, keep) if k]
        klen = lengths[keep]
        tokens = np.concatenate(kept) if kept else np.zeros(0, tokens_T.dtype)
        if cfg.mode == data_pb2.PACK:
            if sep >= 0 and len(kept):
                buf = np.concatenate([np.append(d.astype(np.int64), sep) for d in kept])
            else:
                buf = tokens.astype(np.int64)
            T = len(buf)
            R = -(-(T - 1) // L) if T >= 2 else 0
            starts = np.arange(R, dtype=np.int64) * L
            lens = np.minimum(L + 1, T - starts)
        else:
            buf = tokens.astype(np.int64)
            b = np.concatenate([[0], np.cumsum(klen)])
            starts, lens = [], []
            for i, length in enumerate(klen):
                for k in range(max(0, (int(length) - 1 + L - 1) // L)):
                    starts.append(b[i] + k * L)
                    lens.append(min(L + 1, int(length) - k * L))
            starts, lens = np.array(starts, np.int64), np.array(lens, np.int64)
            R = len(starts)
        order_r = row_order(req.shuffle.seed, epoch, R, req.shuffle.enabled)
        first = min(int(start.row), R) if epoch == start.epoch else 0
        for k in range(first, R):
            nxt = (epoch, k + 1) if k + 1 < R else (epoch + 1, 0)
            pending.append((buf, int(starts[order_r[k]]), int(lens[order_r[k]]), nxt))
        if not req.repeat and pending:
            while len(pending) % (W * B):
                pending.append((buf[:0], 0, 0, (epoch + 1, 0)))
        while len(pending) >= W * B:
            round_, pending = pending[: W * B], pending[W * B :]
            mine = round_[cfg.rank * B : (cfg.rank + 1) * B]
            ids = np.full((B, L), cfg.pad_id, np.int32)
            labels = np.full((B, L), IGNORE, np.int32)
            for r, (b_, s, ln, _) in enumerate(mine):
                row = b_[s : s + ln].astype(np.int32)
                ids[r, : max(ln - 1, 0)] = row[:-1]
                labels[r, : max(ln - 1, 0)] = row[1:]
            tokens_count = int(np.count_nonzero(labels != IGNORE))
            out.append((ids.astype("<i4").tobytes(), labels.astype("<i4").tobytes(), tokens_count, round_[-1][3]))
            dealt += W * B
    return out
