"""L4-5 batch packer (批次打包器): cuts documents into rows, deals rows into micro-batches.

It never drops, reorders or edits a document, never repeats one to fill a batch, and never
changes the batch size or sequence length pushed by L2-1 (``PackerConfig``). Every batch
it emits is ``[micro_batch_size, seq_len]``: input ids and labels as little-endian int32.
Labels are -100 wherever there is no real next token (padding), so padding never counts in
the loss (PyTorch ``cross_entropy``'s default ``ignore_index``).

Rows. The documents of an epoch (the whole global epoch order: every rank's stream reads
all of it, see ``shuffler.py``) become the epoch's rows of ``seq_len`` tokens, a pure
function of the filtered documents in that order, ``seq_len``, mode and separator; never of
the batch size or the ranks. Two modes (``PackerConfig.mode``):

* PACK: the epoch's documents are one stream, each followed by ``separator_id`` unless it
  is -1. Row r is the ``seq_len + 1`` tokens starting at ``cursor + r*seq_len``:
  ``input_ids = row[:-1]``, ``labels = row[1:]``. Consecutive rows share their boundary
  token (Megatron-LM's GPTDataset does the same), so every token of the stream except the
  first is a label exactly once and nothing is thrown away. The epoch's incomplete last row
  is padded, not dropped.
* PAD: one document per row; a document longer than ``seq_len + 1`` continues on the next
  row (again sharing the boundary token); the rest of a row is ``pad_id`` / -100. A
  document of one token has no label and makes no row.

Row order (Megatron-LM's GPTDataset ``shuffle_idx``). The packer holds the epoch's
filtered documents until its last, cuts all its rows, then the global stream takes them in
the order :func:`row_order` ``(seed, epoch, rows)`` when ``PackerConfig.shuffle`` is on
(training with ``data.shuffle``), else in stream order (evaluation). Shuffling documents
alone is not enough: a document is often longer than a global batch (a stdlib file
averages ~18,000 tokens against 2,048 in the demo's batch), so consecutive rows would put
one document in a whole batch. Memory: the epoch's filtered tokens (the shuffler already
holds the split) and the separator-interleaved stream while its rows are dealt.

The deal. From the stream's start (a step boundary: the job's start or a checkpoint's
position), rows are cut into slots of ``micro_batch_size`` (B) rows and slot m goes to
dp rank ``m % world_size`` (W): a round of W slots is one micro-step of every rank, and an
optimizer step of ``grad_accum`` (A) micro-steps takes the next A*W*B rows, the global
batch. So the sequence of global batches depends only on A*W*B, not on how it splits: a
job checkpointed at dp 2 x B 2 resumes at dp 1 x A 2, dp 1 x B 4 or dp 4 x B 1 on the same
rows. An epoch's end is a row boundary only: with ``repeat`` (training) the next epoch's
rows complete the round; without it (evaluation: one pass) the last round is padded with
empty rows (labels -100), so every rank gets as many micro-batches, and ``DataExhausted``
tells L2-1 the pass is over. With ``repeat`` ``DataExhausted`` still marks each epoch's end
(the stream relay then plans the next one).

``MicroBatch.next`` is the position the global stream continues from after the batch's
round (the same on every rank): (epoch, row = rows of that epoch's row order already dealt;
after an epoch's last row, (epoch + 1, 0)). ``DataPosition.document``/``offset`` (the
format before rows were ordered) are always 0 and refused in a start. A stream opened at
the ``next`` of a round that ends a step produces exactly the rows that would have followed:
the packer learns where it resumes from ``PackerConfig.start`` and skips that many rows of
the epoch's order.

Commands it takes: ``packer_config`` (L2-1), ``on_samples_filtered`` (data from L4-4). It
publishes ``MicroBatch`` and ``DataExhausted``.

Legend: B micro_batch_size, L seq_len, W world_size (data-parallel ranks), R rows, T tokens.
"""

from __future__ import annotations

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.contract.frozen import FrozenConfig
from services.data.documents import Documents
from services.data.errors import ConfigAlreadyPushed, InvalidConfig

IGNORE = -100  # label of a padding position


