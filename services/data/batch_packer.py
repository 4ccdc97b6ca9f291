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

Row order (Megatron-LM's GPTDataset ``shuffle_idx``). The global stream takes an epoch's
rows in the order :func:`row_order` ``(seed, epoch, rows)`` when ``PackerConfig.shuffle`` is
on (training with ``data.shuffle``), else in stream order (evaluation). Shuffling documents
alone is not enough: a document is often longer than a global batch (a stdlib file averages
~18,000 tokens against 2,048 in the demo's batch), so consecutive rows would put one
document in a whole batch.

The sample index. The rows and their order are not cut in memory: from the filter's
references (the epoch's order and keep mask, no token) the packer builds, or finds built,
the epoch's sample index (``sample_index.py``: doc_idx, sample_idx, shuffle_idx, memory-mapped,
shared by every stream of the same dataset version and settings; a repeating stream has the
next epoch's built ahead in the background), seeks to its start row,
and has the tokens of its own rank's rows read (the prefetcher's read handle) when L2-1 asks
for batches (``AssembleBatches{count}``: pull, so nothing is assembled ahead of the rank but
the relay's small read-ahead). Memory: the stream's position and one request's rows.

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
after an epoch's last row, (epoch + 1, 0)), in the sample-sequence format
``sample_index.FORMAT`` (``DataPosition.format``; a start in another format is refused, one
empty from a checkpoint written before the field names the same sequence).
``DataPosition.document``/``offset`` (the format before rows were ordered) are always 0 and
refused in a start. A stream opened at
the ``next`` of a round that ends a step produces exactly the rows that would have followed:
the packer learns where it resumes from ``PackerConfig.start`` and skips that many rows of
the epoch's order.

Commands it takes: ``packer_config`` and ``assemble_batches`` (L2-1), ``on_samples_filtered``
(data from L4-4). It publishes ``MicroBatch`` (at most ``count`` per ``AssembleBatches``) and
``DataExhausted`` (when the epoch has no complete round left: with ``repeat`` the relay then
plans the next epoch, whose rows complete the round).

Legend: B micro_batch_size, L seq_len, W world_size (data-parallel ranks), R rows, T tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.contract.frozen import FrozenConfig
from services.data import sample_index
from services.data.documents import Catalog, KeptDocuments
from services.data.errors import ConfigAlreadyPushed, InvalidConfig
from services.data.permutation import argsort_keys

IGNORE = -100  # label of a padding position


@dataclass
class _Rows:
    """Rows ``[lo, hi)`` of an epoch's row order not dealt yet (``index`` None: the padding
    rows that complete a single pass's last round, which hold nothing)."""

    index: sample_index.EpochIndex | None
    catalog: Catalog | None
    epoch: int
    lo: int
    hi: int


class BatchPacker:
    """Finds (or builds) each epoch's rows in the sample index, and deals this rank's."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        # Batch shape, mode and deal, pushed once per stream (seed L4-5 s2: 上层下发后固化);
        # the composition root builds a fresh packer for every stream. ``_cfg`` is the value.
        self._frozen = FrozenConfig[data_pb2.PackerConfig](
            "L4_BATCH_PACKER", "batching rules (PackerConfig)", error=ConfigAlreadyPushed
        )
        self._cfg: data_pb2.PackerConfig | None = None
        self._resume: data_pb2.DataPosition | None = None  # applied to the first epoch only
        # Rows of the global stream not yet dealt, in order (the current epoch's, and the
        # previous epoch's last incomplete round); _open: the epoch whose end is not yet told.
        self._rows: deque[_Rows] = deque()
        self._open: tuple[int, int, str] | None = None  # (epoch, rows it gave, split)
        self._skip = 0  # rows still to pass over (AssembleBatches.skip), across epoch ends
        # "idle" | "packing" | "short_of_samples"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def packer_config(self, msg: data_pb2.PackerConfig, payload: object = None) -> None:
        """Fix batch shape, mode, row order and deal for this stream (pushed once);
        ``msg.start`` resumes: rows ``[0, start.row)`` of epoch ``start.epoch``'s row order
        were dealt before the checkpoint.

        Raises:
            InvalidConfig: seq_len or micro_batch_size 0, mode unspecified, separator < -1,
                rank >= world_size, a start in the document/offset format or another
                sample-sequence format.
            ConfigAlreadyPushed: the config was already set (batch size and sequence length
                never change within a stream; the seed lists no command for it).
        """
        self._frozen.require_unset()
        for name in ("seq_len", "micro_batch_size"):
            if getattr(msg, name) <= 0:
                raise InvalidConfig(f"packer.{name}: must be > 0, got {getattr(msg, name)}")
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
        if msg.start.format not in sample_index.COMPATIBLE:
            raise InvalidConfig(format_refused("packer.start", msg.start.format))
        self._cfg = self._frozen.set(msg)
        if msg.HasField("start") and msg.start.row:
            self._resume = msg.start

    def on_samples_filtered(self, msg: data_pb2.SamplesFiltered, kept: KeptDocuments) -> None:
        """Find or build the epoch's sample index and queue its rows (from the resume row
        for the stream's first epoch).

        Raises:
            RuntimeError: documents before the config (wiring fault).
            OSError: the index cannot be built or read.
        """
        if self._cfg is None:
            raise RuntimeError("packer: samples before PackerConfig")
        self._state = "packing"
        index = self._index(kept)
        first = 0
        if self._resume is not None:
            r, self._resume = self._resume, None
            if r.epoch == kept.epoch:
                first = min(int(r.row), index.rows)
        if first < index.rows:
            self._rows.append(_Rows(index, kept.catalog, kept.epoch, first, index.rows))
        self._open = (kept.epoch, index.rows - first, kept.catalog.store.split)

    def assemble_batches(self, msg: data_pb2.AssembleBatches, payload: object = None) -> None:
        """Pass over ``msg.skip`` rows first (dealt to no one: across epoch ends, the rest
        pending until the next epoch's rows come), then publish up to ``msg.count`` of this
        rank's micro-batches (one per round of W slots); when the epoch's rows hold no
        complete round any more, ``DataExhausted`` (a single pass first pads its last round).

        Raises:
            RuntimeError: before the config (wiring fault).
            DataReadError: the rows' tokens could not be read.
        """
        if self._cfg is None:
            raise RuntimeError("packer: AssembleBatches before PackerConfig")
        B, W = self._cfg.micro_batch_size, max(self._cfg.world_size, 1)
        self._skip += msg.skip
        sent = 0
        while sent < msg.count or self._skip:
            if self._skip:  # rows dealt to no one first (a mixture's component: mixture.py)
                self._pass_over()
                if not self._skip and sent >= msg.count and self._rows:
                    return  # only a skip was asked, and it is done (an epoch emptied: told below)
            queued = sum(r.hi - r.lo for r in self._rows)
            if sent < msg.count and not self._skip and queued >= W * B:
                self._deal_round()
                sent += 1
                continue
            if self._open is None:
                return  # the epoch's end is told; the next epoch's rows come with its plan
            epoch, rows, split = self._open
            if not self._cfg.repeat and queued:  # the pass ends: pad its last round
                self._rows.append(_Rows(None, None, epoch, 0, W * B - queued))
                continue
            self._open = None
            self._state = "short_of_samples"
            position = data_pb2.DataPosition(epoch=epoch + 1, row=0, format=sample_index.FORMAT)
            self._emit(data_pb2.DataExhausted(split=split, position=position, rows=rows))
            return

    def _pass_over(self) -> None:
        """Drop up to the pending skip's rows from the front of the queue (no token read)."""
        while self._skip and self._rows:
            head = self._rows[0]
            k = min(head.hi - head.lo, self._skip)
            head.lo += k
            self._skip -= k
            if head.lo == head.hi:
                self._rows.popleft()

    # ---- the sample index ---------------------------------------------------------------

    def _index(self, kept: KeptDocuments) -> sample_index.EpochIndex:
        store = kept.catalog.store
        if store.index_root is None:  # a store outside a data root (tests): in memory only
            doc_idx, rows, shuffle_idx, tokens = self._build(kept)
            return sample_index.EpochIndex(kept.epoch, doc_idx, rows, shuffle_idx, {"tokens": tokens})
        key = self._key(kept)
        directory = store.index_root / sample_index.key_name(key)
        index = sample_index.open_epoch(directory, kept.epoch, key, lambda: self._build(kept))
        following = kept.following() if self._cfg.repeat else None
        if following is not None:  # the epoch a repeating stream takes next: built meanwhile
            key = self._key(following)
            directory = store.index_root / sample_index.key_name(key)
            sample_index.build_ahead(directory, following.epoch, key, lambda: self._build(following))
        return index

    def _key(self, kept: KeptDocuments) -> dict:
        cfg, order, store = self._cfg, kept.order, kept.catalog.store
        return sample_index.index_key(
            manifest_sha256=store.manifest_sha256,
            split=store.split,
            seq_len=cfg.seq_len,
            mode=cfg.mode,
            separator=cfg.separator_id,
            seed=order.seed,
            shuffle=order.enabled,
            row_seed=cfg.seed,
            row_shuffle=cfg.shuffle,
            rules=kept.rules,
        )

    def _build(self, kept: KeptDocuments) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The epoch's (doc_idx, sample_idx, shuffle_idx, tokens). How many rows there are
        follows from which documents are kept, not from their order: the row order is drawn
        and sorted on a thread of its own while the document order sorts and the rows are
        cut (NumPy's sorts release the GIL): the two sorts are most of the build."""
        cfg, store = self._cfg, kept.catalog.store
        # (store.lengths_n: a pass over the bounds, the gathers then hit memory, not the map;
        # every array here a temporary, freed as soon as it is used: the build's peak memory)
        kept_lengths = store.lengths_n[kept.keep_n]
        num_rows = sample_index.count_rows(kept_lengths, cfg.seq_len, cfg.mode, cfg.separator_id)
        tokens = int(kept_lengths.sum())
        del kept_lengths
        # Drawn beside the cut (sample_index.beside: a compute thread joined before this
        # returns, not one the packer keeps: the handler stays one call).
        drawn = sample_index.beside(lambda: row_order(cfg.seed, kept.epoch, num_rows, cfg.shuffle))
        doc_idx = kept.doc_idx()
        rows = sample_index.cut_rows(store.lengths_n[doc_idx], cfg.seq_len, cfg.mode, cfg.separator_id)
        shuffle_idx = drawn()
        if len(rows) != num_rows:
            raise RuntimeError(f"packer: {len(rows)} rows cut, {num_rows} counted (count_rows and cut_rows disagree)")
        return doc_idx, rows, shuffle_idx, tokens

    # ---- rows and the deal ------------------------------------------------------------

    def _take(self, n: int) -> list[tuple[_Rows, int]]:
        """The next ``n`` rows of the global stream: (their epoch's rows, k in its order)."""
        out: list[tuple[_Rows, int]] = []
        while len(out) < n:
            head = self._rows[0]
            k = min(head.hi - head.lo, n - len(out))
            out.extend((head, j) for j in range(head.lo, head.lo + k))
            head.lo += k
            if head.lo == head.hi:
                self._rows.popleft()
        return out

    def _deal_round(self) -> None:
        """This rank's slot of the next round of W slots of B rows (slot m to rank m % W)."""
        B, W, rank = self._cfg.micro_batch_size, max(self._cfg.world_size, 1), self._cfg.rank
        round_ = self._take(W * B)
        mine = round_[rank * B : (rank + 1) * B]
        rows = self._read_rows(mine)
        last, k = round_[-1]
        nxt = (last.epoch, k + 1) if last.index is not None and k + 1 < last.index.rows else (last.epoch + 1, 0)
        self._publish(rows, nxt)

    def _read_rows(self, rows: list[tuple[_Rows, int]]) -> list[np.ndarray]:
        """The tokens of ``rows`` (int64 [tokens] each; none for a padding row), read in one
        request through the prefetcher's handle."""
        sep = self._cfg.separator_id if self._cfg.mode == data_pb2.PACK else -1
        plans: list[list[tuple[int, int] | None]] = []  # per row: token ranges, None = separator
        ranges: list[tuple[int, int]] = []
        for r, k in rows:
            if r.index is None:
                plans.append([])
                continue
            pos, off, n = r.index.row(k)
            plan = _row_plan(r.index.doc_idx, r.catalog.store.bounds_n1, sep, pos, off, n)
            plans.append(plan)
            ranges.extend(p for p in plan if p is not None)
        reader = next((r.catalog.reader for r, _ in rows if r.catalog is not None), None)
        parts = iter(reader.read_many(ranges) if ranges else ())
        out = []
        for plan in plans:
            pieces = [np.asarray([sep], np.int64) if p is None else next(parts).astype(np.int64) for p in plan]
            out.append(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
        return out

    def _publish(self, rows: list[np.ndarray], nxt: tuple[int, int]) -> None:
        B, L, pad = self._cfg.micro_batch_size, self._cfg.seq_len, self._cfg.pad_id
        inputs = np.full((B, L), pad, "<i4")
        labels = np.full((B, L), IGNORE, "<i4")
        for i, row in enumerate(rows):
            n = max(len(row) - 1, 0)  # positions with a next token
            inputs[i, :n] = row[:n]
            labels[i, :n] = row[1 : n + 1]
        self._emit(
            data_pb2.MicroBatch(
                input_ids=inputs.tobytes(),
                labels=labels.tobytes(),
                batch_size=B,
                seq_len=L,
                tokens=int(np.count_nonzero(labels != IGNORE)),
                next=data_pb2.DataPosition(epoch=nxt[0], row=nxt[1], format=sample_index.FORMAT),
            )
        )


def format_refused(where: str, got: str) -> str:
    """The one line refusing a position in another sample-sequence format."""
    return (
        f"{where}: position in sample-sequence format {got!r}, this data service serves format "
        f"{sample_index.FORMAT!r} (a checkpoint of another data service version cannot resume here)"
    )


def _row_plan(doc_idx, bounds, sep: int, pos: int, off: int, n: int) -> list[tuple[int, int] | None]:
    """Where row (pos, off, n) lies: token ranges (start, count) of the split, and None where
    the separator goes (PACK: each document's unit is its tokens, then the separator)."""
    plan: list[tuple[int, int] | None] = []
    need = n
    while need > 0:
        doc = int(doc_idx[pos])
        lo, hi = int(bounds[doc]), int(bounds[doc + 1])
        if off < hi - lo:
            k = min(hi - lo - off, need)
            plan.append((lo + off, k))
            need -= k
            off += k
        if need > 0 and sep >= 0 and off == hi - lo:
            plan.append(None)
            need -= 1
        pos, off = pos + 1, 0
    return plan


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
    return argsort_keys(keys)  # (the stable argsort of the keys, faster: permutation.py)
