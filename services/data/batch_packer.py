"""L4-5 batch packer (批次打包器): groups documents into micro-batches, pads, converts.

It never drops, reorders or edits a document, never repeats one to fill a batch, and never
changes the batch size or sequence length pushed by L2-1 (``PackerConfig``). Every batch
it emits is ``[micro_batch_size, seq_len]``: input ids and labels as little-endian int32.
Labels are -100 wherever there is no real next token (padding), so padding never counts in
the loss (PyTorch ``cross_entropy``'s default ``ignore_index``).

Two modes (``PackerConfig.mode``):

* PACK: the epoch's documents are one stream, each followed by ``separator_id`` unless it
  is -1. Row r of a batch is the ``seq_len + 1`` tokens starting at ``cursor + r*seq_len``:
  ``input_ids = row[:-1]``, ``labels = row[1:]``. Consecutive rows share their boundary
  token (Megatron-LM's GPTDataset does the same), so every token of the stream except the
  first is a label exactly once and nothing is thrown away.
* PAD: one document per row; a document longer than ``seq_len + 1`` continues on the next
  row (again sharing the boundary token); the rest of a row is ``pad_id`` / -100. A
  document of one token has no label and makes no row.

End of an epoch (the shuffler's ``last`` marker) is a batch boundary: what is left is
emitted as one final batch, its missing rows and tokens padded (PACK: the incomplete final
row is padded, not dropped, so no token is lost), then ``DataExhausted`` tells L2-1 the
shard is used up. Whether another epoch follows is L2-1's call (a new shuffle plan).

``MicroBatch.next`` is the position the stream continues from after the batch: (epoch,
document = position in the rank's shard, offset = tokens of that document's contribution,
separator included, already consumed). A stream opened at ``next`` produces exactly the
batches that would have followed. The packer learns where it resumes from
``PackerConfig.start``.

Commands it takes: ``packer_config`` (L2-1), ``on_samples_filtered`` (data from L4-4). It
publishes ``MicroBatch`` and ``DataExhausted``.

Legend: B micro_batch_size, L seq_len, R rows, T tokens.
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
    """Turns filtered documents into fixed-shape micro-batches."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        # Batch shape and mode, pushed once per stream (seed L4-5 s2: 上层下发后固化); the
        # composition root builds a fresh packer for every stream. ``_cfg`` is the value.
        self._frozen = FrozenConfig[data_pb2.PackerConfig](
            "L4_BATCH_PACKER", "batching rules (PackerConfig)", error=ConfigAlreadyPushed
        )
        self._cfg: data_pb2.PackerConfig | None = None
        self._resume: data_pb2.DataPosition | None = None  # applied to the first batch only
        self._epoch = 0
        # PACK: tokens not yet emitted, and which document each stretch of them belongs to.
        self._buf_T = np.zeros(0, np.int32)
        self._seg_start = np.zeros(0, np.int64)  # where the document's stretch starts in _buf_T
        self._seg_doc = np.zeros(0, np.int64)  # its shard position
        self._seg_off = np.zeros(0, np.int64)  # its tokens consumed before the stretch
        self._seg_len = np.zeros(0, np.int64)  # its contribution length (separator included)
        # PAD: finished rows waiting for a full batch (< B of them).
        self._rows_in = np.zeros((0, 0), np.int32)
        self._rows_lab = np.zeros((0, 0), np.int32)
        self._rows_next = np.zeros((0, 2), np.int64)  # (document, offset) after each row
        # "idle" | "packing" | "short_of_samples"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def packer_config(self, msg: data_pb2.PackerConfig, payload: object = None) -> None:
        """Fix batch shape and mode for this stream (pushed once); ``msg.start`` resumes:
        its ``offset`` tokens of its document were emitted before the checkpoint.

        Raises:
            InvalidConfig: seq_len or micro_batch_size 0, mode unspecified, separator < -1.
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
        self._cfg = self._frozen.set(msg)
        L = msg.seq_len
        self._rows_in = np.zeros((0, L), np.int32)
        self._rows_lab = np.zeros((0, L), np.int32)
        if msg.HasField("start") and msg.start.offset:
            self._resume = msg.start

    def on_samples_filtered(self, msg: data_pb2.SamplesFiltered, docs: Documents) -> None:
        """Pack ``docs``; publish every complete batch; at the epoch's end, the rest.

        Raises:
            RuntimeError: documents before the config (wiring fault).
        """
        if self._cfg is None:
            raise RuntimeError("packer: samples before PackerConfig")
        self._state = "packing"
        self._epoch = docs.epoch
        skip = 0
        if self._resume is not None:
            r, self._resume = self._resume, None
            if len(docs) and docs.epoch == r.epoch and int(docs.index_n[0]) == r.document:
                skip = int(r.offset)
        if self._cfg.mode == data_pb2.PACK:
            self._pack(docs, skip)
        else:
            self._pad(docs, skip)
        if docs.last:
            self._finish_epoch(docs.split)

    # ---- PACK -------------------------------------------------------------------------

    def _pack(self, docs: Documents, skip: int) -> None:
        B, L, sep = self._cfg.micro_batch_size, self._cfg.seq_len, self._cfg.separator_id
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
        buf, c, step = self._buf_T, 0, B * L
        while len(buf) - c >= step + 1:
            rows = as_strided(buf[c:], shape=(B, L + 1), strides=(L * buf.itemsize, buf.itemsize))
            c += step
            self._publish(rows[:, :L], rows[:, 1:], self._position(c))
        if c:
            self._drop_consumed(c)

    def _position(self, c: int) -> tuple[int, int]:
        """(shard position, offset) of buffer index ``c``: the next token to be emitted."""
        k = int(np.searchsorted(self._seg_start, c, side="right")) - 1
        off = int(self._seg_off[k]) + c - int(self._seg_start[k])
        if off >= self._seg_len[k]:
            return int(self._seg_doc[k]) + 1, 0
        return int(self._seg_doc[k]), off

    def _drop_consumed(self, c: int) -> None:
        k = max(0, int(np.searchsorted(self._seg_start, c, side="right")) - 1)
        self._seg_off = self._seg_off[k:].copy()
        self._seg_off[0] += c - self._seg_start[k]
        self._seg_start = np.maximum(self._seg_start[k:] - c, 0)
        self._seg_doc, self._seg_len = self._seg_doc[k:], self._seg_len[k:]
        self._buf_T = self._buf_T[c:]

    # ---- PAD --------------------------------------------------------------------------

    def _pad(self, docs: Documents, skip: int) -> None:
        B, L = self._cfg.micro_batch_size, self._cfg.seq_len
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
            nxt = np.stack([docs.index_n[doc] + done, np.where(done, 0, after)], axis=1)
            self._rows_in = np.concatenate([self._rows_in, inputs])
            self._rows_lab = np.concatenate([self._rows_lab, labels])
            self._rows_next = np.concatenate([self._rows_next, nxt])
        full = len(self._rows_in) // B * B
        for i in range(0, full, B):
            d, o = self._rows_next[i + B - 1]
            self._publish(self._rows_in[i : i + B], self._rows_lab[i : i + B], (int(d), int(o)))
        if full:
            self._rows_in, self._rows_lab = self._rows_in[full:], self._rows_lab[full:]
            self._rows_next = self._rows_next[full:]

    # ---- end of epoch -----------------------------------------------------------------

    def _finish_epoch(self, split: str) -> None:
        B, L, pad = self._cfg.micro_batch_size, self._cfg.seq_len, self._cfg.pad_id
        after_epoch = (0, 0)  # (document, offset) in epoch + 1
        if self._cfg.mode == data_pb2.PACK:
            if len(self._buf_T) >= 2:  # at least one label left
                lens = np.clip(len(self._buf_T) - np.arange(B) * L, 0, L + 1)
                inputs, labels = _gather(self._buf_T, np.arange(B) * L, lens, L, pad)
                self._publish(inputs, labels, after_epoch, epoch=self._epoch + 1)
        elif len(self._rows_in):
            missing = B - len(self._rows_in)
            inputs = np.concatenate([self._rows_in, np.full((missing, L), pad, np.int32)])
            labels = np.concatenate([self._rows_lab, np.full((missing, L), IGNORE, np.int32)])
            self._publish(inputs, labels, after_epoch, epoch=self._epoch + 1)
        self._buf_T = np.zeros(0, np.int32)
        for name in ("_seg_start", "_seg_doc", "_seg_off", "_seg_len"):
            setattr(self, name, np.zeros(0, np.int64))
        self._rows_in, self._rows_lab = self._rows_in[:0], self._rows_lab[:0]
        self._rows_next = self._rows_next[:0]
        self._state = "short_of_samples"
        position = data_pb2.DataPosition(epoch=self._epoch + 1, document=0, offset=0)
        self._emit(data_pb2.DataExhausted(split=split, position=position))

    def _publish(
        self, inputs_BL: np.ndarray, labels_BL: np.ndarray, nxt: tuple[int, int], epoch: int | None = None
    ) -> None:
        labels = np.ascontiguousarray(labels_BL, dtype="<i4")
        self._emit(
            data_pb2.MicroBatch(
                input_ids=np.ascontiguousarray(inputs_BL, dtype="<i4").tobytes(),
                labels=labels.tobytes(),
                batch_size=self._cfg.micro_batch_size,
                seq_len=self._cfg.seq_len,
                tokens=int(np.count_nonzero(labels != IGNORE)),
                next=data_pb2.DataPosition(
                    epoch=self._epoch if epoch is None else epoch, document=nxt[0], offset=nxt[1]
                ),
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