class BatchPacker:
    """Turns filtered documents into rows, and rows into this rank's micro-batches."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        # Batch shape, mode and deal, pushed once per stream (seed L4-5 s2: 上层下发后固化);
        # the composition root builds a fresh packer for every stream. ``_cfg`` is the value.
        self._frozen = FrozenConfig[data_pb2.PackerConfig](
            "L4_BATCH_PACKER", "batching rules (PackerConfig)", error=ConfigAlreadyPushed
        )
        self._cfg: data_pb2.PackerConfig | None = None
        self._resume: data_pb2.DataPosition | None = None  # applied to the first epoch only
        self._epoch = 0
        # The current epoch's filtered documents, as received (rows are cut at its end).
        self._parts: list[np.ndarray] = []
        self._lengths: list[np.ndarray] = []
        # Rows of the global stream not yet dealt (< one round of W*B after each deal): the
        # position after each, and the contents of this rank's only (the others' are
        # skipped, to know where the stream stands); _rows_cut counts rows since the start.
        self._rows_next = np.zeros((0, 2), np.int64)  # (epoch, row) after each row
        self._rows_in = np.zeros((0, 0), np.int32)
        self._rows_lab = np.zeros((0, 0), np.int32)
        self._rows_cut = 0
        # "idle" | "packing" | "short_of_samples"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def packer_config(self, msg: data_pb2.PackerConfig, payload: object = None) -> None:
        """Fix batch shape, mode, row order and deal for this stream (pushed once);
        ``msg.start`` resumes: rows ``[0, start.row)`` of epoch ``start.epoch``'s row order
        were dealt before the checkpoint.

        Raises:
            InvalidConfig: seq_len or micro_batch_size 0, mode unspecified, separator < -1,
                rank >= world_size, a start in the document/offset format.
            ConfigAlreadyPushed: the config was already set (batch size and sequence length
                never change within a stream; the seed lists no command for it).
        """
        self._frozen.require_unset()
        for field in ("seq_len", "micro_batch_size"):
            if getattr(msg, field) <= 0:
                raise InvalidConfig(f"packer.{field}: must be > 0, got {getattr(msg, field)}")
        if msg.mode not in (data_pb2.PACK, data_pb2.PAD):
            raise InvalidConfig(f"packer.mode: must be PACK or PAD, got {data_pb2.PackMode.Name(msg.mode)}")
        if msg.separator_id < -1:
            raise InvalidConfig(f"packer.separator_id: must be -1 (none) or a token id, got {msg.separator_id}")
        if msg.rank >= max(msg.world_size, 1):
            raise InvalidConfig(f"packer.rank: rank {msg.rank} / world_size {msg.world_size}: need rank < world_size")
        if msg.start.document or msg.start.offset:
            raise InvalidConfig(
                "packer.start: a position by document/offset (the format before row positions); "
                "a position is (epoch, row)"
            )
        self._cfg = self._frozen.set(msg)
        L = msg.seq_len
        self._rows_in = np.zeros((0, L), np.int32)
        self._rows_lab = np.zeros((0, L), np.int32)
        if msg.HasField("start") and msg.start.row:
            self._resume = msg.start

    def on_samples_filtered(self, msg: data_pb2.SamplesFiltered, docs: Documents) -> None:
        """Hold ``docs``; at the epoch's end, cut the epoch's rows, order them, and deal
        every complete round (and, for a single pass, the last one, padded).

        Raises:
            RuntimeError: documents before the config (wiring fault).
        """
        if self._cfg is None:
            raise RuntimeError("packer: samples before PackerConfig")
        if docs.epoch != self._epoch:
            self._epoch, self._parts, self._lengths = docs.epoch, [], []
        self._state = "packing"
        if len(docs):
            self._parts.append(docs.tokens_T)
            self._lengths.append(docs.lengths_n)
        if docs.last:
            self._finish_epoch(docs.split)

    # ---- the epoch's rows ----------------------------------------------------------------

    def _epoch_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's rows in stream order: (buffer [T], starts [R], lengths [R]); row r
        is ``buffer[starts[r] : starts[r] + lengths[r]]`` (at most L + 1 tokens)."""
        L, sep = self._cfg.seq_len, self._cfg.separator_id
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        tokens = np.concatenate(self._parts) if self._parts else np.zeros(0, np.int32)
        self._parts, self._lengths = [], []
        n = len(lengths)
        if self._cfg.mode == data_pb2.PACK:
            if sep >= 0 and n:  # interleave: document i's tokens, then one separator
                dtype = np.promote_types(tokens.dtype, np.min_scalar_type(sep))
                buf = np.full(len(tokens) + n, sep, dtype)
                is_token = np.ones(len(buf), dtype=bool)
                is_token[np.cumsum(lengths) + np.arange(n)] = False
                buf[is_token] = tokens
            else:
                buf = tokens
            T = len(buf)
            R = -(-(T - 1) // L) if T >= 2 else 0  # every token after the first is a label once
            starts = np.arange(R, dtype=np.int64) * L
            return buf, starts, np.minimum(L + 1, T - starts)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=bounds[1:])
        # PAD: rows per document, enough to give every token after the first a label.
        per_doc = np.maximum(0, (lengths - 1 + L - 1) // L)
        doc = np.repeat(np.arange(n), per_doc)
        in_doc = (np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)) * L
        return tokens, bounds[doc] + in_doc, np.minimum(L + 1, lengths[doc] - in_doc)

    def _finish_epoch(self, split: str) -> None:
        B, W = self._cfg.micro_batch_size, max(self._cfg.world_size, 1)
        buf, starts, lens = self._epoch_rows()
        R = len(starts)
        order = row_order(self._cfg.seed, self._epoch, R, self._cfg.shuffle)
        first = 0
        if self._resume is not None:
            r, self._resume = self._resume, None
            if r.epoch == self._epoch:
                first = min(int(r.row), R)
        # After row k of the order: (epoch, k + 1); after the epoch's last: the next epoch's start.
        nxt = np.stack([np.full(R, self._epoch, np.int64), np.arange(1, R + 1, dtype=np.int64)], axis=1)
        if R:
            nxt[-1] = (self._epoch + 1, 0)
        chunk = W * B * 64  # gather this rank's rows a few rounds at a time
        for lo in range(first, R, chunk):
            hi = min(lo + chunk, R)
            self._add_rows(buf, starts[order[lo:hi]], lens[order[lo:hi]], nxt[lo:hi])
            self._deal()
        after_epoch = np.array([[self._epoch + 1, 0]], np.int64)
        if not self._cfg.repeat and len(self._rows_next):  # the pass ends: pad its last round
            missing = -len(self._rows_next) % (W * B)
            none = np.zeros(missing, np.int64)
            self._add_rows(buf[:0], none, none, np.repeat(after_epoch, missing, axis=0))
            self._deal()
        self._state = "short_of_samples"
        position = data_pb2.DataPosition(epoch=self._epoch + 1, row=0)
        self._emit(data_pb2.DataExhausted(split=split, position=position, rows=R - first))

    # ---- rows and the deal ------------------------------------------------------------

    def _add_rows(self, buf_T: np.ndarray, starts_R: np.ndarray, lens_R: np.ndarray, next_R2: np.ndarray) -> None:
        """Append rows to the global stream; only this rank's are gathered."""
        B, W = self._cfg.micro_batch_size, max(self._cfg.world_size, 1)
        j = self._rows_cut + np.arange(len(starts_R))  # global row index since the stream's start
        mine = (j // B) % W == self._cfg.rank  # slot j // B goes to rank (j // B) % W
        inputs, labels = _gather(buf_T, starts_R[mine], lens_R[mine], self._cfg.seq_len, self._cfg.pad_id)
        self._rows_in = np.concatenate([self._rows_in, inputs])
        self._rows_lab = np.concatenate([self._rows_lab, labels])
        self._rows_next = np.concatenate([self._rows_next, next_R2])
        self._rows_cut += len(starts_R)

    def _deal(self) -> None:
        """Publish this rank's slot of every complete round (W slots of B rows)."""
        B, W = self._cfg.micro_batch_size, max(self._cfg.world_size, 1)
        rounds = len(self._rows_next) // (W * B)
        for k in range(rounds):
            mine = slice(k * B, (k + 1) * B)
            self._publish(self._rows_in[mine], self._rows_lab[mine], self._rows_next[(k + 1) * W * B - 1])
        if rounds:
            self._rows_in, self._rows_lab = self._rows_in[rounds * B :], self._rows_lab[rounds * B :]
            self._rows_next = self._rows_next[rounds * W * B :]

    def _publish(self, inputs_BL: np.ndarray, labels_BL: np.ndarray, nxt: np.ndarray) -> None:
        labels = np.ascontiguousarray(labels_BL, dtype="<i4")
        epoch, row = (int(v) for v in nxt)
        self._emit(
            data_pb2.MicroBatch(
                input_ids=np.ascontiguousarray(inputs_BL, dtype="<i4").tobytes(),
                labels=labels.tobytes(),
                batch_size=self._cfg.micro_batch_size,
                seq_len=self._cfg.seq_len,
                tokens=int(np.count_nonzero(labels != IGNORE)),
                next=data_pb2.DataPosition(epoch=epoch, row=row),
            )
        )


def row_order(seed: int, epoch: int, num_rows: int, enabled: bool = True) -> np.ndarray:
    """The order the global stream takes an epoch's rows in: int64 [num_rows], a
    permutation of ``range(num_rows)`` (stream order when not ``enabled``).

    Megatron-LM's GPTDataset ``shuffle_idx``: a pure function of its arguments, stable
    across NumPy releases the way :func:`services.data.shuffler.epoch_order` is (sorted raw
    PCG64 outputs), on a stream of its own: ``SeedSequence([seed, epoch, 1])``.
    """
    if not enabled:
        return np.arange(num_rows, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 1])).random_raw(num_rows)
    return np.argsort(keys, kind="stable").astype(np.int64)


def _gather(tokens_T: np.ndarray, starts_R: np.ndarray, lens_R: np.ndarray, L: int, pad_id: int):
    """Rows of up to L+1 tokens: row r is tokens_T[starts_R[r] : starts_R[r] + lens_R[r]].
    -> (input_ids int32 [R, L], labels int32 [R, L]); positions without a next token hold
    ``pad_id`` / -100."""
    R = len(starts_R)
    if R == 0 or len(tokens_T) == 0:
        return np.full((R, L), pad_id, np.int32), np.full((R, L), IGNORE, np.int32)
    idx = np.minimum(starts_R[:, None] + np.arange(L + 1)[None, :], len(tokens_T) - 1)
    rows = tokens_T[idx].astype(np.int32)
    has_label = np.arange(L)[None, :] < (lens_R[:, None] - 1)
    return (np.where(has_label, rows[:, :L], np.int32(pad_id)), np.where(has_label, rows[:, 1:], np.int32(IGNORE)))
