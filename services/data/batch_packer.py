"""L4-5 batch packer (批次打包器): cuts documents into rows, deals rows into micro-batches.

It never drops, reorders or edits a document, never repeats one to fill a batch, and never
changes the batch size or sequence length pushed by L2-1 (``PackerConfig``). Every batch
it emits is ``[micro_batch_size, seq_len]``: input ids and labels as little-endian int32.
Labels are -100 wherever there is no real next token (padding), so padding never counts in
the loss (PyTorch ``cross_entropy``'s default ``ignore_index``).

Rows. The documents (the whole global epoch order: every rank's stream reads all of it,
see ``shuffler.py``) become ONE global stream of rows of ``seq_len`` tokens, a pure function
of the documents, ``seq_len``, mode and separator; never of the batch size or the ranks.
Two modes (``PackerConfig.mode``):

* PACK: the epoch's documents are one stream, each followed by ``separator_id`` unless it
  is -1. Row r is the ``seq_len + 1`` tokens starting at ``cursor + r*seq_len``:
  ``input_ids = row[:-1]``, ``labels = row[1:]``. Consecutive rows share their boundary
  token (Megatron-LM's GPTDataset does the same), so every token of the stream except the
  first is a label exactly once and nothing is thrown away. The epoch's incomplete last row
  is padded, not dropped.
* PAD: one document per row; a document longer than ``seq_len + 1`` continues on the next
  row (again sharing the boundary token); the rest of a row is ``pad_id`` / -100. A
  document of one token has no label and makes no row.

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
round (the same on every rank): (epoch, document = position in the epoch's order, offset =
tokens of that document's contribution, separator included, already consumed). A stream
opened at the ``next`` of a round that ends a step produces exactly the rows that would
have followed; the packer learns where it resumes from ``PackerConfig.start``.

Commands it takes: ``packer_config`` (L2-1), ``on_samples_filtered`` (data from L4-4). It
publishes ``MicroBatch`` and ``DataExhausted``.

Legend: B micro_batch_size, L seq_len, W world_size (data-parallel ranks), R rows, T tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

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
        self._resume: data_pb2.DataPosition | None = None  # applied to the first documents only
        self._epoch = 0
        self._epoch_rows = 0  # rows the current epoch gave the global stream
        # PACK: tokens not yet cut into rows, and which document each stretch of them belongs to.
        self._buf_T = np.zeros(0, np.int32)
        self._seg_start = np.zeros(0, np.int64)  # where the document's stretch starts in _buf_T
        self._seg_doc = np.zeros(0, np.int64)  # its position in the epoch order
        self._seg_off = np.zeros(0, np.int64)  # its tokens consumed before the stretch
        self._seg_len = np.zeros(0, np.int64)  # its contribution length (separator included)
        # Rows of the global stream not yet dealt (< one round of W*B after each deal): the
        # position after each, and the contents of this rank's only (the others' are cut, to
        # know where the stream stands, and dropped); _rows_cut counts rows since the start.
        self._rows_next = np.zeros((0, 3), np.int64)  # (epoch, document, offset) after each row
        self._rows_in = np.zeros((0, 0), np.int32)
        self._rows_lab = np.zeros((0, 0), np.int32)
        self._rows_cut = 0
        # "idle" | "packing" | "short_of_samples"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def packer_config(self, msg: data_pb2.PackerConfig, payload: object = None) -> None:
        """Fix batch shape, mode and deal for this stream (pushed once); ``msg.start``
        resumes: its ``offset`` tokens of its document were emitted before the checkpoint.

        Raises:
            InvalidConfig: seq_len or micro_batch_size 0, mode unspecified, separator < -1,
                rank >= world_size.
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
        self._cfg = self._frozen.set(msg)
        L = msg.seq_len
        self._rows_in = np.zeros((0, L), np.int32)
        self._rows_lab = np.zeros((0, L), np.int32)
        if msg.HasField("start") and msg.start.offset:
            self._resume = msg.start

    def on_samples_filtered(self, msg: data_pb2.SamplesFiltered, docs: Documents) -> None:
        """Cut ``docs`` into rows; deal every complete round; at the epoch's end, its last
        row (and, for a single pass, its last round, padded).

        Raises:
            RuntimeError: documents before the config (wiring fault).
        """
        if self._cfg is None:
            raise RuntimeError("packer: samples before PackerConfig")
        if docs.epoch != self._epoch:
            self._epoch, self._epoch_rows = docs.epoch, 0
        self._state = "packing"
        skip = 0
        if self._resume is not None and len(docs):
            r, self._resume = self._resume, None
            if docs.epoch == r.epoch and int(docs.index_n[0]) == r.document:
                skip = int(r.offset)
        if self._cfg.mode == data_pb2.PACK:
            self._pack(docs, skip)
        else:
            self._pad(docs, skip)
        if docs.last:
            self._finish_epoch(docs.split)
        else:
            self._deal()

    # ---- PACK -------------------------------------------------------------------------

    def _pack(self, docs: Documents, skip: int) -> None:
        L, sep = self._cfg.seq_len, self._cfg.separator_id
        n = len(docs)
        if n:
            contrib = docs.lengths_n + (1 if sep >= 0 else 0)
            if sep >= 0:  # interleave: document i's tokens, then one separator
                out = np.full(len(docs.tokens_T) + n, sep, np.int32)
                is_token = np.ones(len(out), dtype=bool)
                is_token[docs.bounds_n1[1:] + np.arange(n)] = False
                out[is_token] = docs.tokens_T
                starts = docs.bounds_n1[:-1] + np.arange(n)
            else:
                out = docs.tokens_T.astype(np.int32)
                starts = docs.bounds_n1[:-1].copy()
            skip = min(skip, int(contrib[0]))
            offs = np.zeros(n, np.int64)
            offs[0] = skip
            starts = np.maximum(starts - skip, 0)
            base = len(self._buf_T)
            self._buf_T = np.concatenate([self._buf_T, out[skip:]])
            self._seg_start = np.concatenate([self._seg_start, starts + base])
            self._seg_doc = np.concatenate([self._seg_doc, docs.index_n])
            self._seg_off = np.concatenate([self._seg_off, offs])
            self._seg_len = np.concatenate([self._seg_len, contrib])
        buf = self._buf_T
        R = (len(buf) - 1) // L if len(buf) > L else 0  # complete rows: L + 1 tokens each
        if R:
            rows = as_strided(buf, shape=(R, L + 1), strides=(L * buf.itemsize, buf.itemsize))
            self._add_rows(rows[:, :L], rows[:, 1:], self._positions(np.arange(1, R + 1, dtype=np.int64) * L))
            self._drop_consumed(R * L)

    def _positions(self, c_R: np.ndarray) -> np.ndarray:
        """(epoch, document, offset) of buffer indices ``c_R``: the next token to be cut."""
        k = np.searchsorted(self._seg_start, c_R, side="right") - 1
        off = self._seg_off[k] + c_R - self._seg_start[k]
        done = off >= self._seg_len[k]
        doc = self._seg_doc[k] + done
        return np.stack([np.full(len(c_R), self._epoch, np.int64), doc, np.where(done, 0, off)], axis=1)

    def _drop_consumed(self, c: int) -> None:
        k = max(0, int(np.searchsorted(self._seg_start, c, side="right")) - 1)
        self._seg_off = self._seg_off[k:].copy()
        self._seg_off[0] += c - self._seg_start[k]
        self._seg_start = np.maximum(self._seg_start[k:] - c, 0)
        self._seg_doc, self._seg_len = self._seg_doc[k:], self._seg_len[k:]
        self._buf_T = self._buf_T[c:]

    # ---- PAD --------------------------------------------------------------------------

    def _pad(self, docs: Documents, skip: int) -> None:
        L = self._cfg.seq_len
        n = len(docs)
        if n:
            lengths = docs.lengths_n
            first = np.zeros(n, np.int64)
            first[0] = min(skip, int(lengths[0]))
            # Rows per document: enough to give every token after the first a label.
            per_doc = np.maximum(0, (lengths - first - 1 + L - 1) // L)
            doc = np.repeat(np.arange(n), per_doc)
            j = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
            in_doc = first[doc] + j * L
            lens = np.minimum(L + 1, lengths[doc] - in_doc)
            inputs, labels = _gather(docs.tokens_T, docs.bounds_n1[doc] + in_doc, lens, L, self._cfg.pad_id)
            after = in_doc + L
            done = after >= lengths[doc] - 1
            nxt = np.stack(
                [np.full(len(doc), self._epoch, np.int64), docs.index_n[doc] + done, np.where(done, 0, after)], axis=1
            )
            self._add_rows(inputs, labels, nxt)

    # ---- rows and the deal ------------------------------------------------------------

    def _add_rows(self, inputs_RL: np.ndarray, labels_RL: np.ndarray, next_R3: np.ndarray) -> None:
        B, W = self._cfg.micro_batch_size, max(self._cfg.world_size, 1)
        j = self._rows_cut + np.arange(len(inputs_RL))  # global row index since the stream's start
        mine = (j // B) % W == self._cfg.rank  # slot j // B goes to rank (j // B) % W
        self._rows_in = np.concatenate([self._rows_in, inputs_RL[mine]])
        self._rows_lab = np.concatenate([self._rows_lab, labels_RL[mine]])
        self._rows_next = np.concatenate([self._rows_next, next_R3])
        self._rows_cut += len(inputs_RL)
        self._epoch_rows += len(inputs_RL)

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

    # ---- end of epoch -----------------------------------------------------------------

    def _finish_epoch(self, split: str) -> None:
        L, pad = self._cfg.seq_len, self._cfg.pad_id
        after_epoch = np.array([[self._epoch + 1, 0, 0]], np.int64)
        if self._cfg.mode == data_pb2.PACK and len(self._buf_T) >= 2:  # at least one label left
            inputs, labels = _gather(self._buf_T, np.zeros(1, np.int64), np.array([len(self._buf_T)]), L, pad)
            self._add_rows(inputs, labels, after_epoch)
        self._buf_T = np.zeros(0, np.int32)
        for name in ("_seg_start", "_seg_doc", "_seg_off", "_seg_len"):
            setattr(self, name, np.zeros(0, np.int64))
        if not self._cfg.repeat and len(self._rows_next):  # the pass ends: pad its last round
            missing = -len(self._rows_next) % (max(self._cfg.world_size, 1) * self._cfg.micro_batch_size)
            self._add_rows(
                np.full((missing, L), pad, np.int32),
                np.full((missing, L), IGNORE, np.int32),
                np.repeat(after_epoch, missing, axis=0),
            )
            self._epoch_rows -= missing  # (padding: not rows the epoch gave)
        self._deal()
        self._state = "short_of_samples"
        position = data_pb2.DataPosition(epoch=self._epoch + 1, document=0, offset=0)
        self._emit(data_pb2.DataExhausted(split=split, position=position, rows=self._epoch_rows))

    def _publish(self, inputs_BL: np.ndarray, labels_BL: np.ndarray, nxt: np.ndarray) -> None:
        labels = np.ascontiguousarray(labels_BL, dtype="<i4")
        epoch, document, offset = (int(v) for v in nxt)
        self._emit(
            data_pb2.MicroBatch(
                input_ids=np.ascontiguousarray(inputs_BL, dtype="<i4").tobytes(),
                labels=labels.tobytes(),
                batch_size=self._cfg.micro_batch_size,
                seq_len=self._cfg.seq_len,
                tokens=int(np.count_nonzero(labels != IGNORE)),
                next=data_pb2.DataPosition(epoch=epoch, document=document, offset=offset),
            )
        )


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
