"""L4-3 shuffler (数据混洗器): changes the order of documents, nothing else.

It keeps the snapshot of the split the prefetcher read (why the whole split: see
``prefetcher.py``) and, on each ``ShufflePlan`` from L2-1, emits that epoch's order. The
order is :func:`epoch_order`, a pure function of ``(seed, epoch)``: the shuffler never picks
a seed, never advances the epoch by itself (the next epoch is a new plan from L2-1), and
never reads training state. A round's seed and scope are fixed once issued (seed L4-3 s2:
本轮随机种子, 上层下发后本地固化): a plan that names an epoch already planned with other
settings, or arrives while a round is being emitted, is refused
(``ConfigAlreadyPushed``); a new epoch may bring a new plan (本轮混洗启动指令).

No sharding: every stream reads the whole (global) epoch order, whatever the job's
data-parallel size; the batch packer cuts the epoch's rows, orders them (its own
``row_order``, on a stream of the same seed) and deals them to the ranks
(``PackerConfig.rank``). So the data position is one global cursor (epoch, row), and a job
resumes at another dp on the same global sample sequence. A resume emits the whole epoch
again (the packer skips rows, not documents: ``start_document`` is 0 from the relay).

Commands it takes: ``shuffle_plan`` (L2-1; ``start_document`` resumes inside the epoch: the
stream's first plan after a checkpoint), ``on_samples_read`` (data from L4-2). It publishes ``SamplesShuffled`` (payload
:class:`Documents`, to the filter) in chunks of ``chunk_documents`` documents; the epoch's
last chunk has ``last=True`` and may be empty.
"""

from __future__ import annotations

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.data.documents import Documents
from services.data.errors import ConfigAlreadyPushed


def epoch_order(seed: int, epoch: int, num_documents: int, enabled: bool = True) -> np.ndarray:
    """The document order of one epoch: int64 [num_documents], a permutation of
    ``range(num_documents)`` (storage order when not ``enabled``).

    Pure function of its arguments, and stable across NumPy releases: it sorts the raw
    64-bit outputs of PCG64 seeded by ``SeedSequence([seed, epoch])``, both of which NumPy
    keeps stream-compatible (NEP 19), whereas ``Generator.permutation``'s algorithm may change.
    """
    if not enabled:
        return np.arange(num_documents, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])).random_raw(num_documents)
    return np.argsort(keys, kind="stable").astype(np.int64)


class Shuffler:
    """Holds the split's snapshot; emits one epoch's order per plan."""

    def __init__(self, emit: Emitter, chunk_documents: int = 128):
        if chunk_documents <= 0:
            raise ValueError(f"chunk_documents: must be > 0, got {chunk_documents}")
        self._emit = emit
        self._chunk = chunk_documents
        self._parts: list[np.ndarray] = []  # token arrays as read, in storage order
        self._part_bounds: list[np.ndarray] = []  # their document bounds, until complete
        self._num_read = 0
        self._doc_part = np.zeros(0, np.int64)  # [N] which part holds document i
        self._doc_lo = np.zeros(0, np.int64)  # [N] its first token within that part
        self._doc_hi = np.zeros(0, np.int64)  # [N] one past its last token
        self._complete = False
        self._split = ""
        self._tokenizer = ""
        self._dtype = np.dtype(np.uint16)
        # Each round's settings as issued: epoch -> (seed, enabled).
        self._rounds: dict[int, tuple[int, bool]] = {}
        # "idle" | "buffering" | "shuffling" | "done" (a plan's order fully emitted) | "aborted"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def on_samples_read(self, msg: data_pb2.SamplesRead, docs: Documents) -> None:
        """Add a batch of documents (storage order, contiguous) to the snapshot."""
        if self._complete:
            raise RuntimeError("shuffler: samples read after the split was complete")
        if len(docs) and int(docs.index_n[0]) != self._num_read:
            raise RuntimeError(f"shuffler: expected document {self._num_read}, got {int(docs.index_n[0])}")
        self._state = "buffering"
        self._num_read += len(docs)
        self._parts.append(docs.tokens_T)
        self._part_bounds.append(docs.bounds_n1)
        self._split, self._tokenizer, self._dtype = docs.split, docs.tokenizer, docs.tokens_T.dtype
        if docs.last:
            counts = [len(b) - 1 for b in self._part_bounds]
            self._doc_part = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
            self._doc_lo = np.concatenate([b[:-1] for b in self._part_bounds])
            self._doc_hi = np.concatenate([b[1:] for b in self._part_bounds])
            self._part_bounds = []
            self._complete = True

    def shuffle_plan(self, msg: data_pb2.ShufflePlan, payload: object = None) -> None:
        """Emit the order of epoch ``msg.epoch``, from position ``msg.start_document``
        (past the end: only the empty last chunk), then return.

        Raises:
            ConfigAlreadyPushed: a round is being emitted, or ``msg.epoch`` was already
                planned with another seed or scope (a round's seed never changes).
            RuntimeError: the split has not been read completely yet (wiring fault).
        """
        if self._state == "shuffling":
            raise ConfigAlreadyPushed(
                f"L4_SHUFFLER: a plan for epoch {msg.epoch} arrived while a round is being emitted; "
                "a round's seed and scope are fixed until it ends"
            )
        settings = (msg.seed, msg.enabled)
        issued = self._rounds.get(msg.epoch)
        if issued is not None and issued != settings:
            raise ConfigAlreadyPushed(
                f"L4_SHUFFLER: epoch {msg.epoch} was planned with seed {issued[0]}, enabled {issued[1]}; "
                "a round's seed and scope never change"
            )
        if not self._complete:
            raise RuntimeError("shuffler: shuffle plan before the split was read")
        self._rounds[msg.epoch] = settings
        self._state = "shuffling"
        order = epoch_order(msg.seed, msg.epoch, len(self._doc_part), msg.enabled)
        cursor = min(int(msg.start_document), len(order))
        try:
            while True:
                hi = min(cursor + self._chunk, len(order))
                self._emit_chunk(order[cursor:hi], np.arange(cursor, hi, dtype=np.int64), msg.epoch, hi == len(order))
                if hi == len(order):
                    break
                cursor = hi
        except BaseException:
            self._state = "aborted"  # a receiver failed mid-round; the stream ends with its error
            raise
        self._state = "done"

    # ---- private ----------------------------------------------------------------------

    def _emit_chunk(self, docs: np.ndarray, positions: np.ndarray, epoch: int, last: bool) -> None:
        parts = [
            self._parts[p][lo:hi]
            for p, lo, hi in zip(
                self._doc_part[docs].tolist(), self._doc_lo[docs].tolist(), self._doc_hi[docs].tolist()
            )
        ]
        batch = Documents.join(parts, positions, epoch, last, self._split, self._tokenizer, self._dtype)
        self._emit(data_pb2.SamplesShuffled(count=len(batch)), batch)
